"""docker-compose.yaml for real: the CPU images built from PyPI's wheels, the default services (with the
monitoring profile's Prometheus beside them) started, loaded, scraped, swapped, crashed, stopped and broken on
a Docker engine, every request accounted for. The fleet profile is tests/test_compose_fleet.py.

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
import socket
import subprocess
import sys
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
from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL, REPO_ROOT, TORCHSCRIPT_MODEL
from resnet18_kit.model_control import ModelControl, swap, variant_targets
from resnet18_kit.server.embedded import answers_ready
from resnet18_kit.tools.reliability.compose_checks import BACK_WITHIN_S, GRACE_S, counts, crash, wait_for
from resnet18_kit.tools.reliability.fleet_load import FleetLoad, Tally
from resnet18_kit.tools.reliability.loads import ensemble_load, onnx_load, reference_answers

ADMIN_KEY = "compose-test-admin-key"
#: The single project's services to wait for: Grafana (a registry image) is left out.
SINGLE_SERVICES = ("triton", "prometheus")
#: The triton service's command of docker-compose.yaml with the exit timeout at 15 s (an override replaces
#: the whole list; compose fills in the variables).
TRITON_COMMAND = ["--model-config-name=${TRITON_MODEL_CONFIG_NAME:-}", "--model-control=${TRITON_MODEL_CONTROL:-none}",
                  "--exit-timeout-s=15"]


def new_project(engine, tag: str, **options) -> ComposeProject:
    return ComposeProject(engine, f"r18test-{tag}-{os.getpid()}", ComposePorts.free(), options.pop("admin_key", ADMIN_KEY),
                          **options)


@pytest.mark.deploy  # `docker compose config`: the Compose v2 plugin of the test layer, no engine
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
        assert services[name]["image"] == IMAGES["triton"], name
        assert services[name]["build"]["dockerfile"].endswith("deploy/docker/Dockerfile"), name
        assert services[name]["build"]["network"] == "none", name  # it installs from build/wheelhouse only
    assert services["haproxy"]["image"] == IMAGES["haproxy"]
    assert services["prometheus"]["image"] == IMAGES["prometheus"]
    assert services["check-artifacts"]["command"][0] == "--check"
    assert "resnet18_kit.observe.probe" in services["triton"]["healthcheck"]["test"]
    published = {(p["host_ip"], int(p["published"]), p["target"]) for p in services["triton"]["ports"]}
    assert published == {("127.0.0.1", 18000, 8000), ("127.0.0.1", 18001, 8001), ("127.0.0.1", 18002, 8002)}
    cpu = (REPO_ROOT / "deploy/docker/Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=debian:bookworm-slim$", cpu, re.M)
    assert re.search(r'^ENTRYPOINT \["resnet18-kit", "serve", "--host", "0.0.0.0", "--no-export"\]$', cpu, re.M)
    pins = dict(line.split("==", 1) for line in (REPO_ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert IMAGE_TORCH.startswith("torch==") and IMAGE_TORCH.endswith("+cpu") and pins["torch"] not in IMAGE_TORCH


def monitoring_override(folder) -> dict:
    """The test's copies of the shipped Prometheus config (scrape and evaluate every second) and rules
    (`for:` 3 s) in `folder`; returns the compose override's prometheus service that mounts them."""
    config = yaml.safe_load((REPO_ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    rules = yaml.safe_load((REPO_ROOT / "deploy/prometheus/rules/triton.rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.update({"for": "3s"} if "for" in rule else {})
    (folder / "rules").mkdir()
    (folder / "rules" / "triton.rules.yml").write_text(yaml.safe_dump(rules))
    return {"volumes": [f"{folder / 'prometheus.yml'}:/etc/prometheus/prometheus.yml:ro",
                        f"{folder / 'rules'}:/etc/prometheus/rules:ro"]}


@pytest.fixture(scope="module")
def single(engine, images, tmp_path_factory):
    """`docker compose --profile monitoring up --wait triton prometheus` on free ports, model control
    explicit (so that it can be swapped), tritonserver's exit timeout at 15 s (the compose file's: 30 s) so
    that the stop under keep-alive load is shorter (with 5 s, the unload under a flood of refusals outlasted
    it once: exit 1 after 13.3 s). Shared by the tests below in file order: classify, scrape and alert,
    swap and re-create, crash, stop under load, down."""
    folder = tmp_path_factory.mktemp("single")
    override = folder / "override.yaml"
    override.write_text(yaml.safe_dump({"services": {"triton": {"command": TRITON_COMMAND},
                                                     "prometheus": monitoring_override(folder)}}))
    project = new_project(engine, "single", profiles=("monitoring",), extra_files=(override,),
                          settings={"TRITON_MODEL_CONTROL": "explicit"})
    try:  # an `up` that fails half-way leaves containers too
        project.up_s = project.timed_up(*SINGLE_SERVICES)
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
    batch = np.random.default_rng(0).integers(0, 256, (2, 3, 224, 224), dtype=np.uint8)
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


def test_prometheus_scrapes_triton_and_the_queue_alert_fires(single):
    """Prometheus in its container scrapes the Triton container; under a flood of 96 gRPC clients the
    overload alert fires (the test's copy of the config scrapes and evaluates every second, `for:` 3 s)."""
    api = f"http://127.0.0.1:{single.ports.prometheus}/api/v1"

    def get(path: str) -> dict:
        with urllib.request.urlopen(f"{api}/{path}", timeout=5) as response:
            return yaml.safe_load(response.read())["data"]

    wait_for("Prometheus scrapes the Triton container", lambda: any(
        t["labels"]["job"] == "triton" and t["health"] == "up" for t in get("targets")["activeTargets"]), 60, 0.5)
    flood = FleetLoad(single.server_config(), "grpc", onnx_load(4), workers=96).start()
    try:
        firing_s = wait_for("TritonModelQueueNearlyFull firing", lambda: any(
            a["labels"]["alertname"] == "TritonModelQueueNearlyFull" and a["state"] == "firing"
            for a in get("alerts")["alerts"]), 120, 0.5)
    finally:
        tally = flood.stop()
    print(f"\ncompose monitoring: the queue alert fired {firing_s:.1f} s into a flood of 96 gRPC clients; "
          f"{counts(tally)}", flush=True)
    assert tally.lost == 0


def loads_with_both_answers(config, repository) -> list[FleetLoad]:
    """Photos through the ensemble over HTTP and tensors to resnet18_onnx over gRPC (the cache never answers
    those), each answer right under the default or the int8 config."""
    photos, tensors = reference_answers(config, ensemble_load()), reference_answers(config, onnx_load(4))
    with ModelControl(config.grpc_url, ADMIN_KEY) as control:
        swap(control, variant_targets(repository, "int8"))
        photos.also_expected = [reference_answers(config, ensemble_load()).expected]
        tensors.also_expected = [reference_answers(config, onnx_load(4)).expected]
        swap(control, variant_targets(repository, "default"))
    return [FleetLoad(config, "http", photos, workers=1, retry=False, pause_s=0.002),
            FleetLoad(config, "grpc", tensors, workers=2, retry=False, pause_s=0.002)]


def serving(config) -> str:
    with ModelControl(config.grpc_url, ADMIN_KEY) as control:
        return control.served_config(ONNX_MODEL).parameters["model_filename"].string_value


@pytest.mark.slow
def test_the_container_swaps_live_with_nothing_failed_and_a_re_create_costs_the_restart(single, repository):
    """docs/model-repository.md "Swapping configs", both ways: live, `resnet18-kit swap` against the published
    gRPC port (default -> int8; back is the same path, as the fleet's and test_swap_live's swaps show),
    nothing failed; then a new TRITON_MODEL_CONFIG_NAME=int8 and `up` re-create the container, which starts
    from the repository and that setting (a live swap does not outlive it), and the requests sent while it
    is down fail (the later tests run on int8)."""
    config = single.server_config()
    loads = loads_with_both_answers(config, repository)
    for load in loads:
        load.start()
    time.sleep(2.0)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "resnet18_kit", "swap", "--url", config.grpc_url,
                           "--model-config-name", "int8"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TRITON_ADMIN_KEY=ADMIN_KEY))
    swap_s = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert serving(config) == "model.int8.onnx"
    time.sleep(1.0)
    live = [load.stop() for load in loads]
    print(f"\ncompose, live swap default -> int8: {swap_s:.1f} s (command included); "
          + "; ".join(f"{p}: {counts(t)}" for p, t in zip(("http", "grpc"), live)), flush=True)
    for tally in live:
        assert tally.answered > 10 and (tally.failed, tally.lost, tally.refused) == (0, 0, 0), tally.errors

    recreate = ComposeProject(single.engine, single.name, single.ports, ADMIN_KEY, profiles=single.profiles,
                              extra_files=single.files[1:],
                              settings={"TRITON_MODEL_CONTROL": "explicit", "TRITON_MODEL_CONFIG_NAME": "int8"})
    load = FleetLoad(config, "grpc", reference_answers(config, onnx_load(4)), workers=2, retry=False, pause_s=0.002)
    load.load.also_expected, load.load.expected = [], []  # the answers change with the config: counts are measured
    load.start()
    time.sleep(1.0)
    recreate_s = recreate.timed_up("triton")
    time.sleep(1.0)
    recreated = load.stop()
    print(f"compose, re-create with TRITON_MODEL_CONFIG_NAME=int8: up --wait {recreate_s:.1f} s; grpc: "
          f"{counts(recreated)}", flush=True)
    assert serving(config) == "model.int8.onnx", single.engine.docker(
        "logs", "--tail", "80", single.container("triton")).stdout
    assert recreated.lost == 0 and recreated.failed > 0  # the requests sent while it was down


def test_a_crashed_container_is_restarted_and_fails_requests_only_while_down(single):
    config = single.server_config()
    load = FleetLoad(config, "http", reference_answers(config, onnx_load(4)), workers=4, retry=False).start()
    time.sleep(2.0)
    crash(single, "triton")
    killed_at = time.monotonic()
    wait_for("the endpoint refuses (container down)", lambda: not answers_ready(config.http_url, timeout_s=1.0),
             10, 0.02)
    wait_for("the restarted container is ready", lambda: answers_ready(config.http_url, timeout_s=1.0), BACK_WITHIN_S)
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
