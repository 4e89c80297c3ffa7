"""Resident memory of a server's processes (tritonserver and its Python-backend stubs, read from /proc by
the server's `resident_memory_bytes`), sampled on a thread while a scenario runs: start, peak and end."""
from __future__ import annotations

import time
from typing import Protocol

from resnet18_kit.observe.statistics import PeriodicSampler


class ResidentMemory(Protocol):
    """Anything that reports the resident memory of its processes, e.g. server.embedded's
    EmbeddedTritonServer: {process name: bytes}."""

    def resident_memory_bytes(self) -> dict[str, int]: ...


class MemorySampler(PeriodicSampler):
    """Samples the resident memory of `server`'s processes (tritonserver and its stubs, summed) every
    `interval_s` seconds on a thread, at entry and exit too. samples: [(seconds since entry, bytes)];
    start, end and peak: bytes."""

    def __init__(self, server: ResidentMemory, interval_s: float = 0.2):
        super().__init__(interval_s, at_edges=True)
        self.server = server
        self._origin = time.monotonic()

    def __enter__(self) -> "MemorySampler":
        self._origin = time.monotonic()
        return super().__enter__()

    def total_bytes(self) -> int:
        """Resident memory of all of the server's processes now, bytes."""
        return sum(self.server.resident_memory_bytes().values())

    def sample(self) -> tuple[float, int]:
        return time.monotonic() - self._origin, self.total_bytes()

    @property
    def start(self) -> int:
        return self.samples[0][1]

    @property
    def end(self) -> int:
        return self.samples[-1][1]

    @property
    def peak(self) -> int:
        return max(value for _, value in self.samples)

