"""The Triton release the deployments run, and what compose and Kubernetes must agree on.

* Every flag docker-compose.yaml and deploy/kubernetes pass to tritonserver exists in the command-line
  parser of the release they run: deploy/triton/flags-<release>.txt, the option names of
  src/command_line_parser.cc at that release (each file says the commit and the command that made it).
  The 24.10 list is also checked against the embedded server's own `tritonserver --help` (same release),
  which keeps the extraction command honest.
* --http-max-input-size is the preprocess model's image limit plus the request envelope.
* Compose and Kubernetes pass the same server arguments, run the same artifact check, and size probes,
  /dev/shm and images alike, for the default release and for 24.10.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml

from resnet18_kit.contract import (ALL_MODELS, ENSEMBLE_MODEL, IMAGE_INPUT, LOGITS_OUTPUT, PREPROCESS_MODEL,
                                   PROBABILITIES_OUTPUT, REPO_ROOT, TRITON_VERSION)
from resnet18_kit.repository import ModelRepository
from resnet18_kit.observe.model_config import config_parameters, variant_config
from resnet18_kit.server.tritonserver import library_path, server_environment, tritonserver_binary

pytestmark = pytest.mark.deploy

#: The shipped model repository of this checkout (what deployments carry).
SHIPPED = ModelRepository(REPO_ROOT / "model_repository")

DEPLOY = REPO_ROOT / "deploy"
COMPOSE_FILE = REPO_ROOT / "docker-compose.yaml"
#: The GPU deployment (NGC image) is docker-compose.yaml with this override; it is what runs a release.
GPU_OVERRIDE = REPO_ROOT / "docker-compose.gpu.yaml"
FLAG_LISTS = DEPLOY / "triton"
#: NGC release -> (Triton version, how compose selects it, the Kubernetes overlay that runs it).
RELEASES = {
    "26.08": ("2.72.0", None, "overlays/gpu"),
    "24.10": ("2.51.0", DEPLOY / "compose" / "triton-24.10.env", "overlays/gpu-24.10"),
}
OVERLAYS = {"26.08": ("base", "overlays/cpu", "overlays/gpu"),
            "24.10": ("overlays/cpu-24.10", "overlays/gpu-24.10")}
#: Room for the request's JSON header next to one image at the limit (names, shape, parameters, the
#: requested outputs; ~400 bytes measured) and the BYTES element's 4-byte length prefix.
REQUEST_ENVELOPE_BYTES = 64 * 1024
#: Triton's own default for --http-max-input-size (2.59+): 64 MB.
TRITON_DEFAULT_MAX_INPUT_BYTES = 1 << 26
#: Arguments only the Kubernetes Deployment passes (client-side load balancing across replicas).
KUBERNETES_ONLY_FLAGS = ("--grpc-max-connection-age", "--grpc-max-connection-age-grace")
ADMIN_KEY = "test-admin-key"
VENV_BIN = Path(sys.executable).parent
COMPOSE_PARSERS = {"compose-1.29-debian": Path("/usr/bin/docker-compose"),
                   "compose-2.40": VENV_BIN / "docker-compose-v2"}


def tool(path: Path) -> str:
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"{path} is missing: run `scripts/setup.sh test` (what `make test` runs first)")
    return str(path)


def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)


def compose_services(parser: str, release: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "COMPOSE_"))}
    env_file = RELEASES[release][1]
    cmd = [tool(COMPOSE_PARSERS[parser]), "-f", str(COMPOSE_FILE), "-f", str(GPU_OVERRIDE),
           "--project-directory", str(REPO_ROOT)]
    cmd += ["--env-file", str(env_file)] if env_file else []
    result = run(cmd + ["--profile", "perf", "config"], env={**env, "TRITON_ADMIN_KEY": ADMIN_KEY})
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


_rendered: dict[str, dict] = {}


def deployment(path: str) -> dict:
    """The Deployment `kubectl kustomize deploy/kubernetes/<path>` renders."""
    if path not in _rendered:
        result = run([tool(VENV_BIN / "kubectl"), "kustomize", str(DEPLOY / "kubernetes" / path)])
        assert result.returncode == 0, result.stderr
        (_rendered[path],) = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "Deployment"]
    return _rendered[path]


def kubernetes_args(path: str) -> list[str]:
    """The server's arguments as the kubelet passes them: $(VAR) expanded from literal env values (a
    Secret's value stays $(NAME))."""
    (c,) = deployment(path)["spec"]["template"]["spec"]["containers"]
    values = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    return [re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), a) for a in c["args"]]


def release_flags(release: str) -> set[str]:
    """The long options of that release's tritonserver, from deploy/triton/flags-<release>.txt."""
    lines = (FLAG_LISTS / f"flags-{release}.txt").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def unknown_flags(args: list[str], known: set[str]) -> list[str]:
    """The arguments after the program name whose flag (the part before `=`) is not in `known`."""
    return [a for a in args[1:] if a.split("=", 1)[0] not in known]


def flag_value(args: list[str], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]


@pytest.fixture(scope="module", params=sorted(COMPOSE_PARSERS))
def compose_parser(request) -> str:
    return request.param


def test_flag_lists_name_their_release_and_source():
    for release, (version, _, _) in RELEASES.items():
        header = (FLAG_LISTS / f"flags-{release}.txt").read_text()
        assert f"tritonserver {version} = NGC nvcr.io/nvidia/tritonserver:{release}-py3" in header
        assert f"TRITON_VERSION at this commit: {version}" in header
        assert re.search(r"commit [0-9a-f]{40}", header) and "src/command_line_parser.cc" in header
        flags = release_flags(release)
        assert len(flags) > 80 and all(re.fullmatch(r"--[a-z][a-z0-9-]*", f) for f in flags), release
    assert "--http-max-input-size" in release_flags("26.08") and "--http-max-input-size" not in release_flags("24.10")


def test_the_24_10_list_matches_the_embedded_servers_help():
    """The embedded server is Triton 2.51.0, the 24.10 image's release: its --help lists the same flags."""
    assert RELEASES["24.10"][0] == TRITON_VERSION
    result = subprocess.run([str(tritonserver_binary()), "--help"], capture_output=True, text=True, timeout=60,
                            env=server_environment())
    helped = set(re.findall(r"^\s+(--[a-z][a-z0-9-]*)\b", result.stdout + result.stderr, re.M))
    assert helped == release_flags("24.10"), sorted(helped ^ release_flags("24.10"))


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_every_server_flag_exists_in_the_release_it_runs(compose_parser, release):
    known = release_flags(release)
    passed = {f"compose ({compose_parser})": compose_services(compose_parser, release)["triton"]["command"]}
    passed.update({f"kubernetes {path}": kubernetes_args(path) for path in OVERLAYS[release]})
    for where, args in passed.items():
        assert args[0] == "tritonserver", where
        assert all(a.startswith("--") for a in args[1:]), f"{where}: not a flag: {[a for a in args if a[:2] != '--']}"
        missing = unknown_flags(args, known)
        assert not missing, f"{where} passes {missing}, not a flag of tritonserver {RELEASES[release][0]} ({release})"


def test_a_flag_the_release_lacks_is_named():
    args = ["tritonserver", "--model-repository=/models", "--http-max-input-size=1", "--not-a-flag"]
    assert unknown_flags(args, release_flags("24.10")) == ["--http-max-input-size=1", "--not-a-flag"]
    assert unknown_flags(args, release_flags("26.08")) == ["--not-a-flag"]


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_compose_and_kubernetes_pass_the_same_server_arguments(compose_parser, release):
    compose = [a.replace(ADMIN_KEY, "$(TRITON_ADMIN_KEY)")
               for a in compose_services(compose_parser, release)["triton"]["command"]]
    kubernetes = [a for a in kubernetes_args(RELEASES[release][2]) if not a.startswith(KUBERNETES_ONLY_FLAGS)]
    assert kubernetes == compose


def test_http_max_input_size_is_the_preprocess_image_limit_plus_the_envelope(compose_parser):
    max_image_bytes = int(config_parameters(variant_config(SHIPPED, PREPROCESS_MODEL, "default"))["max_image_bytes"])
    expected = max_image_bytes + REQUEST_ENVELOPE_BYTES
    compose = flag_value(compose_services(compose_parser, "26.08")["triton"]["command"], "--http-max-input-size")
    assert compose == [str(expected)], f"--http-max-input-size {compose}, preprocess max_image_bytes {max_image_bytes}"
    for path in OVERLAYS["26.08"]:
        assert flag_value(kubernetes_args(path), "--http-max-input-size") == [str(expected)], path
    # A real request for one image at the limit (binary tensor data, both outputs as top-5 labels) fits.
    image = httpclient.InferInput(IMAGE_INPUT, [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[bytes(max_image_bytes)]], dtype=object))
    outputs = [httpclient.InferRequestedOutput(name, class_count=5) for name in (PROBABILITIES_OUTPUT, LOGITS_OUTPUT)]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        [image], outputs=outputs, request_id=str(uuid.uuid4()), parameters={"timeout": 30_000_000})
    assert max_image_bytes < len(body) <= expected, (len(body), json_size)
    assert expected < TRITON_DEFAULT_MAX_INPUT_BYTES  # tighter than Triton's 64 MB default
    assert ENSEMBLE_MODEL in ALL_MODELS and variant_config(SHIPPED, ENSEMBLE_MODEL, "default").input[0].name == IMAGE_INPUT


def shell_script(script: str, models_dir: Path) -> str:
    assert script.count("/models/") == 1
    return script.replace("/models/", f"{models_dir}/")


@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_artifact_check_refuses_to_start_without_the_export(compose_parser, where, tmp_path):
    if where == "compose":
        check = compose_services(compose_parser, "26.08")["check-artifacts"]
        assert check["entrypoint"] == ["/bin/sh", "-c"]
        script = check["command"][0].replace("$$", "$")  # compose writes a literal $ as $$
    else:
        pod = deployment("overlays/gpu")["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["command"] == ["/bin/sh", "-c"] and init["image"] == pod["containers"][0]["image"]
        script = init["args"][0]
    script = shell_script(script, tmp_path)
    # Exactly the files resnet18_kit/contract.py says the export writes, provenance records aside.
    model_files = sorted(str(p.relative_to(SHIPPED.root)) for p in SHIPPED.generated if p not in SHIPPED.provenance_paths)
    for name in model_files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert run(["/bin/sh", "-c", script]).returncode == 0
    for name in model_files:
        (tmp_path / name).rename(tmp_path / "moved")
        result = run(["/bin/sh", "-c", script])
        assert result.returncode == 1 and f"model_repository/{name} is missing" in result.stdout
        assert "make export" in result.stdout
        (tmp_path / "moved").rename(tmp_path / name)


def to_seconds(duration: str) -> float:
    """Compose / Go durations: 600s, 10m, 10m0s, 1h2m3s."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[u] for n, u in parts)


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_images_probes_and_shm_agree(compose_parser, release):
    triton = compose_services(compose_parser, release)["triton"]
    pod = deployment(RELEASES[release][2])["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == triton["image"] == f"triton-resnet18:{release}"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == \
        to_seconds(triton["healthcheck"]["start_period"])
    compose_probe = [arg for arg in triton["healthcheck"]["test"][1:] if arg != "--kill-wedged"]
    assert c["livenessProbe"]["exec"]["command"][:2] == compose_probe[:2]  # python3 probe.py
    assert flag_value(c["livenessProbe"]["exec"]["command"], "--image") == flag_value(compose_probe, "--image")
    assert flag_value(c["livenessProbe"]["exec"]["command"], "--timeout-s") == flag_value(compose_probe, "--timeout-s")
    exit_timeout = int(flag_value(triton["command"], "--exit-timeout-secs")[0])
    assert to_seconds(triton["stop_grace_period"]) > exit_timeout and pod["terminationGracePeriodSeconds"] > exit_timeout
    (shm,) = [v["emptyDir"] for v in pod["volumes"] if v["name"] == "dshm"]
    assert to_bytes(shm["sizeLimit"]) == to_bytes(triton["shm_size"])


def to_bytes(size: str | int) -> int:
    """Compose sizes (2gb, 512m, 1073741824) and Kubernetes binary quantities (2Gi): powers of 1024."""
    match = re.fullmatch(r"(\d+)\s*([kmg]?)(i|b)?", str(size).lower())
    assert match, size
    return int(match.group(1)) * 1024 ** " kmg".index(match.group(2) or " ")


def test_arguments_name_only_models_and_configs_that_exist(compose_parser):
    services = compose_services(compose_parser, "26.08")
    all_args = [services["triton"]["command"]] + [kubernetes_args(p) for ps in OVERLAYS.values() for p in ps]
    for args in all_args:
        for variant in flag_value(args, "--model-config-name"):
            assert variant in SHIPPED.variant_names(), f"--model-config-name={variant}: no model_repository/*/configs/{variant}.pbtxt"
        for model in flag_value(args, "--load-model"):
            assert model in ALL_MODELS
        assert flag_value(args, "--model-repository") == ["/models"]
    perf = services["perf"]["command"]
    assert perf[perf.index("-m") + 1] in ALL_MODELS


def test_perf_analyzer_flags_exist():
    """perf_analyzer of tritonclient 2.51.0 (the SDK of 24.10); these flags are unchanged in later SDKs."""
    services = compose_services("compose-2.40", "26.08")
    result = subprocess.run([str(VENV_BIN / "perf_analyzer"), "--help"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "LD_LIBRARY_PATH": library_path()})
    flags = set(re.findall(r"^\s+(--[a-z][a-z0-9-]*|-[a-zA-Z])\b", result.stdout + result.stderr, re.M))
    assert len(flags) > 20, result.stdout + result.stderr
    for arg in services["perf"]["command"][1:]:
        if arg.startswith("-"):
            assert arg.split("=", 1)[0] in flags, arg
