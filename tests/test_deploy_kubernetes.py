"""deploy/kubernetes rendered by `kubectl kustomize` (kubectl 1.37 from PyPI) and validated: no cluster runs here.

* Every built-in object is validated strictly (unknown fields are errors) by kubernetes-validate against
  Kubernetes 1.30.0 and 1.37.0.
* The ServiceMonitor and the PrometheusRule are CRD kinds, not in those schemas: their fields are checked
  here by hand from the monitoring.coreos.com/v1 CRDs, and the PrometheusRule holds exactly the groups of
  deploy/prometheus/rules/triton.rules.yml.
* Overlays: gpu, cpu, and both on Triton 2.51.0 (components/triton-24.10); the HPA and its adapter rule.

Cross-checks with compose and the release's flags: tests/test_deploy_release.py.
"""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from resnet18_kit.contract import ALL_MODELS, PREPROCESS_MODEL, REPO_ROOT, TORCHSCRIPT_MODEL
from resnet18_kit.repository import ModelRepository
from resnet18_kit.observe.model_config import variant_config

pytestmark = pytest.mark.deploy

KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
KUSTOMIZE_ROOT = REPO_ROOT / "deploy" / "kubernetes"
#: Overlays on the default release (26.08) and on the embedded server's (24.10), and the base.
KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu", "overlays/cpu-24.10", "overlays/gpu-24.10")
LOADER_POD = KUSTOMIZE_ROOT / "tools" / "model-loader.yaml"
ADAPTER_VALUES = KUSTOMIZE_ROOT / "prometheus-adapter" / "values.yaml"
RULES_FILE = REPO_ROOT / "deploy" / "prometheus" / "rules" / "triton.rules.yml"
RENDER_SCRIPT = REPO_ROOT / "deploy" / "prometheus" / "render_prometheusrule.py"
VENV_BIN = Path(sys.executable).parent
BUILT_IN_KINDS = {"Deployment", "Service", "PersistentVolumeClaim", "HorizontalPodAutoscaler",
                  "PodDisruptionBudget", "Pod"}
SERVICE_MONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")
PROMETHEUS_RULE = ("monitoring.coreos.com/v1", "PrometheusRule")
CUSTOM_KINDS = {SERVICE_MONITOR, PROMETHEUS_RULE}
DURATION = r"(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?"

#: The shipped model repository of this checkout.
SHIPPED = ModelRepository(REPO_ROOT / "model_repository")


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


_rendered: dict[str, list[dict]] = {}


def kustomize(path: str) -> list[dict]:
    if path not in _rendered:
        kubectl = VENV_BIN / "kubectl"
        if not (kubectl.is_file() and os.access(kubectl, os.X_OK)):
            pytest.fail(f"{kubectl} is missing: run `scripts/setup.sh test` (what `make test` runs first)")
        result = run([str(kubectl), "kustomize", str(KUSTOMIZE_ROOT / path)])
        assert result.returncode == 0, result.stderr
        _rendered[path] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return _rendered[path]


def kind(objects: list[dict], kind_name: str) -> dict:
    """The one object of that kind (of several, the one named `triton`)."""
    found = [o for o in objects if o["kind"] == kind_name]
    if len(found) > 1:
        found = [o for o in found if o["metadata"]["name"] == "triton"]
    (obj,) = found
    return obj


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag_value(args: list[str], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_kustomize_renders(path):
    kinds = sorted(o["kind"] for o in kustomize(path))
    assert kinds == sorted(["Deployment", "HorizontalPodAutoscaler", "PersistentVolumeClaim", "PodDisruptionBudget",
                            "PrometheusRule", "Service", "Service", "ServiceMonitor"])


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", [*KUSTOMIZATIONS, "tools/model-loader.yaml"])
def test_kubernetes_validate_strict(path, version):
    objects = [yaml.safe_load(LOADER_POD.read_text())] if path.endswith(".yaml") else kustomize(path)
    checked = 0
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue  # test_service_monitor, test_prometheus_rule
        assert obj["kind"] in BUILT_IN_KINDS, f"{obj['kind']}: add it to the kinds this test knows"
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked == (1 if path.endswith(".yaml") else 6)


def test_kubernetes_validate_is_strict():
    deployment = copy.deepcopy(kind(kustomize("base"), "Deployment"))
    container(deployment)["not_a_field"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_service_monitor(path):
    """ServiceMonitor (monitoring.coreos.com/v1): kubernetes-validate has no schema for it."""
    objects = kustomize(path)
    (monitor,) = [o for o in objects if (o["apiVersion"], o["kind"]) == SERVICE_MONITOR]
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"} and monitor["metadata"]["name"]
    spec = monitor["spec"]
    # The CRD's schema: spec required; in spec, selector and endpoints required.
    assert {"selector", "endpoints"} <= set(spec) and set(spec["selector"]) <= {"matchLabels", "matchExpressions"}
    services = [o for o in objects
                if o["kind"] == "Service" and selects(spec["selector"]["matchLabels"], o["metadata"]["labels"])]
    assert len(services) == 1, "the ServiceMonitor must select one Service, or pods are scraped twice"
    # The job label Prometheus gives Triton's series is that Service's name: the rules' up{job="triton"}.
    assert services[0]["metadata"]["name"] == "triton"
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
        assert re.fullmatch(DURATION, endpoint["interval"]) and endpoint["interval"]


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_prometheus_rule(path):
    """PrometheusRule (monitoring.coreos.com/v1): the CRD's fields, checked by hand."""
    (rule,) = [o for o in kustomize(path) if (o["apiVersion"], o["kind"]) == PROMETHEUS_RULE]
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"} and rule["metadata"]["name"]
    assert set(rule["spec"]) == {"groups"}
    names = [group["name"] for group in rule["spec"]["groups"]]
    assert len(names) == len(set(names)), f"group names must be unique: {names}"
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules", "partial_response_strategy", "limit"}, group["name"]
        for item in group["rules"]:
            assert set(item) <= {"record", "alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, item
            assert ("record" in item) != ("alert" in item), f"{group['name']}: a rule records or alerts: {item}"
            assert isinstance(item["expr"], str) and item["expr"].strip(), item
            assert re.fullmatch(DURATION, item.get("for", "0s")), item
            for field in ("labels", "annotations"):
                assert all(isinstance(v, str) for v in item.get(field, {}).values()), (field, item)
            if "alert" in item:
                assert item["labels"]["severity"] in ("warning", "critical"), item["alert"]
                assert {"summary", "description"} <= set(item["annotations"]), item["alert"]


def test_prometheus_rule_holds_the_groups_of_the_rules_file():
    """One source of truth: the PrometheusRule is written from the compose rules file by a script."""
    result = run([sys.executable, str(RENDER_SCRIPT), "--check"])
    assert result.returncode == 0, result.stderr
    (rule,) = [o for o in kustomize("base") if (o["apiVersion"], o["kind"]) == PROMETHEUS_RULE]
    assert rule["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"]


def test_overlays():
    gpu, cpu = (container(kind(kustomize(p), "Deployment")) for p in ("overlays/gpu", "overlays/cpu"))
    assert flag_value(gpu["args"], "--model-config-name") == ["gpu"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    gpu_pod = kind(kustomize("overlays/gpu"), "Deployment")["spec"]["template"]["spec"]
    assert gpu_pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in gpu_pod["tolerations"])
    assert flag_value(cpu["args"], "--model-config-name") == []  # every model's config.pbtxt
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    cpu_pod = kind(kustomize("overlays/cpu"), "Deployment")["spec"]["template"]["spec"]
    assert "nodeSelector" not in cpu_pod and "tolerations" not in cpu_pod


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/gpu"])
def test_the_24_10_overlays_change_only_the_release(overlay):
    """overlays/<x>-24.10 = overlays/<x> with the 24.10 image and the argument 2.51 lacks swapped, nothing else."""
    patched = copy.deepcopy(kustomize(overlay + "-24.10"))
    original = kustomize(overlay)
    deployment = kind(patched, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert images == {"triton-resnet18:24.10"}
    assert {c["image"] for c in kind(original, "Deployment")["spec"]["template"]["spec"]["containers"]} == \
        {"triton-resnet18:26.08"}
    env = {e["name"]: e.get("value") for e in container(deployment)["env"]}
    assert env["TRITON_HTTP_INPUT_LIMIT_ARG"] == "--log-info=true"
    # Undo those two changes: what remains must equal the 26.08 overlay (env compared by name: the patch
    # moves the entry it merges to the front of the list, which changes nothing for the kubelet).
    for c in pod["containers"] + pod["initContainers"]:
        c["image"] = "triton-resnet18:26.08"
    for e in container(deployment)["env"]:
        if e["name"] == "TRITON_HTTP_INPUT_LIMIT_ARG":
            e["value"] = "--http-max-input-size=20065536"
    original = copy.deepcopy(original)
    for objects in (patched, original):
        c = container(kind(objects, "Deployment"))
        c["env"] = sorted(c["env"], key=lambda e: e["name"])
    assert patched == original


def test_deployment_wiring():
    objects = kustomize("overlays/gpu")
    deployment, hpa = kind(objects, "Deployment"), kind(objects, "HorizontalPodAutoscaler")
    pod, c = deployment["spec"]["template"]["spec"], container(deployment)
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert port_names == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert c["readinessProbe"]["httpGet"]["path"] == c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert "/opt/resnet18-kit/probe.py" in c["livenessProbe"]["exec"]["command"]
    assert c["livenessProbe"]["timeoutSeconds"] >= 10, "one probe round takes up to 8.5 s"
    assert all(c[p]["httpGet"]["port"] in port_names for p in ("readinessProbe", "startupProbe"))
    exit_timeout = int(flag_value(c["args"], "--exit-timeout-secs")[0])
    assert pod["terminationGracePeriodSeconds"] > exit_timeout
    volumes_by_name = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert volumes_by_name[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    repository = mounts[flag_value(c["args"], "--model-repository")[0]]
    claim = volumes_by_name[repository["name"]]["persistentVolumeClaim"]
    assert repository["readOnly"] and claim["readOnly"]
    pvc = kind(objects, "PersistentVolumeClaim")
    loader = yaml.safe_load(LOADER_POD.read_text())
    (loader_volume,) = loader["spec"]["volumes"]
    assert claim["claimName"] == pvc["metadata"]["name"] == loader_volume["persistentVolumeClaim"]["claimName"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    env = {e["name"]: e for e in c["env"]}
    assert env["TRITON_ADMIN_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "triton-admin", "key": "key"}
    # Every $(VAR) in the arguments is defined in the container's env (else the kubelet passes it verbatim).
    for name in re.findall(r"\$\((\w+)\)", " ".join(c["args"])):
        assert name in env, f"$({name}) in the arguments, but no env var {name}"
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"]}
    assert hpa["spec"]["scaleTargetRef"] == target
    assert "replicas" not in deployment["spec"]  # the HPA owns it
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = {s["metadata"]["name"]: s for s in objects if s["kind"] == "Service"}
    for service in services.values():
        assert selects(service["spec"]["selector"], labels)
        assert all(p["targetPort"] in port_names for p in service["spec"]["ports"])
    assert services["triton-grpc"]["spec"]["clusterIP"] == "None"
    assert [p["name"] for p in services["triton-grpc"]["spec"]["ports"]] == ["grpc"]
    assert selects(kind(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)


def adapter_rules() -> list[dict]:
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    assert values["rules"]["default"] is False
    return values["rules"]["custom"]


def test_hpa_scales_on_the_triton_queue_metric():
    (rule,) = adapter_rules()
    assert re.fullmatch(r"nv_inference_pending_request_count\{.*\}", rule["seriesQuery"])
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    for template in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert template in rule["metricsQuery"]
    for path in KUSTOMIZATIONS:
        (metric,) = kind(kustomize(path), "HorizontalPodAutoscaler")["spec"]["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    for model in re.findall(r'model=~?"([^"]+)"', rule["seriesQuery"] + rule["metricsQuery"]):
        assert set(model.split("|")) <= set(ALL_MODELS)


@pytest.mark.parametrize("path", ["overlays/gpu", "overlays/cpu"])
def test_hpa_target_follows_the_batching_of_the_configs_the_overlay_loads(path):
    """Target = max_batch_size, a full batch waiting (the largest preferred batch of resnet18_onnx; for
    resnet18_torchscript on the CPU two of its preferred 8), at most a quarter of max_queue_size."""
    objects = kustomize(path)
    (variant,) = flag_value(container(kind(objects, "Deployment"))["args"], "--model-config-name") or ["default"]
    (metric,) = kind(objects, "HorizontalPodAutoscaler")["spec"]["metrics"]
    target = int(metric["pods"]["target"]["averageValue"])
    for model in ALL_MODELS:
        config = variant_config(SHIPPED, model, variant)
        if config.platform == "ensemble":
            continue
        batching = config.dynamic_batching
        assert target == config.max_batch_size, model
        if model != PREPROCESS_MODEL:  # preprocess sends each request to a free instance (preferred [1])
            assert target == max(batching.preferred_batch_size) or (
                model == TORCHSCRIPT_MODEL and target % max(batching.preferred_batch_size) == 0), model
        assert 4 * target <= batching.default_queue_policy.max_queue_size, model
