"""The recording rules, alerts and dashboard in deploy/, checked without a server.

* `promtool check rules` parses every rule (a rule that does not parse fails naming it, with promtool's
  message); `promtool test rules` runs the unit tests of deploy/prometheus/tests/ (and fails when an
  alert's threshold moves: shown on a copy with one changed).
* The model limits the rules hold (queue bound, preferred batch size per model) are the model configs'.
* Every recording rule the dashboard or the rules use is defined; the dashboard has the panels it
  promises, each with a query.

The same rules, dashboard and adapter query run against a live Triton and Prometheus in
tests/test_monitoring_live.py. promtool comes with Debian's prometheus package (scripts/setup_deploy_tools.sh).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from resnet18_kit.contract import ALL_MODELS, PREPROCESS_MODEL, REPO_ROOT
from resnet18_kit.repository import ModelRepository
from resnet18_kit.observe.model_config import max_queue_size, preferred_batch_sizes, variant_config

pytestmark = pytest.mark.deploy

PROMTOOL = Path("/usr/bin/promtool")
PROMETHEUS_DIR = REPO_ROOT / "deploy" / "prometheus"
RULES_FILE = PROMETHEUS_DIR / "rules" / "triton.rules.yml"
RULES_TESTS = PROMETHEUS_DIR / "tests" / "triton.rules.test.yml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "triton.json"
DEPLOYMENT_DOC = REPO_ROOT / "docs" / "deployment.md"
#: The config variants the deployments load: compose and overlays/gpu `gpu`, overlays/cpu the defaults.
DEPLOYED_VARIANTS = ("default", "gpu")
ALERTS = {"TritonModelQueueNearlyFull", "TritonModelFailingRequests", "TritonQueueTimeRising",
          "TritonBatchesSmallerThanPreferred", "TritonServerDown"}

#: The shipped model repository of this checkout.
SHIPPED = ModelRepository(REPO_ROOT / "model_repository")


def promtool(*args: str) -> subprocess.CompletedProcess:
    if not PROMTOOL.is_file():
        pytest.fail(f"{PROMTOOL} is missing: run `scripts/setup.sh test` (it installs Prometheus)")
    return subprocess.run([str(PROMTOOL), *args], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


def rule_problems(path: Path) -> str | None:
    """promtool's complaint about a rules file, or None when every rule parses."""
    result = promtool("check", "rules", str(path))
    return None if result.returncode == 0 else (result.stdout + result.stderr).strip()


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES_FILE.read_text())["groups"] for rule in group["rules"]]


def test_every_rule_parses():
    assert rule_problems(RULES_FILE) is None, rule_problems(RULES_FILE)
    result = promtool("check", "rules", str(RULES_FILE))
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout, result.stdout
    assert {rule["alert"] for rule in rules() if "alert" in rule} == ALERTS


def test_a_rule_that_does_not_parse_is_named(tmp_path):
    broken = RULES_FILE.read_text().replace('expr: up{job="triton"} == 0', 'expr: up{job="triton"} ==')
    assert broken != RULES_FILE.read_text()
    (tmp_path / "broken.rules.yml").write_text(broken)
    problem = rule_problems(tmp_path / "broken.rules.yml")
    assert problem is not None and "TritonServerDown" in problem and "parse error" in problem, problem


def test_rules_unit_tests_pass():
    result = promtool("test", "rules", str(RULES_TESTS))
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_unit_tests_fail_when_an_alert_threshold_moves(tmp_path):
    """The unit tests pin the thresholds: raising the overload threshold from 3/4 to 0.9 fails them."""
    shutil.copytree(PROMETHEUS_DIR / "rules", tmp_path / "rules")
    shutil.copytree(PROMETHEUS_DIR / "tests", tmp_path / "tests")
    copy = tmp_path / "rules" / RULES_FILE.name
    text = copy.read_text()
    assert text.count(">= 0.75") == 1
    copy.write_text(text.replace(">= 0.75", ">= 0.9"))
    result = promtool("test", "rules", str(tmp_path / "tests" / RULES_TESTS.name))
    assert result.returncode != 0 and "TritonModelQueueNearlyFull" in result.stdout + result.stderr, result.stdout


def model_limits(groups: list[dict]) -> dict[tuple[str, str], float]:
    """{(record name, model): value} of the rules' constant series (`expr: vector(N)` with a model label)."""
    limits = {}
    for group in groups:
        for rule in group["rules"]:
            match = re.fullmatch(r"vector\((\d+(?:\.\d+)?)\)", rule["expr"].strip())
            if match:
                limits[(rule["record"], rule["labels"]["model"])] = float(match.group(1))
    return limits


def limit_mismatches(groups: list[dict]) -> list[str]:
    """Where the rules' model limits differ from the model configs the deployments load, one line each."""
    limits = model_limits(groups)
    problems = [f"{record}{{model={model}}}: no such model" for record, model in limits if model not in ALL_MODELS]
    for variant in DEPLOYED_VARIANTS:
        for model in ALL_MODELS:
            config = variant_config(SHIPPED, model, variant)
            if config.platform == "ensemble":
                continue
            wanted = {"triton:model_max_queue_size": max_queue_size(config)}
            if model != PREPROCESS_MODEL:  # batches of 1 on purpose: no preferred size to fall short of
                # one series per model for every deployment: the largest over the configs they load
                wanted["triton:model_preferred_batch_size"] = max(
                    max(preferred_batch_sizes(variant_config(SHIPPED, model, v))) for v in DEPLOYED_VARIANTS)
            for record, value in wanted.items():
                if limits.get((record, model)) != value:
                    problems.append(f"{record}{{model={model}}} = {limits.get((record, model))}, "
                                    f"but the {variant} config of {model} says {value}")
    return problems


def test_the_rules_model_limits_are_the_model_configs():
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    assert not limit_mismatches(groups), limit_mismatches(groups)
    changed = RULES_FILE.read_text().replace("expr: vector(64)\n        labels: {model: resnet18_onnx}",
                                             "expr: vector(32)\n        labels: {model: resnet18_onnx}")
    problems = limit_mismatches(yaml.safe_load(changed)["groups"])
    assert problems and all("resnet18_onnx" in p for p in problems), problems


def test_every_recording_rule_used_is_defined():
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    texts = {f"rule {r.get('alert') or r.get('record')}": r["expr"] for r in rules()}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        texts.update({f"panel {panel['title']}": t["expr"] for t in panel["targets"]})
    for where, expr in texts.items():
        used = set(re.findall(r"\btriton:[a-z0-9_:]+", expr))
        assert used <= recorded, f"{where} uses {sorted(used - recorded)}, recorded by no rule"


def test_dashboard_panels_and_variables():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["definition"] == "label_values(nv_inference_count, model)"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in ("nv_inference_count", "nv_inference_exec_count", "nv_inference_queue_duration_us",
                   "nv_inference_compute_infer_duration_us", "nv_inference_pending_request_count",
                   "nv_inference_request_failure"):  # throughput, batch, queue vs compute, pending, failures
        assert metric in exprs, metric
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and set(panel["gridPos"]) == {"x", "y", "w", "h"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == panel["datasource"], panel["title"]
            assert "$model" in target["expr"] or "up{" in target["expr"], (panel["title"], target["expr"])


def test_every_alert_is_explained_in_the_deployment_doc():
    text = DEPLOYMENT_DOC.read_text()
    for alert in ALERTS:
        assert alert in text, f"{alert} is not explained in {DEPLOYMENT_DOC.relative_to(REPO_ROOT)}"
