"""docker-compose.yaml (the CPU default) and docker-compose.gpu.yaml (the GPU override), and what they
build and mount, checked by real tools without starting anything (tests/test_compose_live.py starts them).

* Rendered by two compose parsers, Debian's docker-compose 1.29.2 and Compose v2.40.3 (the Go
  implementation behind `docker compose`); both validate the files against the Compose schema.
* The CPU default reserves no GPU and builds its images here (deploy/docker/); the GPU override runs NGC's
  image, whose Triton release is one setting (TRITON_RELEASE, or deploy/compose/triton-24.10.env for
  2.51.0), and its Dockerfile installs the pins for that release's Python.
* Monitoring: Prometheus with deploy/prometheus/ (promtool as mounted), Grafana with the dashboard.
* Fleet: three replicas of `triton` behind HAProxy with deploy/haproxy/ (`haproxy -c` as mounted).

Cross-checks with Kubernetes and the release's flags: tests/test_deploy_release.py. The tools are
installed by scripts/setup_deploy_tools.sh (run by `make test`: `scripts/setup.sh test`); a missing tool fails.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from resnet18_kit.contract import ALL_MODELS, PREPROCESS_MODEL, REPO_ROOT
from resnet18_kit.repository import ModelRepository
from resnet18_kit.observe.model_config import config_parameters, instance_count, variant_config
pytestmark = pytest.mark.deploy

#: The shipped model repository of this checkout (what deployments carry).
SHIPPED = ModelRepository(REPO_ROOT / "model_repository")

COMPOSE_FILE = REPO_ROOT / "docker-compose.yaml"
GPU_OVERRIDE = REPO_ROOT / "docker-compose.gpu.yaml"
DEPLOY = REPO_ROOT / "deploy"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile.gpu"
IMAGE_REQUIREMENTS = DEPLOY / "docker" / "requirements-gpu.txt"
RELEASE_24_10_ENV = DEPLOY / "compose" / "triton-24.10.env"
#: The default NGC release (Triton 2.72.0) and the embedded server's (Triton 2.51.0), with the Python of each image.
DEFAULT_RELEASE, PARITY_RELEASE = "26.08", "24.10"
IMAGE_PYTHON = {DEFAULT_RELEASE: "3.12", PARITY_RELEASE: "3.10"}
ADMIN_KEY = "test-admin-key"
VENV_BIN = Path(sys.executable).parent
SETUP_HINT = "run `scripts/setup.sh test` (what `make test` runs first)"
COMPOSE_PARSERS = {
    "compose-1.29-debian": Path("/usr/bin/docker-compose"),
    "compose-2.40": VENV_BIN / "docker-compose-v2",
}
PROMTOOL = Path("/usr/bin/promtool")
HAPROXY = Path("/usr/sbin/haproxy")
HAPROXY_POLICY = DEPLOY / "haproxy" / "haproxy.cfg"
HAPROXY_COMPOSE_SERVERS = DEPLOY / "haproxy" / "servers-compose.cfg"
FLEET_REPLICAS = ("triton-1", "triton-2", "triton-3")
HAPROXY_ENV = {"FLEET_HTTP_BIND": ":8000", "FLEET_GRPC_BIND": ":8001", "FLEET_RUNTIME_SOCKET": "/tmp/haproxy-test.sock"}
PROFILES = ("perf", "monitoring", "fleet")


def tool(path: Path) -> str:
    return str(path) if path.is_file() and os.access(path, os.X_OK) else pytest.fail(f"{path} is missing: {SETUP_HINT}")


def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)


def compose_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "COMPOSE_", "GRAFANA_"))}, **extra}


def compose_config(parser: str, env_file: Path | None = None, profiles=PROFILES, gpu: bool = True,
                   **env: str) -> subprocess.CompletedProcess:
    """`config` with the GPU override (most checks here are of the GPU deployment), or of the CPU default."""
    cmd = [tool(COMPOSE_PARSERS[parser]), "-f", str(COMPOSE_FILE)] + (["-f", str(GPU_OVERRIDE)] if gpu else [])
    cmd += ["--project-directory", str(REPO_ROOT)]
    profiles = profiles if gpu else tuple(p for p in profiles if p != "perf")
    cmd += ["--env-file", str(env_file)] if env_file else []
    for profile in profiles:
        cmd += ["--profile", profile]
    return run(cmd + ["config"], env=compose_env(**env))


def rendered_compose(parser: str, env_file: Path | None = None, gpu: bool = True, **env: str) -> dict:
    """The whole rendered file (services, volumes) with every profile's services."""
    result = compose_config(parser, env_file, gpu=gpu, TRITON_ADMIN_KEY=ADMIN_KEY, **env)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def to_bytes(size: str | int) -> int:
    """Compose byte values: 1gb, 512m, 1073741824 (units are powers of 1024)."""
    match = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).lower())
    assert match, size
    return int(match.group(1)) * 1024 ** " kmg".index(match.group(2) or " ")


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


def mounted_source(service: dict, target: str) -> Path:
    """The repository path a service mounts at `target` (read-only, inside this repository)."""
    (source,) = [Path(s) for s, t, read_only in volumes(service) if t == target and read_only]
    assert source.is_relative_to(REPO_ROOT) and source.exists(), source
    return source


def flag_value(args: list[str], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]


@pytest.fixture(scope="module", params=sorted(COMPOSE_PARSERS))
def compose_parser(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def compose(compose_parser) -> dict:
    return rendered_compose(compose_parser)["services"]


def test_compose_parsers_reject_an_invalid_file(compose_parser, tmp_path):
    bad = tmp_path / "docker-compose.yaml"
    bad.write_text("services:\n  a:\n    image: busybox\n    not_a_compose_key: 1\n")
    result = run([tool(COMPOSE_PARSERS[compose_parser]), "-f", str(bad), "config"], env=compose_env())
    assert result.returncode != 0 and "not_a_compose_key" in result.stdout + result.stderr


def test_compose_services(compose):
    assert set(compose) == {"check-artifacts", "triton", "perf", "prometheus", "grafana", "haproxy", *FLEET_REPLICAS}
    triton, check, perf = compose["triton"], compose["check-artifacts"], compose["perf"]
    assert Path(triton["build"]["context"]) == REPO_ROOT
    assert (REPO_ROOT / triton["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert triton["depends_on"]["check-artifacts"]["condition"] == "service_completed_successfully"
    assert perf["depends_on"]["triton"]["condition"] == "service_healthy"
    assert perf["profiles"] == ["perf"]
    assert ports(triton) == {("127.0.0.1", p, p) for p in (8000, 8001, 8002)}
    repository = (str(SHIPPED.root), "/models", True)
    assert repository in volumes(triton) and repository in volumes(check)
    assert str(REPO_ROOT / "results") in {source for source, _, _ in volumes(perf)}
    devices = triton["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    health = triton["healthcheck"]
    assert health["test"][:2] == ["CMD", "python3"] and "/opt/resnet18-kit/probe.py" in health["test"]
    assert flag_value(health["test"], "--image") == ["/models/preprocess/warmup/image_bytes"]
    assert "--kill-wedged" in health["test"] and triton["init"] is True
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


@pytest.mark.parametrize("name", sorted(set(SHIPPED.variant_names()) - {"default"}))
def test_compose_config_variant_and_address_from_the_environment(compose_parser, name):
    services = rendered_compose(compose_parser, TRITON_MODEL_CONFIG_NAME=name,
                                TRITON_PUBLISH_ADDRESS="0.0.0.0", TRITON_GRPC_PUBLISH_ADDRESS="0.0.0.0")["services"]
    for service in ("triton", *FLEET_REPLICAS):
        assert flag_value(services[service]["command"], "--model-config-name") == [name], service
    for service in ("triton", "prometheus", "grafana", "haproxy"):
        assert {host for host, _, _ in ports(services[service])} == {"0.0.0.0"}, service
    http_only = rendered_compose(compose_parser, TRITON_PUBLISH_ADDRESS="0.0.0.0")["services"]
    for service in ("triton", "haproxy"):  # gRPC is opened on its own (docs/reliability.md)
        assert ("127.0.0.1", 8001, 8001) in ports(http_only[service]), service


def release_images(services: dict) -> dict[str, str]:
    """Every image reference that follows the Triton release, by where it is."""
    triton = services["triton"]
    return {"check-artifacts": services["check-artifacts"]["image"], "perf": services["perf"]["image"],
            "triton": triton["image"], "build arg": str(triton["build"]["args"]["TRITON_RELEASE"])}


@pytest.mark.parametrize("release", [DEFAULT_RELEASE, PARITY_RELEASE, "25.12"])
def test_the_triton_release_is_one_setting(compose_parser, release):
    if release == DEFAULT_RELEASE:
        services = rendered_compose(compose_parser)["services"]  # nothing set: the default
    elif release == PARITY_RELEASE:
        services = rendered_compose(compose_parser, env_file=RELEASE_24_10_ENV)["services"]
    else:
        services = rendered_compose(compose_parser, TRITON_RELEASE=release)["services"]
    assert release_images(services) == {
        "check-artifacts": f"triton-resnet18:{release}",  # the built image, its shell runs the check
        "perf": f"nvcr.io/nvidia/tritonserver:{release}-py3-sdk",
        "triton": f"triton-resnet18:{release}",
        "build arg": release,
    }
    if release == PARITY_RELEASE:  # 2.51 crashes on gRPC cancellations: gRPC stays on loopback whatever is opened
        opened = rendered_compose(compose_parser, env_file=RELEASE_24_10_ENV, TRITON_PUBLISH_ADDRESS="0.0.0.0")
        published = ports(opened["services"]["triton"])
        assert ("127.0.0.1", 8001, 8001) in published and ("0.0.0.0", 8000, 8000) in published, published
    limit_args = [a for a in services["triton"]["command"] if a.startswith(("--http-max-input-size", "--log-info"))]
    # 2.51 has no --http-max-input-size: its env file swaps the argument for one 2.51 has.
    assert limit_args == (["--log-info=true"] if release == PARITY_RELEASE else ["--http-max-input-size=20065536"])


def test_dockerfile_builds_on_the_release_with_pins_for_its_python():
    text = DOCKERFILE.read_text()
    (default,) = re.findall(r"^ARG TRITON_RELEASE=(\S+)$", text, re.M)
    assert default == DEFAULT_RELEASE
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3"]
    assert re.search(r"^COPY deploy/docker/requirements-gpu\.txt ", text, re.M) and re.search(r"^USER triton-server$", text, re.M)
    lines = [line.split("#")[0].strip() for line in IMAGE_REQUIREMENTS.read_text().splitlines()]
    requirements = [Requirement(line) for line in lines if line]

    def pins(python: str) -> dict[str, str]:
        environment = {"python_version": python, "python_full_version": python + ".0"}
        chosen = [r for r in requirements if r.marker is None or r.marker.evaluate(environment)]
        assert len({r.name for r in chosen}) == len(chosen), f"Python {python}: a package pinned twice"
        return {r.name: str(r.specifier).removeprefix("==") for r in chosen}

    constraints = (REPO_ROOT / "constraints.txt").read_text()  # the project's one list of pinned versions
    project = {k.lower(): v for k, v in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", constraints, re.M)}
    newer, older = pins(IMAGE_PYTHON[DEFAULT_RELEASE]), pins(IMAGE_PYTHON[PARITY_RELEASE])
    assert set(newer) == set(older) == {"numpy", "pillow", "onnxruntime", "openvino", "torch"}
    # Python 3.12 (26.08): the project's own pins. Python 3.10 (24.10): the newest releases with cp310 wheels.
    assert newer == {name: project[name] for name in newer}
    assert older == {**newer, "pillow": "12.3.0", "onnxruntime": "1.23.2", "torch": "2.14.1"}


def test_shm_covers_the_python_backend_stubs(compose):
    """/dev/shm >= one region per Python-backend instance + a worst-case preprocess batch per instance."""
    args = compose["triton"]["command"]
    region = int(re.search(r"shm-default-byte-size=(\d+)", " ".join(args)).group(1))
    needed = 0
    for model in ALL_MODELS:
        config = variant_config(SHIPPED, model, "default")  # default configs: the most Python-backend models
        if config.backend != "python":
            continue
        instances = instance_count(config) or 1
        needed += instances * region
        if model == PREPROCESS_MODEL:
            max_image = int(config_parameters(config)["max_image_bytes"])
            pixels = 3 * 224 * 224 * 4
            needed += instances * config.max_batch_size * (max_image + pixels)
    assert to_bytes(compose["triton"]["shm_size"]) >= needed


# The monitoring profile
def test_monitoring_services_only_with_their_profile(compose, compose_parser):
    for name in ("prometheus", "grafana"):
        service = compose[name]
        assert service["profiles"] == ["monitoring"], name
    # Prometheus is built here from Debian's package (deploy/docker/prometheus.Dockerfile); Grafana is the
    # official image, pinned to a release.
    assert compose["prometheus"]["image"] == "triton-resnet18:prometheus-2"
    assert compose["prometheus"]["build"]["dockerfile"].endswith("prometheus.Dockerfile")
    image, _, tag = compose["grafana"]["image"].partition(":")
    assert image == "grafana/grafana" and re.fullmatch(r"\d+\.\d+\.\d+", tag), compose["grafana"]["image"]
    assert ports(compose["prometheus"]) == {("127.0.0.1", 9090, 9090)}
    assert ports(compose["grafana"]) == {("127.0.0.1", 3000, 3000)}
    if compose_parser == "compose-2.40":  # 1.29's `config` lists every service whatever the profiles
        result = compose_config(compose_parser, profiles=(), TRITON_ADMIN_KEY=ADMIN_KEY)
        assert result.returncode == 0, result.stderr
        assert set(yaml.safe_load(result.stdout)["services"]) == {"check-artifacts", "triton"}


def test_prometheus_config_as_mounted_passes_promtool(compose, tmp_path):
    """promtool checks prometheus.yml with its rule_files glob pointed where compose mounts the rules from."""
    prometheus = compose["prometheus"]
    config_arg = flag_value(prometheus["command"], "--config.file")[0]
    config_file = mounted_source(prometheus, config_arg)
    config = yaml.safe_load(config_file.read_text())
    (rule_glob,) = config["rule_files"]
    rules_dir = mounted_source(prometheus, str(Path(rule_glob).parent))
    matched = sorted(rules_dir.glob(Path(rule_glob).name))
    assert matched == [DEPLOY / "prometheus" / "rules" / "triton.rules.yml"], matched
    config["rule_files"] = [str(rules_dir / Path(rule_glob).name)]
    copy = tmp_path / "prometheus.yml"
    copy.write_text(yaml.safe_dump(config))
    result = run([tool(PROMTOOL), "check", "config", str(copy)])
    assert result.returncode == 0 and "SUCCESS" in result.stdout + result.stderr, result.stdout + result.stderr
    assert re.search(r"SUCCESS: \d+ rules found", result.stdout + result.stderr), result.stdout
    # It scrapes the triton service's metrics port, as job "triton" (the job TritonServerDown watches).
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "triton"]
    (target,) = [t for group in job["static_configs"] for t in group["targets"]]
    host, port = target.split(":")
    assert host == "triton" and (int(port), int(port)) in {(p, t) for _, p, t in ports(compose["triton"])}
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_promtool_check_config_catches_a_bad_config(tmp_path):
    bad = tmp_path / "prometheus.yml"
    bad.write_text("global:\n  scrape_interval: often\n")
    result = run([tool(PROMTOOL), "check", "config", str(bad)])
    assert result.returncode != 0 and "often" in result.stdout + result.stderr


def test_grafana_gets_the_dashboard_and_the_prometheus_data_source(compose):
    grafana = compose["grafana"]
    provisioning = mounted_source(grafana, "/etc/grafana/provisioning")
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == "http://prometheus:9090"  # the compose service and its container port
    assert any(target == 9090 for _, _, target in ports(compose["prometheus"]))
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "triton.yaml").read_text())["providers"]
    dashboards = mounted_source(grafana, provider["options"]["path"])
    assert sorted(p.name for p in dashboards.glob("*.json")) == ["triton.json"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent == Path(provider["options"]["path"]) and (dashboards / Path(home).name).is_file()
    dashboard = json.loads((dashboards / "triton.json").read_text())
    assert dashboard["uid"] and dashboard["panels"]


# The fleet profile
def test_fleet_replicas_are_triton_on_a_gpu_each_and_publish_nothing(compose):
    triton = compose["triton"]
    gpus = []
    for name in FLEET_REPLICAS:
        replica = compose[name]
        assert replica["profiles"] == ["fleet"], name
        assert replica["command"] == triton["command"] and replica["image"] == triton["image"], name
        assert volumes(replica) == volumes(triton) and replica["shm_size"] == triton["shm_size"], name
        assert replica["healthcheck"] == triton["healthcheck"], name
        assert not replica.get("ports"), name  # only HAProxy publishes
        (device,) = replica["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        gpus += device["device_ids"]
    assert sorted(gpus) == ["0", "1", "2"]


def test_fleet_haproxy_mounts_the_policy_and_the_servers_and_publishes_the_front_ends(compose):
    haproxy = compose["haproxy"]
    assert haproxy["profiles"] == ["fleet"]
    # Debian's HAProxy 2.6, the one `resnet18-kit fleet` runs (deploy/docker/haproxy.Dockerfile).
    assert haproxy["image"] == "triton-resnet18:haproxy-2.6"
    assert haproxy["build"]["dockerfile"].endswith("haproxy.Dockerfile")
    policy = mounted_source(haproxy, "/etc/haproxy/haproxy.cfg")
    servers = mounted_source(haproxy, "/etc/haproxy/servers.cfg")
    assert (policy, servers) == (HAPROXY_POLICY, HAPROXY_COMPOSE_SERVERS)
    assert haproxy["command"] == ["-f", "/etc/haproxy/haproxy.cfg", "-f", "/etc/haproxy/servers.cfg"]
    assert ports(haproxy) == {("127.0.0.1", 8000, 8000), ("127.0.0.1", 8001, 8001)}
    assert {k: haproxy["environment"][k] for k in HAPROXY_ENV if k != "FLEET_RUNTIME_SOCKET"} == {
        "FLEET_HTTP_BIND": ":8000", "FLEET_GRPC_BIND": ":8001"}
    depends = haproxy["depends_on"]
    assert set(depends) == set(FLEET_REPLICAS)


def test_fleet_servers_file_names_every_replica_in_both_backends(compose):
    text = HAPROXY_COMPOSE_SERVERS.read_text()
    replicas = sorted(name for name, service in compose.items() if "fleet" in service.get("profiles", [])
                      and name != "haproxy")
    assert replicas == sorted(FLEET_REPLICAS)
    for backend, port in (("triton_http", 8000), ("triton_grpc", 8001)):
        section = text.split(f"backend {backend} from replicas")[1].split("\nbackend ")[0]
        addresses = re.findall(r"server \S+ (\S+):(\d+) ", section)
        assert sorted(host for host, _ in addresses) == replicas, (backend, addresses)
        assert {int(p) for _, p in addresses} == {port}, (backend, addresses)
        assert section.count("check") >= len(replicas), backend


def haproxy_check(*files: Path) -> subprocess.CompletedProcess:
    cmd = [tool(HAPROXY), "-c"]
    for path in files:
        cmd += ["-f", str(path)]
    return run(cmd, env={**os.environ, **HAPROXY_ENV})


def test_fleet_configuration_passes_haproxy_check():
    result = haproxy_check(HAPROXY_POLICY, HAPROXY_COMPOSE_SERVERS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Configuration file is valid" in result.stdout


def test_haproxy_check_catches_a_broken_servers_file(tmp_path):
    broken = tmp_path / "servers.cfg"
    broken.write_text(HAPROXY_COMPOSE_SERVERS.read_text().replace("check-proto h1", "check-proto h9"))
    result = haproxy_check(HAPROXY_POLICY, broken)
    assert result.returncode != 0 and "h9" in result.stdout + result.stderr

