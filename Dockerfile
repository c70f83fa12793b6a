# kvlens sidecar image: slim, non-root (UID 65532), runs with a read-only root filesystem.
#   docker build -t kvlens . && docker run --read-only -p 9433:9433 kvlens
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.12-slim
# No .pyc writes (the root filesystem may be read-only); bind all interfaces inside the pod so
# Prometheus can scrape; protect ingest with KVLENS_INGEST_TOKEN.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVLENS_HOST=0.0.0.0 \
    KVLENS_PORT=9433
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels
USER 65532:65532
EXPOSE 9433
HEALTHCHECK --interval=30s --timeout=3s \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9433/healthz', timeout=2)"]
ENTRYPOINT ["kvlens", "serve"]
