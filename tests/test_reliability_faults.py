"""Faults against the real server: a Python-backend stub killed (what Triton 2.51 does, and the
supervisor's restart), a request that crashes tritonserver, a crash loop, and SIGTERM to `serve` with
requests in flight. Each test runs its own small server (the test model reliability_echo only)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from resnet18_kit.tools.load.outcomes import ANSWERED, ERROR, REFUSED
from resnet18_kit.tools.reliability import ECHO_MODEL, repository_with
from resnet18_kit.tools.reliability.crash_request import send_crashing_request
from resnet18_kit.tools.reliability.loads import echo_load
from resnet18_kit.tools.reliability.sigterm import sigterm_in_flight, start_serve, wait_ready
from resnet18_kit.tools.reliability.stub_kill import stub_kill
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.server.supervisor import Supervisor, SupervisorPolicy

pytestmark = pytest.mark.live

FAST = SupervisorPolicy(poll_interval_s=0.2, restart_drain_s=2.0, ready_timeout_s=120.0)
STUB_DEAD = "is not healthy"


@pytest.fixture
def echo_repository(tmp_path):
    return repository_with([ECHO_MODEL], tmp_path / "repository")


def echo(client, value: float) -> np.ndarray:
    request = httpclient.InferInput("x", [1, 4], "FP32")
    request.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return client.infer(ECHO_MODEL, [request]).as_numpy("y")


def test_triton_251_keeps_a_model_ready_whose_stub_was_killed_and_fails_every_request(echo_repository, tmp_path):
    """The measured behaviour the supervisor exists for: no restart, READY stays true, every request
    fails (HTTP 500 "Stub process '<instance>' is not healthy.")."""
    # exit timeout 2 s: the model with the dead stub never finishes unloading, so stopping takes all of it
    config = config_on_free_ports(model_repository=echo_repository, exit_timeout_s=2)
    with EmbeddedTritonServer(config, log_path=tmp_path / "tritonserver.log") as server:
        client = httpclient.InferenceServerClient(config.http_url)
        try:
            np.testing.assert_array_equal(echo(client, 1.0), np.full((1, 4), 1.0, np.float32))
            (instance, pid), = server.stub_processes().items()
            os.kill(pid, signal.SIGKILL)
            for attempt in range(3):
                with pytest.raises(InferenceServerException) as info:
                    echo(client, 2.0)
                assert info.value.status() == "500" and STUB_DEAD in info.value.message()
                assert instance in info.value.message()
            assert client.is_server_ready() and client.is_model_ready(ECHO_MODEL)
            assert server.stub_processes() == {}  # and nothing restarted it
        finally:
            client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_supervisor_restarts_the_server_when_a_stub_dies_and_requests_succeed_again(echo_repository, tmp_path,
                                                                                   protocol):
    config = config_on_free_ports(model_repository=echo_repository, exit_timeout_s=5)
    with Supervisor(config, FAST, log_path=tmp_path / "tritonserver.log") as supervisor:
        result = stub_kill(supervisor, ECHO_MODEL, echo_load(), protocol=protocol, after_recovery=10)
    print(f"\n{result}")
    total = result["total"]
    assert result["restarts"] == 1 and result["answered_in_a_row_at_end"] >= 10, result
    assert total["lost"] == 0 and total["wrong"] == 0, result
    # The only failures: the dead stub's error, then the restart's refused connections.
    assert total["answered"] + total["error"] == total["sent"], result
    assert result["detected_after_s"] is not None and result["detected_after_s"] < 3.0, result
    assert result["recovered_after_s"] < 60, result


def test_supervisor_restarts_the_server_after_a_request_crashed_it(echo_repository, tmp_path):
    """One HTTP/JSON request with a shape of 10^12 elements aborts Triton 2.51 (std::bad_alloc);
    inference is open, so anyone who can reach HTTP can do it. The supervisor brings it back."""
    config = config_on_free_ports(model_repository=echo_repository, exit_timeout_s=5)
    with Supervisor(config, FAST, log_path=tmp_path / "tritonserver.log") as supervisor:
        first_pid = supervisor.server.process.pid
        print(send_crashing_request(config))
        deadline = time.monotonic() + 120
        while not (supervisor.restarts and supervisor.events[-1].kind == "ready") and time.monotonic() < deadline:
            time.sleep(0.1)
        faults = [e.detail for e in supervisor.events if e.kind == "fault"]
        assert faults and "tritonserver exited" in faults[0], supervisor.events
        assert supervisor.server.process.pid != first_pid
        client = httpclient.InferenceServerClient(config.http_url)
        try:
            np.testing.assert_array_equal(echo(client, 3.0), np.full((1, 4), 3.0, np.float32))
        finally:
            client.close()


def wait_for(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_supervisor_gives_up_on_a_crash_loop(echo_repository, tmp_path):
    """max_restarts=1: the first dead stub is restarted, the second within the window ends the loop."""
    policy = SupervisorPolicy(poll_interval_s=0.2, restart_drain_s=2.0, max_restarts=1, restart_window_s=600)
    config = config_on_free_ports(model_repository=echo_repository, exit_timeout_s=5)
    supervisor = Supervisor(config, policy, log_path=tmp_path / "tritonserver.log")
    supervisor.start()
    try:
        (_, pid), = supervisor.server.stub_processes().items()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: supervisor.restarts == 1 and supervisor.events[-1].kind == "ready")
        (_, pid), = supervisor.server.stub_processes().items()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: supervisor.exit_status is not None)
    finally:
        supervisor.stop()
    kinds = [e.kind for e in supervisor.events]
    assert supervisor.exit_status == 1 and supervisor.restarts == 1, supervisor.events
    assert kinds[-1] == "gave-up" and kinds.count("fault") == 1 and not supervisor.server.running, kinds


def test_sigterm_lets_accepted_requests_finish_refuses_new_ones_and_exits_in_time(echo_repository, tmp_path):
    """SIGTERM to `resnet18-kit serve` while 10 requests are sent at once (the queue holds 8 + 4 executing,
    fewer while the batcher gathers the next batch, so a few may be refused): every accepted request is
    answered; new HTTP requests are refused at once (503 "Exceeds maximum queue size" while the queue still
    holds the accepted ones, then 404 "no available versions" as the models unload, then connection
    refused); the server exits 0 within --exit-timeout-s.
    gRPC keeps accepting new requests while HTTP connections drain, then answers NOT_FOUND ("no
    available versions") while models unload: documented in docs/reliability.md, not hidden."""
    exit_timeout_s = 10
    result = sigterm_in_flight(echo_repository, ECHO_MODEL, echo_load(), in_flight=10,
                               exit_timeout_s=exit_timeout_s, log_path=tmp_path / "serve.log")
    print(f"\n{ {k: v for k, v in result.items() if k != 'after_sigterm'} }")
    for row in result["after_sigterm"]:
        print(row)
    in_flight = result["in_flight"]
    assert in_flight["lost"] == 0 and in_flight["error"] == 0 and in_flight["wrong"] == 0, result["in_flight_failures"]
    assert in_flight["answered"] + in_flight["refused"] == 10 and in_flight["answered"] >= 4, result
    assert result["last_in_flight_answered_after_sigterm_s"] > 0, "SIGTERM came after the last answer"
    assert result["exit_status"] == 0 and result["exit_s"] < exit_timeout_s, result
    after = result["after_sigterm"]
    # (An HTTP request sent within moments of SIGTERM may still be accepted, and is then answered.)
    http_after = [row for row in after if row["protocol"] == "http" and row["sent_s"] >= 0.2]
    assert http_after and all(row["kind"] in (REFUSED, ERROR) for row in http_after), http_after
    assert http_after[-1]["kind"] == ERROR, http_after  # the models unloaded before the server went
    # Nothing sent after SIGTERM hangs or gets a wrong answer: answered (gRPC, during the drain) or refused.
    assert all(row["kind"] in (ANSWERED, REFUSED, ERROR) for row in after), after


def test_killing_serve_outright_takes_its_server_down(echo_repository, tmp_path):
    """`serve` SIGKILLed (no chance to stop tritonserver): the server and the gRPC guard get SIGTERM from the
    kernel (die_with_parent) and exit instead of holding the ports as orphans; the guard removes the counts
    file nobody is left to read, with its folder."""
    from resnet18_kit.observe.processes import child_processes, process_alive

    config = config_on_free_ports(model_repository=echo_repository, exit_timeout_s=5)
    serve = start_serve(config, tmp_path / "serve.log")
    try:
        wait_ready(config, serve, 120)
        children = child_processes(serve.pid)
        (server_pid, _), = [(pid, argv) for pid, argv in children if "tritonserver" in argv[0]]
        (guard_pid, guard_argv), = [(pid, argv) for pid, argv in children if "grpc-guard" in argv]
        counts_file = Path(guard_argv[guard_argv.index("--counts-file") + 1])
        assert counts_file.is_file()
        serve.kill()
        serve.wait()
        wait_for(lambda: not process_alive(server_pid) and not process_alive(guard_pid), timeout_s=30)
        assert not counts_file.parent.exists()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
