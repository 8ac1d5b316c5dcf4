"""Fixtures come from tests/fixtures/ as pytest plugins; the package is imported as
installed (`pip install -e .`), with no sys.path edits."""

pytest_plugins = [
    "tests.fixtures.ci",
    "tests.fixtures.parallel",
    "tests.fixtures.sim",
    "tests.fixtures.redis",
    "tests.fixtures.redis_any",
    "tests.fixtures.stack",
    "tests.fixtures.vllm",
    "tests.fixtures.llamacpp",
    "tests.fixtures.procs",
    "tests.fixtures.tcpproxy",
    "tests.fixtures.hostile",
    "tests.fixtures.restarter",
    "tests.fixtures.summary",
    "tests.fixtures.browser",
]
