"""docker-compose.yaml's fleet profile for real: three Triton replicas behind HAProxy, one project on free
ports (a module fixture), a replica killed under load, a replica swapped live and one re-created, from clients that
never retry (FleetLoad(retry=False): each request's first try is its outcome). The engine is conftest.py's
`engine` fixture; `pytest -s` prints the counts and times.
"""
from __future__ import annotations

import os
import time

import pytest

from resnet18_kit.containers.compose import ComposePorts, ComposeProject
from resnet18_kit.server.embedded import answers_ready
from resnet18_kit.tools.reliability.compose_checks import (BACK_WITHIN_S, counts, crash, grpc_ready, ready_inside,
                                                           wait_for)
from resnet18_kit.tools.reliability.fleet_load import CUT_WITHIN_S, FleetLoad, Tally, not_cut_at
from resnet18_kit.tools.reliability.loads import ensemble_load, onnx_load, reference_answers

ADMIN_KEY = "compose-fleet-test-admin-key"
#: Seconds each load worker waits between its requests while a replica starts: a steady load, not a flood
#: that starves the starting replica of the 2 cores (41-45 s to ready under a flood, 16 s idle).
LOAD_PAUSE_S = 0.1


@pytest.fixture(scope="module")
def compose_settings(ensemble_repository) -> dict[str, str]:
    """Model control explicit, so that the replicas can be swapped, and the ensemble's models only
    (TRITON_MODEL_REPOSITORY): each replica starts and restarts without loading torch; the `single`
    project of test_compose_live serves the whole shipped repository."""
    return {"TRITON_MODEL_CONTROL": "explicit", "TRITON_MODEL_REPOSITORY": str(ensemble_repository.root)}


@pytest.fixture(scope="module")
def fleet(engine, images, compose_settings):
    """`docker compose --profile fleet` (three replicas behind HAProxy) on free ports (`compose_settings`);
    shared by the replay and the swap tests, in that order."""
    project = ComposeProject(engine, f"r18test-fleet-{os.getpid()}", ComposePorts.free(), ADMIN_KEY,
                             profiles=("fleet",), settings=compose_settings)
    try:  # an `up` that fails half-way leaves containers too
        project.up_s = project.timed_up("haproxy")
        print(f"\ncompose fleet profile: up in {project.up_s:.1f} s", flush=True)
        yield project
    finally:
        project.down()
    assert project.resources() == {"container": [], "network": [], "volume": []}


def test_only_answers_cut_at_the_kill_pass_as_cut():
    cut = "request 7: InferenceServerException: [StatusCode.UNKNOWN] Stream removed (Data frame with END_STREAM)"
    assert not_cut_at(Tally(failed_at=[(100.1, cut)]), killed_at=100.0, in_flight=4) == []
    http_cut = "request 9: unavailable (no retry): ConnectionResetError: [Errno 104] Connection reset by peer"
    assert not_cut_at(Tally(failed_at=[(100.0, cut), (100.3, http_cut)]), 100.0, in_flight=4) == []
    late = not_cut_at(Tally(failed_at=[(100.0 + CUT_WITHIN_S + 1, cut)]), 100.0, in_flight=4)
    assert len(late) == 1 and late[0].startswith(f"+{CUT_WITHIN_S + 1:.2f} s from the kill")
    early = not_cut_at(Tally(failed_at=[(99.0, cut)]), 100.0, in_flight=4)
    assert len(early) == 1 and early[0].startswith("-1.00 s")
    wrong = not_cut_at(Tally(failed_at=[(100.1, "request 3: a wrong answer")]), 100.0, in_flight=4)
    assert wrong == ["+0.10 s from the kill: request 3: a wrong answer"]
    many = not_cut_at(Tally(failed_at=[(100.1, cut)] * 5), 100.0, in_flight=4)
    assert many == ["5 cut answers, more than the 4 requests in flight"]


@pytest.mark.slow
def test_fleet_replays_what_a_killed_replica_held_a_plain_client_loses_only_answers_cut_in_transit(fleet):
    """HAProxy replays every request the killed replica held; the only failures a client that never retries
    may see are answers the replica had begun to send at the instant it died (at most one per request in
    flight, within CUT_WITHIN_S of the kill); seen once, one gRPC answer of 2,291 calls."""
    front = fleet.server_config()
    # haproxy's health check: healthy once a replica serves through it
    assert answers_ready(front.http_url, timeout_s=1.0)
    wait_for("HAProxy's gRPC backend serves", lambda: grpc_ready(front.grpc_url), 10, 0.1)
    loads = {protocol: FleetLoad(front, protocol, reference_answers(front, load), workers=4, retry=False)
             for protocol, load in (("http", onnx_load(4)), ("grpc", ensemble_load()))}
    for load in loads.values():
        load.start()
    time.sleep(3.0)
    crash(fleet, "triton-2")  # into a flood: every worker has a request in flight (4 per protocol)
    killed_at = time.monotonic()
    time.sleep(CUT_WITHIN_S)
    for load in loads.values():  # then a steady load, which leaves the restarting replica CPU to start with
        load.pause_s = LOAD_PAUSE_S
    wait_for("triton-2 restarted", lambda: fleet.restart_count("triton-2") >= 1, 30, 0.1)
    wait_for("triton-2 ready again", lambda: ready_inside(fleet, "triton-2"), BACK_WITHIN_S, 0.3)
    back_s = time.monotonic() - killed_at
    time.sleep(2.0)
    for protocol, load in loads.items():
        tally = load.stop()
        cut = "; ".join(f"failed {at - killed_at:+.2f} s from the kill: {m}" for at, m in tally.failed_at)
        print(f"\ncompose fleet, triton-2 killed ({protocol}, no retries): replica ready again {back_s:.1f} s "
              f"after the kill; {counts(tally)} {cut}", flush=True)
        assert tally.lost == 0 and not_cut_at(tally, killed_at, in_flight=load.workers) == [], tally.errors
        assert tally.answered == tally.sent - tally.refused > 0
    assert ready_inside(fleet, "triton-1") and ready_inside(fleet, "triton-3")


@pytest.mark.slow
def test_the_fleet_swaps_a_replica_live_then_a_re_created_replica_fails_nothing(fleet, compose_settings):
    """A replica swapped live to `int8` (`docker compose exec triton-1 resnet18-kit swap`), then re-created
    with a new TRITON_MODEL_CONFIG_NAME (what `up -d --no-deps` does to each replica in turn), under load
    through HAProxy from clients that never retry. One replica shows each mechanism (the swap inside a
    serving replica; HAProxy taking a stopping replica out while the others serve); the other replicas
    would repeat the same step, as the embedded fleet's rolling swap (tests/test_swap_live.py) shows."""
    front = fleet.server_config()
    photos, tensors = ensemble_load(), onnx_load(4)  # answers change with the config: counts are measured

    def under_load(action) -> tuple[list[Tally], float]:
        loads = [FleetLoad(front, "http", photos, workers=1, retry=False, pause_s=LOAD_PAUSE_S).start(),
                 FleetLoad(front, "grpc", tensors, workers=2, retry=False, pause_s=LOAD_PAUSE_S).start()]
        time.sleep(2.0)
        started = time.monotonic()
        action()
        took_s = time.monotonic() - started
        time.sleep(2.0)
        return [load.stop() for load in loads], took_s

    def exec_swap() -> None:
        fleet.run("exec", "-T", "triton-1", "resnet18-kit", "--model-repository", "/models", "swap",
                  "--url", "localhost:8001", "--model-config-name", "int8")

    recreate = ComposeProject(fleet.engine, fleet.name, fleet.ports, ADMIN_KEY, profiles=("fleet",),
                              settings=compose_settings | {"TRITON_MODEL_CONFIG_NAME": "default"})
    runs = {"swap triton-1 (exec) default -> int8": under_load(exec_swap),
            "re-create triton-1 int8 -> default": under_load(
                lambda: recreate.run("up", "-d", "--wait", "--no-deps", "triton-1"))}
    for name, (tallies, took_s) in runs.items():
        print(f"\ncompose fleet, {name}: {took_s:.1f} s; "
              + "; ".join(f"{p}: {counts(t)}" for p, t in zip(("http", "grpc"), tallies)), flush=True)
    for tally in runs["swap triton-1 (exec) default -> int8"][0]:
        assert tally.answered > 10 and (tally.failed, tally.lost) == (0, 0), tally.errors
    for tally in runs["re-create triton-1 int8 -> default"][0]:  # --no-refuse-first: HAProxy takes it out first
        assert tally.answered > 10 and (tally.failed, tally.lost) == (0, 0), tally.errors
