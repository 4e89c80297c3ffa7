"""Config swaps under constant load, every request accounted for: one supervised server, and a fleet whose
replicas are swapped one after another (`resnet18-kit swap`, `--fleet`).

The load is the shipped `resnet18` ensemble on the sample photos over HTTP (one keep-alive connection) and
gRPC (four calls on one channel), sent by plain clients that never retry (reliability.fleet_load), while
the server goes default -> int8 -> default. An answer is right when it equals the answer of the default or
of the int8 config to that photo alone (both read before the load starts). The servers run without a
response cache, so every request runs the models (a cached answer would hide the swap).

Each run returns the counts per protocol (sent / answered / refused / failed / lost), each swap's seconds
(from the load request until every model and the ensemble serve the new config; the same swaps with no load
first: one model load and warm-up each), the throughput (answers
per second) and p99 latency before the first swap and while the swaps ran, the supervisors' faults (a swap
is not one), and the peak resident memory of tritonserver and its stubs before and during the swaps.
`resnet18-kit reliability run --scenario swap` prints them; tests/test_swap_live.py asserts the targets.
"""
from __future__ import annotations

import secrets
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from resnet18_kit.fleet.fleet import Fleet
from resnet18_kit.fleet.swap import swap_fleet
from resnet18_kit.tools.load.outcomes import percentile
from resnet18_kit.tools.reliability.fleet_load import FleetLoad, Tally
from resnet18_kit.tools.reliability.fleet_scenarios import fleet_config
from resnet18_kit.tools.reliability.loads import TensorLoad, ensemble_load, reference_answers
from resnet18_kit.repository import ModelRepository
from resnet18_kit.server.config import ServerConfig, config_on_free_ports, free_ports
from resnet18_kit.model_control import ModelControl, swap, variant_targets
from resnet18_kit.server.supervisor import Supervisor, SupervisorPolicy

#: The swaps each run makes, in order.
SWAPS = ("int8", "default")
#: The table's columns (docs/model-repository.md "Swapping configs").
SWAP_COLUMNS = ("case", "protocol", "sent", "answered", "refused", "failed", "lost", "swaps (s)",
                "infer/s before / during", "p99 ms before / during", "peak memory before / during")


class PeakMemory:
    """The largest total resident memory (bytes) of each server's tritonserver and stubs, sampled every
    `interval_s` on a thread; `mark()` starts a new period (peaks are kept per period)."""

    def __init__(self, servers, interval_s: float = 0.1):
        self.servers, self.interval_s = servers, interval_s
        self.peaks: list[list[int]] = [[0] * len(servers())]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for i, server in enumerate(self.servers()):
                total = sum(server.resident_memory_bytes().values()) if server is not None else 0
                self.peaks[-1][i] = max(self.peaks[-1][i], total)

    def mark(self) -> None:
        self.peaks.append([0] * len(self.servers()))

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def right_answers(config: ServerConfig, control: ModelControl, repository: ModelRepository
                  ) -> tuple[TensorLoad, list[float]]:
    """The ensemble load with the server's answers under the default config and, swapped there and back
    first with no load (one model load and warm-up each), under int8 (also_expected); and the seconds of
    those two idle swaps."""
    load, idle_s = reference_answers(config, ensemble_load()), []
    for variant in SWAPS:
        started = time.monotonic()
        swap(control, variant_targets(repository, variant))
        idle_s.append(time.monotonic() - started)
        if variant != "default":
            load.also_expected.append(reference_answers(config, ensemble_load()).expected)
    return load, idle_s


def phase_figures(tally: Tally, before: tuple[float, float], during: tuple[float, float]) -> dict:
    """Answers per second and p99 latency (ms) of the tries answered in the `before` and `during` windows
    (time.monotonic() start, end)."""
    out = {}
    for name, (start, end) in (("before", before), ("during", during)):
        latencies = sorted(ms for at, ms in tally.answered_at if start <= at <= end)
        out[f"rate_{name}"] = len(latencies) / max(end - start, 1e-9)
        out[f"p99_{name}_ms"] = percentile(latencies, 99) if latencies else float("nan")
    return out


def _run_swaps(load_target: ServerConfig, load: TensorLoad, do_swap, servers, before_s: float, after_s: float,
               swaps: tuple[str, ...] = SWAPS) -> dict:
    """Load `load_target` with HTTP and gRPC, call do_swap(variant) for each of `swaps`, and gather the figures
    (once the stubs of earlier swaps have left, so the memory before is one config's)."""
    _wait_settled(servers)
    with PeakMemory(servers) as memory, ExitStack() as stack:
        loads = [stack.enter_context(FleetLoad(load_target, p, load, workers=w, retry=False, pause_s=0.002))
                 for p, w in (("http", 1), ("grpc", 4))]
        time.sleep(before_s)
        memory.mark()
        started, seconds = time.monotonic(), []
        for variant in swaps:
            mark = time.monotonic()
            do_swap(variant)
            seconds.append(time.monotonic() - mark)
        ended = time.monotonic()
        memory.mark()
        time.sleep(after_s)
        tallies = [lo.stop() for lo in loads]
    return {"tallies": tallies, "swap_s": seconds,
            "phases": [phase_figures(t, (started - before_s + 1.0, started), (started, ended)) for t in tallies],
            "memory_before_bytes": memory.peaks[0], "memory_during_bytes": memory.peaks[1]}


def _wait_settled(servers, timeout_s: float = 60.0) -> None:
    """Wait until no instance of any server has two stubs (a swap's old ones have left)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
            server is not None and len(server.stub_pids()) != len(server.stub_processes()) for server in servers()):
        time.sleep(0.1)


def one_server(repository: Path, workdir: Path, before_s: float = 5.0, after_s: float = 3.0) -> dict:
    """A supervised server (as `serve --model-control explicit` runs it, gRPC behind the guard) swapped
    default -> int8 -> default under load."""
    key = secrets.token_hex(16)
    config = config_on_free_ports(model_repository=repository, model_control="explicit", admin_key=key,
                                  triton_grpc_port=free_ports(1)[0])
    supervisor = Supervisor(config, SupervisorPolicy(queue_warnings=False), log_path=workdir / "tritonserver.log",
                            on_event=lambda event: None)
    started = time.monotonic()
    supervisor.start()
    start_s = time.monotonic() - started  # the cost of a swap by restart: every model loaded and warmed up
    try:
        result = swaps_on(supervisor, key, repository, before_s, after_s)
    finally:
        supervisor.stop()
    result.update(start_s=start_s)
    return result


def swaps_on(supervisor: Supervisor, key: str, repository: Path, before_s: float = 5.0,
             after_s: float = 3.0) -> dict:
    """The swaps of `one_server` on a running supervised server with model control (admin key `key`),
    which is left serving the default config; faults: those its supervisor reported meanwhile."""
    config, events_before = supervisor.config, len(supervisor.events)
    with ModelControl(config.grpc_url, key) as control:
        files = ModelRepository(repository)
        load, idle_s = right_answers(config, control, files)
        result = _run_swaps(config, load, lambda variant: swap(control, variant_targets(files, variant)),
                            lambda: [supervisor.server], before_s, after_s)
    result.update(case="one server", idle_swap_s=idle_s,
                  faults=[e.detail for e in supervisor.events[events_before:] if e.kind == "fault"])
    return result


def fleet(repository: Path, workdir: Path, replicas: int = 3, before_s: float = 5.0, after_s: float = 3.0,
          swaps: tuple[str, ...] = SWAPS) -> dict:
    """A fleet of `replicas` swapped replica by replica (drained in HAProxy, swapped, back UP) under load
    through its front ends, once per variant of `swaps` (SWAPS: there and back; ("int8",) rolls one way)."""
    key = secrets.token_hex(16)
    files = ModelRepository(repository)
    with Fleet(fleet_config(repository, workdir, replicas, model_control="explicit", admin_key=key),
               drain_on_exit=False) as running:
        first = running.config.replicas[0]
        with ModelControl(first.grpc_url, key) as control:
            load, idle_s = right_answers(first, control, files)
        steps: list[dict] = []  # each replica's drain_s, swap_s, rejoin_s, in order
        result = _run_swaps(running.config.front.server_config(), load,
                            lambda variant: steps.extend(r.seconds for r in swap_fleet(
                                workdir, variant_targets(files, variant), key)),
                            lambda: [s.server if s is not None else None for s in running.supervisors],
                            before_s, after_s, swaps)
        faults = [e.detail for s in running.supervisors if s is not None for e in s.events if e.kind == "fault"]
    result.update(case=f"fleet of {replicas}", faults=faults, idle_swap_s=idle_s, replica_steps=steps)
    return result


def table_rows(result: dict) -> list[list]:
    """The HTTP and gRPC rows of a run as the cells of SWAP_COLUMNS."""
    swaps = (" / ".join(f"{s:.1f}" for s in result["swap_s"]) + " (idle, one server: "
             + " / ".join(f"{s:.1f}" for s in result["idle_swap_s"]) + ")")
    memory = (f"{max(result['memory_before_bytes']) / 2**30:.2f} / {max(result['memory_during_bytes']) / 2**30:.2f} GiB"
              " (largest server)")
    rows = []
    for protocol, tally, phase in zip(("http", "grpc"), result["tallies"], result["phases"]):
        rows.append([result["case"], protocol, tally.sent, tally.answered, tally.refused, tally.failed, tally.lost,
                     swaps, f"{phase['rate_before']:.1f} / {phase['rate_during']:.1f}",
                     f"{phase['p99_before_ms']:.0f} / {phase['p99_during_ms']:.0f}", memory])
    return rows
