#!/usr/bin/env bash
# Install a pinned LiteLLM proxy into its own virtual environment for the LiteLLM door's
# tests (tests/integration/test_door_litellm.py). Idempotent: a marker file written last
# says the venv is complete; a half-made venv is removed and made again.
#
#   bash .ci/install-litellm.sh          # ~1 min, ~750 MB
#
# 1.106.12: the newest whose `proxy` extra resolves from PyPI alone (1.108 and later pin
# litellm-proxy-extras builds that are not on PyPI). llm-health itself is not installed
# there: the test puts the checkout's exporter/ on PYTHONPATH; its one missing
# dependency, prometheus-client, is added at the version the checkout uses.
set -euo pipefail

LITELLM_VERSION=1.106.12
VENV="${LLM_HEALTH_LITELLM_VENV:-$HOME/.cache/llm-health/litellm-${LITELLM_VERSION}}"
MARKER="$VENV/.llm-health-complete"
PYTHON="${LLM_HEALTH_LITELLM_BASE_PYTHON:-python3}"

if [[ -f "$MARKER" ]] && LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" -c 'import litellm.proxy.proxy_server, prometheus_client' >/dev/null 2>&1; then
    echo "install-litellm: $VENV is complete ($(cat "$MARKER"))"
    exit 0
fi
if [[ -e "$VENV" ]]; then
    echo "install-litellm: removing incomplete $VENV"
    rm -rf "$VENV"
fi
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "litellm[proxy]==${LITELLM_VERSION}" "prometheus-client==$(python3 -c 'import importlib.metadata as m; print(m.version("prometheus-client"))')"
LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" -c 'import litellm.proxy.proxy_server, prometheus_client'
date -u +"%Y-%m-%dT%H:%M:%SZ litellm[proxy]==${LITELLM_VERSION}" > "$MARKER"
echo "install-litellm: done: $VENV"
