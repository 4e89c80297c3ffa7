"""The main job as two stages: the `resnet18` ensemble's `preprocess` (decoding on CPU, Python backend)
then the network, sharing one device (here: the same 2 cores), planned and simulated as a tandem.

The model:
  * each stage is a Triton model with its own dynamic batcher, queue policy and instances; the ensemble
    scheduler hands a request to the network the moment preprocess answers it, so stage 2's arrivals
    are stage 1's completions (an exact tandem: `simulate_ensemble` runs planner.simulator on stage 1,
    then on stage 2 with stage 1's completion times as arrivals); a request refused or timed out at
    either stage is refused for the client;
  * each stage's execution time per batch is its own profile measured alone (preprocess: a batch of b
    images costs b x one image's time, because model.py decodes one image after another on one core;
    the network: its `resnet18-kit plan profile`) times an **interference factor** measured with both
    stages busy: the stage's compute time per inference inside the ensemble, run closed loop on real
    photos, over the same alone (resnet18_kit/tools/planner/measure_ensemble.py). One factor per (preprocess
    instances, network instances) pair measured; it is the cost of sharing the cores at full load, where
    the stages always overlap; at a lower load they overlap less, and a factor f counts as
    1 + (f - 1) x load (`EnsembleProfile.stage_profiles`);
  * one more factor per pair, shared by both stages (`calibrated`): the closed-loop run's throughput fell
    short of what the two stage factors alone allow (docs/records/capacity.md has the runs); what the ensemble
    spends outside both stages' compute (tensors handed between stub processes, the front end decoding
    photo requests) runs on the same cores, so both stages' times are stretched until the model's
    capacity is the measured one. Measured at full load only, so the levels a validation predicts are
    not used to fit it;
  * the speed-under-load traces of the single-model planner are not used for the stages (the factors
    already hold the main slowdown; stated in the plan's output), nor is Triton 2.51's lost wake-up
    unless asked (`lost_wakeup`, on both stages' queue policies);
  * the fixed latency outside both executions (client, protocol, the ensemble's hand-over) is the
    profile's `overhead_us`: a lone photo's p50 end to end minus both stages' batch-1 times.

Capacity of a device: min over the stages of instances x batch / exec(batch) with its factor, and no
more (this is what the factors are for: two stages' alone capacities cannot both be had on 2 cores).

File format (`ENSEMBLE_PROFILE_FORMAT`): {"format", "preprocess": <profile JSON>, "network": <profile
JSON>, "interference": [{"preprocess_instances", "network_instances", "preprocess_factor",
"network_factor", ...measured figures}], "overhead_us", "photos", "measured_utc"}.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from resnet18_kit.tools.planner.arrivals import Poisson
from resnet18_kit.tools.planner.batcher import BatcherConfig, QueuePolicy
from resnet18_kit.tools.planner.profile import BatchTiming, Profile
from resnet18_kit.tools.planner.search import (SearchSpace, Slo, candidates_for, capacity_bound, p99_trust,
                                         queue_size_for)
from resnet18_kit.tools.planner.simulator import LostWakeup, SimResult, simulate

ENSEMBLE_PROFILE_FORMAT = "triton-ensemble-profile/1"


@dataclass(frozen=True)
class Interference:
    """Both stages busy at once, preprocess_instances and network_instances sharing the device: each
    stage's execution time per inference over its time alone (>= 1 means slower)."""

    preprocess_instances: int
    network_instances: int
    preprocess_factor: float
    network_factor: float
    measured: dict = field(default_factory=dict, compare=False)
    #: Both stages' times are multiplied by this too: the closed-loop run's shortfall from the capacity the
    #: two factors alone give (the ensemble's hand-over of tensors between stub processes and the front end
    #: decoding requests cost the same cores outside any stage's compute); 1 = none (`calibrated`).
    shared_factor: float = 1.0


@dataclass
class EnsembleProfile:
    """What the two-stage model needs (module doc). Raises ValueError when a stage lacks what the
    ensemble needs: batch 1 for preprocess, interference for at least one pair of instance counts."""

    preprocess: Profile
    network: Profile
    interference: tuple[Interference, ...]
    overhead_us: float = 0.0
    photos: str = ""
    measured_utc: str = ""

    def __post_init__(self) -> None:
        if not self.interference:
            raise ValueError("the ensemble profile has no interference measurement (both stages busy)")
        for pair in self.interference:
            if 1 not in self.preprocess.timings.get(pair.preprocess_instances, {}):
                raise ValueError(f"the ensemble profile lacks the preprocess stage with "
                                 f"{pair.preprocess_instances} instance(s), batch 1")
            if pair.network_instances not in self.network.timings:
                raise ValueError(f"the ensemble profile lacks the network stage with "
                                 f"{pair.network_instances} instance(s)")

    def pair(self, preprocess_instances: int, network_instances: int) -> Interference:
        for p in self.interference:
            if (p.preprocess_instances, p.network_instances) == (preprocess_instances, network_instances):
                return p
        raise KeyError(f"no interference measured for {preprocess_instances} preprocess and "
                       f"{network_instances} network instance(s)")

    def stage_profiles(self, pair: Interference, max_batch: int, load: float = 1.0) -> tuple[Profile, Profile]:
        """(preprocess, network) profiles as they run side by side: preprocess's batch-1 time times b for
        every b up to max_batch, both scaled by the pair's factors; no overhead (the ensemble's is added
        once), no speed traces. `load` (offered / capacity, 0..1): the factors were measured at full load,
        where the stages overlap all the time; at a lower load they overlap less, and each factor f
        counts as 1 + (f - 1) x load (first order in the chance that the other stage is busy)."""
        one = self.preprocess.timings[pair.preprocess_instances][1]
        share = min(1.0, max(0.0, load))
        shared = 1 + (pair.shared_factor - 1) * share
        f_pre = (1 + (pair.preprocess_factor - 1) * share) * shared
        f_net = (1 + (pair.network_factor - 1) * share) * shared
        pre = {b: BatchTiming(b * one.mean_ms * f_pre, math.sqrt(b) * one.std_ms * f_pre)
               for b in range(1, max_batch + 1)}
        net = {n: {b: BatchTiming(t.mean_ms * f_net, t.std_ms * f_net)
                   for b, t in by_batch.items()}
               for n, by_batch in self.network.timings.items() if n == pair.network_instances}
        return (Profile(model=self.preprocess.model, timings={pair.preprocess_instances: pre}),
                Profile(model=self.network.model, timings=net))

    def to_json(self) -> dict:
        return {"format": ENSEMBLE_PROFILE_FORMAT, "measured_utc": self.measured_utc, "photos": self.photos,
                "overhead_us": self.overhead_us, "preprocess": self.preprocess.to_json(),
                "network": self.network.to_json(),
                "interference": [{"preprocess_instances": p.preprocess_instances,
                                  "network_instances": p.network_instances,
                                  "preprocess_factor": round(p.preprocess_factor, 4),
                                  "network_factor": round(p.network_factor, 4),
                                  "shared_factor": round(p.shared_factor, 4), **p.measured}
                                 for p in self.interference]}

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> "EnsembleProfile":
        """Read a file written by `save`. FileNotFoundError; ValueError naming the file when it is not an
        ensemble profile, or lacks a stage."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != ENSEMBLE_PROFILE_FORMAT:
            raise ValueError(f"{path}: not a {ENSEMBLE_PROFILE_FORMAT} file (resnet18-kit plan profile-ensemble)")
        for stage in ("preprocess", "network"):
            if stage not in data:
                raise ValueError(f"{path}: the profile lacks the {stage} stage")
        pairs = tuple(Interference(int(p["preprocess_instances"]), int(p["network_instances"]),
                                   float(p["preprocess_factor"]), float(p["network_factor"]),
                                   {k: v for k, v in p.items() if not k.endswith(("_instances", "_factor"))},
                                   float(p.get("shared_factor", 1.0)))
                      for p in data.get("interference", []))
        try:
            return cls(Profile.from_json(data["preprocess"]), Profile.from_json(data["network"]), pairs,
                       float(data.get("overhead_us", 0.0)), data.get("photos", ""), data.get("measured_utc", ""))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None


def calibrated(profile: EnsembleProfile, preprocess_batcher: BatcherConfig, network_batcher: BatcherConfig
               ) -> EnsembleProfile:
    """`profile` with each pair's shared_factor set from its closed-loop run (measured["ensemble_throughput"],
    images/s, run with these batchers): the capacity the stage factors alone give over the throughput
    measured, at least 1. Uses the full-load run only, never a level a validation predicts."""
    pairs = []
    for pair in profile.interference:
        plain = replace(pair, shared_factor=1.0)
        pre, net = profile.stage_profiles(plain, preprocess_batcher.max_batch_size)
        capacity = min(stage_capacity_rps(pre, StageConfig(preprocess_batcher, pair.preprocess_instances)),
                       stage_capacity_rps(net, StageConfig(network_batcher, pair.network_instances)))
        measured = float(pair.measured.get("ensemble_throughput", 0.0))
        pairs.append(replace(plain, shared_factor=max(1.0, capacity / measured) if measured > 0 else 1.0))
    return replace(profile, interference=tuple(pairs))


@dataclass(frozen=True)
class StageConfig:
    """One stage's serving config: its batcher, its instance count and how many of them execute at once
    (Triton's rate limiter; observe.model_config.concurrent_executions; None = all). The interference
    pair and the execution times are those of `slots` instances running together; an instance beyond
    the slots takes a batch and holds it until a slot frees (planner.simulator.simulate's `concurrent`)."""

    batcher: BatcherConfig
    instances: int
    concurrent: int | None = None

    @property
    def slots(self) -> int:
        """Executions at once: min(concurrent, instances)."""
        return min(self.concurrent or self.instances, self.instances)


def stage_capacity_rps(profile: Profile, stage: StageConfig) -> float:
    """Inferences/s the stage can execute with every instance busy (planner.search.device_capacity_rps
    without a server ceiling)."""
    if not stage.batcher.dynamic_batching:
        return stage.slots / profile.exec_s(1, stage.slots)
    return profile.device_throughput(stage.batcher.max_batch_size, stage.slots)


@dataclass
class EnsembleResult:
    """One simulated replica of the ensemble: end-to-end latencies (s, after the warm-up, overhead
    included), what was refused at either stage, each stage's SimResult."""

    latencies_s: np.ndarray
    arrivals: int
    refused: int
    throughput_rps: float
    offered_rps: float
    stages: tuple[SimResult, SimResult]

    def percentile_ms(self, p: float) -> float:
        return float(np.percentile(self.latencies_s, p)) * 1e3 if self.latencies_s.size else math.inf


def simulate_ensemble(arrivals_s: np.ndarray, profile: EnsembleProfile, preprocess: StageConfig,
                      network: StageConfig, *, seed: int = 0, warmup_fraction: float = 0.1,
                      lost_wakeup: LostWakeup | None = None, load: float = 1.0) -> EnsembleResult:
    """The tandem (module doc) for requests of one image arriving at `arrivals_s` (sorted, seconds);
    `load`: the offered rate over the pair's capacity, for the interference factors (stage_profiles)."""
    arrivals_s = np.asarray(arrivals_s, dtype=float)
    pair = profile.pair(preprocess.slots, network.slots)
    pre_profile, net_profile = profile.stage_profiles(pair, preprocess.batcher.max_batch_size, load)
    first = simulate(arrivals_s, preprocess.batcher, pre_profile, preprocess.instances, seed=seed,
                     warmup_fraction=warmup_fraction, lost_wakeup=lost_wakeup, concurrent=preprocess.concurrent)
    passed = np.flatnonzero(~np.isnan(first.done_s))
    order = passed[np.argsort(first.done_s[passed], kind="stable")]
    second = simulate(first.done_s[order], network.batcher, net_profile, network.instances, seed=seed + 7,
                      warmup_fraction=0.0, lost_wakeup=lost_wakeup, concurrent=network.concurrent)
    end_s = np.full(arrivals_s.size, np.nan)
    end_s[order] = second.done_s
    n_first = int(arrivals_s.size * warmup_fraction)
    measured = end_s[n_first:] - arrivals_s[n_first:]
    answered = measured[~np.isnan(measured)]
    window_s = arrivals_s[-1] - arrivals_s[n_first] if arrivals_s.size > n_first + 1 else 0.0
    in_window = np.count_nonzero((end_s >= arrivals_s[n_first]) & (end_s <= arrivals_s[-1])) if window_s else 0
    return EnsembleResult(
        latencies_s=answered + profile.overhead_us / 1e6, arrivals=arrivals_s.size - n_first,
        refused=int(arrivals_s.size - n_first - answered.size),
        throughput_rps=in_window / window_s if window_s else 0.0,
        offered_rps=(arrivals_s.size - n_first - 1) / window_s if window_s else 0.0, stages=(first, second))


@dataclass
class EnsembleCandidate:
    """Both stages' configs, the device capacity, the devices found (0 = SLO not met) and the result."""

    preprocess: StageConfig
    network: StageConfig
    capacity_rps: float
    bottleneck: str
    devices: int = 0
    capacity_devices: int = 0
    result: EnsembleResult | None = None

    def describe(self) -> str:
        return (f"preprocess {self.preprocess.instances} instance(s) [{self.preprocess.batcher.describe()}] -> "
                f"network {self.network.instances} instance(s) [{self.network.batcher.describe()}]")


def ensemble_candidates(profile: EnsembleProfile, slo: Slo, space: SearchSpace,
                        preprocess_batcher: BatcherConfig) -> list[EnsembleCandidate]:
    """Every measured (preprocess instances, network instances) pair x the network batchers the
    single-model planner would try (planner.search.candidates_for on the network's profile, with the
    pair's factor), the preprocess batcher as given (its queue size set for the SLO)."""
    found = []
    for pair in profile.interference:
        pre_profile, net_profile = profile.stage_profiles(pair, preprocess_batcher.max_batch_size)
        pre_probe = StageConfig(preprocess_batcher, pair.preprocess_instances)
        pre_capacity = stage_capacity_rps(pre_profile, pre_probe)
        pre_queue = replace(preprocess_batcher.queue, max_queue_size=queue_size_for(
            pre_capacity, slo.budget_ms, preprocess_batcher.max_batch_size)) \
            if preprocess_batcher.queue.max_queue_size else preprocess_batcher.queue
        pre = StageConfig(replace(preprocess_batcher, queue=pre_queue), pair.preprocess_instances)
        net_space = replace(space, instances=(pair.network_instances,), max_batch_sizes=tuple(
            b for b in (space.max_batch_sizes or net_profile.batch_sizes(pair.network_instances))
            if b <= preprocess_batcher.max_batch_size))
        for c in candidates_for(net_profile, slo, net_space):
            network = StageConfig(c.batcher, c.instances)
            net_capacity = stage_capacity_rps(net_profile, network)
            bottleneck = "preprocess" if pre_capacity <= net_capacity else "network"
            found.append(EnsembleCandidate(pre, network, min(pre_capacity, net_capacity), bottleneck))
    return found


@dataclass
class EnsemblePlan:
    target_rps: float
    slo: Slo
    best: EnsembleCandidate | None
    candidates: list[EnsembleCandidate]
    simulations: int


def plan_ensemble(target_rps: float, slo: Slo, profile: EnsembleProfile, space: SearchSpace,
                  preprocess_batcher: BatcherConfig) -> EnsemblePlan:
    """The cheapest pair of configs (fewest devices, then the lowest latency at the SLO percentile, 2%
    counting as equal, then fewer instances in all) meeting the SLO with nothing refused; devices searched
    upward from each candidate's capacity bound (planner.search's rule: load strictly below capacity)."""
    candidates = ensemble_candidates(profile, slo, space, preprocess_batcher)
    for c in candidates:
        c.capacity_devices = capacity_bound(target_rps, c.capacity_rps, space.max_utilization)
    candidates.sort(key=lambda c: (c.capacity_devices, c.network.batcher.max_queue_delay_us,
                                   c.preprocess.instances + c.network.instances))
    best_devices, simulations = math.inf, 0
    for c in candidates:
        for devices in range(c.capacity_devices, min(best_devices, c.capacity_devices + 8) + 1):
            arrivals = Poisson(target_rps).arrivals(space.requests, devices, space.balancer,
                                                    np.random.default_rng(space.seed))
            result = simulate_ensemble(arrivals, profile, c.preprocess, c.network, seed=space.seed,
                                       lost_wakeup=space.lost_wakeup, load=target_rps / devices / c.capacity_rps)
            simulations += 1
            c.result = result
            if (result.refused == 0 and result.percentile_ms(slo.percentile) <= slo.budget_ms
                    and result.throughput_rps >= 0.97 * result.offered_rps):
                c.devices = devices
                best_devices = min(best_devices, devices)
                break
    feasible = [c for c in candidates if c.devices and c.devices == best_devices]
    best = None
    if feasible:
        lowest = min(c.result.percentile_ms(slo.percentile) for c in feasible)
        close = [c for c in feasible if c.result.percentile_ms(slo.percentile) <= lowest * 1.02]
        best = min(close, key=lambda c: (c.preprocess.instances + c.network.instances,
                                         c.network.batcher.max_queue_delay_us, c.network.batcher.max_batch_size))
    return EnsemblePlan(target_rps, slo, best, candidates, simulations)


#: How far the ensemble's predicted p99 can be trusted, by its load (offered / capacity); same form as
#: planner.search.P99_TRUST. From the two-stage validation on photos (`resnet18-kit plan validate-ensemble`;
#: its figures are in docs/records/capacity.md): the prediction ran low at light load, was a rough
#: guide up to 80% of capacity and missed widely above it, while the throughput held throughout.
ENSEMBLE_P99_TRUST: tuple[tuple[float, bool, str], ...] = (
    (0.5, False, "CAUTION: below 50% of capacity the predicted p99 runs low: expect up to a third more"),
    (0.8, False, "CAUTION: between 50% and 80% of capacity the predicted p99 is a rough guide; measure it "
                 "(resnet18-kit plan validate-ensemble)"),
    (math.inf, False, "NOT TRUSTED: above 80% of capacity the predicted p99 can miss several times over; the "
                      "throughput holds: plan for a --qps at most 80% of capacity"),
)


def format_ensemble_plan(p: EnsemblePlan, profile: EnsembleProfile) -> str:
    """The plan as `resnet18-kit plan ensemble` prints it, with the limits of the model it stands on."""
    lines = [f"target {p.target_rps:,.1f} images/s through the ensemble, SLO {p.slo.describe()}, Poisson arrivals",
             f"searched {len(p.candidates)} pairs of stage configs, {p.simulations} simulations"]
    if p.best is None:
        lines.append("no pair of configs meets the SLO within the devices tried")
        return "\n".join(lines)
    c, r = p.best, p.best.result
    pair = profile.pair(c.preprocess.instances, c.network.instances)
    busy = [s.utilization for s in r.stages]
    load = p.target_rps / c.devices / c.capacity_rps
    lines += [
        f"BEST: {c.devices} device(s); per device capacity {c.capacity_rps:.1f} images/s "
        f"(bottleneck: {c.bottleneck}), load {load:.0%} of it",
        f"  preprocess: {c.preprocess.instances} instance(s), {c.preprocess.batcher.describe()}; "
        f"x{pair.preprocess_factor:.2f} beside the network; busy {busy[0]:.0%}",
        f"  network:    {c.network.instances} instance(s), {c.network.batcher.describe()}; "
        f"x{pair.network_factor:.2f} beside preprocess; busy {busy[1]:.0%}, average batch {r.stages[1].average_batch:.1f}",
        f"  both stages x{pair.shared_factor:.2f} more: what the closed-loop run lost outside their compute",
        f"  latency end to end: p50 {r.percentile_ms(50):,.1f} ms, p99 {r.percentile_ms(99):,.1f} ms; "
        f"throughput {r.throughput_rps * c.devices:,.1f} images/s in all",
        f"  p99 at {load:.0%} of capacity: {p99_trust(load, ENSEMBLE_P99_TRUST)[1]}",
        "  model: tandem of two batchers; stage times measured alone x the interference factors measured at full "
        "load, counted in proportion to the load; no speed-under-load traces",
    ]
    return "\n".join(lines)

