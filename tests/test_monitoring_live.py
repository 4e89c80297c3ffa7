"""The monitoring in deploy/ against a real Prometheus (Debian's 2.42) scraping a real embedded Triton 2.51.

One server (the reliability echo model: y = x after 200 ms, batches of up to 4, a queue of 8) and one
Prometheus (scrape and rule evaluation every second, the shipped rules with `for:` shortened to
TEST_FOR_S) serve every test here. A flood of concurrent clients keeps the echo's queue full.

* The overload alert goes pending, then firing, under the flood, and clears once it stops; its state
  changes are printed with their times (`pytest -s` shows them).
* The HPA's signal: prometheus-adapter's query (deploy/kubernetes/prometheus-adapter/values.yaml), its
  template filled in as the adapter does for one pod, gives the number the HPA would see.
* Every query of the Grafana dashboard returns data under load.
* Every Triton metric named by the rules, the dashboard and the adapter is one the server exports.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from resnet18_kit.contract import REPO_ROOT
from resnet18_kit.observe.model_config import max_queue_size, read_config
from resnet18_kit.tools.reliability import ECHO_MODEL, RELIABILITY_REPOSITORY, repository_with
from resnet18_kit.server.config import config_on_free_ports, free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer

pytestmark = [pytest.mark.live, pytest.mark.deploy]

PROMETHEUS = Path("/usr/bin/prometheus")
RULES_FILE = REPO_ROOT / "deploy" / "prometheus" / "rules" / "triton.rules.yml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "triton.json"
ADAPTER_VALUES = REPO_ROOT / "deploy" / "kubernetes" / "prometheus-adapter" / "values.yaml"
OVERLOAD_ALERT = "TritonModelQueueNearlyFull"
#: `for:` of every alert in the test copy of the rules, in seconds (the shipped rules wait minutes).
TEST_FOR_S = 3
#: Labels the Prometheus Operator would add to the scraped series; the adapter maps them to the pod.
POD_LABELS = {"namespace": "triton-test", "pod": "triton-0"}
FLOOD_CLIENTS = 32
REFUSED_RETRY_S = 0.05
#: The window Grafana's $__rate_interval stands for here (several 1 s scrapes).
RATE_INTERVAL = "10s"
RATE_INTERVAL_S = 10


def echo_max_queue_size() -> int:
    """max_queue_size of the echo model's config.pbtxt (8)."""
    return max_queue_size(read_config(RELIABILITY_REPOSITORY / ECHO_MODEL / "config.pbtxt"))


def rules_for_test(for_s: int) -> dict:
    """The shipped rules with every `for:` set to `for_s` seconds, and the echo model's queue bound added to
    the model limits (as the shipped file lists the product's models)."""
    rules = yaml.safe_load(RULES_FILE.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = f"{for_s}s"
        if group["name"] == "triton-model-limits":
            group["rules"].append({"record": "triton:model_max_queue_size", "expr": f"vector({echo_max_queue_size()})",
                                   "labels": {"model": ECHO_MODEL}})
    return rules



class Prometheus:
    """A prometheus process on a free port with its own storage, scraping Triton metrics ports: one
    (labelled POD_LABELS) or, for a fleet, several, each labelled as its own pod (`pods`: port -> pod)."""

    def __init__(self, workdir: Path, metrics_port: int | None = None, pods: dict[int, str] | None = None):
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}"
        (workdir / "rules.yml").write_text(yaml.safe_dump(rules_for_test(TEST_FOR_S)))
        pods = pods or {metrics_port: POD_LABELS["pod"]}
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(workdir / "rules.yml")],
            "scrape_configs": [{"job_name": "triton", "static_configs": [
                {"targets": [f"127.0.0.1:{metrics_port}"], "labels": POD_LABELS | {"pod": pod}}
                for metrics_port, pod in pods.items()]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params) -> dict:
        """GET an API path; the JSON answer's `data`."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict, float]]:
        """Instant query: (labels, value) per series."""
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]

    def wait_until(self, what: str, condition, timeout_s: float):
        """Poll `condition()` every 0.25 s until it returns something truthy; fail naming `what`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited: {self.log.name}"
            try:
                value = condition()
            except OSError:  # not listening yet
                value = None
            if value:
                return value
            time.sleep(0.25)
        pytest.fail(f"after {timeout_s:.0f} s: {what}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


class Flood:
    """FLOOD_CLIENTS threads sending the echo model requests back to back over gRPC, so that its queue stays
    full: 12 requests fit (4 running, 8 queued), an answered client sends again at once, a refused one after
    REFUSED_RETRY_S. start() and stop() may be called again."""

    def __init__(self, url: str):
        self.url = url
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.counts = {"answered": 0, "refused": 0}
        self.lock = threading.Lock()
        self.started_at: float | None = None

    def _client(self) -> None:
        x = grpcclient.InferInput("x", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
        with grpcclient.InferenceServerClient(self.url) as client:
            while not self.stop_event.is_set():
                try:
                    client.infer(ECHO_MODEL, [x])
                    outcome = "answered"
                except InferenceServerException:
                    outcome = "refused"
                    time.sleep(REFUSED_RETRY_S)
                with self.lock:
                    self.counts[outcome] += 1

    def start(self) -> None:
        if self.threads:
            return
        self.stop_event.clear()
        self.started_at = time.monotonic()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(FLOOD_CLIENTS)]
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(30)
        self.threads = []


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    repository = repository_with([ECHO_MODEL], tmp_path_factory.mktemp("repository") / "models")
    server = EmbeddedTritonServer(config_on_free_ports(model_repository=repository),
                                  log_path=tmp_path_factory.mktemp("triton") / "tritonserver.log")
    server.start()
    yield server
    server.stop(drain_s=0)


@pytest.fixture(scope="module")
def prometheus(triton, tmp_path_factory):
    if not PROMETHEUS.is_file():
        pytest.fail(f"{PROMETHEUS} is missing: run `scripts/setup.sh test` (it installs Prometheus)")
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), triton.config.metrics_port)
    try:
        server.wait_until("prometheus scraping triton (up == 1)",
                          lambda: [v for _, v in server.query('up{job="triton"}') if v == 1], timeout_s=30)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def flood(triton):
    load = Flood(triton.config.grpc_url)
    yield load
    load.stop()


def overload_state(prometheus: Prometheus) -> tuple[str, str | None]:
    """(state, value) of the overload alert for the echo model: inactive, pending or firing."""
    for alert in prometheus.get("/api/v1/alerts")["alerts"]:
        if alert["labels"]["alertname"] == OVERLOAD_ALERT and alert["labels"].get("model") == ECHO_MODEL:
            return alert["state"], alert.get("value")
    return "inactive", None


def test_overload_alert_goes_pending_then_firing_and_clears(prometheus, flood):
    prometheus.wait_until("the overload alert inactive before the flood",
                          lambda: overload_state(prometheus)[0] == "inactive", timeout_s=30)
    changes = [(0.0, time.strftime("%H:%M:%S"), "inactive", None)]
    started = time.monotonic()

    def watch(until_state: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state, value = overload_state(prometheus)
            value = None if value is None else float(value)
            if state != changes[-1][2]:
                changes.append((time.monotonic() - started, time.strftime("%H:%M:%S"), state, value))
                print(f"[+{changes[-1][0]:5.1f} s] {changes[-1][1]} {OVERLOAD_ALERT}{{model={ECHO_MODEL}}}: "
                      f"{changes[-2][2]} -> {state} (queue fill {'-' if value is None else value})", flush=True)
            if state == until_state:
                return
            time.sleep(0.2)
        pytest.fail(f"{OVERLOAD_ALERT} not {until_state} within {timeout_s:.0f} s; states seen: {changes}")

    print(f"\n[+  0.0 s] {changes[0][1]} flood starts: {FLOOD_CLIENTS} clients, queue bound {echo_max_queue_size()}, "
          f"alert for: {TEST_FOR_S} s", flush=True)
    flood.start()
    watch("firing", timeout_s=40)
    stop_at, stop_wall = time.monotonic() - started, time.strftime("%H:%M:%S")
    flood.stop()
    print(f"[+{stop_at:5.1f} s] {stop_wall} flood stopped: {flood.counts}", flush=True)
    watch("inactive", timeout_s=30)
    states = [state for _, _, state, _ in changes]
    # A dip of the queue fill under the threshold for one evaluation (2 busy cores) sends a pending alert
    # back to inactive, and `for:` starts again: that is the rule working, so pending/inactive may repeat
    # before it fires; it must fire once and then clear.
    assert states[-3:] == ["pending", "firing", "inactive"] and states.count("firing") == 1, changes
    assert set(states[:-3]) <= {"inactive", "pending"}, changes
    pending_s, firing_s = changes[-3][0], changes[-2][0]
    assert firing_s - pending_s >= TEST_FOR_S - 0.5, changes  # `for:` held it pending first
    assert changes[-2][3] >= 0.75 and changes[-1][0] - stop_at < 20, changes
    assert flood.counts["answered"] > 0 and flood.counts["refused"] > 0, flood.counts


def substitute_dashboard_variables(expr: str) -> str:
    """A panel query with the dashboard's variables given concrete values (the echo model)."""
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model", ECHO_MODEL)


def test_dashboard_queries_return_data_under_load(prometheus, flood):
    flood.start()
    prometheus.wait_until("the echo model's inference rate > 0 under the flood", lambda: [
        v for _, v in prometheus.query(f'sum(rate(nv_inference_count{{model="{ECHO_MODEL}"}}[{RATE_INTERVAL}]))')
        if v > 0], timeout_s=30)
    # A rate window wholly inside the flood, so that the values are the steady state's.
    time.sleep(max(0.0, RATE_INTERVAL_S + 1 - (time.monotonic() - flood.started_at)))
    dashboard = json.loads(DASHBOARD.read_text())
    print()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = substitute_dashboard_variables(target["expr"])
            assert "$" not in expr, f"{panel['title']}: a variable left in {expr}"
            result = prometheus.query(expr)
            values = {json.dumps(labels, sort_keys=True): value for labels, value in result}
            print(f"{panel['title']} / {target['legendFormat']}: {values}", flush=True)
            assert result, f"panel '{panel['title']}' target {target['refId']} returned nothing: {expr}"
            assert all(math.isfinite(v) and v >= 0 for v in values.values()), (panel["title"], values)
    assert prometheus.query(f'sum(rate(nv_inference_count{{model="{ECHO_MODEL}"}}[{RATE_INTERVAL}]))')[0][1] > 0


def adapter_query(pods: tuple[str, ...] = (POD_LABELS["pod"],)) -> str:
    """prometheus-adapter's metricsQuery as the adapter sends it for `pods` (an HPA's target pods: the
    adapter asks for all of them in one query, `pod=~"a|b"`, grouped by pod)."""
    (rule,) = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    series = re.fullmatch(r"(\w+)\{.*\}", rule["seriesQuery"]).group(1)
    matchers = f'namespace="{POD_LABELS["namespace"]}",pod=~"{"|".join(pods)}"'
    return (rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
            .replace("<<.GroupBy>>", "pod"))


def test_hpa_signal_under_load(prometheus, flood):
    flood.start()
    query = adapter_query()
    assert "<<" not in query, query
    prometheus.wait_until("the echo model's queue full in Prometheus", lambda: [
        v for _, v in prometheus.query(f'nv_inference_pending_request_count{{model="{ECHO_MODEL}"}}')
        if v >= echo_max_queue_size() / 2], timeout_s=30)
    ((labels, value),) = prometheus.query(query)
    print(f"\nHPA signal triton_pending_requests{{pod={labels.get('pod')}}} = {value:.2f} (query: {query})", flush=True)
    assert labels == {"pod": POD_LABELS["pod"]}
    # A 1-minute average of a queue of 8 that has been full for some seconds: above 0, at most the bound.
    assert 0 < value <= echo_max_queue_size(), value


def metric_names(expr: str) -> set[str]:
    """Triton metric names (nv_*) a PromQL expression or adapter rule names."""
    return set(re.findall(r"\bnv_[a-z0-9_]+\b", expr))


def queries_in_deploy() -> dict[str, str]:
    """Every PromQL text in deploy/: rules, dashboard targets and the adapter rule, by where it is."""
    found = {}
    for group in yaml.safe_load(RULES_FILE.read_text())["groups"]:
        for rule in group["rules"]:
            found[f"{RULES_FILE.name}: {rule.get('alert') or rule.get('record')}"] = rule["expr"]
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            found[f"{DASHBOARD.name}: {panel['title']} {target['refId']}"] = target["expr"]
    for template in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if template["type"] == "query":
            found[f"{DASHBOARD.name}: variable {template['name']}"] = template["definition"]
    (rule,) = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    found[f"{ADAPTER_VALUES.name}: {rule['name']['as']}"] = " ".join(
        [rule["seriesQuery"], rule["name"]["matches"], rule["metricsQuery"]])
    return found


def unexported(queries: dict[str, str], exported: set[str]) -> dict[str, list[str]]:
    """Metric names the queries use that the server does not export: {name: [where, ...]}."""
    missing: dict[str, list[str]] = {}
    for where, expr in queries.items():
        for name in sorted(metric_names(expr) - exported):
            missing.setdefault(name, []).append(where)
    return missing


def test_every_metric_named_in_deploy_is_one_triton_exports(triton):
    with urllib.request.urlopen(triton.config.metrics_url, timeout=10) as response:
        text = response.read().decode()
    exported = set(re.findall(r"^# TYPE (\w+) ", text, re.M))
    assert "nv_inference_pending_request_count" in exported, text[:500]
    queries = queries_in_deploy()
    assert sum(1 for q in queries.values() if metric_names(q)) >= 15, queries  # the extraction finds names
    assert not unexported(queries, exported), f"not exported by Triton 2.51: {unexported(queries, exported)}"
    # A misspelt metric is named, with where it is used.
    bad = {"dashboard.json: Throughput A": "sum(rate(nv_inference_counts[1m]))"}
    assert unexported(bad, exported) == {"nv_inference_counts": ["dashboard.json: Throughput A"]}


def test_rules_and_hpa_signal_over_a_fleet(tmp_path_factory):
    """Two echo replicas behind HAProxy (resnet18-kit fleet's classes), one Prometheus scraping both metrics
    ports as two pods: the flood goes through HAProxy's gRPC front end, the queue alert fires for each
    replica, and the adapter's query (both pods in one query, as the HPA asks) gives each pod's signal."""
    from resnet18_kit.fleet.fleet import Fleet
    from resnet18_kit.tools.reliability.fleet_scenarios import fleet_config, light_repository

    repository = light_repository(tmp_path_factory.mktemp("fleet-repository") / "models")
    fleet = Fleet(fleet_config(repository, tmp_path_factory.mktemp("fleet"), replicas=2))
    fleet.start()
    pods = {c.metrics_port: f"triton-{i}" for i, c in enumerate(fleet.config.replicas)}
    prometheus = Prometheus(tmp_path_factory.mktemp("prometheus-fleet"), pods=pods)
    flood = Flood(fleet.config.front.server_config().grpc_url)
    try:
        prometheus.wait_until("prometheus scraping both replicas", lambda: len(
            [v for _, v in prometheus.query('up{job="triton"}') if v == 1]) == 2, timeout_s=30)
        flood.start()

        def firing_pods() -> set[str]:
            return {a["labels"].get("pod") for a in prometheus.get("/api/v1/alerts")["alerts"]
                    if a["labels"]["alertname"] == OVERLOAD_ALERT and a["state"] == "firing"}

        fired = prometheus.wait_until(f"{OVERLOAD_ALERT} firing for both replicas",
                                      lambda: firing_pods() if firing_pods() == set(pods.values()) else None,
                                      timeout_s=40)
        query = adapter_query(tuple(pods.values()))
        signal = dict(prometheus.wait_until("the HPA signal for both pods", lambda: (
            lambda r: r if len(r) == 2 and all(v > 0 for _, v in r) else None)(
            [(labels["pod"], value) for labels, value in prometheus.query(query)]), timeout_s=30))
        print(f"\nfleet of 2: {OVERLOAD_ALERT} firing for {sorted(fired)}; HPA signal per pod {signal}; "
              f"the HPA's average {sum(signal.values()) / len(signal):.2f} (query: {query})", flush=True)
        assert set(signal) == set(pods.values())
        assert all(0 < v <= echo_max_queue_size() for v in signal.values()), signal
        assert all(status == {"UP"} for status in (fleet.status(0), fleet.status(1))), fleet.statuses()
    finally:
        flood.stop()
        prometheus.stop()
        fleet.stop()
