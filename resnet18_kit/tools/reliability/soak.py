"""A bounded soak run on loopback (`resnet18-kit reliability soak`). Starts the embedded tritonserver on the
model repository, measures the `resnet18` ensemble's capacity (closed loop, 32 requests in flight, gRPC, the sample photos), then sends
requests at `--load` (default 0.8) of that capacity as a Poisson process for `--minutes` (default 10)
and checks every answer against the reference. Resident memory of tritonserver and of each Python-backend
stub is sampled every 5 s.

Reports requests sent / answered / failed / lost (lost = no outcome within 60 s), latency percentiles
per minute, and memory at start, end and peak per process; passes (exit 0) when no request failed and
the total resident memory grew less than `--memory-bound-mib` from start to end. Not part of the
tests: it takes minutes. Figures in docs/records/reliability.md.

Progress: a bar over the seconds of the capacity measurement, then over the seconds of the soak, on
stderr (drawn on a terminal only), and a log line per minute with that minute's answers, failures,
latency and resident memory. The report, the per-minute table and PASS/FAIL go to stdout; the record
to <--out>/soak-<time>/soak.json (default <results>/reliability).

    resnet18-kit reliability soak                          # 10 minutes at 80 %
    resnet18-kit reliability soak --minutes 1 --load 0.5
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from pathlib import Path

import tritonclient.grpc.aio as grpcaio

from resnet18_kit.tools.load.outcomes import ANSWERED, LOST, Outcome, percentile, summarize
from resnet18_kit.observe.machine import cpu_share, cpu_ticks
from resnet18_kit.progress import Progress
from resnet18_kit.tools.reliability.loads import ensemble_load, infer_input, reference_answers
from resnet18_kit.tools.reliability.senders import infer_async
from resnet18_kit.server.config import MiB, config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer

log = logging.getLogger(__name__)


async def closed_loop(url: str, load, concurrency: int, duration_s: float) -> float:
    """Answers per second with `concurrency` requests always in flight for `duration_s` seconds."""
    client = grpcaio.InferenceServerClient(url)
    answered, stop_at = 0, time.monotonic() + duration_s
    output = [grpcaio.InferRequestedOutput(load.output_name)]

    async def worker(offset: int):
        nonlocal answered
        index = offset
        while time.monotonic() < stop_at:
            await client.infer(load.model, [infer_input(grpcaio, load, index)], outputs=output)
            answered += 1
            index += concurrency

    started = time.monotonic()
    try:
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    finally:
        await client.close()
    return answered / (time.monotonic() - started)


async def open_loop(url: str, load, rate_per_s: float, duration_s: float, max_in_flight: int,
                    seed: int = 0, results: list[tuple[float, Outcome]] | None = None
                    ) -> tuple[list[tuple[float, Outcome]], int]:
    """Poisson arrivals at `rate_per_s` (requests/s) for `duration_s` (seconds), at most `max_in_flight`
    requests outstanding; returns ((send time s, outcome) per request, times the in-flight bound delayed
    a send). results: the list to append to as outcomes come in (another thread may read it meanwhile)."""
    client = grpcaio.InferenceServerClient(url)
    rng = random.Random(seed)
    results = [] if results is None else results
    in_flight = asyncio.Semaphore(max_in_flight)
    delayed = 0

    async def one(index: int, sent_at: float):
        try:
            results.append((sent_at, await infer_async(client, grpcaio, load, index)))
        finally:
            in_flight.release()

    tasks, origin, index = [], time.monotonic(), 0
    next_at = origin
    try:
        while True:
            next_at += rng.expovariate(rate_per_s)
            if next_at - origin >= duration_s:
                break
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if in_flight.locked():
                delayed += 1
            await in_flight.acquire()
            tasks.append(asyncio.ensure_future(one(index, time.monotonic() - origin)))
            index += 1
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    return results, delayed


class MemoryLog:
    """Resident memory (bytes) per process of the server every `interval_s` seconds, on a thread;
    samples: [(seconds since start, {process: bytes})]."""

    def __init__(self, server: EmbeddedTritonServer, interval_s: float = 5.0):
        self.server, self.interval_s = server, interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._origin = time.monotonic()

    def _run(self):
        while True:
            self.samples.append((round(time.monotonic() - self._origin, 1), self.server.resident_memory_bytes()))
            if self._stop.wait(self.interval_s):
                self.samples.append((round(time.monotonic() - self._origin, 1), self.server.resident_memory_bytes()))
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def total_mib(self) -> tuple[float, float] | None:
        """(first, latest) total resident memory of the server's processes, MiB; None before a sample."""
        samples = list(self.samples)
        if not samples:
            return None
        return sum(samples[0][1].values()) / MiB, sum(samples[-1][1].values()) / MiB

    def report(self) -> dict:
        """Per process and "total": start_mib, end_mib, peak_mib, growth_mib (MiB)."""
        names = sorted({name for _, sample in self.samples for name in sample})
        per_process = {}
        for name in names + ["total"]:
            values = [sum(s.values()) if name == "total" else s.get(name, 0) for _, s in self.samples]
            per_process[name] = {"start_mib": round(values[0] / MiB, 1), "end_mib": round(values[-1] / MiB, 1),
                                 "peak_mib": round(max(values) / MiB, 1),
                                 "growth_mib": round((values[-1] - values[0]) / MiB, 1)}
        return per_process


def per_minute(results: list[tuple[float, Outcome]]) -> list[dict]:
    """One row per minute of send time: minute (1-based), sent, answered, failed, p50_ms, p99_ms
    (latency of the answered requests, milliseconds)."""
    rows = []
    minutes = int(max((t for t, _ in results), default=0) // 60) + 1
    for minute in range(minutes):
        chunk = [o for t, o in results if minute * 60 <= t < (minute + 1) * 60]
        latencies = sorted(o.latency_s * 1000 for o in chunk if o.kind == ANSWERED)
        rows.append({"minute": minute + 1, "sent": len(chunk), "answered": sum(o.kind == ANSWERED for o in chunk),
                     "failed": sum(o.kind != ANSWERED for o in chunk),
                     "p50_ms": round(percentile(latencies, 50), 1), "p99_ms": round(percentile(latencies, 99), 1)})
    return rows


class MinuteLog:
    """Logs each finished minute of the soak (answers so far of the requests sent in it, latency, total
    resident memory) once, as the ticker passes the minute; `finish` logs the minutes not yet logged."""

    def __init__(self, results: list[tuple[float, Outcome]], memory: MemoryLog, progress: Progress):
        self.results, self.memory, self.progress = results, memory, progress
        self.logged = 0  # minutes logged

    def __call__(self, elapsed_s: float) -> None:
        while self.logged < int(elapsed_s // 60):
            self._log(self.logged + 1)

    def finish(self) -> None:
        """Log the minutes not logged yet (the last one, once every answer is in)."""
        for minute in range(self.logged + 1, len(per_minute(self.results)) + 1):
            self._log(minute)

    def _log(self, minute: int) -> None:
        self.logged = minute
        rows = per_minute(list(self.results))
        if minute > len(rows):
            return
        row, memory = rows[minute - 1], self.memory.total_mib()
        note = (f"minute {minute}: {row['answered']} answered, {row['failed']} failed, p50 {row['p50_ms']} ms, "
                f"p99 {row['p99_ms']} ms" + (f", memory {memory[1]:.0f} MiB ({memory[1] - memory[0]:+.0f})"
                                             if memory else ""))
        self.progress.set_postfix(note)
        log.log(logging.WARNING if row["failed"] else logging.INFO, "%s; %s", note, self.progress.status())


def soak(repository: Path, out: Path, minutes: float = 10.0, load_fraction: float = 0.8, capacity_s: float = 30.0,
         max_in_flight: int = 256, memory_bound_mib: float = 64.0) -> int:
    """Run the soak (module doc) on the model repository `repository`, its record in `out`/soak-<time>/;
    exit status 0 when it passes, 1 when it fails."""
    out_dir = out / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    config = config_on_free_ports(model_repository=repository)
    log.info("starting tritonserver (log: %s)", out_dir / "tritonserver.log")
    with EmbeddedTritonServer(config, log_path=out_dir / "tritonserver.log") as server:
        load = reference_answers(config, ensemble_load())
        log.info("measuring capacity (%.0f s, 32 in flight, gRPC, ensemble)", capacity_s)
        with Progress(capacity_s, "s", "soak: capacity", log, log_updates=False) as progress, \
                progress.ticking():
            capacity = asyncio.run(closed_loop(config.grpc_url, load, 32, capacity_s))
        rate = capacity * load_fraction
        log.info("capacity %.1f req/s; sending %.1f req/s for %g min", capacity, rate, minutes)
        ticks_before = cpu_ticks()
        results: list[tuple[float, Outcome]] = []
        with MemoryLog(server) as memory, \
                Progress(minutes * 60, "s", f"soak: {rate:.1f} req/s", log, log_updates=False) as progress:
            minute_log = MinuteLog(results, memory, progress)
            with progress.ticking(on_tick=minute_log):
                results, delayed = asyncio.run(open_loop(config.grpc_url, load, rate, minutes * 60,
                                                         max_in_flight, results=results))
            minute_log.finish()
        ticks_after = cpu_ticks()
    outcomes = [o for _, o in results]
    summary = summarize(outcomes, len(outcomes))
    failed = len(outcomes) - summary[ANSWERED]
    mem = memory.report()
    record = {"capacity_per_s": round(capacity, 2), "load": load_fraction, "rate_per_s": round(rate, 2),
              "minutes": minutes, "summary": summary, "failed": failed, "sends_delayed_by_bound": delayed,
              "per_minute": per_minute(results), "memory": mem, "memory_samples": memory.samples,
              "cpu_steal_share": round(cpu_share(ticks_before, ticks_after)["steal"], 3),
              "failures": [o.__dict__ for o in outcomes if o.kind != ANSWERED][:50]}
    (out_dir / "soak.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"\nsoak: {summary['sent']} sent, {summary[ANSWERED]} answered, {failed} failed, {summary[LOST]} lost; "
          f"latency p50 {summary.get('answered_ms', {}).get('p50')} ms, p99 {summary.get('answered_ms', {}).get('p99')} ms; "
          f"CPU steal {record['cpu_steal_share']:.1%}")
    for row in record["per_minute"]:
        print(f"  minute {row['minute']:>2}: sent {row['sent']:>5}, answered {row['answered']:>5}, failed "
              f"{row['failed']}, p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms")
    print("resident memory (MiB): process: start -> end (peak)")
    for name, figures in mem.items():
        print(f"  {name:<28} {figures['start_mib']:>8} -> {figures['end_mib']:>8} ({figures['peak_mib']})")
    ok = failed == 0 and mem["total"]["growth_mib"] < memory_bound_mib
    print(f"soak: {'PASS' if ok else 'FAIL'} (zero failed requests; total memory growth "
          f"{mem['total']['growth_mib']} MiB < {memory_bound_mib:g} MiB); record: {out_dir / 'soak.json'}")
    return 0 if ok else 1

