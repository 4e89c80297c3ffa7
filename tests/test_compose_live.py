"""docker-compose.yaml for real: the CPU images built from PyPI's wheels, the stack started, loaded, stopped,
crashed and broken on a Docker engine, every request accounted for.

The engine (the `engine` and `images` fixtures of conftest.py) is the user's (DOCKER_HOST, or Docker's
default socket) when one answers, else a private dockerd of the checkout (resnet18_kit/containers/engine.py: its own socket, data root, exec root and
pidfile; its image cache in build/docker/ survives between runs), stopped by its pid at the end. Every
project here has its own name and free ports on 127.0.0.1, and `down` removes it. The figures (time to
healthy, counts, times back) are printed: `pytest -s tests/test_compose_live.py` shows them.

Clients here never retry (FleetLoad(retry=False)): each request's first try is its outcome.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import time
import urllib.request

import numpy as np
import pytest
import yaml

from resnet18_kit.client import TritonClassifierClient
from resnet18_kit.client.samples import sample_photos
from resnet18_kit.containers.compose import ComposePorts, ComposeProject
from resnet18_kit.containers.engine import Engine
from resnet18_kit.containers.image import IMAGE_TORCH, IMAGES
from resnet18_kit.contract import ENSEMBLE_MODEL, REPO_ROOT, TORCHSCRIPT_MODEL
from resnet18_kit.tools.reliability.fleet_load import FleetLoad, Tally
from resnet18_kit.tools.reliability.loads import ensemble_load, onnx_load, reference_answers

ADMIN_KEY = "compose-test-admin-key"
#: docker-compose.yaml's stop_grace_period for Triton.
GRACE_S = 40.0
#: Seconds a replica or container may take to come back after its process was killed.
BACK_WITHIN_S = 90.0


def new_project(engine, tag: str, **options) -> ComposeProject:
    return ComposeProject(engine, f"r18test-{tag}-{os.getpid()}", ComposePorts.free(), options.pop("admin_key", ADMIN_KEY),
                          **options)


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def grpc_ready(url: str) -> bool:
    import tritonclient.grpc as grpcclient

    try:
        with grpcclient.InferenceServerClient(url) as client:
            return client.is_server_ready(client_timeout=1.0)
    except Exception:  # refused, 503 from HAProxy: not yet
        return False


def wait_for(what: str, condition, timeout_s: float, poll_s: float = 0.1) -> float:
    """Seconds until condition() is true; fails naming `what` after timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if condition():
            return time.monotonic() - start
        time.sleep(poll_s)
    pytest.fail(f"not within {timeout_s:.0f} s: {what}")


def counts(tally: Tally) -> str:
    tries = {kind: len(values) for kind, values in sorted(tally.tries.items())}
    return (f"sent {tally.sent}, answered {tally.answered}, refused {tally.refused}, failed {tally.failed}, "
            f"lost {tally.lost}; tries {tries}")


def ready_inside(project: ComposeProject, service: str) -> bool:
    """/v2/health/ready answers 200 inside the service's container (a replica publishes no port)."""
    probe = ("import urllib.request as u; u.urlopen('http://localhost:8000/v2/health/ready', timeout=1)")
    result = project.engine.docker("exec", project.container(service), "python", "-c", probe, check=False, timeout_s=10)
    return result.returncode == 0


def crash(project: ComposeProject, service: str) -> None:
    """SIGKILL the container's main process from the host, as the kernel's OOM killer or a crash would.
    (`docker kill` counts as a manual stop: Docker then applies no restart policy.)"""
    os.kill(project.state(service)["Pid"], signal.SIGKILL)


def test_the_cpu_default_reserves_no_gpu_and_builds_every_image_it_runs_but_grafana():
    """Rendered without the GPU override (no engine needed): no device reservation; the Triton, HAProxy and
    Prometheus images are built here (deploy/docker/) on the BASE_IMAGE build argument, with torch's CPU
    build; only Grafana comes from a registry. The host ports move together with their settings."""
    project = ComposeProject(Engine(), "r18static", ComposePorts(18000, 18001, 18002, 19090, 13000), ADMIN_KEY,
                             profiles=("fleet", "monitoring"))
    services = yaml.safe_load(project.run("config").stdout)["services"]
    assert "perf" not in services
    for name, service in services.items():
        assert not service.get("deploy", {}).get("resources", {}).get("reservations"), name
        if name != "grafana":
            assert service["build"]["args"]["BASE_IMAGE"] == "debian:bookworm-slim", name
    for name in ("check-artifacts", "triton", "triton-1", "triton-2", "triton-3"):
        assert services[name]["image"] == IMAGES["triton"][0], name
        assert services[name]["build"]["dockerfile"].endswith(IMAGES["triton"][1]), name
    assert services["haproxy"]["image"] == IMAGES["haproxy"][0]
    assert services["prometheus"]["image"] == IMAGES["prometheus"][0]
    assert services["check-artifacts"]["command"][0] == "--check"
    assert "resnet18_kit.server.probe" in services["triton"]["healthcheck"]["test"]
    published = {(p["host_ip"], int(p["published"]), p["target"]) for p in services["triton"]["ports"]}
    assert published == {("127.0.0.1", 18000, 8000), ("127.0.0.1", 18001, 8001), ("127.0.0.1", 18002, 8002)}
    cpu = (REPO_ROOT / IMAGES["triton"][1]).read_text()
    assert re.search(r"^ARG BASE_IMAGE=debian:bookworm-slim$", cpu, re.M)
    assert re.search(r'^ENTRYPOINT \["resnet18-kit", "serve", "--host", "0.0.0.0", "--no-export"\]$', cpu, re.M)
    pins = dict(line.split("==", 1) for line in (REPO_ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert IMAGE_TORCH.startswith("torch==") and IMAGE_TORCH.endswith("+cpu") and pins["torch"] not in IMAGE_TORCH


@pytest.fixture(scope="module")
def single(engine, images, tmp_path_factory):
    """`docker compose up --wait` of the default services (check-artifacts, triton) on free ports, with
    tritonserver's exit timeout at 15 s (the compose file's: 30 s) so that the stop under keep-alive load is
    shorter (with 5 s, the unload under a flood of refusals outlasted it once: exit 1 after 13.3 s)."""
    override = tmp_path_factory.mktemp("single") / "override.yaml"
    override.write_text(yaml.safe_dump({"services": {"triton": {"command": ["--exit-timeout-s=15"]}}}))
    project = new_project(engine, "single", extra_files=(override,))
    try:  # an `up` that fails half-way leaves containers too
        project.up_s = project.timed_up()
        print(f"\ncompose up --wait: healthy in {project.up_s:.1f} s", flush=True)
        yield project
    finally:
        project.down()


def test_up_wait_is_healthy_and_classifies_like_the_embedded_server(single, triton_server):
    assert single.state("triton")["Health"]["Status"] == "healthy"
    assert single.state("check-artifacts")["ExitCode"] == 0
    photos = [path.read_bytes() for path in sample_photos()]
    with TritonClassifierClient(triton_server.config.http_url) as embedded:
        expected = [top[0].label for top in embedded.classify(photos, top_k=1)]
    batch = np.random.default_rng(0).standard_normal((2, 3, 224, 224), dtype=np.float32)
    with TritonClassifierClient(triton_server.config.http_url) as embedded:
        expected_logits = embedded.infer_tensor(batch, model=TORCHSCRIPT_MODEL)
    config = single.server_config()
    for protocol, url in (("http", config.http_url), ("grpc", config.grpc_url)):
        with TritonClassifierClient(url, protocol=protocol) as client:
            assert [top[0].label for top in client.classify(photos, top_k=1)] == expected, protocol
    # TorchScript in the image is torch's CPU build 2.13.0; the embedded server runs constraints.txt's torch.
    with TritonClassifierClient(config.http_url) as client:
        np.testing.assert_allclose(client.infer_tensor(batch, model=TORCHSCRIPT_MODEL), expected_logits,
                                   rtol=1e-4, atol=1e-4)
    with urllib.request.urlopen(config.metrics_url, timeout=5) as response:
        metrics = response.read().decode()
    served = re.search(rf'^nv_inference_request_success{{model="{ENSEMBLE_MODEL}",version="1"}} (\d+)', metrics, re.M)
    assert served and int(served.group(1)) >= 2, metrics[:2000]  # these two requests, and the health probe's


def test_a_crashed_container_is_restarted_and_fails_requests_only_while_down(single):
    config = single.server_config()
    load = FleetLoad(config, "http", reference_answers(config, onnx_load(4)), workers=4, retry=False).start()
    time.sleep(2.0)
    crash(single, "triton")
    killed_at = time.monotonic()
    wait_for("the endpoint refuses (container down)", lambda: not ready(config.http_url), 10, 0.02)
    wait_for("the restarted container is ready", lambda: ready(config.http_url), BACK_WITHIN_S)
    back_s = time.monotonic() - killed_at
    time.sleep(2.0)
    during = load.stop()
    after = FleetLoad(config, "http", reference_answers(config, onnx_load(4)), workers=4, retry=False, limit=40)
    after = after.start().wait(120)
    print(f"\ncrash under load: back {back_s:.1f} s after the kill; during: {counts(during)}; "
          f"after: {counts(after)}", flush=True)
    assert during.lost == 0 and after.lost == 0
    assert during.answered > 0 and set(during.tries) <= {"answered", "unavailable"}, during.errors
    assert after.answered == after.sent == 40, after.errors
    assert single.state("triton")["Restarting"] is False and single.state("triton")["Running"]


def stop_under_load(project: ComposeProject, loads: dict[str, FleetLoad]) -> tuple[float, dict, dict[str, Tally], dict]:
    """`docker compose stop triton` 2 s into `loads`: seconds it took, the container's State, each load's
    tally, and how many each answered after the stop began."""
    for load in loads.values():
        load.start()
    time.sleep(2.0)
    before = {name: load.tally.answered for name, load in loads.items()}
    start = time.monotonic()
    project.run("stop", "triton")
    stop_s = time.monotonic() - start
    tallies = {name: load.stop() for name, load in loads.items()}
    after = {name: tallies[name].answered - before[name] for name in loads}
    return stop_s, project.state("triton"), tallies, after


def test_stop_under_load_finishes_what_is_in_flight_refuses_the_rest_and_loses_nothing(single):
    """gRPC clients (through the guard), HTTP clients that close their connection after each request, and
    HTTP clients that keep it open (keep-alive: Triton 2.51 alone serves those through its whole exit timeout,
    then abandons what it holds and exits 1, reproduced without a container in tests/test_lifecycle.py).
    serve in the container unloads the models first: what was accepted is answered, what comes later is
    refused before it runs, the container exits 0."""
    config = single.server_config()
    loads = {"grpc": FleetLoad(config, "grpc", reference_answers(config, onnx_load(4)), workers=2, retry=False),
             "http": FleetLoad(config, "http", reference_answers(config, onnx_load(4)), workers=2, retry=False,
                               keep_alive=False),
             "http keep-alive": FleetLoad(config, "http", reference_answers(config, onnx_load(4)), workers=2,
                                          retry=False)}
    stop_s, state, tallies, after = stop_under_load(single, loads)
    for name, tally in tallies.items():
        print(f"\ncompose stop under load ({name}): stopped in {stop_s:.1f} s, exit {state['ExitCode']}; "
              f"{after[name]} answered after the stop began; {counts(tally)}", flush=True)
        assert tally.lost == 0
        # After the stop began a request is answered, or refused before it ran: the connection is refused,
        # the guard answers UNAVAILABLE, or Triton says the model no longer takes requests.
        assert set(tally.tries) <= {"answered", "unavailable", "refused"} or all(
            any(word in e for word in ("not ready", "stopping", "no available versions", "unavailable"))
            for e in tally.errors), tally.errors
    assert set(tallies["http keep-alive"].tries) <= {"answered", "unavailable"}, tallies["http keep-alive"].errors
    assert state["Status"] == "exited" and state["ExitCode"] == 0, state
    assert stop_s < GRACE_S


def test_down_leaves_no_container_network_or_volume(single):
    single.down()
    assert single.resources() == {"container": [], "network": [], "volume": []}


def test_no_admin_key_is_one_line(engine, images):
    project = new_project(engine, "nokey", admin_key=None)
    result = project.run("up", "--wait", check=False)
    assert result.returncode != 0
    assert "set TRITON_ADMIN_KEY" in result.stderr.strip().splitlines()[-1], result.stderr
    assert project.resources() == {"container": [], "network": [], "volume": []}


def test_missing_model_files_are_named(engine, images, tmp_path):
    repository = tmp_path / "model_repository"
    shutil.copytree(REPO_ROOT / "model_repository", repository, symlinks=True,
                    ignore=shutil.ignore_patterns("*.onnx", "*.pt", "provenance.json", "warmup", "__pycache__"))
    project = new_project(engine, "nofiles", settings={"TRITON_MODEL_REPOSITORY": str(repository)})
    try:
        result = project.run("up", "--wait", check=False)
        assert result.returncode != 0
        assert "check-artifacts" in result.stderr and "exit 2" in result.stderr.lower(), result.stderr
        logs = project.run("logs", "--no-log-prefix", "check-artifacts").stdout.strip().splitlines()
        assert len(logs) == 1 and "model files missing" in logs[0] and "model.onnx" in logs[0], logs
        assert "triton" not in " ".join(project.run("ps", "-q", "triton").stdout.split())
    finally:
        project.down()


def test_a_taken_port_is_named(engine, images):
    project = new_project(engine, "port")
    holder = socket.socket()
    holder.bind(("127.0.0.1", project.ports.http))
    holder.listen()
    try:
        result = project.run("up", "--wait", check=False)
        assert result.returncode != 0
        assert str(project.ports.http) in result.stderr.strip().splitlines()[-1], result.stderr
    finally:
        holder.close()
        project.down()


@pytest.fixture(scope="module")
def fleet(engine, images):
    """`docker compose --profile fleet` (three replicas behind HAProxy) on free ports, with model control
    explicit so that its replicas can be swapped; shared by the replay and the swap tests, in that order."""
    project = new_project(engine, "fleet", profiles=("fleet",), settings={"TRITON_MODEL_CONTROL": "explicit"})
    try:  # an `up` that fails half-way leaves containers too
        project.up_s = project.timed_up("haproxy")
        print(f"\ncompose fleet profile: up in {project.up_s:.1f} s", flush=True)
        yield project
    finally:
        project.down()


@pytest.mark.slow
def test_fleet_replays_what_a_killed_replica_held_no_error_to_a_plain_client(fleet):
    front = fleet.server_config()
    assert ready(front.http_url)  # haproxy's health check: healthy once a replica serves through it
    wait_for("HAProxy's gRPC backend serves", lambda: grpc_ready(front.grpc_url), 10, 0.1)
    loads = {protocol: FleetLoad(front, protocol, reference_answers(front, load), workers=4, retry=False)
             for protocol, load in (("http", onnx_load(4)), ("grpc", ensemble_load()))}
    for load in loads.values():
        load.start()
    time.sleep(3.0)
    crash(fleet, "triton-2")
    killed_at = time.monotonic()
    wait_for("triton-2 restarted", lambda: fleet.restart_count("triton-2") >= 1, 30, 0.1)
    wait_for("triton-2 ready again", lambda: ready_inside(fleet, "triton-2"), BACK_WITHIN_S, 0.3)
    back_s = time.monotonic() - killed_at
    time.sleep(2.0)
    for protocol, load in loads.items():
        tally = load.stop()
        print(f"\ncompose fleet, triton-2 killed ({protocol}, no retries): replica ready again {back_s:.1f} s "
              f"after the kill; {counts(tally)}", flush=True)
        assert tally.failed == 0 and tally.lost == 0, tally.errors
        assert tally.answered == tally.sent - tally.refused > 0
    assert ready_inside(fleet, "triton-1") and ready_inside(fleet, "triton-3")


@pytest.mark.slow
def test_the_fleet_swaps_each_replica_live_then_a_re_created_replica_fails_nothing(fleet):
    """Each replica swapped live to `int8` (`docker compose exec triton-N resnet18-kit swap`), then one
    replica re-created with a new TRITON_MODEL_CONFIG_NAME (what `up -d --no-deps` does to each replica in
    turn), under load through HAProxy from clients that never retry. One re-created replica shows the
    mechanism (HAProxy takes the stopping replica out, the others serve); the others would repeat it."""
    front = fleet.server_config()
    photos, tensors = ensemble_load(), onnx_load(4)  # answers change with the config: counts are measured

    def under_load(action) -> tuple[list[Tally], float]:
        loads = [FleetLoad(front, "http", photos, workers=1, retry=False, pause_s=0.002).start(),
                 FleetLoad(front, "grpc", tensors, workers=2, retry=False, pause_s=0.002).start()]
        time.sleep(2.0)
        started = time.monotonic()
        action()
        took_s = time.monotonic() - started
        time.sleep(2.0)
        return [load.stop() for load in loads], took_s

    def exec_swaps() -> None:
        for replica in ("triton-1", "triton-2", "triton-3"):
            fleet.run("exec", "-T", replica, "resnet18-kit", "--model-repository", "/models", "swap",
                      "--url", "localhost:8001", "--model-config-name", "int8")

    recreate = ComposeProject(fleet.engine, fleet.name, fleet.ports, ADMIN_KEY, profiles=("fleet",),
                              settings={"TRITON_MODEL_CONTROL": "explicit", "TRITON_MODEL_CONFIG_NAME": "default"})
    runs = {"swap each replica (exec) default -> int8": under_load(exec_swaps),
            "re-create triton-1 int8 -> default": under_load(
                lambda: recreate.run("up", "-d", "--wait", "--no-deps", "triton-1"))}
    for name, (tallies, took_s) in runs.items():
        print(f"\ncompose fleet, {name}: {took_s:.1f} s; "
              + "; ".join(f"{p}: {counts(t)}" for p, t in zip(("http", "grpc"), tallies)), flush=True)
    for tally in runs["swap each replica (exec) default -> int8"][0]:
        assert tally.answered > 10 and (tally.failed, tally.lost) == (0, 0), tally.errors
    for tally in runs["re-create triton-1 int8 -> default"][0]:  # --no-refuse-first: HAProxy takes it out first
        assert tally.answered > 10 and (tally.failed, tally.lost) == (0, 0), tally.errors


def test_monitoring_profile_scrapes_triton_and_the_queue_alert_fires(engine, images, tmp_path):
    """Prometheus in its container scrapes the Triton container; under a flood the overload alert fires.
    The test's copy of the shipped config scrapes and evaluates every second, its rules hold `for:` 3 s."""
    config = yaml.safe_load((REPO_ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    rules = yaml.safe_load((REPO_ROOT / "deploy/prometheus/rules/triton.rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.update({"for": "3s"} if "for" in rule else {})
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "triton.rules.yml").write_text(yaml.safe_dump(rules))
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({"services": {"prometheus": {"volumes": [
        f"{tmp_path / 'prometheus.yml'}:/etc/prometheus/prometheus.yml:ro",
        f"{tmp_path / 'rules'}:/etc/prometheus/rules:ro"]}}}))
    project = new_project(engine, "monitoring", profiles=("monitoring",), extra_files=(override,))
    try:
        project.timed_up("triton", "prometheus")
        api = f"http://127.0.0.1:{project.ports.prometheus}/api/v1"

        def get(path: str) -> dict:
            with urllib.request.urlopen(f"{api}/{path}", timeout=5) as response:
                return yaml.safe_load(response.read())["data"]

        wait_for("Prometheus scrapes the Triton container", lambda: any(
            t["labels"]["job"] == "triton" and t["health"] == "up" for t in get("targets")["activeTargets"]), 60, 0.5)
        front = project.server_config()
        flood = FleetLoad(front, "grpc", onnx_load(4), workers=96).start()
        try:
            firing_s = wait_for("TritonModelQueueNearlyFull firing", lambda: any(
                a["labels"]["alertname"] == "TritonModelQueueNearlyFull" and a["state"] == "firing"
                for a in get("alerts")["alerts"]), 120, 0.5)
        finally:
            tally = flood.stop()
        print(f"\ncompose monitoring: the queue alert fired {firing_s:.1f} s into a flood of 96 gRPC clients; "
              f"{counts(tally)}", flush=True)
        assert tally.lost == 0
    finally:
        project.down()
