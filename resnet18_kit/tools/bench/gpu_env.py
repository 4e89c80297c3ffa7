"""What `bench gpu` checks on the machine before it serves: the GPU (nvidia-smi, torch.cuda), the libraries
the bundle's binaries load (ldd), the Python-backend stub of this Python and its libpython, and a sampler of
the GPU's utilization while a load level runs.

Everything here runs with the standard library and tolerates what a machine lacks: a missing tool or
library is a value in the record (None, or a list of missing libraries), never an exception, so the run can
say in one line what is missing and go on.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from resnet18_kit.observe.machine import cpu_model
from resnet18_kit.observe.statistics import PeriodicSampler
from resnet18_kit.contract import STUB_EXECUTABLE
from resnet18_kit.server.tritonserver import library_path

#: Libraries worth naming in the record when ldd resolves them: where each was found.
NOTED_LIBRARIES = ("libpython", "libb64", "libcudart")


def this_python() -> str:
    """"X.Y" of the running interpreter."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def ldd(binary: Path) -> dict[str, str | None]:
    """The shared libraries `binary` needs, as ldd resolves them with the kit's LD_LIBRARY_PATH
    (server.tritonserver.library_path): soname -> path, None when not found. {"ldd": None} without ldd."""
    if not shutil.which("ldd"):
        return {"ldd": None}
    result = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=30,
                            env=dict(os.environ, LD_LIBRARY_PATH=library_path()))
    libraries: dict[str, str | None] = {}
    for line in result.stdout.splitlines():
        name, arrow, resolved = line.strip().partition("=>")
        if arrow:
            target = resolved.split("(")[0].strip()
            libraries[name.strip()] = None if target in ("not found", "") else target
    return libraries


def library_report(binary: Path) -> dict:
    """{"missing": [sonames ldd cannot find], <noted library>: path, ...} for `binary`."""
    libraries = ldd(binary)
    if libraries == {"ldd": None}:
        return {"missing": [], "ldd": "not installed: not checked"}
    report = {"missing": sorted(name for name, path in libraries.items() if path is None)}
    report.update({name: path for name, path in libraries.items() if name.startswith(NOTED_LIBRARIES)})
    return report


def libpython_folder(version: str) -> Path | None:
    """A folder of this interpreter's installation holding libpython<version>.so.1.0 (its LIBDIR, its
    prefix's lib/), for a Python built with a shared library the system loader does not know; None."""
    name = f"libpython{version}.so.1.0"
    candidates = [sysconfig.get_config_var("LIBDIR"), Path(sys.base_prefix) / "lib",
                  Path(sys.executable).resolve().parent.parent / "lib"]
    return next((Path(c) for c in candidates if c and (Path(c) / name).is_file()), None)


def check_stub(site: Path, stub_pythons: list[str], links: Path) -> tuple[dict, str | None]:
    """The Python-backend stub of this Python in the unpacked bundle (site: its site/ folder): its ldd
    report, and the one line that says why the Python backend cannot start here (None when it can). When
    libpython is missing and this interpreter's installation has it, a link to it alone is made in `links`,
    that folder put on LD_LIBRARY_PATH (os.environ, which the server inherits) and the stub checked again."""
    version = this_python()
    stub = site / "pytriton" / "tritonserver" / "python_backend_stubs" / version / STUB_EXECUTABLE
    if not stub.is_file():
        return {}, (f"the bundle has Python-backend stubs for Python {', '.join(stub_pythons)}, not for this "
                    f"Python {version} ({sys.executable}): run it with python{stub_pythons[0]}")
    report = library_report(stub)
    libpython = f"libpython{version}.so.1.0"
    folder = libpython_folder(version) if libpython in report["missing"] else None
    if folder is not None:
        links.mkdir(parents=True, exist_ok=True)
        (links / libpython).unlink(missing_ok=True)
        (links / libpython).symlink_to(folder / libpython)
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(links), os.environ.get("LD_LIBRARY_PATH")]))
        report = {**library_report(stub), "linked": str(folder / libpython)}
    if libpython in report["missing"]:
        return report, (f"{libpython} not found (ldd of the {version} stub): the Python backend cannot start; "
                        f"install the system's libpython{version} package (Debian, Ubuntu: libpython{version} or "
                        f"libpython{version}t64) or use a python{version} built with a shared libpython")
    if report["missing"]:
        return report, f"the {version} stub lacks {', '.join(report['missing'])} (ldd): the Python backend cannot start"
    return report, None


def overlay_python(folder: Path, packages: Path) -> Path:
    """A minimal virtual environment in `folder` over this interpreter's base Python, whose site-packages
    holds links to every entry of `packages` (so their versions are found first) and a .pth naming this
    interpreter's site-packages (everything else, found after). A Python started from it, and a Python-backend
    stub whose PATH starts with its bin/ (ServerConfig.stub_python), import from it. Returns its bin/python3.
    OSError when the folder cannot be written."""
    version = this_python()
    base = Path(getattr(sys, "_base_executable", "") or sys.executable).resolve()
    site_packages = folder / "lib" / f"python{version}" / "site-packages"
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    site_packages.mkdir(parents=True, exist_ok=True)
    (folder / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = false\n"
                                      f"version = {platform.python_version()}\n")
    for name in ("python3", f"python{version}"):
        (folder / "bin" / name).unlink(missing_ok=True)
        (folder / "bin" / name).symlink_to(base)
    for entry in packages.iterdir():
        (site_packages / entry.name).unlink(missing_ok=True)
        (site_packages / entry.name).symlink_to(entry)
    import site

    (site_packages / "zz_this_python.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return folder / "bin" / "python3"


def nvidia_smi() -> list[dict] | None:
    """One dict per GPU (name, driver, memory MiB, compute capability) from nvidia-smi; None without it."""
    if not shutil.which("nvidia-smi"):
        return None
    fields = ("name", "driver_version", "memory.total", "compute_cap")
    result = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                            capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()
        return [{"error": said[-1] if said else f"nvidia-smi exited {result.returncode}"}]
    return [dict(zip(fields, (cell.strip() for cell in line.split(",")))) for line in result.stdout.splitlines()
            if line.strip()]


def torch_facts() -> dict:
    """torch's version, its CUDA and cuDNN, whether a GPU is usable and which, and the TF32 settings the
    served model and the in-process bar both run with (torch's defaults); {"version": None, ...} without torch."""
    try:
        import torch
    except ImportError as exc:
        return {"version": None, "cuda_available": False, "error": f"torch does not import: {exc}"}

    facts = {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
             "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
             "tf32_convolutions": torch.backends.cudnn.allow_tf32,
             "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    if facts["cuda_available"]:
        facts["device"] = torch.cuda.get_device_name(0)
        facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        facts["device_count"] = torch.cuda.device_count()
    return facts


def onnxruntime_providers() -> list[str] | None:
    """onnxruntime.get_available_providers(), or None when onnxruntime is not installed."""
    try:
        import onnxruntime
    except ImportError:
        return None
    return list(onnxruntime.get_available_providers())


def machine() -> dict:
    """The host: CPU model, usable cores, memory GB, free /dev/shm MiB, glibc, OS, this Python."""
    memory_kb = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal")), 0)
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "memory_gb": round(memory_kb / 1e6, 1),
            "shm_free_mib": shm.f_bavail * shm.f_frsize // 2**20 if shm else 0,
            "glibc": "-".join(platform.libc_ver()), "platform": platform.platform(),
            "python": platform.python_version(), "executable": sys.executable}


class GpuSampler(PeriodicSampler):
    """GPU 0's utilization (0..1) and memory in use (MiB) from nvidia-smi every `interval_s` while a load
    level runs; `mean_busy` and `peak_memory_mib` hold the result (None without nvidia-smi)."""

    def __init__(self, interval_s: float = 0.5):
        super().__init__(interval_s)
        self.available = shutil.which("nvidia-smi") is not None

    def sample(self) -> tuple[float, float] | None:
        if not self.available:
            return None
        try:
            result = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=utilization.gpu,memory.used",
                                     "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
            busy, memory = (float(cell) for cell in result.stdout.split(","))
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None
        return busy / 100.0, memory

    @property
    def mean_busy(self) -> float | None:
        return round(sum(s[0] for s in self.samples) / len(self.samples), 3) if self.samples else None

    @property
    def peak_memory_mib(self) -> float | None:
        return max(s[1] for s in self.samples) if self.samples else None
