"""Swapping configs on a running server and fleet (docs/model-repository.md "Swapping configs"): under
constant load nothing fails or is lost; every failed swap leaves the previous config answering every
request sent during it; the supervisor follows a swap and still restarts a server whose stub dies after one.
`pytest -s` prints each run's figures (reliability.swap_scenarios, `resnet18-kit reliability run
--scenario swap`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL
from resnet18_kit.tools.reliability import swap_scenarios
from resnet18_kit.tools.reliability.fleet_load import FleetLoad
from resnet18_kit.tools.reliability.loads import ensemble_load, reference_answers
from resnet18_kit.server.config import config_on_free_ports, free_ports
from resnet18_kit.model_control import ModelControl, swap, variant_targets
from resnet18_kit.server.supervisor import Supervisor, SupervisorPolicy

pytestmark = pytest.mark.live

KEY = "swap-test-key"


def show(result: dict) -> None:
    print("\n" + json.dumps({k: v for k, v in result.items() if k != "tallies"} |
                            {"tallies": [t.row() for t in result["tallies"]]}, default=str), flush=True)


def assert_nothing_failed(result: dict, swaps: tuple[str, ...] = swap_scenarios.SWAPS) -> None:
    for protocol, tally in zip(("http", "grpc"), result["tallies"]):
        assert tally.answered > 20, (protocol, tally.row())
        assert (tally.failed, tally.lost, tally.refused) == (0, 0, 0), (protocol, tally.row(), tally.errors)
    assert result["faults"] == []  # a swap's stubs leaving is not a fault
    assert len(result["swap_s"]) == len(swaps)


def test_a_live_swap_under_load_fails_nothing(swappable, ensemble_repository):
    """default -> int8 -> default on one supervised server under HTTP and gRPC load through the ensemble
    (`resnet18-kit reliability run --scenario swap` starts its own: swap_scenarios.one_server)."""
    result = swap_scenarios.swaps_on(swappable, KEY, ensemble_repository.root, before_s=3.0, after_s=2.0)
    show(result)
    assert_nothing_failed(result)


def test_a_rolling_swap_of_a_fleet_fails_nothing_for_a_client_that_never_retries(ensemble_repository, tmp_path):
    """The same on a fleet of 2, each replica drained in HAProxy, swapped to int8 and put back in turn (one
    serves while the other is swapped: a third replica would repeat the same step). One way only: the way
    back is the same steps to another config, which the one-server swap above makes under load, and the
    fleet's way there and back is `resnet18-kit reliability run --scenario swap`'s."""
    result = swap_scenarios.fleet(ensemble_repository.root, tmp_path, replicas=2, before_s=3.0, after_s=2.0,
                                  swaps=("int8",))
    show(result)
    assert_nothing_failed(result, swaps=("int8",))


@pytest.fixture(scope="module")
def swappable(ensemble_repository, tmp_path_factory):
    """A supervised server with model control (as `serve --model-control explicit` runs one)."""
    config = config_on_free_ports(model_repository=ensemble_repository.root, model_control="explicit", admin_key=KEY,
                                  triton_grpc_port=free_ports(1)[0])
    supervisor = Supervisor(config, SupervisorPolicy(queue_warnings=False),
                            log_path=tmp_path_factory.mktemp("swappable") / "tritonserver.log",
                            on_event=lambda event: None)
    supervisor.start()
    try:
        yield supervisor
    finally:
        supervisor.stop(hurry=True)


def swap_command(config, *args: str, key: str | None = KEY) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_ADMIN_KEY"} | ({"TRITON_ADMIN_KEY": key} if key else {})
    return subprocess.run([sys.executable, "-m", "resnet18_kit", "--model-repository", str(config.model_repository),
                           "swap", "--url", config.grpc_url, *args],
                          capture_output=True, text=True, env=env, timeout=300)


def settled_stub(supervisor, instance: str, timeout_s: float = 60.0) -> int:
    """The pid of `instance`'s stub once a swap's old stubs have left: one stub per instance, the same pids
    in two reads a second apart (so the supervisor's checks, every 0.5 s, have seen them too)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        stubs = supervisor.server.stub_pids()
        if len(stubs) == len(dict(stubs)) and stubs == last:
            return dict(stubs)[instance]
        assert time.monotonic() < deadline, f"a swap's old stubs never left: {stubs}"
        last = stubs
        time.sleep(1.0)


def runtime(config) -> str:
    with ModelControl(config.grpc_url, KEY) as control:
        return control.served_config(ONNX_MODEL).parameters["model_filename"].string_value


def test_a_failed_swap_changes_nothing_and_the_old_config_answers_throughout(swappable, ensemble_repository, tmp_path):
    """Each bad swap: one line naming the problem, a non-zero exit, resnet18_onnx still on model.onnx, and
    every request sent meanwhile (HTTP and gRPC, through the ensemble) answered by it."""
    config = swappable.config
    source = ensemble_repository.config_path(ONNX_MODEL).read_text()
    small = tmp_path / "small.pbtxt"
    small.write_text(source.replace("max_batch_size: 16", "max_batch_size: 8"))
    renamed = tmp_path / "renamed.pbtxt"
    renamed.write_text(source.replace('name: "logits"', 'name: "scores"'))
    missing = tmp_path / "missing.pbtxt"
    missing.write_text(source.replace('"model.onnx"', '"absent.onnx"'))
    cases = [  # (arguments, key, exit status, what the line names)
        (["--model-config-name", "nope"], KEY, 2, "no model"),
        (["--config", str(small)], KEY, 2, "max_batch_size 8, but ensemble 'resnet18'"),
        (["--config", str(renamed)], KEY, 2, "output 'logits', which this config lacks"),
        (["--config", str(missing)], KEY, 1, "absent.onnx"),
        (["--model-config-name", "int8"], None, 2, "TRITON_ADMIN_KEY is not set"),
        (["--model-config-name", "int8"], "wrong-key", 1, "admin key is missing or wrong"),
    ]
    load = reference_answers(config, ensemble_load())
    with FleetLoad(config, "http", load, workers=1, retry=False) as http, \
            FleetLoad(config, "grpc", load, workers=2, retry=False) as grpc:
        for args, key, status, named in cases:
            done = swap_command(config, *args, key=key)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == status, (args, done.stderr)
            assert len(lines) == 1 and named in lines[0] and "Traceback" not in done.stderr, (args, done.stderr)
            assert runtime(config) == "model.onnx", args
        time.sleep(1.0)
    for tally in (http.tally, grpc.tally):
        assert tally.answered > 10 and (tally.failed, tally.lost) == (0, 0), (tally.row(), tally.errors)
    with ModelControl(config.grpc_url, KEY) as control:
        assert control.ready(ENSEMBLE_MODEL)


def test_after_a_swap_a_dead_stub_still_restarts_the_server_which_keeps_the_swapped_config(
        swappable, ensemble_repository):
    """Swap to int8, kill one of its new stubs: the supervisor counts the swap's stubs leaving as no fault,
    the killed one as a fault, restarts the server and loads int8 back; requests are answered again."""
    config = swappable.config
    done = swap_command(config, "--model-config-name", "int8")
    assert done.returncode == 0, done.stderr
    assert "resnet18_onnx: now serving python (openvino, model.int8.onnx)" in done.stderr
    assert runtime(config) == "model.int8.onnx"
    killed = settled_stub(swappable, f"{ONNX_MODEL}_0_0")  # the old instances leave once their requests are done
    faults_before = sum(e.kind == "fault" for e in swappable.events)
    assert faults_before == 0
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not any(e.kind == "ready" and "swapped configs put back: resnet18_onnx" in e.detail for e in swappable.events):
        assert time.monotonic() < deadline, [e.detail for e in swappable.events]
        time.sleep(0.2)
    assert [e.detail for e in swappable.events if e.kind == "fault"][0].startswith(
        f"Python-backend stub of instance '{ONNX_MODEL}_0_0'")
    assert runtime(config) == "model.int8.onnx"
    load = ensemble_load()
    tally = FleetLoad(config, "grpc", load, workers=1, retry=False, limit=10).start().wait()
    assert tally.answered == 10, tally.errors
    with ModelControl(config.grpc_url, KEY) as control:
        swap(control, variant_targets(ensemble_repository, "default"))
    assert runtime(config) == "model.onnx"


def test_a_swap_sent_onto_a_dead_stub_falls_back_to_the_supervisors_restart(swappable, ensemble_repository):
    """A stub killed just before a swap: the supervisor restarts the server (a swap would leave the dead
    instance behind, which never unloads); the swap says it failed or completes on the restarted server,
    and a swap sent again serves the new config."""
    config = swappable.config
    killed = settled_stub(swappable, f"{ONNX_MODEL}_0_1")  # a stub that serves, not one a swap retires
    restarts = sum(e.kind == "restart" for e in swappable.events)
    os.kill(killed, signal.SIGKILL)
    first = swap_command(config, "--model-config-name", "int8")
    assert first.returncode in (0, 1) and "Traceback" not in first.stderr, first.stderr
    deadline = time.monotonic() + 120
    while not (sum(e.kind == "restart" for e in swappable.events) > restarts and swappable.wait_serving(1.0)):
        assert time.monotonic() < deadline, (killed, first.stderr, [e.detail for e in swappable.events])
    assert f"instance '{ONNX_MODEL}_0_1'" in [e.detail for e in swappable.events if e.kind == "fault"][-1]
    again = swap_command(config, "--model-config-name", "int8")
    assert again.returncode == 0 and runtime(config) == "model.int8.onnx", again.stderr
    tally = FleetLoad(config, "grpc", ensemble_load(), workers=1, retry=False, limit=10).start().wait()
    assert tally.answered == 10, tally.errors
    with ModelControl(config.grpc_url, KEY) as control:
        swap(control, variant_targets(ensemble_repository, "default"))


def test_serve_refuses_model_control_without_an_admin_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_ADMIN_KEY"}
    done = subprocess.run([sys.executable, "-m", "resnet18_kit", "--results", str(tmp_path), "serve",
                           "--model-control", "explicit", "--check"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "--model-control explicit needs an admin key" in done.stderr


def test_triton_251_answers_an_image_seen_before_a_swap_from_its_cache_with_the_old_config(
        ensemble_repository, tmp_path):
    """Triton 2.51 keys the response cache by model, version and inputs, not config: after a swap to int8 a
    photo the ensemble answered before is answered with the default config's logits, a new photo with
    int8's. The swap says so (stale_cache_note)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from resnet18_kit.tools.load.photos import tagged
    from resnet18_kit.server.config import DEFAULT_CACHE_BYTES
    from resnet18_kit.server.embedded import EmbeddedTritonServer

    config = config_on_free_ports(model_repository=ensemble_repository.root, model_control="explicit", admin_key=KEY,
                                  response_cache_bytes=DEFAULT_CACHE_BYTES)
    photo = sample_photo_bytes()
    with EmbeddedTritonServer(config, log_path=tmp_path / "tritonserver.log", drain_on_exit=False):
        client = grpcclient.InferenceServerClient(config.grpc_url)

        def logits(image: bytes) -> np.ndarray:
            request = grpcclient.InferInput("image", [1, 1], "BYTES")
            request.set_data_from_numpy(np.array([[image]], dtype=np.object_))
            return client.infer(ENSEMBLE_MODEL, [request]).as_numpy("logits")

        before, fresh_before = logits(photo), logits(tagged(photo, "fresh-before"))
        control, lines = ModelControl(config.grpc_url, KEY), []
        try:
            swap(control, variant_targets(ensemble_repository, "int8"), on_line=lines.append)
            after, fresh_after = logits(photo), logits(tagged(photo, "fresh-after"))
            swap(control, variant_targets(ensemble_repository, "default"))
        finally:
            control.close()
            client.close()
    np.testing.assert_array_equal(after, before)  # from the cache: the default config's answer
    assert not np.allclose(fresh_after, fresh_before, rtol=1e-4, atol=1e-4)  # computed by int8
    assert any("response cache of resnet18 still answers" in line for line in lines), lines


def sample_photo_bytes() -> bytes:
    from resnet18_kit.client.samples import sample_photos

    return sample_photos()[0].read_bytes()


def test_triton_251_holds_http_requests_during_a_load_sent_over_http_so_swap_loads_over_grpc(
        ensemble_repository, tmp_path):
    """Triton 2.51 answers an HTTP model load on an HTTP worker thread and holds the HTTP requests of that
    thread's connections until the load is done (server issues 8117, 8958; fix proposed in PR 8737, in no
    release yet). Two HTTP clients send tensors while resnet18_onnx is swapped to int8 and back, over HTTP
    and then over gRPC (what ModelControl uses). The server has one HTTP worker thread, so that every
    connection shares the load's thread: with Triton's default of several, whether a client's connection
    lands on it is chance (a fresh clone once saw 0.33 and 0.74 s held of loads of 4.2 and 5.2 s). Over
    HTTP a request waits about as long as the load; over gRPC none waits half of it (0.15 and 0.26 s of
    2.8 and 3.2 on an AMD EPYC with 2 cores)."""
    import threading

    import numpy as np
    import tritonclient.http as httpclient
    from google.protobuf import json_format

    from resnet18_kit.server.config import ADMIN_HEADER
    from resnet18_kit.server.embedded import EmbeddedTritonServer

    config = config_on_free_ports(model_repository=ensemble_repository.root, model_control="explicit", admin_key=KEY,
                                  extra_args=("--http-thread-count=1",))

    def longest_wait(load) -> tuple[float, float]:
        """(longest HTTP request in s, the load's s) while `load()` runs."""
        stop, latencies = threading.Event(), []

        def send() -> None:
            with httpclient.InferenceServerClient(config.http_url) as client:
                tensor = httpclient.InferInput("input", [1, 3, 224, 224], "UINT8")
                tensor.set_data_from_numpy(np.zeros((1, 3, 224, 224), np.uint8))
                while not stop.is_set():
                    started = time.monotonic()
                    client.infer(ONNX_MODEL, [tensor])
                    latencies.append(time.monotonic() - started)
        senders = [threading.Thread(target=send) for _ in range(2)]
        for sender in senders:
            sender.start()
        time.sleep(1.0)
        started = time.monotonic()
        load()
        took_s = time.monotonic() - started
        time.sleep(0.5)
        stop.set()
        for sender in senders:
            sender.join()
        return max(latencies), took_s

    variants = ["int8", "default"]
    with EmbeddedTritonServer(config, log_path=tmp_path / "tritonserver.log", drain_on_exit=False), \
            httpclient.InferenceServerClient(config.http_url, network_timeout=120) as http, \
            ModelControl(config.grpc_url, KEY) as control:
        over_http = [longest_wait(lambda v=v: http.load_model(
            ONNX_MODEL, headers={ADMIN_HEADER: KEY},
            config=json_format.MessageToJson(variant_targets(ensemble_repository, v, [ONNX_MODEL])[0].config)))
            for v in variants]
        over_grpc = [longest_wait(lambda v=v: swap(control, variant_targets(ensemble_repository, v, [ONNX_MODEL])))
                     for v in variants]
    print(f"\nlongest HTTP request / load, s: over HTTP {over_http}; over gRPC {over_grpc}", flush=True)
    assert all(wait_s >= 0.8 * took_s for wait_s, took_s in over_http), over_http
    assert all(wait_s < 0.5 * took_s for wait_s, took_s in over_grpc), over_grpc


def test_serve_with_model_control_as_a_user_runs_it_names_its_config_swaps_and_stops_twice(tmp_path):
    """`serve --model-control explicit --model-config-name int8` in a subprocess: its ready block names the
    variant and how to swap it; `swap` to default over its gRPC port; two SIGTERMs (as make and Kubernetes
    send) stop it with status 0 and nothing left."""
    http, grpc, metrics = free_ports(3)
    env = dict(os.environ, TRITON_ADMIN_KEY=KEY)
    serve = subprocess.Popen([sys.executable, "-m", "resnet18_kit", "--results", str(tmp_path), "serve",
                              "--model-control", "explicit", "--model-config-name", "int8", "--http-port", str(http),
                              "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        banner = []
        for line in serve.stdout:
            banner.append(line.rstrip())
            if line.startswith("serve: Ctrl-C"):
                break
        config_line = next((line for line in banner if line.startswith("  config")), "")
        assert config_line.startswith("  config  int8   (model control on: `resnet18-kit swap --url 127.0.0.1:"), banner
        done = subprocess.run([sys.executable, "-m", "resnet18_kit", "swap", "--url", f"127.0.0.1:{grpc}",
                               "--model-config-name", "default"], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0 and "resnet18_onnx: now serving python (model.onnx)" in done.stderr, \
            done.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        serve.send_signal(signal.SIGTERM)
        status = serve.wait(timeout=120)
    assert status == 0
