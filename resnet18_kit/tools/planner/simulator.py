"""Discrete-event simulation of one Triton replica: arrivals, the queue and its policy, the dynamic
batcher (planner.batcher.form_batch) and N model instances sharing one device.

Plain event-driven code (a heap of completions and batcher timers, arrivals merged from a sorted array)
rather than SimPy: the batcher is one decision function re-evaluated at three kinds of events (a request
arrives, an execution ends, the batcher's timer fires), which a heap expresses in a few lines, and the
planner runs thousands of simulations, for which the plain loop is several times faster.

What happens, in simulated time:
  * a request reaches the batcher at its arrival time; the fixed per-request overhead of the profile
    (client, protocol, server front end) is added to its latency, not simulated as a resource;
  * with a max_queue_size, a request finding that many requests queued is refused at once;
  * while an instance is idle and requests wait, the batcher decides (form_batch): a batch goes to the
    idle instance, or the batcher sleeps until its timer (max queue delay, closest timeout) or the next
    arrival; while every instance is busy it forms nothing, and every 500 ms it rejects timed-out
    requests anywhere in the queue (Triton's WaitForPayloadSlotAvailable);
  * an execution of a batch of b takes the profile's time for b with this instance count (a gamma draw
    with the measured mean and standard deviation, or the mean when `exec_noise` is False), times the
    speed factor of the moment when a `speed` trace is given (resnet18_kit/tools/planner/speed.py: how the execution time
    moves with the load served, measured; `speed_for` in resnet18_kit/tools/planner/search.py picks the trace for a load).

Optional, off by default and always reported: `lost_wakeup`, a model of Triton 2.51's lost wake-up
(see LostWakeup), so the documented algorithm and the server's known deviation stay separable.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from math import inf

import numpy as np

from resnet18_kit.tools.planner.batcher import BatcherConfig, Request, drop_all_expired, form_batch
from resnet18_kit.tools.planner.profile import Profile
from resnet18_kit.tools.planner.speed import SpeedTrace

#: Triton's batcher re-checks the queue every 500 ms when it has nothing to do, or while it waits for
#: an idle instance (default_wait_microseconds in dynamic_batch_scheduler.cc).
BATCHER_IDLE_WAIT_S = 0.5

_COMPLETE, _TIMER, _SWEEP, _WAKE = 0, 1, 2, 3


@dataclass(frozen=True)
class LostWakeup:
    """Triton 2.51's lost wake-up, as an explicit and separately reported model.

    In r24.10 an instance thread notifies the batcher when an execution ends (Payload::Execute calls
    the payload's callback) *before* it registers again as a waiting consumer (RateLimiter::
    DequeuePayload increments the count and notifies nobody). A batcher that wakes in between finds no
    free instance and sleeps in WaitForPayloadSlotAvailable for up to 500 ms; the next request's
    Enqueue (which notifies once a consumer waits) or another instance's completion wakes it earlier.
    Modelled as: when an execution ends with requests waiting, with `probability` the batcher misses
    it and forms nothing until the next arrival, the next completion, or `idle_wait_s` later.
    The probability is measured from Triton's request trace (missed_wakeups in
    resnet18_kit/tools/planner/validate_analysis.py), never fitted to the level it predicts."""

    probability: float
    idle_wait_s: float = BATCHER_IDLE_WAIT_S


@dataclass
class SimResult:
    """Outcome of one simulation. Times in seconds; counts of requests.

    latencies_s, queue_s: per completed request after the warm-up (latency includes the overhead).
    throughput_rps: completions (of any request) per second between the first measured arrival and the
        last arrival.
    utilization: busy fraction of the execution slots (the instances that run at once) over the same window.
    batches: {batch size: executions} after the warm-up.
    done_s: completion time of every request, warm-up included, by arrival index (NaN: refused or timed
        out); what a next stage receives (resnet18_kit/tools/planner/ensemble.py).
    """

    arrivals: int
    completed: int
    refused: int
    timed_out: int
    latencies_s: np.ndarray
    queue_s: np.ndarray
    throughput_rps: float
    offered_rps: float
    utilization: float
    batches: dict[int, int] = field(default_factory=dict)
    stalls: int = 0
    done_s: np.ndarray | None = None

    def percentile_ms(self, p: float) -> float:
        """Latency percentile `p` (0-100) of completed requests, milliseconds (inf when none completed)."""
        return float(np.percentile(self.latencies_s, p)) * 1e3 if self.latencies_s.size else inf

    @property
    def average_batch(self) -> float:
        executions = sum(self.batches.values())
        return sum(b * n for b, n in self.batches.items()) / executions if executions else 0.0

    def summary(self) -> dict:
        return {"offered_rps": self.offered_rps, "throughput_rps": self.throughput_rps,
                "p50_ms": self.percentile_ms(50), "p90_ms": self.percentile_ms(90),
                "p95_ms": self.percentile_ms(95), "p99_ms": self.percentile_ms(99),
                "utilization": self.utilization, "average_batch": self.average_batch,
                "refused": self.refused, "timed_out": self.timed_out, "stalls": self.stalls}


def simulate(arrivals_s: np.ndarray, config: BatcherConfig, profile: Profile, instances: int = 1, *,
             sizes: np.ndarray | None = None, timeouts_us: np.ndarray | None = None,
             exec_noise: bool = True, warmup_fraction: float = 0.1, seed: int = 0,
             lost_wakeup: LostWakeup | None = None, speed: SpeedTrace | None = None,
             concurrent: int | None = None) -> SimResult:
    """Simulate one replica serving requests arriving at `arrivals_s` (sorted, seconds).

    sizes: batch size of each request (default 1). timeouts_us: per-request queue timeout asked by the
    client (0 = none; applied as Triton does, see QueuePolicy.timeout_s). The first `warmup_fraction`
    of the requests load the system but are left out of the figures. speed: execution-time factors
    over time (block bootstrap from the first arrival on), None = the profile's times as they are.
    concurrent: how many of the instances execute at once (Triton's rate limiter; observe.model_config.
    concurrent_executions), None = all. With fewer, an idle instance still takes a batch from the batcher
    and holds it until an execution slot frees (first come, first served), and every execution takes the
    profile's time for `concurrent` instances (each has the cores of one slot).
    """
    arrivals_s = np.asarray(arrivals_s, dtype=float)
    n = arrivals_s.size
    sizes = np.ones(n, dtype=int) if sizes is None else np.asarray(sizes, dtype=int)
    rng = np.random.default_rng(seed)
    speed_at = speed.sampler(np.random.default_rng(seed + 1)) if speed else None
    start_s = arrivals_s[0] if n else 0.0
    max_batch = config.max_batch_size
    slots_total = min(concurrent or instances, instances)
    mean_s, std_s = profile.exec_table_s(max_batch, slots_total)
    shape = np.where(std_s > 0, (mean_s / np.where(std_s > 0, std_s, 1)) ** 2, 0.0)
    policy = config.queue if config.dynamic_batching else None
    max_queue = policy.max_queue_size if policy else 0
    deadlines = np.full(n, inf)
    if policy is not None and (policy.default_timeout_us or (policy.allow_timeout_override and timeouts_us is not None)):
        requested = np.zeros(n, dtype=np.int64) if timeouts_us is None else np.asarray(timeouts_us)
        deadlines = arrivals_s + np.array([policy.timeout_s(int(t)) for t in requested])
    has_deadlines = bool(np.isfinite(deadlines).any())
    first_measured = int(n * warmup_fraction)
    window_start = arrivals_s[first_measured] if n else 0.0
    window_end = arrivals_s[-1] if n else 0.0

    queue: deque[Request] = deque()
    events: list = []  # (time, sequence, kind, payload)
    sequence = 0
    idle = instances  # instances not holding a batch
    slots = slots_total  # executions that may start now
    held: deque[list[Request]] = deque()  # batches taken by an instance, waiting for a slot
    timer_generation = sweep_generation = 0
    sweep_pending = False
    stalled_until = -inf  # LostWakeup: the batcher missed a free instance and sleeps until then
    latencies = np.full(n, np.nan)
    queued = np.full(n, np.nan)
    done = np.full(n, np.nan)
    refused = timed_out = stalls = 0
    completed_in_window = 0
    busy_in_window = 0.0
    batches: dict[int, int] = {}

    def push(time_s: float, kind: int, payload=None) -> None:
        nonlocal sequence
        sequence += 1
        heapq.heappush(events, (time_s, sequence, kind, payload))

    def execute(batch: list[Request], now: float) -> None:
        nonlocal idle
        idle -= 1
        if slots:
            start(batch, now)
        else:
            held.append(batch)

    def start(batch: list[Request], now: float) -> None:
        nonlocal slots, busy_in_window
        total = sum(r.size for r in batch)
        if shape[total] > 0 and exec_noise:
            duration = rng.gamma(shape[total], mean_s[total] / shape[total])
        else:
            duration = mean_s[total]
        if speed_at:
            duration *= speed_at(now - start_s)
        for r in batch:
            r.start_s = now
        slots -= 1
        if batch[0].index >= first_measured:
            batches[total] = batches.get(total, 0) + 1
        busy_in_window += max(0.0, min(now + duration, window_end) - max(now, window_start))
        push(now + duration, _COMPLETE, batch)

    def reject(expired: list[Request]) -> None:
        nonlocal timed_out
        timed_out += sum(1 for r in expired if r.index >= first_measured)

    def dispatch(now: float) -> None:
        nonlocal timer_generation, sweep_pending, sweep_generation
        if now < stalled_until:
            return
        while queue and idle:
            if not config.dynamic_batching:
                execute([queue.popleft()], now)
                continue
            decision = form_batch(queue, now, config)
            reject(decision.rejected)
            if decision.count:
                execute([queue.popleft() for _ in range(decision.count)], now)
            elif decision.wake_s is not None:
                timer_generation += 1
                push(decision.wake_s, _TIMER, timer_generation)
                break
        if queue and not idle and has_deadlines and not sweep_pending:
            sweep_pending = True
            sweep_generation += 1
            push(now + BATCHER_IDLE_WAIT_S, _SWEEP, sweep_generation)

    i = 0
    while i < n or events:
        next_arrival = arrivals_s[i] if i < n else inf
        if events and events[0][0] <= next_arrival:
            now, _, kind, payload = heapq.heappop(events)
            if kind == _COMPLETE:
                idle += 1
                slots += 1
                if held:
                    start(held.popleft(), now)
                sweep_pending = False  # the wait for a slot ends; a new one restarts the 500 ms
                if window_start <= now <= window_end:
                    completed_in_window += len(payload)
                for r in payload:
                    done[r.index] = now
                    if r.index >= first_measured:
                        latencies[r.index] = now - r.arrival_s
                        queued[r.index] = r.start_s - r.arrival_s
                stalled_until = -inf  # a completion's callback wakes the batcher
                if lost_wakeup and queue and rng.random() < lost_wakeup.probability:
                    stalled_until = now + lost_wakeup.idle_wait_s
                    stalls += sum(1 for r in queue if r.index >= first_measured) > 0
                    push(stalled_until, _WAKE)
            elif kind == _TIMER and payload != timer_generation:
                continue
            elif kind == _SWEEP:
                if payload != sweep_generation or not sweep_pending:
                    continue
                sweep_pending = False
                reject(drop_all_expired(queue, now))
            elif kind == _WAKE:
                if now < stalled_until:
                    continue
            dispatch(now)
        else:
            now = next_arrival
            if max_queue and len(queue) >= max_queue:
                refused += int(i >= first_measured)
            else:
                queue.append(Request(i, now, int(sizes[i]), deadlines[i]))
                stalled_until = -inf  # Enqueue notifies the batcher once a consumer waits
                dispatch(now)
            i += 1

    measured = latencies[first_measured:]
    answered = ~np.isnan(measured)
    window = window_end - window_start
    return SimResult(
        arrivals=n - first_measured, completed=int(answered.sum()), refused=refused, timed_out=timed_out,
        latencies_s=measured[answered] + profile.overhead_us / 1e6, queue_s=queued[first_measured:][answered],
        throughput_rps=completed_in_window / window if window > 0 else 0.0,
        offered_rps=(n - first_measured - 1) / window if window > 0 else 0.0,
        utilization=busy_in_window / (slots_total * window) if window > 0 else 0.0,
        batches=dict(sorted(batches.items())), stalls=stalls, done_s=done)
