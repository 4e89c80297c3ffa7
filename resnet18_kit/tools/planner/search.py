"""The planner: the cheapest serving config (fewest devices) whose simulated latency meets the SLO.

For every candidate (instances per device x max_batch_size x max_queue_delay, plus the default
scheduler without dynamic batching), the device count is searched upward from its capacity bound:

    capacity bound = the smallest D with  target_rps / D  <  max_utilization x per-device capacity,

where per-device capacity = max over b <= max_batch_size of instances x b / exec_s(b) (and no more than
the profile's server ceiling, the protocol and batcher limit of one replica). Load exactly at capacity
is excluded: a queue fed at 100% of its service rate grows without bound, however long a simulation
happens to show it bounded. From there D grows (1, 2, 4, ... then bisection) until one replica, fed its
share of the arrivals by the load balancer, meets the latency percentile with no request refused or
timed out. Candidates are tried in order of capacity bound, and a candidate whose bound exceeds the best
device count found so far is not simulated. Among candidates with the fewest devices the one with the
lowest latency at the SLO percentile wins, latencies within 2% counting as equal (then: the shorter
queue delay, fewer instances, smaller max batch).

One device per replica (one tritonserver per device); the replicas are identical, so one is simulated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from resnet18_kit.tools.planner.arrivals import Poisson
from resnet18_kit.tools.planner.batcher import BatcherConfig, QueuePolicy
from resnet18_kit.tools.planner.profile import Profile
from resnet18_kit.tools.planner.simulator import LostWakeup, SimResult, simulate
from resnet18_kit.tools.planner.speed import SpeedTrace


#: Relative latency difference below which two candidates with the same device count are ranked equal.
LATENCY_TIE = 0.02


@dataclass(frozen=True)
class Slo:
    """A latency objective: the `percentile` (0-100) of request latency must be <= `budget_ms`."""

    percentile: float
    budget_ms: float

    def describe(self) -> str:
        return f"p{self.percentile:g} <= {self.budget_ms:g} ms"


@dataclass(frozen=True)
class SearchSpace:
    """What the planner may choose, and how it simulates each choice.

    instances: instance counts per device (None = every count the profile has).
    max_batch_sizes: None = the profile's measured batch sizes (with the largest).
    delay_fractions: max_queue_delay candidates as fractions of the execution time of a max batch.
    no_batching: also try the default scheduler (no dynamic_batching block).
    balancer: "round_robin" or "random" (planner.arrivals).
    requests: simulated requests per replica and candidate; seed: the random stream (the same for every
        candidate: common random numbers make the comparison fair).
    max_utilization: headroom; offered load per device must stay below this x its capacity.
    base_queue: queue policy written with the plan (max_queue_size is set by the planner, see
        `queue_size_for`); None = no queue policy at all (unbounded queue, payload prefetching: no lost
        wake-up in Triton 2.51, see docs/capacity.md).
    lost_wakeup: Triton 2.51's lost wake-up, modelled when given (planner.simulator.LostWakeup).
    speed_under_load: scale execution times by the profile's speed trace for each candidate's load
        (resnet18_kit/tools/planner/speed.py) when the profile has one.
    """

    instances: tuple[int, ...] | None = None
    max_batch_sizes: tuple[int, ...] | None = None
    delay_fractions: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)
    no_batching: bool = True
    balancer: str = "round_robin"
    requests: int = 20000
    seed: int = 1
    max_utilization: float = 1.0
    base_queue: QueuePolicy | None = field(default_factory=lambda: QueuePolicy(allow_timeout_override=True))
    lost_wakeup: LostWakeup | None = None
    speed_under_load: bool = True


@dataclass
class Candidate:
    """One config with the fewest devices it needs (devices 0 = cannot meet the SLO)."""

    batcher: BatcherConfig
    instances: int
    capacity_rps: float
    capacity_bound: int
    devices: int = 0
    result: SimResult | None = None
    simulations: int = 0

    #: ceil(target / capacity): the devices if each could run at 100% (the textbook figure).
    devices_at_full_load: int = 0
    #: p99 (ms) of the same devices simulated with the closed-loop table alone, no speed under load
    #: (`plan` sets it for the best candidate when the search used the speed traces): the other end of
    #: the range P99_RANGE_NOTE speaks of.
    p99_static_ms: float | None = None

    @property
    def feasible(self) -> bool:
        return self.devices > 0

    def predicted(self, slo: Slo) -> dict:
        r = self.result
        return {"devices": self.devices, "instances_per_device": self.instances,
                "batcher": self.batcher.describe(), "capacity_bound": self.capacity_bound,
                "devices_at_full_load": self.devices_at_full_load,
                "per_device_capacity_rps": self.capacity_rps,
                "throughput_rps_per_device": r.throughput_rps, "offered_rps_per_device": r.offered_rps,
                "p50_ms": r.percentile_ms(50), "p99_ms": r.percentile_ms(99),
                f"p{slo.percentile:g}_ms": r.percentile_ms(slo.percentile),
                "busy_fraction": r.utilization, "capacity_used": r.throughput_rps / self.capacity_rps,
                "average_batch": r.average_batch, "refused": r.refused, "timed_out": r.timed_out,
                "p99_static_ms": self.p99_static_ms}


@dataclass
class Plan:
    """The planner's answer: the best candidate, the best without dynamic batching, all evaluated."""

    target_rps: float
    slo: Slo
    best: Candidate | None
    no_batching: Candidate | None
    candidates: list[Candidate]
    arrival: str


def device_capacity_rps(profile: Profile, batcher: BatcherConfig, instances: int) -> float:
    """Inferences/s one device can serve with this config, every instance busy (see module doc)."""
    if batcher.dynamic_batching:
        capacity = profile.device_throughput(batcher.max_batch_size, instances)
    else:
        capacity = instances / profile.exec_s(1, instances)
    return min(capacity, profile.server_ceiling_rps) if profile.server_ceiling_rps else capacity


def speed_for(profile: Profile, batcher: BatcherConfig, instances: int, offered_rps: float) -> SpeedTrace | None:
    """The profile's speed trace (resnet18_kit/tools/planner/speed.py) measured nearest to this load: offered requests/s
    over the device's capacity with this config; None when the profile has none."""
    return profile.speed_trace(instances, offered_rps / device_capacity_rps(profile, batcher, instances))


def capacity_bound(target_rps: float, capacity_rps: float, max_utilization: float = 1.0) -> int:
    """The smallest device count whose per-device load is strictly below max_utilization x capacity."""
    return math.floor(target_rps / (max_utilization * capacity_rps)) + 1


def queue_size_for(capacity_rps: float, budget_ms: float, max_batch_size: int) -> int:
    """max_queue_size written with a plan: the requests one device serves within the latency budget
    (a request queued behind more cannot meet it: refusing it at once is better back-pressure), and
    at least two max batches."""
    return max(2 * max_batch_size, math.ceil(capacity_rps * budget_ms / 1000.0))


def candidates_for(profile: Profile, slo: Slo, space: SearchSpace) -> list[Candidate]:
    """Every config of the search space, with its per-device capacity (not yet simulated)."""
    found = []
    for instances in space.instances or tuple(profile.instance_counts):
        sizes = space.max_batch_sizes or tuple(profile.batch_sizes(instances))
        if space.no_batching:
            batcher = BatcherConfig(max_batch_size=max(sizes), dynamic_batching=False)
            found.append(Candidate(batcher, instances, device_capacity_rps(profile, batcher, instances), 0))
        for max_batch in sorted(set(sizes)):
            if max_batch < 2:
                continue  # dynamic batching with batches of 1 only adds the queue policy
            exec_ms = profile.timing(max_batch, instances).mean_ms
            delays_us = sorted({int(round(f * exec_ms * 1000)) for f in space.delay_fractions})
            for delay_us in delays_us:
                if delay_us / 1000 + exec_ms > slo.budget_ms:
                    continue  # a lone request waits the delay, then a whole execution
                probe = BatcherConfig(max_batch_size=max_batch, max_queue_delay_us=delay_us)
                capacity = device_capacity_rps(profile, probe, instances)
                queue = QueuePolicy() if space.base_queue is None else replace(
                    space.base_queue, max_queue_size=queue_size_for(capacity, slo.budget_ms, max_batch))
                found.append(Candidate(replace(probe, queue=queue), instances, capacity, 0))
    return found


def evaluate(candidate: Candidate, devices: int, target_rps: float, profile: Profile, space: SearchSpace,
             arrival=None) -> SimResult:
    """Simulate one replica of `devices` under the candidate's config."""
    process = arrival or Poisson(target_rps)
    rng = np.random.default_rng(space.seed)
    arrivals = process.arrivals(space.requests, devices, space.balancer, rng)
    candidate.simulations += 1
    speed = speed_for(profile, candidate.batcher, candidate.instances, target_rps / devices) \
        if space.speed_under_load else None
    return simulate(arrivals, candidate.batcher, profile, candidate.instances, seed=space.seed,
                    lost_wakeup=space.lost_wakeup, speed=speed)


def meets(result: SimResult, slo: Slo) -> bool:
    """The SLO percentile within budget, nothing refused or timed out, and the replica kept up."""
    return (result.completed > 0 and result.percentile_ms(slo.percentile) <= slo.budget_ms
            and result.refused == 0 and result.timed_out == 0
            and result.throughput_rps >= 0.97 * result.offered_rps)


def fewest_devices(candidate: Candidate, target_rps: float, profile: Profile, slo: Slo, space: SearchSpace,
                   arrival=None, limit: int | None = None) -> Candidate:
    """Set candidate.devices (0 when not met by `limit` devices) and .result, searching upward from the
    capacity bound (exponential steps, then bisection)."""
    low = candidate.capacity_bound
    limit = limit or 64 * low
    if low > limit:
        return candidate
    results: dict[int, SimResult] = {}

    def ok(devices: int) -> bool:
        results[devices] = evaluate(candidate, devices, target_rps, profile, space, arrival)
        return meets(results[devices], slo)

    if ok(low):
        candidate.devices, candidate.result = low, results[low]
        return candidate
    failing, step = low, 1
    while True:
        trial = min(failing + step, limit)
        if ok(trial):
            break
        if trial >= limit:
            candidate.result = results[trial]
            return candidate
        failing, step = trial, step * 2
    passing = trial
    while passing - failing > 1:
        middle = (failing + passing) // 2
        if ok(middle):
            passing = middle
        else:
            failing = middle
    candidate.devices, candidate.result = passing, results[passing]
    return candidate


def plan(target_rps: float, slo: Slo, profile: Profile, space: SearchSpace = SearchSpace(),
         arrival=None) -> Plan:
    """Search the space (module docstring) and return the Plan."""
    candidates = candidates_for(profile, slo, space)
    for c in candidates:
        c.capacity_bound = capacity_bound(target_rps, c.capacity_rps, space.max_utilization)
        c.devices_at_full_load = math.ceil(target_rps / c.capacity_rps)
    candidates.sort(key=lambda c: (c.capacity_bound, c.batcher.max_queue_delay_us, c.instances,
                                   c.batcher.max_batch_size))
    best_devices = math.inf
    for c in candidates:
        if c.capacity_bound > best_devices:
            continue
        limit = None if best_devices == math.inf else int(best_devices)
        fewest_devices(c, target_rps, profile, slo, space, arrival, limit)
        if c.feasible:
            best_devices = min(best_devices, c.devices)
    # The no-batching baseline is reported even when it costs more than the best.
    baseline = next((c for c in candidates if not c.batcher.dynamic_batching), None)
    if baseline is not None and not baseline.feasible:
        fewest_devices(baseline, target_rps, profile, slo, space, arrival)
    feasible = [c for c in candidates if c.feasible and c.devices == best_devices]
    best = None
    if feasible:
        # Latencies within LATENCY_TIE of the lowest count as equal (simulation noise): then the
        # shorter queue delay, fewer instances, smaller max batch.
        lowest = min(c.result.percentile_ms(slo.percentile) for c in feasible)
        close = [c for c in feasible if c.result.percentile_ms(slo.percentile) <= lowest * (1 + LATENCY_TIE)]
        best = min(close, key=lambda c: (c.batcher.max_queue_delay_us, c.instances, c.batcher.max_batch_size))
        if space.speed_under_load:  # the other end of the range: the machine as fast as in the table
            best.p99_static_ms = evaluate(best, best.devices, target_rps, profile,
                                          replace(space, speed_under_load=False), arrival).percentile_ms(99)
    description = (arrival.describe() if arrival else Poisson(target_rps).describe())
    return Plan(target_rps, slo, best, baseline, candidates, f"{description}, {space.balancer} balancer")


def max_rate(profile: Profile, slo: Slo, space: SearchSpace = SearchSpace(), steps: int = 8) -> float:
    """The highest Poisson load (inferences/s) ONE device serves within the SLO with some config of the
    space (nothing refused, the replica keeping up): bisection over (0, the largest per-device capacity),
    `steps` halvings (resolution capacity / 2**steps). 0.0 when not even the lowest load tried meets it."""
    candidates = candidates_for(profile, slo, space)
    low, high = 0.0, max((c.capacity_rps for c in candidates), default=0.0)
    for _ in range(steps):
        rate = (low + high) / 2
        if any(meets(evaluate(c, 1, rate, profile, space), slo) for c in candidates if c.capacity_rps > rate):
            low = rate
        else:
            high = rate
    return low


#: How far the p99 the model predicts can be trusted, by the load per device as a fraction of its capacity
#: (upper bound of the load, trusted, what the plan prints). The bounds come from the validation against the
#: real server (`resnet18-kit plan validate`; its hit rates per load are in docs/records/capacity.md):
#: below half the capacity the predicted p99 held, up to 80% it held on about half the levels, above 80%
#: the measured p99 itself varied many times over between runs while the throughput held.
P99_TRUST: tuple[tuple[float, bool, str], ...] = (
    (0.5, True, "p99 held at loads like this when validated against the real server"),
    (0.8, False, "CAUTION: between 50% and 80% of capacity the predicted p99 is a rough guide (the p99 without "
                 "the slowdowns, below, is often closer); measure it (resnet18-kit plan validate) or plan "
                 "below 50% (--max-utilization 0.5)"),
    (math.inf, False, "NOT TRUSTED: above 80% of capacity the p99 varies many times over between runs; the "
                      "throughput holds, the p99 does not: plan below 80% (--max-utilization 0.8) for a p99 "
                      "you can rely on"),
)


#: What the two predictions of a p99 (with and without the profile's slowdowns under load) tell of the
#: measured one: it mostly fell within 25% of the range they span (docs/records/capacity.md); the wider
#: the range, the less either end alone can be relied on.
P99_RANGE_NOTE = "the measured p99 mostly falls in that range (+-25%; docs/records/capacity.md)"


def p99_trust(capacity_used: float, table: tuple[tuple[float, bool, str], ...] = P99_TRUST) -> tuple[bool, str]:
    """(trusted, why) for a p99 predicted at `capacity_used` (throughput / device capacity, 0..1), from
    `table` (the validation's measured hit rates: (upper bound of the load, trusted, text) rows)."""
    return next((trusted, why) for bound, trusted, why in table if capacity_used < bound)


def format_plan(p: Plan) -> str:
    """The plan as printed by `resnet18-kit plan plan`."""
    lines = [f"target {p.target_rps:,.0f} inferences/s, SLO {p.slo.describe()}, arrivals: {p.arrival}"]
    evaluated = [c for c in p.candidates if c.simulations]
    lines.append(f"searched {len(p.candidates)} configs, simulated {len(evaluated)} "
                 f"({sum(c.simulations for c in p.candidates)} simulations)")
    for title, c in (("BEST", p.best), ("no dynamic batching", p.no_batching)):
        if c is None:
            continue
        if not c.feasible:
            lines.append(f"{title}: {c.batcher.describe()}: cannot meet the SLO "
                         f"(capacity bound {c.capacity_bound:,} devices)")
            continue
        d = c.predicted(p.slo)
        lines += [
            f"{title}: {d['devices']:,} devices x {c.instances} instance(s)   "
            f"(device capacity {d['per_device_capacity_rps']:,.1f} infer/s: {d['devices_at_full_load']:,} "
            f"devices at 100% busy, {d['capacity_bound']:,} below it)",
            f"  batcher: {d['batcher']}",
            f"  per device: offered {d['offered_rps_per_device']:,.1f}/s, throughput {d['throughput_rps_per_device']:,.1f}/s, "
            f"average batch {d['average_batch']:.1f}, busy {d['busy_fraction']:.0%}, "
            f"capacity used {d['capacity_used']:.0%}",
            f"  latency: p50 {d['p50_ms']:,.1f} ms, p99 {d['p99_ms']:,.1f} ms "
            f"(SLO p{p.slo.percentile:g} <= {p.slo.budget_ms:g} ms)",
            f"  p99 at {d['capacity_used']:.0%} of capacity: {p99_trust(d['capacity_used'])[1]}",
            *([f"  p99 {d['p99_ms']:,.1f} ms with the profile's slowdowns under load, {d['p99_static_ms']:,.1f} ms "
               f"without them: {P99_RANGE_NOTE}"] if d.get("p99_static_ms") is not None else []),
            f"  fleet: predicted throughput {d['throughput_rps_per_device'] * d['devices']:,.0f} infer/s",
        ]
    if p.best is not None and p.best.batcher.dynamic_batching:
        b = p.best
        lines.append(f"queue delay chosen: {b.batcher.max_queue_delay_us / 1000:g} ms "
                     f"(max_queue_delay_microseconds: {b.batcher.max_queue_delay_us})")
        same = sorted((c for c in p.candidates if c.feasible and c.instances == b.instances
                       and c.batcher.dynamic_batching and c.batcher.max_batch_size == b.batcher.max_batch_size),
                      key=lambda c: c.batcher.max_queue_delay_us)
        lines.append("  delays tried with this max batch: " + ", ".join(
            f"{c.batcher.max_queue_delay_us / 1000:g} ms -> {c.devices:,} devices, "
            f"p{p.slo.percentile:g} {c.result.percentile_ms(p.slo.percentile):,.0f} ms" for c in same))
    return "\n".join(lines)


def plan_to_json(p: Plan) -> dict:
    """The plan as written by --json: target (infer/s), SLO (percentile, ms), best and no-batching figures."""
    def candidate(c):
        if c is None or not c.feasible:
            return None
        d = c.predicted(p.slo)
        d["p99_trusted"], d["p99_trust"] = p99_trust(d["capacity_used"])
        return d
    return {"target_rps": p.target_rps, "slo": {"percentile": p.slo.percentile, "budget_ms": p.slo.budget_ms},
            "arrivals": p.arrival, "best": candidate(p.best), "no_batching": candidate(p.no_batching),
            "queue_delay_us": p.best.batcher.max_queue_delay_us if p.best else None}
