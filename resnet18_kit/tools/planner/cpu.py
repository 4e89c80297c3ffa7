"""CPU accounting for measurements on a shared, noisy machine.

On the reference machine (2 vCPUs, shared with other people's servers and tests, CPU steal from the
hypervisor) a measurement is only as good as the cores it had. `CpuAccount` says how the cores were used
during a measurement; `wait_until_quiet` holds a measurement back until other processes leave the cores.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from resnet18_kit.observe.machine import cpu_ticks

#: A measurement during which other processes used more than this share of all cores is done again
#: (up to MAX_ATTEMPTS times in all); the figures kept say how contaminated they were.
MAX_FOREIGN_SHARE = 0.15
MAX_ATTEMPTS = 3


class CpuAccount:
    """Who used the cores between `start()` and `stop()`: this measurement (the server's session, this
    process and its finished children, e.g. perf_analyzer) or anything else on the machine ("foreign":
    other people's servers and tests on a shared machine), and the hypervisor (steal). Fractions of all
    cores' time, from /proc/stat and /proc/<pid>/stat clock ticks."""

    def __init__(self, session_id: int | None = None):
        self.session_id = session_id
        self.result: dict[str, float] = {}

    @staticmethod
    def _machine() -> tuple[int, int, int]:
        ticks = cpu_ticks()
        return ticks["busy"], ticks["steal"], ticks["total"]

    def _ours(self) -> int:
        own = os.times()
        ticks = int((own.user + own.system + own.children_user + own.children_system) * os.sysconf("SC_CLK_TCK"))
        if self.session_id:
            for stat in Path("/proc").glob("[0-9]*/stat"):
                try:
                    parts = stat.read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(parts[3]) == self.session_id:  # field 6: session id
                    ticks += int(parts[11]) + int(parts[12])  # utime, stime
        return ticks

    def start(self) -> "CpuAccount":
        self._before = (*self._machine(), self._ours())
        return self

    def stop(self) -> dict[str, float]:
        busy, steal, total, ours = (b - a for a, b in zip(self._before, (*self._machine(), self._ours())))
        total = max(1, total)
        self.result = {"ours": ours / total, "foreign": max(0.0, busy - ours) / total, "steal": steal / total}
        return self.result


def wait_until_quiet(max_foreign: float = 0.10, window_s: float = 2.0, max_wait_s: float = 120.0,
                     session_id: int | None = None) -> float:
    """Block until, over `window_s`, processes outside this measurement used < max_foreign of the cores
    (or max_wait_s passes). Returns the last window's foreign share."""
    deadline = time.monotonic() + max_wait_s
    while True:
        account = CpuAccount(session_id).start()
        time.sleep(window_s)
        foreign = account.stop()["foreign"]
        if foreign < max_foreign or time.monotonic() > deadline:
            return foreign
