"""deploy/compose.yaml and what it provisions: every file it mounts exists, every reference
between the files (scrape target, rule files, datasource, dashboard) resolves, and the real
promtool and amtool accept the Prometheus and Alertmanager configurations."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from .deploy_helpers import DEPLOY, ROOT, RULES, alert_names, binary, exported_names, load_yaml, recorded_names

COMPOSE = DEPLOY / "compose.yaml"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = DEPLOY / "alertmanager" / "alertmanager.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "rematd.json"
METRIC = re.compile(r"\b(rematd_\w+|process_\w+|dcgm:\w+|up)\b")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = load_yaml(COMPOSE)
    return doc


def service(compose: dict[str, Any], name: str) -> dict[str, Any]:
    assert name in compose["services"], f"compose.yaml has no service {name!r}"
    svc: dict[str, Any] = compose["services"][name]
    return svc


def host_path(compose: dict[str, Any], name: str, container_path: str) -> Path:
    """The file in the repository a container sees at ``container_path``, through a bind mount."""
    target = PurePosixPath(container_path)
    best: tuple[int, Path] | None = None
    for volume in service(compose, name).get("volumes", []):
        source, mount, *_ = volume.split(":")
        if not source.startswith("."):
            continue
        mount_path = PurePosixPath(mount)
        if target == mount_path or mount_path in target.parents:
            depth = len(mount_path.parts)
            if best is None or depth > best[0]:
                best = (depth, (DEPLOY / source).resolve() / target.relative_to(mount_path))
    assert best is not None, f"{name}: nothing mounted at {container_path}"
    return best[1]


def container_ports(svc: dict[str, Any]) -> set[int]:
    return {int(str(p).rsplit(":", 1)[1].split("/")[0]) for p in svc.get("ports", [])}


def test_services_and_loopback_ports(compose: dict[str, Any]) -> None:
    always = {name for name, svc in compose["services"].items() if not svc.get("profiles")}
    assert always == {"rematd", "prometheus", "alertmanager", "grafana"}
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond the host's loopback"
    assert container_ports(service(compose, "rematd")) == {50051, 8080}


def test_rematd_builds_the_image_and_needs_a_token(compose: dict[str, Any]) -> None:
    rematd = service(compose, "rematd")
    context = (DEPLOY / rematd["build"]["context"]).resolve()
    assert context == ROOT
    assert (context / rematd["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert re.fullmatch(r"\$\{REMATD_TOKEN:\?.+\}", rematd["environment"]["REMATD_TOKEN"]), "refuse to start without"
    assert "rematd-data:/data" in rematd["volumes"], "the store (/data/rematd.db) outlives the container"
    grafana = service(compose, "grafana")
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")


def test_the_postgres_profile_runs_two_replicas_on_one_database(compose: dict[str, Any]) -> None:
    profiled = {name for name, svc in compose["services"].items() if svc.get("profiles")}
    assert profiled == {"postgres", "rematd-fleet"}
    assert all(compose["services"][n]["profiles"] == ["postgres"] for n in profiled)
    db = service(compose, "postgres")
    assert "ports" not in db, "the database stays on the compose network"
    assert db["environment"]["POSTGRES_PASSWORD"] == "${POSTGRES_PASSWORD:-}", "the image refuses an empty one"
    fleet = service(compose, "rematd-fleet")
    assert fleet["deploy"]["replicas"] == 2 and fleet["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert fleet["build"] == service(compose, "rematd")["build"]
    url = next(a.split("=", 1)[1] for a in fleet["command"] if a.startswith("--db="))
    user, rest = url.removeprefix("postgresql://").split(":", 1)
    assert user == db["environment"]["POSTGRES_USER"] and rest.endswith("@postgres:5432/rematd")
    assert re.fullmatch(r"\$\{REMATD_TOKEN:\?.+\}", fleet["environment"]["REMATD_TOKEN"])
    assert container_ports(fleet) == {50051, 8080}
    # Prometheus finds each replica by the service's name, on its HTTP port, in the job the alerts select.
    [job] = [j for j in load_yaml(PROMETHEUS_YML)["scrape_configs"] if j["job_name"] == "rematd"]
    [dns] = job["dns_sd_configs"]
    assert dns["names"] == ["rematd-fleet"] and dns["type"] == "A" and dns["port"] == 8080


def test_every_bind_mount_exists(compose: dict[str, Any]) -> None:
    named = set(compose.get("volumes", {}))
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts {source}, which is missing"
            else:
                assert source in named, f"{name} uses undeclared volume {source}"


def test_prometheus_scrapes_rematd_and_loads_every_rule_file(compose: dict[str, Any]) -> None:
    prom = service(compose, "prometheus")
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert host_path(compose, "prometheus", "/etc/prometheus/prometheus.yml") == PROMETHEUS_YML
    config = load_yaml(PROMETHEUS_YML)
    loaded: set[Path] = set()
    for pattern in config["rule_files"]:
        where = host_path(compose, "prometheus", str(PurePosixPath(pattern).parent))
        loaded |= set(where.glob(PurePosixPath(pattern).name))
    assert loaded == set(RULES)

    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    rematd = jobs["rematd"]
    assert rematd.get("metrics_path", "/metrics") == "/metrics"
    assert not rematd.get("honor_labels", False), "the alerts expect the target's job label and exported_job"
    [target] = [t for sc in rematd["static_configs"] for t in sc["targets"]]
    host, port = target.split(":")
    assert host in compose["services"] and int(port) in container_ports(service(compose, host))
    assert int(port) == 8080

    [am] = [t for a in config["alerting"]["alertmanagers"] for sc in a["static_configs"] for t in sc["targets"]]
    host, port = am.split(":")
    assert host == "alertmanager" and int(port) in container_ports(service(compose, host))


def test_promtool_accepts_the_configuration_with_its_rules(tmp_path: Path) -> None:
    config = load_yaml(PROMETHEUS_YML)
    config["rule_files"] = [str(DEPLOY / "prometheus" / "rules" / "*.yml")]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    out = subprocess.run([binary("promtool"), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for rule_file in RULES:
        assert str(rule_file) in out.stdout, f"promtool did not load {rule_file.name}"


def test_amtool_accepts_the_alertmanager_configuration(compose: dict[str, Any]) -> None:
    assert host_path(compose, "alertmanager", "/etc/alertmanager/alertmanager.yml") == ALERTMANAGER_YML
    out = subprocess.run(
        [binary("amtool"), "check-config", str(ALERTMANAGER_YML)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    config = load_yaml(ALERTMANAGER_YML)
    names = set(alert_names())
    for rule in config["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            if m := re.fullmatch(r'alertname="(\w+)"', matcher):
                assert m.group(1) in names, f"inhibit rule names unknown alert {m.group(1)}"


def test_grafana_datasource_and_dashboard_are_provisioned(compose: dict[str, Any]) -> None:
    provisioning = host_path(compose, "grafana", "/etc/grafana/provisioning")
    datasources = [d for f in (provisioning / "datasources").glob("*.yml") for d in load_yaml(f)["datasources"]]
    [prom] = [d for d in datasources if d["type"] == "prometheus"]
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", prom["url"]).groups()  # type: ignore[union-attr]
    assert host == "prometheus" and int(port) in container_ports(service(compose, "prometheus"))

    providers = [p for f in (provisioning / "dashboards").glob("*.yml") for p in load_yaml(f)["providers"]]
    [provider] = providers
    folder = host_path(compose, "grafana", provider["options"]["path"])
    assert DASHBOARD in set(folder.glob("*.json"))
    home = service(compose, "grafana")["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path(compose, "grafana", home) == DASHBOARD

    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    uids = {d["uid"] for d in datasources}
    assert dashboard["uid"] == "rematd"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    known = exported_names() | recorded_names() | {"up"}
    drawn = set()
    for panel in dashboard["panels"]:
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] in uids, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} queries nothing"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in uids
            names = set(METRIC.findall(target["expr"]))
            assert names and names <= known, f"{panel['title']}: unknown series {names - known}"
            drawn |= names
            assert set(re.findall(r"\$(\w+)", target["expr"])) <= variables
    service_wide = {"rematd_active_streams", "rematd_invalid_messages_total"}
    per_job = {n for n in exported_names() if n.startswith("rematd_") and not n.endswith("_created")} - service_wide
    assert per_job <= drawn, f"series on no panel: {per_job - drawn}"
