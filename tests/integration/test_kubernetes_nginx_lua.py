"""deploy/kubernetes/nginx-lua/: the admission door inside nginx on Kubernetes. Every object
valid against Kubernetes' own schemas (1.30 and 1.37, strict), the Deployment mounting
what the image's entrypoint reads (compose/nginx-lua.Dockerfile: the same image as
Compose's service), the Service and probes on declared ports, the gate's file accepted by
the door's plan, and the ConfigMap's nginx file and gate.yml run on a real nginx."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from llm_health.config.gate import parse_gate_config
from llm_health.gate.nginx_lua import plan
from tests.fixtures.k8s_manifests import K8S_VERSIONS, KUSTOMIZATION_FIELDS, k8s_validate
from tests.fixtures.lua_conf import admit_through_lua_conf
from tests.fixtures.paths import ROOT

HERE = ROOT / "deploy" / "kubernetes" / "nginx-lua"
DOCKERFILE = ROOT / "compose" / "nginx-lua.Dockerfile"


def documents() -> list[dict[str, Any]]:
    return [d for p in sorted(HERE.glob("*.yaml")) if p.name != "kustomization.yaml" for d in yaml.safe_load_all(p.read_text()) if d]


def one(kind: str) -> dict[str, Any]:
    [found] = [d for d in documents() if d["kind"] == kind]
    return found


def config() -> dict[str, str]:
    return one("ConfigMap")["data"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_object_matches_the_kubernetes_schema(doc, version):
    assert k8s_validate(doc, version) == version


def test_the_kustomization_applies_each_file_once_into_the_base_namespace():
    kust = yaml.safe_load((HERE / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization" and set(kust) <= KUSTOMIZATION_FIELDS, sorted(kust)
    base = yaml.safe_load((HERE.parent / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in HERE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert kust["namespace"] == base["namespace"] == "llm-health"
    for doc in documents():
        assert "namespace" not in doc["metadata"], doc["metadata"]  # kustomize sets it


def test_the_deployment_runs_compose_s_image_and_mounts_what_its_entrypoint_reads():
    text = DOCKERFILE.read_text()
    [entry] = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))[2:]
    gate_file = re.search(r"--config.file (\S+)", entry)[1]
    out = re.search(r"--out (\S+)", entry)[1]
    conf_file = re.search(r"exec nginx -c (\S+)", entry)[1]
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    pod = one("Deployment")["spec"]["template"]["spec"]
    [nginx] = pod["containers"]
    assert nginx["image"] == compose["services"]["nginx-lua"]["image"]
    mounts = {m["mountPath"]: m for m in nginx["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts[gate_file]["subPath"] == "gate.yml" and mounts[conf_file]["subPath"] == "nginx.conf"
    assert volumes[mounts[gate_file]["name"]]["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
    # the root file system is read-only: the plan (--out), the pid and nginx's temporary files go to an emptyDir
    assert nginx["securityContext"]["readOnlyRootFilesystem"] is True and "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert out.startswith("/tmp/") and f'lua_package_path "{out}/?.lua;' in config()["nginx.conf"]
    for path in re.findall(r"(?:pid|_temp_path) (\S+);", config()["nginx.conf"]):
        assert path.startswith("/tmp/"), path
    assert nginx["securityContext"]["runAsUser"] == 65534 and re.search(r"^USER nobody$", text, re.M)


def test_the_service_and_the_probes_reach_the_door():
    pod = one("Deployment")["spec"]["template"]["spec"]
    [nginx] = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in nginx["ports"]}
    service = one("Service")["spec"]
    assert service["selector"].items() <= one("Deployment")["spec"]["template"]["metadata"]["labels"].items()
    assert [p["targetPort"] for p in service["ports"]] == ["http"] and f"listen 0.0.0.0:{ports['http']};" in config()["nginx.conf"]
    for probe in ("readinessProbe", "livenessProbe"):
        get = nginx[probe]["httpGet"]
        assert get["port"] == "http" and f"location = {get['path']} " in config()["nginx.conf"], probe


def test_the_gate_file_is_one_the_door_runs():
    cfg = parse_gate_config(yaml.safe_load(config()["gate.yml"]), "door-config.yaml:gate.yml")
    door = plan(cfg)  # PlanError where the Lua door cannot run it (Sentinel, Cluster, TLS)
    assert door["redis"]["host"] == "redis.llm-health.svc.cluster.local" and list(door["routes"]) == ["chat"]
    # nginx's resolver has no search domains: every name the door or nginx resolves is in full
    assert "resolver kube-dns.kube-system.svc.cluster.local" in config()["nginx.conf"]
    assert "server vllm.llm-health.svc.cluster.local:8000;" in config()["nginx.conf"]


async def test_the_configmap_s_files_admit_a_request_on_a_real_nginx(own_redis_server, tmp_path: Path):
    """The ConfigMap's nginx.conf and gate.yml as the pod runs them, the container's paths,
    the Service names and the cluster's DNS moved to this test's."""
    moves = {
        "/tmp/": "{tmp}",
        "vllm.llm-health.svc.cluster.local:8000": "{engine}",
        "0.0.0.0:8080": "{listen}",
        "error_log stderr": "error_log {tmp}error.log",
        "resolver kube-dns.kube-system.svc.cluster.local": "resolver 127.0.0.1",  # the test's Redis is an address
    }
    gate = config()["gate.yml"].replace("redis://redis.llm-health.svc.cluster.local:6379/0", own_redis_server.url)
    await admit_through_lua_conf(config()["nginx.conf"], gate, moves, own_redis_server.url, tmp_path, "k8s-1")
