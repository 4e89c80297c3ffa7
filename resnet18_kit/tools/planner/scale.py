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

import math
from dataclasses import dataclass

from resnet18_kit.tools.planner.batcher import BatcherConfig
from resnet18_kit.tools.planner.profile import Profile
from resnet18_kit.tools.planner.search import SearchSpace, Slo, device_capacity_rps, plan

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


@dataclass(frozen=True)
class PublishedFigure:
    """A throughput published by someone else, for a GPU row on paper (never measured here)."""

    device: str
    setup: str
    infer_per_s: float
    p99_ms: float
    source: str


#: NVIDIA's own Triton measurement of ResNet-50 v1.5 on one A100 (DeepLearningExamples,
#: PyTorch/Classification/ConvNets/triton/resnet50/README.md, "Online: NVIDIA DGX A100 (1x A100 80GB), ONNX
#: Runtime TensorRT with FP16", 256 concurrent client requests).
A100_RESNET50 = PublishedFigure(
    "NVIDIA A100 80GB", "ResNet-50 v1.5, ONNX Runtime + TensorRT FP16, Triton dynamic batching (max batch 128, "
    "preferred 64 and 128, 1 ms delay, 1 instance), 256 requests in flight", 6127.3, 46.5,
    "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/triton/resnet50/README.md")
#: GFLOPS per 224x224 image, torchvision's model documentation (resnet18: 1.81, resnet50: 4.09).
GFLOPS = {"resnet18": 1.81, "resnet50": 4.09}


def gpu_rows_on_paper(targets: tuple[float, ...] = TARGETS_RPS, figure: PublishedFigure = A100_RESNET50,
                      ceiling_rps: float = 0.0) -> list[str]:
    """Rows of the scale table for a GPU, from `figure`, NOT measured here: ResNet-50's throughput scaled
    to ResNet-18 by FLOPs (4.09 / 1.81 = 2.26x; an upper bound: a smaller network keeps a GPU less busy
    per request, and the front end's per-request cost does not shrink), replicas = ceil(target / that),
    at 100 % (add headroom); then a line naming the source. `ceiling_rps`: the server ceiling measured here
    (req/s), set beside the rate each GPU replica's front end must carry."""
    scaled = figure.infer_per_s * GFLOPS["resnet50"] / GFLOPS["resnet18"]
    label = f"resnet18 on {figure.device} (NOT MEASURED: published ResNet-50 figure x {GFLOPS['resnet50'] / GFLOPS['resnet18']:.2f} by FLOPs)"
    binds = ("Triton's front end, unless the host gives it the cores (the ceiling measured here is per 2 cores)"
             if ceiling_rps and ceiling_rps < scaled else "GPU compute")
    rows = [f"| {label} | {t:,.0f} | p99 ~{figure.p99_ms:.0f} ms (ResNet-50's) | {math.ceil(t / scaled):,} | 1 "
            f"| max batch 128, delay 1 ms | - | {scaled:,.0f} / {ceiling_rps:,.0f} | {binds} |" for t in targets]
    return rows + [f"\nGPU rows: from {figure.infer_per_s:,.0f} infer/s at p99 {figure.p99_ms:.1f} ms, {figure.setup} "
                   f"({figure.source}); not measured here."]


def format_rows(rows: list[ScaleRow]) -> str:
    """The scale table (Markdown) of `rows`, then the GPU rows on paper (gpu_rows_on_paper)."""
    lines = ["| model | target infer/s | SLO | replicas (1 device each) | instances | batcher | predicted p99 ms "
             "| per-replica compute / server ceiling | binds first |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.target_rps:,.0f} | {r.slo.describe()} | {r.replicas:,} | {r.instances} "
                     f"| {r.batcher} | {r.p99_ms:,.1f} | {r.compute_rps:,.0f} / {r.ceiling_rps:,.0f} | {r.binding} |")
    targets = tuple(sorted({r.target_rps for r in rows})) or TARGETS_RPS
    ceiling = max((r.ceiling_rps for r in rows if r.ceiling_rps), default=0.0)
    return "\n".join(lines + gpu_rows_on_paper(targets, ceiling_rps=ceiling))
