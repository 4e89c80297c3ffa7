"""The machine and versions a benchmark ran on (results/<run>/machine.json and the report's header)."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib.metadata import version
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


#: /proc/cpuinfo flags that decide how fast the INT8 and FP32 networks run, strongest first: AMX (Intel
#: Sapphire Rapids and later), AVX-512 VNNI, AVX-VNNI (256-bit), AVX-512, AVX2.
ISA_FLAGS = (("amx_int8", "AMX"), ("avx512_vnni", "AVX-512 VNNI"), ("avx_vnni", "AVX-VNNI"), ("avx512f", "AVX-512"),
             ("avx2", "AVX2"))


def cpu_isa() -> list[str]:
    """The ISA_FLAGS names this CPU has, strongest first (empty where /proc/cpuinfo has no flags)."""
    try:
        flags = next((set(line.split(":", 1)[1].split()) for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), set())
    except OSError:
        flags = set()
    return [name for flag, name in ISA_FLAGS if flag in flags]


def processor_line(machine: dict) -> str:
    """"AMD EPYC, 2 cores, AVX-512 VNNI, no AMX" from machine_info's record: the figures' processor; without
    an "isa" entry (records written before it existed) only "AMD EPYC, 2 cores"."""
    where = f"{machine.get('cpu', 'an unnamed CPU')}, {machine.get('cores', '?')} cores"
    if "isa" not in machine:
        return where
    isa = machine["isa"] or []
    vector = next((name for name in isa if name != "AMX"), "no AVX2")
    return f"{where}, {vector}, {'AMX' if 'AMX' in isa else 'no AMX'}"


def gpu_names() -> str | None:
    """`nvidia-smi -L` output, or None when there is no NVIDIA GPU or driver."""
    if not shutil.which("nvidia-smi"):
        return None
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return result.stdout.strip() or None if result.returncode == 0 else None


def machine_info(triton_version: str) -> dict:
    """CPU model, usable cores (the process's affinity), its ISA (cpu_isa), GPU, memory and the versions
    that matter."""
    memory_kb = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal")), 0) if Path("/proc/meminfo").exists() else 0
    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "isa": cpu_isa(), "gpu": gpu_names(),
            "memory_gb": round(memory_kb / 1e6, 1), "platform": platform.platform(),
            "python": platform.python_version(), "triton_version": triton_version,
            **{name: version(name) for name in ("onnxruntime", "torch", "tritonclient", "nvidia-pytriton")}}


def cpu_ticks() -> dict[str, int]:
    """Cumulative CPU time of all cores from /proc/stat, in clock ticks: busy, steal, total.
    steal = time the hypervisor gave this VM's vCPUs to others (noise on shared machines)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return {"busy": user + nice + system + irq + softirq, "steal": steal,
            "total": user + nice + system + idle + iowait + irq + softirq + steal}


def cpu_share(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Fractions of all CPU time between two `cpu_ticks` readings: busy (any process) and steal."""
    total = max(1, after["total"] - before["total"])
    return {"busy": (after["busy"] - before["busy"]) / total, "steal": (after["steal"] - before["steal"]) / total}
