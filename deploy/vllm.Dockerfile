# syntax=docker/dockerfile:1
# vLLM's official GPU image with the kvtether plugin (package `vllm_plugin`) installed.
#
#   docker build -f deploy/vllm.Dockerfile -t kvtether/vllm-openai:v0.32.0 .   # repo root
#
# Run it like the upstream image, adding the plugin's flags:
#   --scheduler-cls vllm_plugin.scheduler.KvtetherScheduler --scheduling-policy priority
# and KVTETHER_PLUGIN_DAEMON_ADDRESS=host:port (or unix:/path) naming the daemon.

ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
ARG PYTHON_IMAGE=python:3.11-slim

# kvtether is pure Python: its wheel is built once, on a small image, and installed
# into vLLM's interpreter below (whatever its Python version).
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
COPY vllm_plugin ./vllm_plugin
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${VLLM_IMAGE}
# Older pips ignore PIP_BREAK_SYSTEM_PACKAGES; newer ones need it when the image's
# interpreter is marked externally managed.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /tmp/wheels
# Every package vLLM shipped with stays at its version (installed.txt is a constraints
# file): kvtether's dependencies must fit vLLM's, never the other way round. Then the
# import the engine does at start-up is tried, so a broken image fails its build.
RUN python3 -m pip list --format=freeze > /tmp/installed.txt \
    && python3 -m pip install --no-cache-dir -c /tmp/installed.txt /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels /tmp/installed.txt \
    && python3 -c "import vllm_plugin.scheduler"
# The upstream image's own entry point, spelled out so the compose file's and the
# Kubernetes manifest's arguments mean the same thing whatever the base image does.
ENTRYPOINT ["vllm", "serve"]
