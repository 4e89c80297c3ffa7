"""Where a served model's threads may run: the CPU affinity of every thread of its stub processes.

A model instance of the Python backend is one stub process. A runtime inside it that pins its threads
to cores (OpenVINO by default, ONNX Runtime with intra_op_num_threads 0) picks the same cores in every
instance, since the instances know nothing of each other: two single-threaded instances then share one
core while the other idles. `PlacementSampler` reads each stub thread's allowed CPUs
(`Cpus_allowed_list` of /proc/<pid>/task/<tid>/status, Linux) while a load runs, because runtimes pin
during an inference and not before; `shared_pinned_cores` names the cores pinned by two instances or more.
"""
from __future__ import annotations

from pathlib import Path

from resnet18_kit.observe.statistics import PeriodicSampler


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a kernel CPU list such as "0-3,8,10-11". ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def thread_affinities(pid: int) -> dict[int, frozenset[int]]:
    """{thread id: CPUs it may run on} for every thread of `pid`; {} once the process is gone."""
    affinities = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    for task in tasks:
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    affinities[int(task.name)] = parse_cpu_list(line.split(":", 1)[1])
        except (OSError, ValueError):  # the thread ended while we looked
            continue
    return affinities


class PlacementSampler(PeriodicSampler):
    """Every `interval_s` seconds, the cores each process of `processes` ({name: pid}, e.g. the stubs of
    EmbeddedTritonServer.stub_processes()) has a thread pinned to: cores of any thread whose affinity is
    narrower than `usable` (the CPUs the server may use, e.g. os.sched_getaffinity of tritonserver).
    `pinned` holds, per name, the union over all samples ({} for a process never seen pinned)."""

    def __init__(self, processes: dict[str, int], usable: frozenset[int] | set[int], interval_s: float = 0.1):
        super().__init__(interval_s, at_edges=True)
        self.processes, self.usable = dict(processes), frozenset(usable)
        self.pinned: dict[str, frozenset[int]] = {name: frozenset() for name in self.processes}
        self.threads_seen: dict[str, int] = {name: 0 for name in self.processes}

    def sample(self) -> None:
        for name, pid in self.processes.items():
            affinities = thread_affinities(pid)
            self.threads_seen[name] = max(self.threads_seen[name], len(affinities))
            narrowed = [cpus for cpus in affinities.values() if cpus < self.usable]
            self.pinned[name] = self.pinned[name].union(*narrowed)
        return None


def shared_pinned_cores(pinned: dict[str, frozenset[int]]) -> dict[int, list[str]]:
    """{core: the names pinned to it} for each core that two processes or more of `pinned` (as
    PlacementSampler.pinned) have threads pinned to; {} when no core is shared."""
    owners: dict[int, list[str]] = {}
    for name, cores in sorted(pinned.items()):
        for core in cores:
            owners.setdefault(core, []).append(name)
    return {core: names for core, names in sorted(owners.items()) if len(names) > 1}


def describe(pinned: dict[str, frozenset[int]]) -> str:
    """One phrase for a report: "unpinned", or which names were pinned to which cores."""
    if not any(pinned.values()):
        return "unpinned"
    return "pinned: " + "; ".join(f"{name} -> core {','.join(map(str, sorted(cores)))}"
                                  for name, cores in sorted(pinned.items()) if cores)
