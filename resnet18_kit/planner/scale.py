"""Scale on paper: replicas for a range of loads from measured profiles, and which limit binds first.

Per replica (one tritonserver on one device) two limits are measured:
  * model compute: the profile's best throughput, max over b of instances x b / exec(b);
  * protocol + batcher: the server ceiling, the request rate one server carries with a trivial model
    (results/bench-*/summary.json, `identity` over gRPC; client and server shared the 2 cores).
Whichever is lower binds a replica. Above the replicas sits the load balancer, which carries every
request: it is not measured here (no cluster), so the table gives the request rate it must carry and
the assumption used to size it.
"""
from __future__ import annotations

from dataclasses import dataclass

from resnet18_kit.planner.batcher import BatcherConfig
from resnet18_kit.planner.profile import Profile
from resnet18_kit.planner.search import SearchSpace, Slo, device_capacity_rps, plan

TARGETS_RPS = (1_000, 20_000, 100_000, 1_000_000)


@dataclass
class ScaleRow:
    model: str
    target_rps: float
    slo: Slo
    replicas: int
    instances: int
    batcher: str
    p99_ms: float
    compute_rps: float
    ceiling_rps: float
    binding: str


def binding_limit(profile: Profile, batcher: BatcherConfig, instances: int) -> tuple[str, float, float]:
    """(which limit binds a replica, compute capacity infer/s, server ceiling req/s)."""
    compute = device_capacity_rps(Profile(profile.model, profile.timings, profile.overhead_us, 0.0),
                                  batcher, instances)
    ceiling = profile.server_ceiling_rps
    if ceiling and ceiling < compute:
        return "protocol + batcher (server ceiling)", compute, ceiling
    return "model compute", compute, ceiling


def scale_rows(profile: Profile, slo: Slo, targets: tuple[float, ...] = TARGETS_RPS,
               space: SearchSpace = SearchSpace(requests=10000, delay_fractions=(0.0, 0.25, 1.0))) -> list[ScaleRow]:
    rows = []
    for target in targets:
        p = plan(target, slo, profile, space)
        best = p.best
        if best is None:
            rows.append(ScaleRow(profile.model, target, slo, 0, 0, "SLO not reachable", float("nan"), 0, 0, "-"))
            continue
        binding, compute, ceiling = binding_limit(profile, best.batcher, best.instances)
        rows.append(ScaleRow(profile.model, target, slo, best.devices, best.instances, best.batcher.describe(),
                             best.result.percentile_ms(99), compute, ceiling, binding))
    return rows


def format_rows(rows: list[ScaleRow]) -> str:
    lines = ["| model | target infer/s | SLO | replicas (1 device each) | instances | batcher | predicted p99 ms "
             "| per-replica compute / server ceiling | binds first |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.target_rps:,.0f} | {r.slo.describe()} | {r.replicas:,} | {r.instances} "
                     f"| {r.batcher} | {r.p99_ms:,.1f} | {r.compute_rps:,.0f} / {r.ceiling_rps:,.0f} | {r.binding} |")
    return "\n".join(lines)
