"""compose/: the Compose file is valid against the Compose Specification's schema, and
every config it mounts passes its own tool (promtool, amtool, llm-health's parser)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from llm_health.config import exporter as exporter_config
from llm_health.config import restarter as restarter_config
from llm_health.config.gate import parse_gate_config
from llm_health.config.load import load_yaml
from tests.fixtures.paths import ROOT, RULES
from tests.fixtures.stack import AMTOOL, PROMTOOL, run_tool

COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"


def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def bind_mounts(service: dict) -> list[tuple[Path, str]]:
    """(host path, container path) of every bind mount (short syntax, relative sources)."""
    out = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            out.append(((COMPOSE_DIR / source).resolve(), target))
    return out


def mount_of(service: str, container_path: str) -> Path:
    for host, target in bind_mounts(compose()["services"][service]):
        if target == container_path:
            return host
    raise AssertionError(f"{service} mounts nothing at {container_path}")


def test_compose_file_matches_the_compose_specification():
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(compose()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_schema_rejects_a_broken_file():
    """The vendored schema is strict enough to catch a typo."""
    broken = compose()
    broken["services"]["redis"]["comand"] = ["redis-server"]
    assert list(jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).iter_errors(broken))


def test_services():
    services = compose()["services"]
    assert {"prometheus", "alertmanager", "grafana", "redis", "llm-health", "restarter"} <= set(services)
    assert services["redis"]["command"][-2:] == ["--notify-keyspace-events", "Egx"]
    build = services["llm-health"]["build"]
    assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == COMPOSE_DIR / "Dockerfile"
    restarter = services["restarter"]
    assert restarter["image"] == services["llm-health"]["image"]
    entry = restarter["entrypoint"]
    assert entry[:2] == ["llm-health", "restarter"] and entry[entry.index("--web.listen-address") + 1] == "0.0.0.0:9120"
    assert "9120:9120" in restarter["ports"] and "9118:9118" in services["llm-health"]["ports"]


def test_every_bind_mount_exists():
    for name, service in compose()["services"].items():
        for host, _ in bind_mounts(service):
            assert host.exists(), f"{name}: {host} does not exist"


def test_mounts_are_the_files_the_tests_use():
    assert mount_of("prometheus", "/etc/prometheus/rules") == RULES / "fast"
    assert mount_of("grafana", "/etc/grafana/provisioning") == ROOT / "grafana" / "provisioning"
    provider = yaml.safe_load((ROOT / "grafana" / "provisioning" / "dashboards" / "llm-health.yml").read_text())["providers"][0]
    assert mount_of("grafana", provider["options"]["path"]) == ROOT / "grafana" / "dashboards"
    assert mount_of("alertmanager", "/etc/alertmanager/alertmanager.yml") == COMPOSE_DIR / "alertmanager.yml"
    assert mount_of("llm-health", "/etc/llm-health/config.yml") == COMPOSE_DIR / "llm-health.yml"


def test_dockerfile():
    text = (COMPOSE_DIR / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    # the package with every extra: the exporter's Redis view and the gate need them
    assert re.search(r"pip install [^\n]*'\.\[all\]'(\s|&&)", text)
    entry = re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1)
    assert json.loads(entry) == ["llm-health", "serve", "--config.file", "/etc/llm-health/config.yml", "--web.listen-address", "0.0.0.0:9118"]
    # every COPY source exists in the build context (the repository root)
    for sources in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for source in sources.split():
            assert (ROOT / source).exists(), source


@pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed")
def test_promtool_check_config_with_the_mounted_rules(tmp_path):
    """prometheus.yml names the rules by their container path; check it with that path
    pointed at the rules directory compose mounts there."""
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    rules_dir = mount_of("prometheus", "/etc/prometheus/rules")
    config["rule_files"] = [f.replace("/etc/prometheus/rules", str(rules_dir)) for f in config["rule_files"]]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = run_tool(PROMTOOL, "check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    found = int(re.search(r"(\d+) rule files found", result.stdout).group(1))
    assert found == len(list(rules_dir.glob("*.rules.yml"))) == 7, result.stdout


@pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed")
def test_promtool_check_rules_as_mounted():
    rules = sorted(mount_of("prometheus", "/etc/prometheus/rules").glob("*.rules.yml"))
    assert rules
    result = run_tool(PROMTOOL, "check", "rules", *map(str, rules))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_mounted_rules_were_made_for_the_scrape_intervals_of_prometheus_yml():
    """compose scrapes faster than the committed rules/ (30 s): it mounts the `fast`
    variant, rendered for its own intervals, and the variant must say the same ones."""
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    default = config["global"]["scrape_interval"]
    jobs = {j["job_name"]: j.get("scrape_interval", default) for j in config["scrape_configs"]}
    variant = yaml.safe_load((RULES / "config.yaml").read_text())["variants"]["fast"]["scrape_intervals"]
    assert {key: jobs["llm-health" if key == "exporter" else key] for key in variant} == variant
    assert set(variant) == set(yaml.safe_load((RULES / "config.yaml").read_text())["scrape_intervals"])
    for name, job in (("vllm.rules.yml", "vllm"), ("llm-health.rules.yml", "exporter")):
        assert f"For these scrape intervals: {job} {variant[job]}.\n" in (RULES / "fast" / name).read_text()


def test_scrape_jobs_match_the_rule_selectors():
    jobs = {j["job_name"]: j for j in yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())["scrape_configs"]}
    selectors = yaml.safe_load((RULES / "config.yaml").read_text())["selectors"]
    for selector in selectors.values():
        m = re.fullmatch(r'job(=~?)"([^"]+)"', selector)
        assert m, selector
        wanted = m.group(2).split("|") if m.group(1) == "=~" else [m.group(2)]
        assert any(job in jobs for job in wanted), f"rules select {selector} but prometheus.yml has no such job"
    targets = [t for c in jobs["llm-health"]["static_configs"] for t in c["targets"]]
    assert targets == ["llm-health:9118"]
    alerting = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())["alerting"]
    assert alerting["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]


@pytest.mark.skipif(not AMTOOL, reason="amtool is not installed")
def test_amtool_check_config_as_mounted():
    result = run_tool(AMTOOL, "check-config", str(mount_of("alertmanager", "/etc/alertmanager/alertmanager.yml")))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alertmanager_credentials_file_is_mounted():
    receivers = yaml.safe_load((COMPOSE_DIR / "alertmanager.yml").read_text())["receivers"]
    hook = next(r for r in receivers if r["name"] == "restarter")["webhook_configs"][0]
    token_path = hook["http_config"]["authorization"]["credentials_file"]
    host = mount_of("alertmanager", token_path)
    assert host.read_text().strip()
    entry = compose()["services"]["restarter"]["entrypoint"]
    assert mount_of("restarter", entry[entry.index("--web.token-file") + 1]) == host
    assert hook["url"] == "http://restarter:9120/alerts" and "restarter" in compose()["services"]


def test_llm_health_config_loads_with_the_exporters_parser():
    config = exporter_config.load(COMPOSE_DIR / "llm-health.yml")
    assert [(b.name, b.url, b.kind) for b in config.backends] == [("gpu0", "http://vllm-a:8000", "engine")]
    assert config.redis is not None and config.redis.url == "redis://redis:6379/0"


def test_readme_explains_pointing_at_your_own_vllm():
    text = (COMPOSE_DIR / "README.md").read_text()
    assert "## Pointing it at your own vLLM servers" in text
    assert "llm-health.yml" in text and "prometheus.yml" in text


def test_restarter_config_loads_and_names_the_same_backends():
    entry = compose()["services"]["restarter"]["entrypoint"]
    path = mount_of("restarter", entry[entry.index("--config.file") + 1])
    config = restarter_config.load_config(path)
    exporter_names = {b["name"] for b in yaml.safe_load((COMPOSE_DIR / "llm-health.yml").read_text())["backends"]}
    assert {t.name for t in config.targets} <= exporter_names  # LLMBackendHung matches on backend
    jobs = {j["job_name"]: j for j in yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())["scrape_configs"]}
    vllm_targets = {t for c in jobs["vllm"]["static_configs"] for t in c["targets"]}
    assert {t.instance for t in config.targets} <= vllm_targets  # VLLMEngineHung matches on instance


def test_gate_config_loads_and_is_scraped():
    entry = compose()["services"]["gate"]["entrypoint"]
    gate = parse_gate_config(load_yaml(mount_of("gate", entry[entry.index("--config.file") + 1])), "gate.yml")
    assert gate.redis_url == "redis://redis:6379/0" and gate.routes["chat"].upstream == "http://vllm-a:8000"
    jobs = {j["job_name"]: j for j in yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())["scrape_configs"]}
    assert [t for c in jobs["llm-health-gate"]["static_configs"] for t in c["targets"]] == ["gate:9119"]


def test_the_nginx_lua_service_builds_and_mounts_what_its_entrypoint_names():
    service = compose()["services"]["nginx-lua"]
    assert service["profiles"] == ["nginx-lua"] and "8080:8080" in service["ports"]
    dockerfile = (COMPOSE_DIR / service["build"]["context"] / service["build"]["dockerfile"]).resolve()
    assert dockerfile == COMPOSE_DIR / "nginx-lua.Dockerfile"
    text = dockerfile.read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)  # Debian 12: the packages docs/admission.md names
    assert "apt-get install -y --no-install-recommends libnginx-mod-http-lua lua-nginx-redis" in text
    for sources in re.findall(r"^COPY (.+) \S+$", text, re.M):
        assert all((ROOT / s).exists() for s in sources.split()), sources
    [entry] = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))[2:]
    gate_file = re.search(r"--config.file (\S+)", entry)[1]
    out = re.search(r"--out (\S+)", entry)[1]
    conf_file = re.search(r"exec nginx -c (\S+)", entry)[1]
    assert mount_of("nginx-lua", gate_file) == COMPOSE_DIR / "gate.yml"
    conf = mount_of("nginx-lua", conf_file).read_text()
    assert f'lua_package_path "{out}/?.lua;' in conf and "resolver 127.0.0.11" in conf  # Docker's DNS for `redis`


async def test_the_nginx_lua_service_s_files_admit_a_request_on_a_real_nginx(own_redis_server, tmp_path):
    """compose/nginx-lua.conf and compose/gate.yml as the container runs them, their
    container paths and service names moved to this test's: `llm-health nginx-lua` writes
    the plan, nginx loads the file and a request is admitted and recorded."""
    from tests.fixtures.lua_conf import admit_through_lua_conf

    moves = {
        "/tmp/": "{tmp}",  # first: the paths moved in below are under /tmp too (/tmp/llm-health is lua_dir)
        "vllm-a:8000": "{engine}",
        "0.0.0.0:8080": "{listen}",
        "error_log stderr": "error_log {tmp}error.log",
    }
    gate = (COMPOSE_DIR / "gate.yml").read_text().replace("redis://redis:6379/0", own_redis_server.url)
    await admit_through_lua_conf((COMPOSE_DIR / "nginx-lua.conf").read_text(), gate, moves, own_redis_server.url, tmp_path, "compose-1")
