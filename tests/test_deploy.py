"""Deployment files, checked by real tools: neither a Docker engine nor a cluster runs here.

* docker-compose.yaml: rendered by two compose parsers, Debian's docker-compose 1.29.2 and Compose v2.40.3
  (the Go implementation behind `docker compose`); both validate the file against the Compose schema.
* deploy/kubernetes: rendered by `kubectl kustomize` (kubectl 1.37 from PyPI), every built-in object
  validated strictly (unknown fields are errors) by kubernetes-validate against Kubernetes 1.30.0 and 1.37.0.
  The ServiceMonitor is a CRD kind, not in those schemas: its required fields are checked here by hand,
  from the monitoring.coreos.com/v1 CRD (spec.selector, spec.endpoints, endpoint fields, interval format).
* Cross-checks: the arguments name only models and config variants that exist in model_repository/,
  every flag exists in Triton 2.51's tritonserver / perf_analyzer (the bundled binaries of the same
  release as the image), compose and Kubernetes pass the same server arguments, the artifact checks run
  in a real shell, and the shm size and HPA target agree with the model configs.

The tools are installed by scripts/setup_deploy_tools.sh (run by `make setup`); a missing tool fails.
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
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from resnet18_kit.contract import (ALL_MODELS, MODEL_REPOSITORY, ONNX_INT8_PATH, ONNX_PATH, PREPROCESS_MODEL, REPO_ROOT,
                              TORCHSCRIPT_PATH, WARMUP_IMAGE_PATH)
from resnet18_kit.server.embedded import library_path, server_environment, tritonserver_binary

KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"
COMPOSE_FILE = REPO_ROOT / "docker-compose.yaml"
DOCKERFILE = REPO_ROOT / "deploy" / "docker" / "Dockerfile"
KUSTOMIZE_ROOT = REPO_ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu")
LOADER_POD = KUSTOMIZE_ROOT / "tools" / "model-loader.yaml"
ADAPTER_VALUES = KUSTOMIZE_ROOT / "prometheus-adapter" / "values.yaml"
#: The files `make export` writes that a server cannot start without (relative to the repository).
MODEL_FILES = sorted(str(p.relative_to(MODEL_REPOSITORY)) for p in (ONNX_PATH, ONNX_INT8_PATH, TORCHSCRIPT_PATH,
                                                                    WARMUP_IMAGE_PATH))
#: Arguments only the Kubernetes Deployment passes (client-side load balancing across replicas).
KUBERNETES_ONLY_FLAGS = ("--grpc-max-connection-age", "--grpc-max-connection-age-grace")
ADMIN_KEY = "test-admin-key"
VENV_BIN = Path(sys.executable).parent
SETUP_HINT = "run scripts/setup_deploy_tools.sh (part of `make setup`)"
COMPOSE_PARSERS = {
    "compose-1.29-debian": Path("/usr/bin/docker-compose"),
    "compose-2.40": VENV_BIN / "docker-compose-v2",
}


def tool(path: Path) -> str:
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"{path} is missing: {SETUP_HINT}")
    return str(path)


def run(cmd: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT, **kwargs)


# ---------------------------------------------------------------------------------------------------
# Repository facts


def config_names() -> list[str]:
    """Config variants that exist: model_repository/<model>/configs/<name>.pbtxt."""
    return sorted({p.stem for p in MODEL_REPOSITORY.glob("*/configs/*.pbtxt")})


def model_config(model: str, variant: str | None) -> model_config_pb2.ModelConfig:
    """The config Triton loads for `model` with --model-config-name=variant (config.pbtxt when absent)."""
    path = MODEL_REPOSITORY / model / "configs" / f"{variant}.pbtxt"
    if variant is None or not path.is_file():
        path = MODEL_REPOSITORY / model / "config.pbtxt"
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def flag_value(args: list[str], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]


def test_model_repository_matches_export_artifacts():
    on_disk = sorted(p.parent.name for p in MODEL_REPOSITORY.glob("*/config.pbtxt"))
    assert on_disk == sorted(ALL_MODELS)
    assert config_names(), "no config variants in model_repository/*/configs/"


# ---------------------------------------------------------------------------------------------------
# docker compose


def compose_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "COMPOSE_"))}
    return {**env, **extra}


def compose_config(parser: str, **env: str) -> subprocess.CompletedProcess:
    cmd = [tool(COMPOSE_PARSERS[parser]), "-f", str(COMPOSE_FILE), "--project-directory", str(REPO_ROOT),
           "--profile", "perf", "config"]
    return run(cmd, env=compose_env(**env))


def rendered_compose(parser: str, **env: str) -> dict:
    result = compose_config(parser, TRITON_ADMIN_KEY=ADMIN_KEY, **env)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def to_bytes(size: str | int) -> int:
    """Compose byte values: 1gb, 512m, 1073741824 (units are powers of 1024)."""
    match = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).lower())
    assert match, size
    return int(match.group(1)) * 1024 ** " kmg".index(match.group(2) or " ")


def to_seconds(duration: str) -> float:
    """Compose / Go durations: 600s, 10m, 10m0s, 1h2m3s."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def quantity_bytes(quantity: str) -> int:
    """Kubernetes binary quantities: 1Gi, 512Mi."""
    match = re.fullmatch(r"(\d+)([KMG]i)", quantity)
    assert match, quantity
    return int(match.group(1)) * 1024 ** ("KiMiGi".index(match.group(2)) // 2 + 1)


def ports(service: dict) -> set[tuple[str, int, int]]:
    """(host address, published, target), from either parser's rendering."""
    out = set()
    for port in service["ports"]:
        if isinstance(port, str):  # 1.29: "127.0.0.1:8000:8000/tcp"
            host, published, target = port.split("/")[0].rsplit(":", 2)
            out.add((host, int(published), int(target)))
        else:
            out.add((port["host_ip"], int(port["published"]), int(port["target"])))
    return out


def volumes(service: dict) -> set[tuple[str, str, bool]]:
    """(source, target, read-only), from either parser's rendering."""
    out = set()
    for volume in service["volumes"]:
        if isinstance(volume, str):  # 1.29: "/abs/src:/target:ro"
            source, target, mode = (volume.split(":") + ["rw"])[:3]
            out.add((source, target, mode == "ro"))
        else:
            out.add((volume["source"], volume["target"], bool(volume.get("read_only"))))
    return out


@pytest.fixture(scope="module", params=sorted(COMPOSE_PARSERS))
def compose_parser(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def compose(compose_parser) -> dict:
    return rendered_compose(compose_parser)


def test_compose_parsers_reject_an_invalid_file(compose_parser, tmp_path):
    bad = tmp_path / "docker-compose.yaml"
    bad.write_text("services:\n  a:\n    image: busybox\n    not_a_compose_key: 1\n")
    result = run([tool(COMPOSE_PARSERS[compose_parser]), "-f", str(bad), "config"], env=compose_env())
    assert result.returncode != 0 and "not_a_compose_key" in result.stdout + result.stderr


def test_compose_services(compose):
    assert set(compose) == {"check-artifacts", "triton", "perf"}
    triton, check, perf = compose["triton"], compose["check-artifacts"], compose["perf"]
    assert Path(triton["build"]["context"]) == DOCKERFILE.parent
    assert check["image"] == TRITON_IMAGE and perf["image"] == TRITON_IMAGE + "-sdk"
    assert triton["depends_on"]["check-artifacts"]["condition"] == "service_completed_successfully"
    assert perf["depends_on"]["triton"]["condition"] == "service_healthy"
    assert perf["profiles"] == ["perf"]
    assert ports(triton) == {("127.0.0.1", p, p) for p in (8000, 8001, 8002)}
    repository = (str(MODEL_REPOSITORY), "/models", True)
    assert repository in volumes(triton) and repository in volumes(check)
    assert str(REPO_ROOT / "results") in {source for source, _, _ in volumes(perf)}
    devices = triton["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    health = triton["healthcheck"]
    assert health["test"][0] == "CMD" and "http://localhost:8000/v2/health/ready" in health["test"]
    exit_timeout = int(flag_value(triton["command"], "--exit-timeout-secs")[0])
    assert to_seconds(triton["stop_grace_period"]) > exit_timeout
    assert triton["command"][0] == "tritonserver"
    assert flag_value(triton["command"], "--model-repository") == ["/models"]
    assert flag_value(triton["command"], "--model-config-name") == ["gpu"]
    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        (value,) = flag_value(triton["command"], flag)
        apis, key = value.split(":")
        assert {"model-repository", "shared-memory"} <= set(apis.split(",")) and key == f"admin-key={ADMIN_KEY}"


def test_compose_requires_the_admin_key(compose_parser):
    result = compose_config(compose_parser)
    assert result.returncode != 0
    assert "TRITON_ADMIN_KEY" in result.stdout + result.stderr


@pytest.mark.parametrize("name", config_names())
def test_compose_config_variant_and_address_from_the_environment(compose_parser, name):
    services = rendered_compose(compose_parser, TRITON_MODEL_CONFIG_NAME=name, TRITON_PUBLISH_ADDRESS="0.0.0.0")
    assert flag_value(services["triton"]["command"], "--model-config-name") == [name]
    assert {host for host, _, _ in ports(services["triton"])} == {"0.0.0.0"}


def shell_script(script: str, models_dir: Path) -> str:
    assert script.count("/models/") == 1
    return script.replace("/models/", f"{models_dir}/")


@pytest.fixture(scope="module")
def artifact_checks(compose) -> dict[str, str]:
    """The artifact check of compose (as the container's shell gets it) and of the Kubernetes init container."""
    check = compose["check-artifacts"]
    assert check["entrypoint"] == ["/bin/sh", "-c"]
    deployment = kind(kustomize("overlays/gpu"), "Deployment")
    (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["/bin/sh", "-c"] and init["image"] == container(deployment)["image"]
    # Compose writes a literal $ as $$ (renderings keep the escape); the shell gets one $.
    return {"compose": check["command"][0].replace("$$", "$"), "kubernetes": init["args"][0]}


@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_artifact_check_refuses_to_start_without_the_export(artifact_checks, where, tmp_path):
    script = shell_script(artifact_checks[where], tmp_path)
    for name in MODEL_FILES:  # exactly the files export/artifacts.py says the export writes
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert run(["/bin/sh", "-c", script]).returncode == 0
    for name in MODEL_FILES:
        (tmp_path / name).rename(tmp_path / "moved")
        result = run(["/bin/sh", "-c", script])
        assert result.returncode == 1 and f"model_repository/{name} is missing" in result.stdout
        assert "make export" in result.stdout
        (tmp_path / "moved").rename(tmp_path / name)


def test_dockerfile_extends_the_same_image_with_pinned_packages():
    text = DOCKERFILE.read_text()
    assert re.findall(r"^FROM (\S+)", text, re.M) == [TRITON_IMAGE]
    pins = dict(re.findall(r"^\s+([a-z][a-z0-9_-]*)==(\S+)", text, re.M))
    assert set(pins) == {"numpy", "pillow", "onnxruntime", "openvino", "torch"}
    requirements = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO_ROOT / "requirements.txt").read_text(), re.M))
    # numpy matches; the others are the newest releases with wheels for the image's Python 3.10 (see Dockerfile).
    assert pins["numpy"] == requirements["numpy"] and pins["openvino"] == requirements["openvino"]
    assert re.search(r"^USER triton-server$", text, re.M)


# ---------------------------------------------------------------------------------------------------
# Kubernetes


_rendered: dict[str, list[dict]] = {}


def kustomize(path: str) -> list[dict]:
    if path not in _rendered:
        result = run([tool(VENV_BIN / "kubectl"), "kustomize", str(KUSTOMIZE_ROOT / path)])
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


BUILT_IN_KINDS = {"Deployment", "Service", "PersistentVolumeClaim", "HorizontalPodAutoscaler",
                  "PodDisruptionBudget", "Pod"}
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_kustomize_renders(path):
    kinds = sorted(o["kind"] for o in kustomize(path))
    assert kinds == sorted(["Deployment", "HorizontalPodAutoscaler", "PersistentVolumeClaim",
                            "PodDisruptionBudget", "Service", "Service", "ServiceMonitor"])


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", [*KUSTOMIZATIONS, "tools/model-loader.yaml"])
def test_kubernetes_validate_strict(path, version):
    objects = [yaml.safe_load(LOADER_POD.read_text())] if path.endswith(".yaml") else kustomize(path)
    checked = 0
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue  # test_custom_resources
        assert obj["kind"] in BUILT_IN_KINDS, f"{obj['kind']}: add it to the kinds this test knows"
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked == (1 if path.endswith(".yaml") else 6)


def test_kubernetes_validate_is_strict():
    deployment = copy.deepcopy(kind(kustomize("base"), "Deployment"))
    container(deployment)["not_a_field"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_custom_resources(path):
    """ServiceMonitor (monitoring.coreos.com/v1): kubernetes-validate has no schema for it."""
    objects = kustomize(path)
    monitors = [o for o in objects if (o["apiVersion"], o["kind"]) in CUSTOM_KINDS]
    assert len(monitors) == 1
    monitor = monitors[0]
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"} and monitor["metadata"]["name"]
    spec = monitor["spec"]
    # The CRD's schema: spec required; in spec, selector and endpoints required.
    assert {"selector", "endpoints"} <= set(spec) and set(spec["selector"]) <= {"matchLabels", "matchExpressions"}
    services = [o for o in objects
                if o["kind"] == "Service" and selects(spec["selector"]["matchLabels"], o["metadata"]["labels"])]
    assert len(services) == 1, "the ServiceMonitor must select one Service, or pods are scraped twice"
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
        assert re.fullmatch(r"(\d+h)?(\d+m)?(\d+s)?(\d+ms)?", endpoint["interval"]) and endpoint["interval"]


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


def test_compose_and_kubernetes_pass_the_same_server_arguments(compose):
    compose_args = [a.replace(ADMIN_KEY, "$(TRITON_ADMIN_KEY)") for a in compose["triton"]["command"]]
    k8s_args = [a for a in container(kind(kustomize("overlays/gpu"), "Deployment"))["args"]
                if not a.startswith(KUBERNETES_ONLY_FLAGS)]
    assert k8s_args == compose_args


def test_deployment_wiring(compose):
    objects = kustomize("overlays/gpu")
    deployment, hpa = kind(objects, "Deployment"), kind(objects, "HorizontalPodAutoscaler")
    pod, c = deployment["spec"]["template"]["spec"], container(deployment)
    assert c["image"].startswith("triton-resnet18:") and compose["triton"]["image"] == c["image"]
    assert c["image"] == "triton-resnet18:" + TRITON_IMAGE.split(":")[1].split("-")[0]
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert port_names == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert c["readinessProbe"]["httpGet"]["path"] == c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert all(c[p]["httpGet"]["port"] in port_names for p in ("readinessProbe", "livenessProbe", "startupProbe"))
    startup = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert startup == to_seconds(compose["triton"]["healthcheck"]["start_period"])
    exit_timeout = int(flag_value(c["args"], "--exit-timeout-secs")[0])
    assert pod["terminationGracePeriodSeconds"] > exit_timeout
    volumes_by_name = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    shm = volumes_by_name[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory" and quantity_bytes(shm["sizeLimit"]) == to_bytes(compose["triton"]["shm_size"])
    repository = mounts[flag_value(c["args"], "--model-repository")[0]]
    claim = volumes_by_name[repository["name"]]["persistentVolumeClaim"]
    assert repository["readOnly"] and claim["readOnly"]
    pvc = kind(objects, "PersistentVolumeClaim")
    loader = yaml.safe_load(LOADER_POD.read_text())
    (loader_volume,) = loader["spec"]["volumes"]
    assert claim["claimName"] == pvc["metadata"]["name"] == loader_volume["persistentVolumeClaim"]["claimName"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    (key,) = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "TRITON_ADMIN_KEY"]
    assert key == {"name": "triton-admin", "key": "key"}
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


@pytest.mark.parametrize("path", ["overlays/gpu", "overlays/cpu"])
def test_hpa_target_follows_the_batching_of_the_configs_the_overlay_loads(path):
    """Target = the largest preferred batch (a full batch waiting), at most a quarter of max_queue_size."""
    objects = kustomize(path)
    (variant,) = flag_value(container(kind(objects, "Deployment"))["args"], "--model-config-name") or [None]
    (metric,) = kind(objects, "HorizontalPodAutoscaler")["spec"]["metrics"]
    target = int(metric["pods"]["target"]["averageValue"])
    for model in ALL_MODELS:
        config = model_config(model, variant)
        if config.platform == "ensemble":
            continue
        batching = config.dynamic_batching
        assert target == config.max_batch_size, model
        if model != PREPROCESS_MODEL:  # preprocess sends each request to a free instance (preferred [1])
            assert target == max(batching.preferred_batch_size), model
        assert 4 * target <= batching.default_queue_policy.max_queue_size, model


def test_shm_covers_the_python_backend_stubs(compose):
    """/dev/shm >= one region per Python-backend instance + a worst-case preprocess batch per instance."""
    args = compose["triton"]["command"]
    region = int(re.search(r"shm-default-byte-size=(\d+)", " ".join(args)).group(1))
    needed = 0
    for model in ALL_MODELS:
        config = model_config(model, None)  # default configs: the most Python-backend models
        if config.backend != "python":
            continue
        instances = sum(g.count or 1 for g in config.instance_group) or 1
        needed += instances * region
        if model == PREPROCESS_MODEL:
            max_image = int(config.parameters["max_image_bytes"].string_value)
            pixels = 3 * 224 * 224 * 4
            needed += instances * config.max_batch_size * (max_image + pixels)
    assert to_bytes(compose["triton"]["shm_size"]) >= needed


# ---------------------------------------------------------------------------------------------------
# Names and flags: only what exists in model_repository/ and in Triton 2.51


def all_server_args(compose_by_variant: list[dict]) -> list[list[str]]:
    args = [services["triton"]["command"] for services in compose_by_variant]
    for path in KUSTOMIZATIONS:
        args.append(container(kind(kustomize(path), "Deployment"))["args"])
    return args


def test_arguments_name_only_models_and_configs_that_exist(compose_parser):
    names = config_names()
    renderings = [rendered_compose(compose_parser)]
    for args in all_server_args(renderings):
        for variant in flag_value(args, "--model-config-name"):
            assert variant in names, f"--model-config-name={variant}: no model_repository/*/configs/{variant}.pbtxt"
        for model in flag_value(args, "--load-model"):
            assert model in ALL_MODELS
        assert flag_value(args, "--model-repository") == ["/models"]
    perf = renderings[0]["perf"]["command"]
    assert perf[perf.index("-m") + 1] in ALL_MODELS
    for rule in adapter_rules():
        for model in re.findall(r'model=~?"([^"]+)"', rule["seriesQuery"] + rule["metricsQuery"]):
            assert set(model.split("|")) <= set(ALL_MODELS)


def help_flags(cmd: list[str], env: dict[str, str]) -> set[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    flags = set(re.findall(r"^\s+(--[a-z][a-z0-9-]*|-[a-zA-Z])\b", result.stdout + result.stderr, re.M))
    assert len(flags) > 20, result.stdout + result.stderr
    return flags


def test_flags_exist_in_triton_2_51(compose):
    """tritonserver / perf_analyzer of the wheels in requirements.txt: the release of the 24.10 image."""
    server_flags = help_flags([str(tritonserver_binary()), "--help"], server_environment())
    for args in all_server_args([compose]):
        for arg in args[1:]:
            assert arg.split("=", 1)[0] in server_flags, arg
    perf_flags = help_flags([str(VENV_BIN / "perf_analyzer"), "--help"],
                            {**os.environ, "LD_LIBRARY_PATH": library_path()})
    for arg in compose["perf"]["command"][1:]:
        if arg.startswith("-"):
            assert arg.split("=", 1)[0] in perf_flags, arg
