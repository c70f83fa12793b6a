# kvlens sidecar image: slim, non-root (UID 65532), runs with a read-only root filesystem; tail
# checkpoints go to the volume /var/lib/kvlens (an anonymous volume unless you mount one).
#   docker build -t kvlens . && docker run --read-only -p 127.0.0.1:9433:9433 kvlens
# It listens on all interfaces (Prometheus must reach it) and warns, loudly and in the metric
# kvlens_ingest_open, until KVLENS_INGEST_TOKEN is set.
#
# The base image is pinned to the Python release CI tests on (3.11.7). Pin its digest too when
# you build for production: `docker buildx imagetools inspect python:3.11.7-slim-bookworm` prints
# it; pass it as --build-arg PYTHON_IMAGE=python:3.11.7-slim-bookworm@sha256:<digest>.
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY service ./service
# The sidecar is the `serve` extra (the bare wheel is the vLLM plugin alone), with `kv-events`
# (pyzmq, a manylinux wheel bundling libzmq) so the fleet-level kvlens of the KV-events section
# runs from this image: build their wheels here so the final stage installs without a compiler
# or an index.
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[serve,kv-events]'

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="kvlens" \
      org.opencontainers.image.description="Is your prefix cache actually paying off? Prefix-cache metrics for vLLM and SGLang." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/kvlens/kvlens" \
      org.opencontainers.image.documentation="https://github.com/kvlens/kvlens#readme" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"
# No .pyc writes (the root filesystem may be read-only); bind all interfaces inside the pod so
# Prometheus can scrape; protect ingest with KVLENS_INGEST_TOKEN. numba's cache of the KV index's
# loops lives in the state volume: numba uses no cache directory it cannot write (not even to
# read it), and the package's own is read-only at run time.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVLENS_HOST=0.0.0.0 \
    KVLENS_PORT=9433 \
    KVLENS_STATE_DIR=/var/lib/kvlens \
    NUMBA_CACHE_DIR=/var/lib/kvlens/numba
COPY --from=build /wheels /tmp/wheels
# The KV index's compiled loops go into numba's cache at build time, in the volume's initial
# content (a Docker volume starts with it; an empty one, Kubernetes' emptyDir, compiles them at
# the first start and keeps them for the container's restarts).
RUN pip install --no-cache-dir --no-index --find-links /tmp/wheels 'kvlens[serve,kv-events]' && rm -rf /tmp/wheels \
    && mkdir -p /var/lib/kvlens \
    && python -c 'from kvlens.fleet import kernels; kernels.warm()' \
    && chown -R 65532:65532 /var/lib/kvlens
USER 65532:65532
VOLUME ["/var/lib/kvlens"]
EXPOSE 9433
# Follows KVLENS_PORT and KVLENS_TLS_CERT_FILE (HTTPS when set), as `kvlens serve` does.
HEALTHCHECK --interval=30s --timeout=3s CMD ["python", "-m", "kvlens.healthcheck"]
ENTRYPOINT ["kvlens", "serve"]
