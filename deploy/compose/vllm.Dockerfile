# vLLM with the kvlens plugin: installing kvlens (no extra) is the whole install (entry point
# vllm.stat_logger_plugins); it needs only the standard library, so vLLM's packages stay as they
# are. Build from the repository root:
#   docker build -f deploy/compose/vllm.Dockerfile -t kvlens-vllm:0.33.0 .
# checkov:skip=CKV_DOCKER_3: vLLM's image runs as root; deploy/kubernetes runs it as UID 1000, and compose keeps the upstream default (its caches live under root's home).
FROM vllm/vllm-openai:v0.33.0
COPY pyproject.toml README.md LICENSE /src/kvlens/
COPY service /src/kvlens/service
RUN pip install --no-cache-dir /src/kvlens && rm -rf /src/kvlens
# For compose (Kubernetes uses the probes in deploy/kubernetes/deployment.yaml). A model load
# takes minutes: failures during the start period do not count. Port 8000 is the one the
# deploy files pass with --port.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
