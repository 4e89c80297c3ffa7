"""The model's measured cost on one device: what the simulator and the planner need, as a small JSON.

A profile holds, for each number of model instances sharing the device, the execution time of one batch
per batch size (mean and standard deviation, milliseconds, measured with every instance busy), plus the
fixed per-request latency outside the queue and the execution (client, protocol, server front end), and
optionally the request rate one server can carry at all whatever the model (measured with a trivial
model: the protocol and batcher ceiling). Execution times between measured batch sizes are interpolated
linearly; batch sizes beyond the largest measured one are refused (no extrapolation).

File format (`PROFILE_FORMAT`):

    {"format": "triton-capacity-profile/1", "model": "resnet18_onnx", "device": "2-core CPU ...",
     "source": "how it was measured", "measured_utc": "...",
     "overhead_us": 900.0, "server_ceiling_rps": 4976.0,
     "instances": {"1": {"1": {"mean_ms": 22.1, "std_ms": 1.9, "executions": 40}, "8": {...}}},
     "speed_under_load": {"1": [{"utilization": 0.25, "window_s": 1.0, "factors": [1.12, 1.31, ...]}, ...]}}

"speed_under_load" is optional (resnet18_kit/tools/planner/speed.py): how the execution time moves with the load served.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from resnet18_kit.tools.planner.speed import SpeedTrace, nearest

PROFILE_FORMAT = "triton-capacity-profile/1"


@dataclass(frozen=True)
class BatchTiming:
    """One batch size's execution on one instance: mean and standard deviation in milliseconds."""

    mean_ms: float
    std_ms: float = 0.0
    executions: int = 0


@dataclass
class Profile:
    """Execution time per batch size, per instance count, for one model on one device.

    timings: {instances sharing the device: {batch size: BatchTiming}}.
    overhead_us: fixed latency per request outside queue and execution (client send/receive, protocol,
        server front end), microseconds; added to every simulated latency.
    server_ceiling_rps: requests/s one server (one replica) can take in through its protocol stack and
        batcher whatever the model, 0 = unknown/unbounded (measured with a trivial model).
    speed: {instances: SpeedTrace per measured utilization, ascending} (resnet18_kit/tools/planner/speed.py); empty = the
        execution time does not depend on the load (the table is used as is).
    """

    model: str
    timings: dict[int, dict[int, BatchTiming]]
    overhead_us: float = 0.0
    server_ceiling_rps: float = 0.0
    device: str = ""
    source: str = ""
    measured_utc: str = ""
    extra: dict = field(default_factory=dict)
    speed: dict[int, tuple[SpeedTrace, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.timings or any(not by_batch for by_batch in self.timings.values()):
            raise ValueError("a profile needs at least one instance count with one batch size")
        for instances, by_batch in self.timings.items():
            for batch, timing in by_batch.items():
                if instances < 1 or batch < 1 or not timing.mean_ms > 0:
                    raise ValueError(f"bad timing {instances} instance(s), batch {batch}: {timing}")

    # -- queries -------------------------------------------------------------------------------------

    @property
    def instance_counts(self) -> list[int]:
        return sorted(self.timings)

    def batch_sizes(self, instances: int) -> list[int]:
        """The measured batch sizes for `instances`, ascending."""
        return sorted(self._table(instances))

    def max_batch_size(self, instances: int) -> int:
        return self.batch_sizes(instances)[-1]

    def _table(self, instances: int) -> dict[int, BatchTiming]:
        if instances not in self.timings:
            raise KeyError(f"profile of {self.model} has no figures for {instances} instance(s) "
                           f"(it has {self.instance_counts})")
        return self.timings[instances]

    def timing(self, batch: int, instances: int = 1) -> BatchTiming:
        """Execution time of a batch of `batch` on one of `instances` instances sharing the device,
        interpolated linearly between measured sizes (mean and std alike). Batch sizes below the
        smallest measured one take its figures; above the largest raise ValueError."""
        table = self._table(instances)
        sizes = sorted(table)
        if batch > sizes[-1]:
            raise ValueError(f"batch {batch} beyond the largest measured ({sizes[-1]}) for {instances} instance(s)")
        if batch in table:
            return table[batch]
        i = bisect.bisect_left(sizes, batch)
        if i == 0:
            return table[sizes[0]]
        lo, hi = sizes[i - 1], sizes[i]
        w = (batch - lo) / (hi - lo)
        a, b = table[lo], table[hi]
        return BatchTiming(a.mean_ms + w * (b.mean_ms - a.mean_ms), a.std_ms + w * (b.std_ms - a.std_ms))

    def exec_s(self, batch: int, instances: int = 1) -> float:
        """Mean execution time in seconds of a batch of `batch` (see `timing`)."""
        return self.timing(batch, instances).mean_ms / 1000.0

    def exec_table_s(self, max_batch: int, instances: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(mean_s, std_s) arrays indexed by batch size 0..max_batch (index 0 unused), for the simulator."""
        mean = np.zeros(max_batch + 1)
        std = np.zeros(max_batch + 1)
        for b in range(1, max_batch + 1):
            t = self.timing(b, instances)
            mean[b], std[b] = t.mean_ms / 1000.0, t.std_ms / 1000.0
        return mean, std

    def device_throughput(self, max_batch: int, instances: int = 1) -> float:
        """The most inferences/s one device can execute with batches of at most `max_batch`, every one of
        its `instances` instances busy: max over b <= max_batch of instances x b / exec_s(b)."""
        return max(instances * b / self.exec_s(b, instances) for b in range(1, max_batch + 1))

    def speed_trace(self, instances: int, utilization: float) -> SpeedTrace | None:
        """The speed trace for `instances` measured nearest to `utilization` (offered load / capacity),
        or None when the profile has none for that instance count."""
        return nearest(self.speed.get(instances, ()), utilization)

    # -- JSON --------------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format": PROFILE_FORMAT, "model": self.model, "device": self.device, "source": self.source,
            "measured_utc": self.measured_utc, "overhead_us": self.overhead_us,
            "server_ceiling_rps": self.server_ceiling_rps,
            "instances": {str(n): {str(b): {"mean_ms": round(t.mean_ms, 4), "std_ms": round(t.std_ms, 4),
                                            "executions": t.executions}
                                   for b, t in sorted(by_batch.items())}
                          for n, by_batch in sorted(self.timings.items())},
            **({"speed_under_load": {str(n): [t.to_json() for t in traces]
                                     for n, traces in sorted(self.speed.items())}} if self.speed else {}),
            **({"extra": self.extra} if self.extra else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a {PROFILE_FORMAT} file (format={data.get('format')!r})")
        timings = {int(n): {int(b): BatchTiming(float(t["mean_ms"]), float(t.get("std_ms", 0.0)),
                                                int(t.get("executions", 0)))
                            for b, t in by_batch.items()}
                   for n, by_batch in data["instances"].items()}
        return cls(model=data["model"], timings=timings, overhead_us=float(data.get("overhead_us", 0.0)),
                   server_ceiling_rps=float(data.get("server_ceiling_rps", 0.0)), device=data.get("device", ""),
                   source=data.get("source", ""), measured_utc=data.get("measured_utc", ""),
                   extra=data.get("extra", {}),
                   speed={int(n): tuple(SpeedTrace.from_json(t) for t in traces)
                          for n, traces in data.get("speed_under_load", {}).items()})

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> "Profile":
        """Read a profile written by `save` (resnet18-kit plan profile). Raises FileNotFoundError, or
        ValueError naming the file when it is not JSON."""
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a profile JSON file ({exc})") from None


def constant_profile(exec_ms: float, max_batch: int, model: str = "constant", overhead_us: float = 0.0,
                     server_ceiling_rps: float = 0.0) -> Profile:
    """A device that runs any batch of 1..max_batch in `exec_ms` (the textbook example's device)."""
    sizes = sorted({1, max_batch, *[2 ** k for k in range(int(math.log2(max_batch)) + 1)]})
    return Profile(model=model, timings={1: {b: BatchTiming(exec_ms) for b in sizes if b <= max_batch}},
                   overhead_us=overhead_us, server_ceiling_rps=server_ceiling_rps,
                   device=f"constant {exec_ms:g} ms per batch of up to {max_batch}", source="by definition")
