"""Write deploy/kubernetes/prometheusrule.yaml from deploy/prometheus/rules/*.yml.

python deploy/render_prometheusrule.py          # write it
python deploy/render_prometheusrule.py --check  # exit 1 when the committed file differs

The rule files are the source: promtool tests them, compose loads them, and the Prometheus
operator gets the same groups through this PrometheusRule.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent
RULES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
TARGET = DEPLOY / "kubernetes" / "prometheusrule.yaml"
HEADER = """\
# Generated from deploy/prometheus/rules/*.yml by: python deploy/render_prometheusrule.py
# Do not edit; edit the rule files (and their promtool tests) and render again.
# The operator's ruleSelector must match these labels (kube-prometheus-stack selects
# release: <its release name> by default).
"""


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings, so expressions and descriptions stay readable."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def groups() -> list[dict[str, Any]]:
    merged: list[dict[str, Any]] = []
    for path in RULES:
        with path.open(encoding="utf-8") as f:
            merged += yaml.safe_load(f)["groups"]
    return merged


def render() -> str:
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "rematd",
            "labels": {
                "app.kubernetes.io/name": "rematd",
                "app.kubernetes.io/component": "server",
                "release": "kube-prometheus-stack",
            },
        },
        "spec": {"groups": groups()},
    }
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=4096, allow_unicode=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the committed file differs")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not TARGET.exists() or TARGET.read_text(encoding="utf-8") != text:
            print(f"{TARGET.relative_to(DEPLOY.parent)} is out of date; run: python deploy/render_prometheusrule.py")
            return 1
        print(f"{TARGET.relative_to(DEPLOY.parent)} is up to date")
        return 0
    TARGET.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
