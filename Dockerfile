# kvlens sidecar image: slim, non-root (UID 65532), runs with a read-only root filesystem; tail
# checkpoints go to the volume /var/lib/kvlens (an anonymous volume unless you mount one).
#   docker build -t kvlens . && docker run --read-only -p 127.0.0.1:9433:9433 kvlens
# It listens on all interfaces (Prometheus must reach it) and warns, loudly and in the metric
# kvlens_ingest_open, until KVLENS_INGEST_TOKEN is set.
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
    KVLENS_PORT=9433 \
    KVLENS_STATE_DIR=/var/lib/kvlens
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels \
    && mkdir -p /var/lib/kvlens && chown 65532:65532 /var/lib/kvlens
USER 65532:65532
VOLUME ["/var/lib/kvlens"]
EXPOSE 9433
HEALTHCHECK --interval=30s --timeout=3s \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9433/healthz', timeout=2)"]
ENTRYPOINT ["kvlens", "serve"]
