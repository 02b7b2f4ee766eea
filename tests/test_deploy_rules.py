"""The Prometheus rules: promtool checks and unit tests for real, and what operators read."""

from __future__ import annotations

import re
import subprocess

import pytest

from .deploy_helpers import DEPLOY, RULE_TESTS, RULES, binary, exported_names, load_yaml, recorded_names

README = DEPLOY / "README.md"


def github_anchors(markdown: str) -> set[str]:
    """Heading anchors as GitHub renders them: lower case, punctuation dropped, spaces to dashes."""
    anchors = set()
    for line in markdown.splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def rules() -> list[dict[str, object]]:
    return [r for path in RULES for g in load_yaml(path)["groups"] for r in g["rules"]]


def test_promtool_check_rules() -> None:
    out = subprocess.run(
        [binary("promtool"), "check", "rules", *map(str, RULES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(RULES)


@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_promtool_test_rules(test_file: object) -> None:
    out = subprocess.run(
        [binary("promtool"), "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_rule_file_has_a_unit_test_and_every_alert_is_tested() -> None:
    tested_files = set()
    tested_alerts = set()
    for path in RULE_TESTS:
        doc = load_yaml(path)
        tested_files |= {(path.parent / f).resolve() for f in doc["rule_files"]}
        for group in doc["tests"]:
            for case in group.get("alert_rule_test", []):
                # An alert counts as tested when some case expects it to fire and some case expects silence.
                tested_alerts.add((case["alertname"], bool(case["exp_alerts"])))
    assert {p.resolve() for p in RULES} <= tested_files
    for rule in rules():
        if "alert" in rule:
            assert (rule["alert"], True) in tested_alerts, f"{rule['alert']}: no test makes it fire"
            assert (rule["alert"], False) in tested_alerts, f"{rule['alert']}: no test keeps it silent"


def test_alerts_carry_summary_description_and_a_runbook_in_the_readme() -> None:
    anchors = github_anchors(README.read_text(encoding="utf-8"))
    for rule in rules():
        if "alert" not in rule:
            continue
        name = rule["alert"]
        ann = rule["annotations"]
        assert isinstance(ann, dict)
        assert ann["summary"] and len(ann["description"]) > 80, f"{name}: say what happened and what to do"
        assert ann["runbook_url"] == f"deploy/README.md#{str(name).lower()}", name
        assert str(name).lower() in anchors, f"deploy/README.md has no section for {name}"
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}  # type: ignore[index]


def test_rules_use_only_metrics_rematd_exports() -> None:
    exported = exported_names()
    assert "rematd_oom_risk_ratio" in exported and "process_open_fds" in exported
    for rule in rules():
        expr = str(rule["expr"])
        names = set(re.findall(r"\b(rematd_\w+|process_\w+)", expr))
        assert names <= exported, f"{rule.get('alert') or rule.get('record')}: unknown {names - exported}"


def test_readme_documents_every_metric_and_recorded_series() -> None:
    readme = README.read_text(encoding="utf-8")
    names = {n for n in exported_names(per_rank=True) if not n.endswith("_created")} | recorded_names()
    missing = sorted(n for n in names if f"`{n}`" not in readme)
    assert not missing, f"deploy/README.md does not document {missing}"
