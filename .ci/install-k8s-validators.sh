#!/usr/bin/env bash
# Install the Node.js validators that tests/integration/test_kubernetes_schemas.py runs on the
# prometheus-operator objects of deploy/kubernetes/ (ServiceMonitor, PodMonitor,
# PrometheusRule): @kubernetes-models/prometheus-operator and the TypeScript compiler,
# exactly as .ci/k8s-validators/package-lock.json pins them, into a cache directory
# outside the repository. Idempotent: a marker file written last holds the lock file's
# sha256; a directory without it, or with another lock's, is removed and made again.
#
#   bash .ci/install-k8s-validators.sh           # seconds; about 50 MB
#   LLM_HEALTH_K8S_VALIDATORS_DIR=/some/dir bash .ci/install-k8s-validators.sh
#
# Node.js 20 or newer, with npm, must be on PATH; where `node` or `npm` is missing, Debian's
# nodejs and npm packages are installed (as root, or with sudo).
set -euo pipefail
cd "$(dirname "$0")/.."

SRC=.ci/k8s-validators
DIR="${LLM_HEALTH_K8S_VALIDATORS_DIR:-$HOME/.cache/llm-health/npm-k8s-models-6.0.0}"
MARKER="$DIR/.llm-health-complete"
NODE_MIN=20   # cidr-regex and is-cidr (dependencies of the models) declare node >= 20

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    echo "install-k8s-validators: installing Debian's nodejs and npm"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
node_major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$node_major" -lt "$NODE_MIN" ]; then
    echo "install-k8s-validators: node $(node --version) is too old; the validators need Node.js ${NODE_MIN} or newer" >&2
    exit 1
fi

want=$(cat "$SRC/package.json" "$SRC/package-lock.json" | sha256sum | cut -d' ' -f1)
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$want" ] && [ -d "$DIR/node_modules" ]; then
    echo "install-k8s-validators: $DIR is complete"
    exit 0
fi

if [ -e "$DIR" ]; then
    echo "install-k8s-validators: removing incomplete or outdated $DIR"
    rm -rf "$DIR"
fi
mkdir -p "$DIR"
cp "$SRC/package.json" "$SRC/package-lock.json" "$DIR/"
# `npm ci` installs exactly what the lock file says (and fails if package.json disagrees
# with it); no package here has an install script, so none is run.
# The models declare node >= 22 but run on 20 (checked here on 20.20); npm only warns
# about that (EBADENGINE), and --loglevel=error keeps the warning out of the log.
echo "install-k8s-validators: npm ci in $DIR (node $(node --version), npm $(npm --version))"
npm ci --prefix "$DIR" --no-audit --no-fund --ignore-scripts --loglevel=error
node -e '
const dir = process.argv[1];
for (const name of ["@kubernetes-models/prometheus-operator", "typescript"]) {
  const meta = require(`${dir}/node_modules/${name}/package.json`);
  console.log(`install-k8s-validators: ${name}@${meta.version}`);
}' "$DIR"
echo "$want" > "$MARKER"
echo "install-k8s-validators: done: $DIR"
