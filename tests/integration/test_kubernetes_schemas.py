"""deploy/kubernetes/ against the real schemas (the consistency checks no schema sees are
in test_kubernetes.py; both read the manifests through tests/fixtures/k8s_manifests.py):

- kustomization.yaml applies every manifest once, in one namespace named in one place;
- core kinds (Deployment, Service, ConfigMap, Namespace) against Kubernetes' own OpenAPI
  schemas for 1.30 and 1.37, strict (unknown fields refused), with kubernetes-validate;
- the prometheus-operator kinds (ServiceMonitor, PodMonitor, PrometheusRule) with node:
  the models of @kubernetes-models/prometheus-operator (required fields, types, patterns)
  and the TypeScript compiler over the same package's type declarations (unknown fields,
  which the models let through). Both come from .ci/install-k8s-validators.sh; without
  them these tests skip here and fail in CI.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.fixtures.ci import require
from tests.fixtures.k8s_manifests import (
    ALTERNATIVES,
    CORE,
    DEPLOY,
    INSTALL_SCRIPT,
    K8S_VERSIONS,
    KUSTOMIZATION_FIELDS,
    MODELS_PACKAGE,
    MODELS_VERSION,
    MONITORING,
    MONITORING_KINDS,
    VALIDATORS_SRC,
    all_documents,
    doc_id,
    k8s_validate,
    kustomization,
    load,
    manifest_files,
    monitoring_documents,
    one,
)

# ---------------------------------------------------------------------------------------
# kustomization.yaml


def test_kustomization_applies_every_manifest_once():
    k = kustomization()
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert set(k) <= KUSTOMIZATION_FIELDS, f"not kustomize fields: {sorted(set(k) - KUSTOMIZATION_FIELDS)}"
    resources = k["resources"]
    assert len(resources) == len(set(resources)), resources
    for name in resources:
        assert (DEPLOY / name).is_file(), f"kustomization.yaml lists {name}, which does not exist"
    for path in manifest_files():
        if path.name in ALTERNATIVES:
            replaced = ALTERNATIVES[path.name]
            # exactly one of the two: both would scrape every series twice
            assert (path.name in resources) != (replaced in resources), f"apply {path.name} or {replaced}, exactly one"
        else:
            assert path.name in resources, f"{path.name} is in deploy/kubernetes/ but kustomization.yaml does not apply it"


def test_one_namespace_named_in_one_place():
    namespace = one("Namespace")
    assert kustomization()["namespace"] == namespace["metadata"]["name"]
    for name, doc in all_documents():
        # kustomize sets it on every object; one written here would be a second place to change
        assert "namespace" not in doc["metadata"], f"{doc_id((name, doc))} names its namespace"


# ---------------------------------------------------------------------------------------
# core kinds: Kubernetes' own schemas


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("item", CORE, ids=doc_id)
def test_core_kinds_match_the_kubernetes_schema(item, version):
    assert k8s_validate(item[1], version) == version


def test_the_schema_check_can_fail():
    deployment = copy.deepcopy(one("Deployment"))
    vllm = deployment["spec"]["template"]["spec"]["containers"][0]
    vllm["livenessProbes"] = vllm.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="livenessProbes"):
        kubernetes_validate.validate(deployment, "1.37", strict=True)

    dashboards = copy.deepcopy(one("ConfigMap", load(DEPLOY / "grafana-dashboards.yaml"), name="llm-health-dashboard-fleet"))
    dashboards["metadata"]["labels"]["grafana_dashboard"] = 1  # what an unquoted `1` in YAML gives
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'string'"):
        kubernetes_validate.validate(dashboards, "1.37", strict=True)

    service = copy.deepcopy(one("Service"))
    service["spec"]["ports"][0]["port"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, "1.30", strict=True)


def test_every_document_has_a_validator():
    for name, doc in all_documents():
        if doc["apiVersion"] == MONITORING:
            assert doc["kind"] in MONITORING_KINDS, doc_id((name, doc))
        else:
            k8s_validate(doc, K8S_VERSIONS[-1])


# ---------------------------------------------------------------------------------------
# prometheus-operator kinds: node, @kubernetes-models/prometheus-operator and tsc


def validators_dir() -> Path:
    default = Path.home() / ".cache" / "llm-health" / f"npm-k8s-models-{MODELS_VERSION}"
    return Path(os.environ.get("LLM_HEALTH_K8S_VALIDATORS_DIR", default))


def validators_problem() -> str | None:
    """None when node and the validators (of the committed lock file) are installed."""
    fix = f"run `bash {INSTALL_SCRIPT}`"
    if not shutil.which("node"):
        return f"node is not on PATH: {fix}"
    d = validators_dir()
    want = hashlib.sha256((VALIDATORS_SRC / "package.json").read_bytes() + (VALIDATORS_SRC / "package-lock.json").read_bytes()).hexdigest()
    marker = d / ".llm-health-complete"
    if not marker.is_file() or marker.read_text().strip() != want:
        return f"the validators in {d} are missing, incomplete or from another package-lock.json: {fix}"
    return None


@pytest.fixture(scope="module")
def validators() -> Path:
    require(validators_problem())
    return validators_dir()


def operator_models(validators: Path, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """validate-crs.mjs over docs: one {"ok": ..., "error": ...} per document."""
    proc = subprocess.run(
        ["node", str(VALIDATORS_SRC / "validate-crs.mjs"), str(validators)],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["package"] == f"{MODELS_PACKAGE}@{MODELS_VERSION}"
    assert len(answer["results"]) == len(docs)
    return answer["results"]


def typecheck(validators: Path, docs: list[dict[str, Any]], tmp: Path) -> dict[int, list[str]]:
    """Each document as an object literal of its kind's interface from the package's type
    declarations, through tsc: TypeScript refuses a property an object literal's type does
    not declare, at any depth. Returns {document index: [error, ...]}."""
    models = validators / "node_modules" / MODELS_PACKAGE / "monitoring.coreos.com" / "v1"
    kinds = sorted({d["kind"] for d in docs})
    lines = [f"import type {{ I{kind} }} from {json.dumps(str(models / (kind + '.js')))};" for kind in kinds]
    first = len(lines) + 1  # the line of document 0
    lines += [f"export const doc{i}: I{d['kind']} = {json.dumps(d)};" for i, d in enumerate(docs)]
    (tmp / "check.mts").write_text("\n".join(lines) + "\n")
    options = {
        "strict": True,
        "noEmit": True,
        "module": "nodenext",
        "moduleResolution": "nodenext",
        "target": "es2022",
        "lib": ["es2022"],
        "types": [],
        "skipLibCheck": True,
    }
    (tmp / "tsconfig.json").write_text(json.dumps({"compilerOptions": options, "files": ["check.mts"]}))
    tsc = validators / "node_modules" / "typescript" / "bin" / "tsc"
    proc = subprocess.run(["node", str(tsc), "-p", "tsconfig.json", "--pretty", "false"], cwd=tmp, capture_output=True, text=True, timeout=300)
    errors: dict[int, list[str]] = {}
    last: list[str] | None = None
    for line in proc.stdout.splitlines():
        m = re.match(r"check\.mts\((\d+),\d+\): error (TS\d+: .*)", line)
        if m:
            assert int(m[1]) >= first, f"tsc refused the imports, not a document:\n{proc.stdout}"
            last = errors.setdefault(int(m[1]) - first, [])
            last.append(m[2])
        elif line.startswith(" ") and last is not None:  # the rest of the message before
            last[-1] += "\n" + line
        elif line.strip():
            raise AssertionError(f"tsc: {proc.stdout}{proc.stderr}")
    assert proc.returncode == 0 or errors, f"tsc exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    return errors


def test_monitoring_objects_pass_the_operator_models(validators):
    items = monitoring_documents()
    assert {d["kind"] for _, d in items} == set(MONITORING_KINDS)
    results = operator_models(validators, [d for _, d in items])
    failed = {doc_id(item): r["error"] for item, r in zip(items, results) if not r["ok"]}
    assert not failed


def first_alert(prometheusrule: dict[str, Any]) -> dict[str, Any]:
    """The first alerting rule of a PrometheusRule (a group may hold recording rules only)."""
    return next(r for g in prometheusrule["spec"]["groups"] for r in g["rules"] if "alert" in r)


def break_monitors() -> dict[str, tuple[dict[str, Any], str]]:
    """Broken copies of the shipped objects: {what: (document, text its error must hold)}."""
    docs = [d for _, d in monitoring_documents()]
    sm, pm, pr = (copy.deepcopy(next(d for d in docs if d["kind"] == k)) for k in MONITORING_KINDS)
    cases: dict[str, tuple[dict[str, Any], str]] = {}

    d = copy.deepcopy(sm)
    del d["spec"]["endpoints"]
    cases["ServiceMonitor without endpoints"] = (d, "endpoints")
    d = copy.deepcopy(sm)
    d["spec"]["endpoints"][0]["interval"] = "15 seconds"
    cases["interval that is no duration"] = (d, "interval")
    d = copy.deepcopy(pm)
    d["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["action"] = "replac"
    cases["relabel action misspelt"] = (d, "action")
    d = copy.deepcopy(pr)
    del d["spec"]["groups"][0]["rules"][0]["expr"]
    cases["rule without expr"] = (d, "expr")
    d = copy.deepcopy(pr)
    first_alert(d)["for"] = "5 minutes"
    cases["for that is no duration"] = (d, "for")
    d = copy.deepcopy(sm)
    d["metadata"]["labels"]["app.kubernetes.io/part-of"] = 1
    cases["label value that is no string"] = (d, "labels")
    return cases


def test_the_operator_models_can_fail(validators):
    cases = break_monitors()
    results = operator_models(validators, [doc for doc, _ in cases.values()])
    for (what, (_, expected)), result in zip(cases.items(), results):
        assert not result["ok"], f"{what}: accepted"
        assert expected in result["error"], f"{what}: {result['error']}"


def test_monitoring_objects_have_no_unknown_fields(validators, tmp_path):
    items = monitoring_documents()
    errors = typecheck(validators, [d for _, d in items], tmp_path)
    assert not {doc_id(items[i]): e for i, e in errors.items()}


def test_unknown_fields_are_refused(validators, tmp_path):
    """What the models let through (a typo is an unknown field to them), tsc refuses."""
    docs = [d for _, d in monitoring_documents()]
    sm, pm, pr = (next(d for d in docs if d["kind"] == k) for k in MONITORING_KINDS)
    typos: list[tuple[dict[str, Any], str]] = []

    d = copy.deepcopy(sm)
    d["spec"]["endpoints"][0]["intervall"] = d["spec"]["endpoints"][0].pop("interval")
    typos.append((d, "intervall"))
    d = copy.deepcopy(sm)
    d["metadata"]["lables"] = d["metadata"].pop("labels")
    typos.append((d, "lables"))
    d = copy.deepcopy(pm)
    d["spec"]["podMetricEndpoints"] = d["spec"].pop("podMetricsEndpoints")
    typos.append((d, "podMetricEndpoints"))
    d = copy.deepcopy(pm)
    d["spec"]["podMetricsEndpoints"][1]["relabelings"][0]["replacment"] = "llm-health"
    typos.append((d, "replacment"))
    d = copy.deepcopy(pr)
    rule = first_alert(d)
    rule["annotation"] = rule.pop("annotations")
    typos.append((d, "annotation"))

    # the models accept every one of them: this check is what catches them
    assert all(r["ok"] for r in operator_models(validators, [doc for doc, _ in typos]))
    errors = typecheck(validators, [doc for doc, _ in typos], tmp_path)
    for i, (_, field) in enumerate(typos):
        assert any(f"'\"{field}\"' does not exist" in e for e in errors.get(i, [])), f"{field}: {errors.get(i)}"
