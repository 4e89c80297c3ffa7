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


def gpu_names() -> str | None:
    """`nvidia-smi -L` output, or None when there is no NVIDIA GPU or driver."""
    if not shutil.which("nvidia-smi"):
        return None
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return result.stdout.strip() or None if result.returncode == 0 else None


def machine_info(triton_version: str) -> dict:
    """CPU model, usable cores (the process's affinity), GPU, memory and the versions that matter."""
    memory_kb = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal")), 0) if Path("/proc/meminfo").exists() else 0
    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "gpu": gpu_names(),
            "memory_gb": round(memory_kb / 1e6, 1), "platform": platform.platform(),
            "python": platform.python_version(), "triton_version": triton_version,
            **{name: version(name) for name in ("onnxruntime", "torch", "tritonclient", "nvidia-pytriton")}}
