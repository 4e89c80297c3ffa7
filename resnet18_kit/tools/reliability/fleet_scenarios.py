"""The fleet under load: spread, rolling restart, a replica killed, a stub killed, overload, the ensemble.

Each scenario starts a fleet (fleet.Fleet: replicas on free ports behind HAProxy), sends load through its
front ends with `FleetLoad` (one long-lived connection per HTTP sender, one HTTP/2 connection shared by
every gRPC sender) and returns one row: the requests' outcomes (sent / answered / refused / failed / lost),
each replica's share of what the replicas counted (nv_inference_count on its own metrics port), and the
scenario's own figures. A light model stands in for ResNet-18 where the 2-core CPU would be the limit:

  identity         bench's FP32 [N,16] -> same, 2 instances, no delay (thousands of infer/s)
  reliability_echo y = x after 200 ms, batches of up to 4, a queue of 8 (refuses under a flood)
  resnet18         the shipped ensemble on the sample photos (the `ensemble` scenario)

`resnet18-kit reliability run --scenario fleet` runs them all and prints FLEET_COLUMNS as a table;
tests/test_fleet.py runs each with smaller numbers and asserts the targets. Once measured, a scenario's
fleet is killed (Fleet drain_on_exit=False): the graceful stop is the fleet command's, tested on its own.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from resnet18_kit.fleet.fleet import Fleet, FleetConfig
from resnet18_kit.fleet.haproxy import FrontEnd, runtime_socket_in
from resnet18_kit.observe.metrics import model_counters
from resnet18_kit.tools.reliability import ECHO_MODEL, RELIABILITY_REPOSITORY
from resnet18_kit.tools.reliability.fleet_load import FleetLoad, Tally, not_cut_at
from resnet18_kit.tools.reliability.loads import TensorLoad, echo_load, ensemble_load, reference_answers
from resnet18_kit.server.config import ServerConfig, free_ports
from resnet18_kit.server.supervisor import SupervisorPolicy

IDENTITY_MODEL = "identity"
IDENTITY_REPOSITORY = Path(__file__).resolve().parent.parent / "bench" / "model_repository"
#: The table's columns (docs/records/deployment.md, the fleet).
FLEET_COLUMNS = ("case", "replicas", "protocol", "sent", "answered", "refused", "failed", "lost",
                 "share per replica", "also")


def light_repository(target: Path) -> Path:
    """A model repository in `target` with links to the identity and echo models; returns `target`."""
    target.mkdir(parents=True, exist_ok=True)
    for source in (IDENTITY_REPOSITORY / IDENTITY_MODEL, RELIABILITY_REPOSITORY / ECHO_MODEL):
        link = target / source.name
        if not link.exists():
            link.symlink_to(source)
    return target


def identity_load(count: int = 16) -> TensorLoad:
    """`count` inputs for identity (FP32 [1, 16] filled with i), each its own reference answer."""
    inputs = [np.full((1, 16), i, np.float32) for i in range(count)]
    return TensorLoad(IDENTITY_MODEL, "INPUT", "OUTPUT", "FP32", inputs, [x.copy() for x in inputs])


def fleet_config(repository: Path, workdir: Path, replicas: int, take_out_on_fault: bool = True,
                 grpc_guard: bool = True, **options) -> FleetConfig:
    """A FleetConfig of `replicas` replicas of `repository` and both front ends on free ports, files in
    `workdir`, a 10 s exit timeout per replica, each replica's gRPC behind a guard as `resnet18-kit fleet`
    has it (grpc_guard); `options` go to ServerConfig."""
    ports = free_ports(4 * replicas + 2)
    configs = tuple(ServerConfig(model_repository=repository, http_port=ports[4 * i], grpc_port=ports[4 * i + 1],
                                 metrics_port=ports[4 * i + 2], exit_timeout_s=10,
                                 triton_grpc_port=ports[4 * i + 3] if grpc_guard else None, **options)
                    for i in range(replicas))
    front = FrontEnd("127.0.0.1", ports[-2], ports[-1], runtime_socket_in(workdir))
    return FleetConfig(configs, front, workdir, supervisor=SupervisorPolicy(poll_interval_s=0.2, queue_warnings=False),
                       take_out_on_fault=take_out_on_fault)


def counts(fleet: Fleet, model: str) -> list[float]:
    """nv_inference_count of `model` on each replica's metrics endpoint, in replica order."""
    return [model_counters(c.metrics_url, model).get("nv_inference_count", 0.0) for c in fleet.config.replicas]


def shares(before: list[float], after: list[float]) -> list[float]:
    """Each replica's fraction of what all replicas counted between `before` and `after`."""
    deltas = [b - a for a, b in zip(before, after)]
    total = sum(deltas)
    return [d / total if total else 0.0 for d in deltas]


def spread_error(share: list[float]) -> float:
    """The largest relative gap between a replica's share and an even one (0.1 = 10 %)."""
    even = 1.0 / len(share)
    return max(abs(s - even) / even for s in share)


def row(case: str, fleet: Fleet, protocol: str, tally: Tally, share: list[float], also: str = "") -> dict:
    """One row of FLEET_COLUMNS with the tally's counts (and its retries and per-try figures kept)."""
    return {"case": case, "replicas": len(fleet.config.replicas), "protocol": protocol, **tally.row(),
            "share": [round(s, 3) for s in share], "spread_error": round(spread_error(share), 3),
            "errors": tally.errors[:3], "also": also}


def spread(repository: Path, workdir: Path, replicas: int, protocols: tuple[str, ...] = ("http", "grpc"),
           requests: int = 600) -> list[dict]:
    """Even spread, on one fleet of `replicas`, one row per protocol in turn: `requests` identity requests over
    ONE connection (HTTP: one sender on one keep-alive connection; gRPC: four senders on one channel); each
    replica's share of that protocol's requests."""
    rows = []
    with Fleet(fleet_config(repository, workdir, replicas), drain_on_exit=False) as fleet:
        for protocol in protocols:
            before = counts(fleet, IDENTITY_MODEL)
            load = FleetLoad(fleet.config.front.server_config(), protocol, identity_load(),
                             workers=1 if protocol == "http" else 4, limit=requests).start()
            tally = load.wait()
            share = shares(before, counts(fleet, IDENTITY_MODEL))
            rows.append(row("even spread", fleet, protocol, tally, share,
                            f"largest gap from an even share {spread_error(share):.1%}"))
    return rows


class CountWatch:
    """Each replica's nv_inference_count of `model`, read every `interval_s` on a thread and summed as
    increments, so that a replica restarted meanwhile (its counter starts again from 0) keeps what it
    counted before: a fall is taken as a restart, and the new value as its increment. What a replica
    counted between the last read and its death is missed (under `interval_s` of its traffic)."""

    def __init__(self, fleet: Fleet, model: str, interval_s: float = 0.2):
        import threading

        self.fleet, self.model, self.interval_s = fleet, model, interval_s
        self.totals = [0.0] * len(fleet.config.replicas)
        self._last: list[float | None] = [None] * len(fleet.config.replicas)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="count-watch", daemon=True)

    def read(self) -> None:
        for i, config in enumerate(self.fleet.config.replicas):
            try:
                value = model_counters(config.metrics_url, self.model, timeout_s=1.0).get("nv_inference_count", 0.0)
            except OSError:  # down or restarting: read it next time
                continue
            last = self._last[i]
            if last is not None:
                self.totals[i] += value - last if value >= last else value
            self._last[i] = value

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.read()

    def __enter__(self) -> "CountWatch":
        self.read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.read()

    def shares(self) -> list[float]:
        return shares([0.0] * len(self.totals), self.totals)


#: under_load's senders: (protocol, workers): HTTP one connection, gRPC four calls on one channel.
UNDER_LOAD_WORKERS = (("http", 1), ("grpc", 4))


def under_load(fleet: Fleet, load: TensorLoad, action, seconds_before_s: float = 2.0, seconds_after_s: float = 2.0,
               retry_dead_stub: bool = False, retry: bool = True) -> tuple[dict, list[Tally], list[float]]:
    """Run `action(fleet)` (its return value first in the result) while HTTP (one connection) and gRPC
    (four calls on one channel) load runs (retry=False: plain clients that never retry), from
    `seconds_before_s` before to `seconds_after_s` after it;
    returns (action's result, [http tally, grpc tally], each replica's share counted by a CountWatch)."""
    front = fleet.config.front.server_config()
    watch = CountWatch(fleet, load.model)
    with watch, ExitStack() as stack:
        loads = [stack.enter_context(FleetLoad(front, p, load, workers=w, retry_dead_stub=retry_dead_stub,
                                               pause_s=0.002, retry=retry))
                 for p, w in UNDER_LOAD_WORKERS]
        time.sleep(seconds_before_s)
        result = action(fleet)
        time.sleep(seconds_after_s)
        tallies = [lo.stop() for lo in loads]
        for index in range(len(fleet.config.replicas)):  # every replica back, so its last count is read
            fleet.wait_status(index, "UP", 60)
    return result, tallies, watch.shares()


def both_rows(case: str, fleet: Fleet, tallies: list[Tally], share: list[float], also: str) -> list[dict]:
    """The HTTP and gRPC rows of a scenario that ran both loads together."""
    return [row(case, fleet, p, t, share, also) for p, t in zip(("http", "grpc"), tallies)]


def rolling_restart(repository: Path, workdir: Path, replicas: int = 3) -> list[dict]:
    """Every replica restarted in turn (Fleet.roll: drain, graceful stop, start, back UP) under load."""
    with Fleet(fleet_config(repository, workdir, replicas), drain_on_exit=False) as fleet:
        started = time.monotonic()
        steps, tallies, share = under_load(fleet, identity_load(), lambda f: f.roll())
        took = time.monotonic() - started
        stops = ", ".join(f"{s['stop_s']:.1f}" for s in steps)
        retried = sum(t.retried for t in tallies)
        return both_rows("rolling restart", fleet, tallies, share,
                         f"{replicas} replicas restarted one by one in {took:.0f} s (stops {stops} s); "
                         f"clients retried {retried} requests")


def watch_pool(fleet: Fleet, index: int, timeout_s: float = 120.0) -> dict:
    """Poll HAProxy every 10 ms from now: seconds until replica `index` left the pool (its status and the
    check's result then) and until it was UP again."""
    started, left, how = time.monotonic(), None, ""
    while time.monotonic() - started < timeout_s:
        row_ = fleet.haproxy.api.states()[("triton_http", f"replica{index + 1}")]
        if left is None and row_["status"] != "UP":
            left, how = time.monotonic() - started, f"{row_['status']} ({row_['check_status'] or 'set by the fleet'})"
        elif left is not None and row_["status"] == "UP":
            return {"left_s": left, "how": how, "back_s": time.monotonic() - started}
        time.sleep(0.01)
    return {"left_s": left, "how": how, "back_s": None}


def replica_killed(repository: Path, workdir: Path, replicas: int = 3, retry: bool = True) -> list[dict]:
    """SIGKILL one replica (its tritonserver and its gRPC guard, as a crash of its host or container would)
    under load: when HAProxy's own check takes it out (the fleet's reaction to its supervisor is off here,
    so the check is what is measured), when it is back (its supervisor restarts both, two good checks),
    and what the clients saw. HAProxy replays the requests the replica held (deploy/haproxy/haproxy.cfg),
    so clients that never retry (retry=False) see no error either."""
    def kill(fleet: Fleet) -> dict:
        server = fleet.supervisors[1].server
        # The guard, the replica's front door, dies first: killed after tritonserver, it would live on for a
        # moment and answer the requests it holds with UNAVAILABLE ("failed to connect"), a proper gRPC
        # reply HAProxy cannot replay, where a crashed host answers nothing at all.
        if server.guard is not None:
            server.guard.process.kill()
        server.process.kill()
        killed_at = time.monotonic()
        return {**watch_pool(fleet, 1), "killed_at": killed_at}

    with Fleet(fleet_config(repository, workdir, replicas, take_out_on_fault=False),
               drain_on_exit=False) as fleet:
        seen, tallies, share = under_load(fleet, identity_load(), kill, retry=retry)
        clients = (f"clients retried {sum(t.retried for t in tallies)} requests" if retry
                   else "plain clients, no retries")
        rows = both_rows("replica SIGKILLed", fleet, tallies, share,
                         f"out of the pool {seen['left_s'] * 1000:.0f} ms after the kill as {seen['how']} "
                         f"(check every 500 ms); UP again after {seen['back_s'] or float('nan'):.1f} s; {clients}")
        for entry, tally, (_, workers) in zip(rows, tallies, UNDER_LOAD_WORKERS):  # failures not cut in transit
            entry["not_cut_at_kill"] = not_cut_at(tally, seen["killed_at"], in_flight=workers)
        return rows


def stub_killed(repository: Path, workdir: Path, replicas: int = 3) -> list[dict]:
    """SIGKILL one Python-backend stub of a replica under load: its supervisor sees it, the fleet puts the
    replica in maintenance and back once restarted; clients retry "Stub process is not healthy"."""
    def kill(fleet: Fleet) -> dict:
        import os
        import signal

        stubs = fleet.supervisors[1].server.stub_processes()
        os.kill(next(pid for name, pid in stubs.items() if IDENTITY_MODEL in name), signal.SIGKILL)
        return watch_pool(fleet, 1)

    with Fleet(fleet_config(repository, workdir, replicas), drain_on_exit=False) as fleet:
        seen, tallies, share = under_load(fleet, identity_load(), kill, retry_dead_stub=True)
        dead = sum(len(t.tries.get("dead-stub", [])) for t in tallies)
        retried = sum(t.retried for t in tallies)
        return both_rows("stub SIGKILLed", fleet, tallies, share,
                         f"out of the pool {seen['left_s'] * 1000:.0f} ms after the kill as {seen['how']}; UP again "
                         f"after {seen['back_s'] or float('nan'):.1f} s; clients retried {retried} requests "
                         f"({dead} tries answered 'not healthy')")


def overload(repository: Path, workdir: Path, replicas: int = 2, senders: int = 48, seconds: float = 6.0) -> dict:
    """A flood of `senders` gRPC calls on one channel at echo replicas that hold 12 requests each: refusals
    (503 / UNAVAILABLE) and how fast they come back; whether any replica left the pool."""
    with Fleet(fleet_config(repository, workdir, replicas), drain_on_exit=False) as fleet:
        before = counts(fleet, ECHO_MODEL)
        load = FleetLoad(fleet.config.front.server_config(), "grpc", echo_load(), workers=senders).start()
        lowest_up, end = replicas, time.monotonic() + seconds
        while time.monotonic() < end:
            lowest_up = min(lowest_up, sum(fleet.status(i) == {"UP"} for i in range(replicas)))
            time.sleep(0.05)
        tally = load.stop()
        share = shares(before, counts(fleet, ECHO_MODEL))
        result = row("fleet overloaded", fleet, "grpc", tally, share,
                     f"{len(tally.tries.get('refused', []))} tries refused, p99 {tally.try_ms('refused', 99):.1f} ms "
                     f"at the client; replicas UP throughout: {lowest_up} of {replicas} at the lowest")
        result["lowest_up"] = lowest_up
        return result


def ensemble(repository: Path, workdir: Path, replicas: int = 2, requests: int = 60) -> list[dict]:
    """The shipped `resnet18` ensemble on the sample photos through the fleet, over HTTP and gRPC, each
    answer compared with replica 1's answer to the same photo alone."""
    with Fleet(fleet_config(repository, workdir, replicas), drain_on_exit=False) as fleet:
        load = reference_answers(fleet.config.replicas[0], ensemble_load())
        before = counts(fleet, load.model)
        tallies = []
        for protocol, workers in (("http", 1), ("grpc", 2)):
            tallies.append(FleetLoad(fleet.config.front.server_config(), protocol, load, workers=workers,
                                     limit=requests // 2).start().wait())
        share = shares(before, counts(fleet, load.model))
        return both_rows("resnet18 ensemble, photos", fleet, tallies, share,
                         f"answers equal to a lone replica's; {requests} requests")


def run_all(shipped: Path, workdir: Path, requests: int = 600) -> list[dict]:
    """Every scenario in the order of the table: even spread (N = 2, 3; HTTP, gRPC; `requests` each),
    rolling restart, replica SIGKILLed, stub SIGKILLed, overload (light models), then the ensemble of the
    shipped repository `shipped`. Each fleet's files in its own folder under `workdir`."""
    light = light_repository(workdir / "models")
    rows = [r for n in (2, 3) for r in spread(light, workdir / f"spread-{n}", n, requests=requests)]
    rows += rolling_restart(light, workdir / "rolling-restart")
    rows += replica_killed(light, workdir / "replica-killed")
    rows += stub_killed(light, workdir / "stub-killed")
    rows.append(overload(light, workdir / "overload"))
    rows += ensemble(shipped, workdir / "ensemble")
    return rows


def table_cells(result: dict) -> list:
    """A row of run_all as the cells of FLEET_COLUMNS."""
    share = " / ".join(f"{s:.1%}" for s in result["share"])
    return [result["case"], result["replicas"], result["protocol"], result["sent"], result["answered"],
            result["refused"], result["failed"], result["lost"], share, result["also"]]
