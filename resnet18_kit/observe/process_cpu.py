"""CPU time a server's processes spend over a measurement window, per process, from /proc (Linux).

    with ProcessCpu({"tritonserver": server.process.pid}) as cpu:
        ... load ...
    cpu.seconds  # {"tritonserver": 1.9, "stub preprocess": 3.1, "stub resnet18_onnx": 6.2, ...}

Each root pid is followed with its descendants (tritonserver's Python-backend stubs), each process named by
`role`: the stubs by the model they serve (instances of one model summed), anything else by the root's name.
CPU time is utime + stime of /proc/<pid>/stat (every thread of the process), in seconds (clock ticks /
SC_CLK_TCK, 10 ms resolution). A process that starts during the window counts from zero; one that exits
during it keeps only what was read at the start (its last ticks are lost: restarts make the figure low).
"""
from __future__ import annotations

import os
from pathlib import Path

from resnet18_kit.contract import STUB_EXECUTABLE
from resnet18_kit.observe.processes import child_processes

#: Clock ticks per second of /proc/<pid>/stat's utime and stime.
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float | None:
    """utime + stime of `pid` (all its threads, not its children) in seconds; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # field 3 (state) is fields[0]; utime, stime are 14, 15
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def process_cpu_ms() -> float:
    """This process's CPU time so far (all its threads: user + system, os.times), milliseconds: the
    in-process bars' side of the comparison."""
    times = os.times()
    return (times.user + times.system) * 1e3


def role(argv: list[str], default: str) -> str:
    """"stub <model>" for a Python-backend stub (from its model path), else `default`."""
    if argv and Path(argv[0]).name == STUB_EXECUTABLE and len(argv) > 1:
        parts = Path(argv[1]).parts
        return f"stub {parts[-3]}" if len(parts) >= 3 else "stub"
    return default


def process_tree(roots: dict[str, int]) -> dict[int, str]:
    """{pid: role} of each root pid (named by its key) and every live descendant (named by `role`)."""
    found: dict[int, str] = {}
    todo = [(pid, name) for name, pid in roots.items() if pid]
    while todo:
        pid, name = todo.pop()
        if pid in found:
            continue
        found[pid] = name
        todo += [(child, role(argv, name)) for child, argv in child_processes(pid)]
    return found


class ProcessCpu:
    """CPU seconds spent by `roots` (role -> pid) and their descendants between `start()` and `stop()`
    (or `with` entry and exit): `seconds` {role: s}, `total_s`. The tree is read again at the stop, so
    stubs started during the window count (from zero)."""

    def __init__(self, roots: dict[str, int]):
        self.roots = dict(roots)
        self.seconds: dict[str, float] = {}
        self._before: dict[int, tuple[str, float]] = {}

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        snapshot = {}
        for pid, name in process_tree(self.roots).items():
            cpu_s = process_cpu_s(pid)
            if cpu_s is not None:
                snapshot[pid] = (name, cpu_s)
        return snapshot

    def start(self) -> "ProcessCpu":
        self._before = self._snapshot()
        return self

    def stop(self) -> dict[str, float]:
        after = self._snapshot()
        seconds: dict[str, float] = {}
        for pid, (name, cpu_s) in after.items():
            before = self._before.get(pid)
            spent = cpu_s - before[1] if before and before[0] == name else cpu_s
            seconds[name] = seconds.get(name, 0.0) + max(0.0, spent)
        self.seconds = dict(sorted(seconds.items()))
        return self.seconds

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def __enter__(self) -> "ProcessCpu":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def per_inference_ms(seconds: dict[str, float], inferences: int) -> dict:
    """CPU milliseconds per inference: {"total": ms, "by_process": {role: ms}}; total None without
    inferences. The stubs of one model are one role; all stubs together are also "stubs"."""
    if inferences <= 0:
        return {"total": None, "by_process": {}}
    by_process = {name: round(s * 1e3 / inferences, 3) for name, s in seconds.items()}
    stubs = sum(s for name, s in seconds.items() if name.startswith("stub"))
    if stubs:
        by_process["stubs"] = round(stubs * 1e3 / inferences, 3)
    return {"total": round(sum(seconds.values()) * 1e3 / inferences, 3), "by_process": by_process}


def cpu_phrase(served: dict | None, inprocess_ms: float | None) -> str:
    """"; CPU per inference: server 5.47 ms (tritonserver 0.67, stubs 3.17, grpc guard 1.58) / in-process
    2.00 ms = 2.74x" from a level's server_cpu_ms_per_inference (observe.process_cpu.per_inference_ms) and the
    bar's cpu_ms_per_image; "" when either is missing."""
    if not served or served.get("total") is None or not inprocess_ms or inprocess_ms != inprocess_ms:
        return ""
    parts = {name: ms for name, ms in served["by_process"].items() if name == "stubs" or not name.startswith("stub")}
    split = ", ".join(f"{name} {ms:.2f}" for name, ms in parts.items())
    return (f"; CPU per inference: server {served['total']:.2f} ms ({split}) / in-process {inprocess_ms:.2f} ms"
            f" = {served['total'] / inprocess_ms:.2f}x")
