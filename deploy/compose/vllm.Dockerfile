# vLLM with the kvlens plugin: installing kvlens (no extra) is the whole install (entry point
# vllm.stat_logger_plugins); it needs only the standard library, so vLLM's packages stay as they
# are. Build from the repository root:
#   docker build -f deploy/compose/vllm.Dockerfile -t kvlens-vllm:0.33.0 .
FROM vllm/vllm-openai:v0.33.0
COPY pyproject.toml README.md LICENSE /src/kvlens/
COPY service /src/kvlens/service
RUN pip install --no-cache-dir /src/kvlens && rm -rf /src/kvlens
