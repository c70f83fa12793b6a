# vLLM with the kvlens plugin: installing kvlens is the whole install (entry point
# vllm.stat_logger_plugins). Build from the repository root:
#   docker build -f deploy/compose/vllm.Dockerfile -t kvlens-vllm:0.33.0 .
FROM vllm/vllm-openai:v0.33.0
COPY pyproject.toml README.md /src/kvlens/
COPY service /src/kvlens/service
RUN pip install --no-cache-dir /src/kvlens && rm -rf /src/kvlens
