"""Request arrival processes, and how a load balancer splits them over identical replicas.

Every process is described by its cumulative intensity Lambda(t) (expected arrivals by time t): a
process's arrivals are Lambda^-1 of the points of a unit-rate Poisson process. That gives both
balancers exactly and cheaply, for one replica out of `replicas`:
  * "round_robin": the replica takes every replicas-th request of the whole stream, i.e. Lambda^-1 of
    every replicas-th unit-rate point: gaps of Gamma(replicas, 1) in Lambda-space. With many replicas
    each one sees an almost regular stream (what gRPC client-side round_robin or an L7 proxy does);
  * "random": each request goes to a replica chosen at random: a thinned process, Lambda / replicas
    (what a hash or random L4 balancer does; each replica sees the full burstiness).
A replayed trace is split the same way, by index (round robin) or at random.

Time is in seconds, rates in requests per second.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BALANCERS = ("round_robin", "random")


def _unit_points(count: int, replicas: int, balancer: str, rng: np.random.Generator) -> np.ndarray:
    """`count` arrival positions in Lambda-space (expected-arrival units) of one replica's share."""
    if balancer == "round_robin":
        gaps = rng.gamma(shape=replicas, scale=1.0, size=count)
        gaps[0] = rng.uniform(0, replicas)  # the replica's phase in the round
    elif balancer == "random":
        gaps = rng.exponential(scale=replicas, size=count)
    else:
        raise ValueError(f"balancer must be one of {BALANCERS}, not {balancer!r}")
    return np.cumsum(gaps)


@dataclass(frozen=True)
class Poisson:
    """Poisson arrivals at `rate_rps` requests/s."""

    rate_rps: float

    def arrivals(self, count: int, replicas: int = 1, balancer: str = "round_robin",
                 rng: np.random.Generator | None = None) -> np.ndarray:
        """`count` arrival times (s) of one replica of `replicas` behind `balancer`."""
        rng = rng or np.random.default_rng(0)
        return _unit_points(count, replicas, balancer, rng) / self.rate_rps

    def describe(self) -> str:
        return f"Poisson {self.rate_rps:g} req/s"


@dataclass(frozen=True)
class Bursty:
    """A two-state Markov-modulated Poisson process with mean rate `rate_rps`: bursts at
    `burst_factor` x the mean rate for a fraction `burst_fraction` of the time, bursts lasting
    `burst_s` on average (exponential), the rest of the time at the rate that keeps the mean.
    burst_factor x burst_fraction must be <= 1 (the quiet rate cannot be negative)."""

    rate_rps: float
    burst_factor: float = 3.0
    burst_fraction: float = 0.2
    burst_s: float = 1.0

    def __post_init__(self) -> None:
        if not (self.burst_factor >= 1 and 0 < self.burst_fraction < 1
                and self.burst_factor * self.burst_fraction <= 1):
            raise ValueError("need burst_factor >= 1, 0 < burst_fraction < 1, burst_factor x burst_fraction <= 1")

    @property
    def quiet_rate_rps(self) -> float:
        f = self.burst_fraction
        return self.rate_rps * (1 - self.burst_factor * f) / (1 - f)

    def arrivals(self, count: int, replicas: int = 1, balancer: str = "round_robin",
                 rng: np.random.Generator | None = None) -> np.ndarray:
        rng = rng or np.random.default_rng(0)
        points = _unit_points(count, replicas, balancer, rng)
        # The modulating path: alternating quiet and burst periods until Lambda covers every point.
        quiet_s = self.burst_s * (1 - self.burst_fraction) / self.burst_fraction
        rates = (self.quiet_rate_rps, self.burst_factor * self.rate_rps)
        edges_t, edges_lambda = [0.0], [0.0]
        state = int(rng.random() < self.burst_fraction)
        while edges_lambda[-1] < points[-1]:
            duration = rng.exponential(self.burst_s if state else quiet_s)
            edges_t.append(edges_t[-1] + duration)
            edges_lambda.append(edges_lambda[-1] + rates[state] * duration)
            state = 1 - state
        return np.interp(points, edges_lambda, edges_t)  # Lambda^-1, piecewise linear

    def describe(self) -> str:
        return (f"bursty {self.rate_rps:g} req/s mean (x{self.burst_factor:g} for {self.burst_fraction:.0%} "
                f"of the time, bursts of {self.burst_s:g} s)")


@dataclass(frozen=True)
class Trace:
    """Arrival times replayed from a file, optionally rescaled to a mean rate.

    Files: perf_analyzer's --profile-export-file JSON (every request's send timestamp, ns), or text with
    one arrival per line, the first comma/space-separated field in seconds ('#' comments allowed).
    """

    times_s: np.ndarray
    source: str = ""

    @classmethod
    def load(cls, path: Path) -> "Trace":
        path = Path(path)
        text = path.read_text()
        if path.suffix == ".json":
            times = send_times_s(json.loads(text))
        else:
            rows = [line.split("#")[0].replace(",", " ").split() for line in text.splitlines()]
            times = np.array(sorted(float(r[0]) for r in rows if r and _is_number(r[0])))
        if times.size < 2:
            raise ValueError(f"{path}: fewer than 2 arrivals")
        return cls(times - times[0], source=str(path))

    @property
    def rate_rps(self) -> float:
        return (self.times_s.size - 1) / (self.times_s[-1] - self.times_s[0])

    def scaled_to(self, rate_rps: float) -> "Trace":
        """The same pattern, time-compressed or stretched to a mean of `rate_rps`."""
        return Trace(self.times_s * (self.rate_rps / rate_rps), self.source)

    def arrivals(self, count: int, replicas: int = 1, balancer: str = "round_robin",
                 rng: np.random.Generator | None = None) -> np.ndarray:
        """Up to `count` arrivals of one replica; the trace is replayed again (shifted by its length)
        as often as needed to reach `count`."""
        rng = rng or np.random.default_rng(0)
        needed = count * replicas
        period = self.times_s[-1] + 1.0 / self.rate_rps
        repeats = -(-needed // self.times_s.size)
        full = (self.times_s[None, :] + period * np.arange(repeats)[:, None]).ravel()[:needed]
        if balancer == "round_robin":
            mine = full[int(rng.integers(replicas))::replicas]
        elif balancer == "random":
            mine = full[rng.random(full.size) < 1.0 / replicas]
        else:
            raise ValueError(f"balancer must be one of {BALANCERS}, not {balancer!r}")
        return mine[:count]

    def describe(self) -> str:
        return f"trace {self.source} ({self.times_s.size} arrivals, {self.rate_rps:.1f} req/s mean)"


def send_times_s(export: dict) -> np.ndarray:
    """The send times (s, ascending, from the first) of every request in a perf_analyzer profile export
    ({"experiments": [{"requests": [{"timestamp": ns, ...}, ...]}, ...]}, e.g. load.perf_analyzer's
    load_profile_export); an empty array when it holds no request."""
    stamps = sorted(r["timestamp"] for e in export["experiments"] for r in e["requests"])
    return (np.array(stamps, dtype=float) - stamps[0]) / 1e9 if stamps else np.array([])


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
