"""The Kubernetes manifests: core kinds validated offline against the Kubernetes schemas with
kubernetes-validate --strict; the Prometheus-operator kinds (no schema there) checked here,
and the PrometheusRule proven to carry exactly the rule files' groups."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .deploy_helpers import DEPLOY, KUBERNETES, RULES, binary, load_yaml, load_yaml_documents

# The oldest release with gRPC probes generally available, and a recent one.
KUBERNETES_VERSIONS = ["1.27.0", "1.33.0"]
OPERATOR_GROUP = "monitoring.coreos.com/"
MANIFESTS = sorted(p for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")


def objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in MANIFESTS for doc in load_yaml_documents(path)]


def one(kind: str) -> dict[str, Any]:
    found = [doc for _, doc in objects() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def core_files() -> list[Path]:
    return sorted({path for path, doc in objects() if not doc["apiVersion"].startswith(OPERATOR_GROUP)})


def container() -> dict[str, Any]:
    [c] = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


@functools.cache
def serve_flags() -> frozenset[str]:
    """The options ``rematd serve`` accepts, from its own --help."""
    out = subprocess.run(
        [sys.executable, "-m", "rematd.server.cli", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return frozenset(re.findall(r"(--[a-z][a-z-]+)", out.stdout))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_manifests_validate_strictly_offline(version: str) -> None:
    files = core_files()
    kinds = {doc["kind"] for path, doc in objects() if path in files}
    assert {"Deployment", "Service", "ConfigMap", "PersistentVolumeClaim"} <= kinds
    exe = Path(sys.executable).parent / "kubernetes-validate"
    out = subprocess.run(
        [str(exe), "--strict", "--kubernetes-version", version, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    # A kind without a schema only warns; every file must have been validated for real.
    assert "WARN" not in text and "ERROR" not in text, text
    assert text.count(" passed ") == sum(1 for path, _ in objects() if path in files), text


def test_deployment_probes_resources_security_and_token() -> None:
    deployment = one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "http": 8080}

    ready = c["readinessProbe"]["httpGet"]
    assert ready["path"] == "/readyz" and ready["port"] in ("http", ports["http"]), "ready when the store is writable"
    for probe in ("livenessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/healthz" and get["port"] in ("http", ports["http"])

    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind]), f"resources.{kind} needs cpu and memory"

    dockerfile = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    uid = int(re.findall(r"^USER (\d+)", dockerfile, flags=re.M)[-1])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == uid, "the image's user"
    assert pod["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/data", "/tmp"}, "writable record and scratch space"

    env = {e["name"]: e for e in c["env"]}
    token = env["REMATD_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token == {"name": "rematd-token", "key": "token"}
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    assert "create secret generic rematd-token --from-literal=token=" in readme, "tell operators how to create it"

    configmap = one("ConfigMap")
    for e in env.values():
        if ref := e.get("valueFrom", {}).get("configMapKeyRef"):
            assert ref["name"] == configmap["metadata"]["name"] and ref["key"] in configmap["data"]
    for arg in c["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in env, f"{arg} expands an undefined variable"

    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {one("PersistentVolumeClaim")["metadata"]["name"]}
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"


def test_args_are_flags_rematd_serve_accepts() -> None:
    flags = serve_flags()
    args = container()["args"]
    used = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    assert used <= flags, f"unknown to rematd serve: {used - flags}"
    values = dict(a.split("=", 1) for a in args)
    assert int(values["--grpc-port"]) == container()["ports"][0]["containerPort"]
    assert values["--db"].startswith("/data/")


def test_service_routes_both_ports_to_the_pods() -> None:
    service = one("Service")
    template = one("Deployment")["spec"]["template"]
    assert service["metadata"]["name"] == "rematd", "the job label the alerts select: up{job='rematd'}"
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    named = {p["name"] for p in container()["ports"]}
    assert {p["name"] for p in service["spec"]["ports"]} == {"grpc", "http"}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in named


def test_servicemonitor_scrapes_the_http_port() -> None:
    monitor = one("ServiceMonitor")
    service = one("Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint.get("honorLabels", False) is False, "the alerts expect exported_job"
    assert re.fullmatch(r"\d+[smh]", endpoint["interval"])
    allowed = {"port", "path", "interval", "scrapeTimeout", "honorLabels", "scheme", "tlsConfig", "bearerTokenSecret"}
    assert set(endpoint) <= allowed, f"unexpected ServiceMonitor endpoint fields: {set(endpoint) - allowed}"
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}


def test_prometheusrule_carries_exactly_the_rule_files(tmp_path: Path) -> None:
    check = subprocess.run(
        [sys.executable, str(DEPLOY / "render_prometheusrule.py"), "--check"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    rule = one("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    expected = [g for path in RULES for g in load_yaml(path)["groups"]]
    assert rule["spec"]["groups"] == expected
    names = [g["name"] for g in rule["spec"]["groups"]]
    assert len(names) == len(set(names)), "group names are unique within a PrometheusRule"
    # What the operator hands Prometheus is valid for promtool too.
    extracted = tmp_path / "from-prometheusrule.yml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}), encoding="utf-8")
    out = subprocess.run([binary("promtool"), "check", "rules", str(extracted)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_yaml(KUBERNETES / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)
    image = container()["image"].split(":")[0]
    assert [i["name"] for i in kustomization["images"]] == [image]


def test_dockerfile_command_uses_flags_rematd_serve_accepts() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    used = set(re.findall(r'"(--[a-z][a-z-]+)"', dockerfile.split("\nCMD", 1)[1]))
    assert used and used <= serve_flags()


FLEET = DEPLOY / "kubernetes-fleet"


@functools.cache
def fleet_objects() -> tuple[dict[str, Any], ...]:
    """The fleet overlay as kustomize renders it (kubectl's own kustomize, offline)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not on PATH: its kustomize renders the fleet overlay (any kubectl 1.21 or later)"
    out = subprocess.run([kubectl, "kustomize", str(FLEET)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc is not None)


def fleet_one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in fleet_objects() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_fleet_overlay_validates_strictly_offline(version: str, tmp_path: Path) -> None:
    core = [d for d in fleet_objects() if not d["apiVersion"].startswith(OPERATOR_GROUP)]
    files = []
    for i, doc in enumerate(core):
        files.append(tmp_path / f"{i}-{doc['kind']}.yaml")
        files[-1].write_text(yaml.safe_dump(doc), encoding="utf-8")
    exe = Path(sys.executable).parent / "kubernetes-validate"
    out = subprocess.run(
        [str(exe), "--strict", "--kubernetes-version", version, *map(str, files)], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "WARN" not in text and "ERROR" not in text, text
    assert text.count(" passed ") == len(files), text


def test_fleet_overlay_runs_replicas_on_postgresql_from_a_secret() -> None:
    deployment = fleet_one("Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] > 1 and spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, "a new replica is ready before an old one goes"
    pod = spec["template"]["spec"]
    [c] = pod["containers"]
    assert not [d for d in fleet_objects() if d["kind"] == "PersistentVolumeClaim"], "no SQLite volume"
    assert all("persistentVolumeClaim" not in v for v in pod["volumes"])
    assert "/data" not in {m["mountPath"] for m in c["volumeMounts"]}
    env = {e["name"]: e for e in c["env"]}
    args = dict(a.split("=", 1) for a in c["args"])
    assert {a.split("=", 1)[0] for a in c["args"]} <= serve_flags()
    var = re.fullmatch(r"\$\((\w+)\)", args["--db"])
    assert var is not None and env[var.group(1)]["valueFrom"]["secretKeyRef"] == {"name": "rematd-db", "key": "url"}
    assert float(args["--drain-seconds"]) > 0, "readiness fails before streams are told to move"
    grace = float(args.get("--grace-seconds", 5))
    assert pod["terminationGracePeriodSeconds"] > float(args["--drain-seconds"]) + grace
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", "not ready while the store is unreachable"
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    assert "create secret generic rematd-db --from-literal=url=" in readme


def test_fleet_overlay_has_a_headless_service_and_a_disruption_budget() -> None:
    labels = fleet_one("Deployment")["spec"]["template"]["metadata"]["labels"]
    headless = fleet_one("Service", "rematd-headless")
    assert headless["spec"]["clusterIP"] == "None" and not headless["spec"].get("publishNotReadyAddresses", False)
    assert headless["spec"]["selector"].items() <= labels.items()
    assert [p["name"] for p in headless["spec"]["ports"]] == ["grpc"]
    budget = fleet_one("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["maxUnavailable"] == 1
    # The ServiceMonitor still scrapes every replica through the Service `rematd`, not twice through both.
    monitor = fleet_one("ServiceMonitor")
    selected = [
        s["metadata"]["name"]
        for s in fleet_objects()
        if s["kind"] == "Service"
        and monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert selected == ["rematd"]
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    assert "dns:///rematd-headless." in readme
