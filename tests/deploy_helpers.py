"""Shared pieces of the deployment tests: paths, YAML loading, real binaries and processes."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rematd.planner.messages import OomReport
from rematd.server.metrics.registry import Metrics

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
RULES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
RULE_TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.yml"))
KUBERNETES = DEPLOY / "kubernetes"


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def load_yaml_documents(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def binary(name: str) -> str:
    """The path of a tool the tests run for real; a clear failure when it is missing."""
    path = shutil.which(name)
    if path is None:
        raise AssertionError(
            f"{name!r} is not on PATH: install the Debian package 'prometheus' "
            "(listed in scripts/system-packages.txt; make setup installs it as root)"
        )
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alert_names() -> list[str]:
    return [r["alert"] for path in RULES for g in load_yaml(path)["groups"] for r in g["rules"] if "alert" in r]


def exported_names(*, per_rank: bool = False) -> set[str]:
    """Every sample name rematd's registry exposes with a job running, read from a real exposition
    (with ``per_rank``, as ``--per-rank-metrics`` makes it)."""
    from rematd.server.core.advisor import AdvisorCore
    from rematd.server.store.store import Store

    from .test_service import hello, stats

    with tempfile.TemporaryDirectory() as tmp:
        metrics = Metrics(CollectorRegistry(), per_rank=per_rank)
        core = AdvisorCore(Store(Path(tmp) / "r.db"), metrics)
        session, _ = core.open_session(hello())
        core.on_stats(session, stats(0, 500))
        core.on_oom(session, OomReport(step=0))
        text = generate_latest(metrics.registry).decode()
        core.close_session(session, ended=False)
        core.store.close()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def recorded_names() -> set[str]:
    return {r["record"] for path in RULES for g in load_yaml(path)["groups"] for r in g["rules"] if "record" in r}
