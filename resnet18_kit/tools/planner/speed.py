"""Execution speed under open-loop load: how a device's execution time moves with the load it serves.

Why: the validation (docs/records/capacity.md) found that on this machine a two-thread ONNX Runtime instance
runs its batches 15-17% slower on average at 30% load than in the closed-loop profile (where it is busy
all the time), and in stretches of several seconds up to 1.8x slower (executions' durations from
Triton's trace, 2 s windows, lag-1 autocorrelation 0.4-0.7), while at 95% load it runs as profiled.
A static table of execution times cannot express either. (Likely cause: a vCPU that goes idle loses its
physical core to other tenants; a two-thread execution waits at every operator for the slower thread.
GPUs have their own version: clocks that drop when idle.)

The fix is measured, never fitted to a level being predicted: `resnet18_kit/tools/planner/measure.py` runs batch-1 requests
open loop (Poisson) at a few fractions of capacity, between closed-loop runs (100%), polling the
server's statistics extension every `window_s`; each window's mean execution time (compute_infer per
execution) divided by the mean of the closed-loop runs just before and after is one factor. A
`SpeedTrace` is that series of factors for one utilization. The simulator multiplies every execution's profiled time by the factor of the moment,
taken from a block bootstrap of the series (blocks of `BLOCK_WINDOWS` consecutive windows, in random
order), so both the mean slowdown and the slow stretches (their length, depth and frequency) carry over.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

#: Consecutive windows kept together by the block bootstrap: the slow stretches seen lasted 2-6 s.
BLOCK_WINDOWS = 5


@dataclass(frozen=True)
class SpeedTrace:
    """Execution-time factors measured at one load.

    utilization: offered load during the measurement, as a fraction of the device's capacity
        (1.0 = closed loop, every instance always busy).
    window_s: length of each window, seconds.
    factors: per window, the mean execution time divided by the closed-loop mean (dimensionless, > 0).
    """

    utilization: float
    window_s: float
    factors: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.factors or self.window_s <= 0 or any(not f > 0 for f in self.factors):
            raise ValueError(f"a speed trace needs windows > 0 s and positive factors: {self}")

    @property
    def mean(self) -> float:
        return float(np.mean(self.factors))

    def sampler(self, rng: np.random.Generator, block_windows: int = BLOCK_WINDOWS) -> Callable[[float], float]:
        """A function of simulated time t >= 0 (s) to the factor at t: the measured windows replayed in
        blocks of `block_windows`, each block starting at a random window (block bootstrap)."""
        factors = np.asarray(self.factors, dtype=float)
        block = max(1, min(block_windows, factors.size))
        drawn: list[float] = []

        def factor_at(t_s: float) -> float:
            window = int(max(0.0, t_s) / self.window_s)
            while window >= len(drawn):
                start = int(rng.integers(0, factors.size - block + 1))
                drawn.extend(factors[start:start + block])
            return drawn[window]

        return factor_at

    def to_json(self) -> dict:
        return {"utilization": round(self.utilization, 4), "window_s": self.window_s,
                "factors": [round(f, 4) for f in self.factors]}

    @classmethod
    def from_json(cls, data: dict) -> "SpeedTrace":
        return cls(float(data["utilization"]), float(data["window_s"]), tuple(float(f) for f in data["factors"]))


def window_factors(samples: list[tuple[int, int]], baseline_ms: float, min_executions: int = 3) -> list[float]:
    """Factors from cumulative statistics snapshots.

    samples: (executions, compute_infer ns), cumulative, one snapshot per window (the statistics
        extension's `execution_count` and `inference_stats.compute_infer.ns`, batch 1 so one request is
        one execution).
    baseline_ms: the closed-loop mean execution time the factors are relative to.
    Windows with fewer than `min_executions` executions are skipped (too few to average).
    """
    return [mean_execution_ms(a, b) / baseline_ms for a, b in zip(samples, samples[1:])
            if b[0] - a[0] >= min_executions]


def mean_execution_ms(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Mean compute_infer per execution (ms) between two cumulative (executions, compute_infer ns)
    snapshots; 0.0 when nothing executed in between."""
    executions = after[0] - before[0]
    return (after[1] - before[1]) / executions / 1e6 if executions else 0.0


def nearest(traces: tuple[SpeedTrace, ...], utilization: float) -> SpeedTrace | None:
    """The trace measured at the utilization nearest to `utilization` (None when there are none)."""
    return min(traces, key=lambda t: abs(t.utilization - utilization)) if traces else None
