"""The one file a bare, offline GPU machine needs for `resnet18-kit bench gpu`, built here and size-checked.

    resnet18-kit bench gpu-pack [--out build/gpu] [--limit-mib 64] [--xz-preset 6] [--stub-python 3.12 ...]

Writes <out>/resnet18_kit_gpu.pyz, a zip application; on the GPU machine `python3 resnet18_kit_gpu.pyz --out
DIR` runs `resnet18-kit bench gpu --bundle resnet18_kit_gpu.pyz --out DIR` (docs/benchmarks.md). It holds:
  * the Python the run imports from the zip itself (deflated): this package's modules, tqdm (its log lines),
    `__main__.py` and `manifest.json` (what is inside, by group, with sizes);
  * `payload.tar.xz` (stored, xz --xz-preset), which `bench gpu` unpacks first:
      site/pytriton/tritonserver/  tritonserver 2.51 and the Python backend of nvidia-pytriton 0.7.0, with the
                                   stubs of --stub-python (default 3.12, the GPU machine's, and this Python,
                                   so that `bench gpu --dry-run` serves from the bundle here)
      site/nvidia_pytriton.libs/   the wheel's bundled libraries those binaries load (ldd), libpython excepted
      bin/, lib/                   perf_analyzer 2.51 (tritonclient's wheel), libb64.so.0d, libcudart.so.12
      model_repository/            the models the gpu_python variant serves, without exported files
      photos/                      the sample photos (scikit-image's data, resnet18_kit/client/samples.py)
      stub-site/3.12/              numpy 1.26 for the 3.12 stub (STUB_NUMPY_WHY), from PyPI's wheel
No tritonclient: the run reads the server over HTTP with the standard library and loads it with perf_analyzer.

Prints the file, its size in MiB and its groups (files, unpacked MiB). Exit 0 when written; 2 when a piece
is missing here or the file would exceed --limit-mib (one line each; nothing is left behind).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from resnet18_kit.contract import (ENSEMBLE_MODEL, PREPROCESS_MODEL, STUB_EXECUTABLE, TORCHSCRIPT_MODEL,
                                   TRITON_VERSION)
from resnet18_kit.repository import ModelRepository
from resnet18_kit.settings import Settings, default_folder, shown

MiB = 1 << 20
BUNDLE_NAME = "resnet18_kit_gpu.pyz"
PAYLOAD = "payload.tar.xz"
MANIFEST = "manifest.json"
#: The config variant the GPU run serves: the network by TorchScript on the GPU in the Python backend.
GPU_VARIANT = "gpu_python"
#: The models that variant serves (resnet18_onnx keeps a CPU config and is left out of the bundle).
GPU_MODELS = (PREPROCESS_MODEL, TORCHSCRIPT_MODEL, ENSEMBLE_MODEL)
#: The Python of the GPU machine (python3 with torch): the stub it needs.
GPU_PYTHON = "3.12"
#: Pure-Python packages the run imports that such a machine lacks (cli's log set-up: resnet18_kit.progress).
PURE_PACKAGES = ("tqdm",)
#: Where perf_analyzer finds libcudart.so.12: a link to the server's bundled libcudart 12.6.
CUDART_LINK = "lib/libcudart.so.12"
GROUPS = ("tritonserver", "bundled libraries", "perf_analyzer", "python (in the zip)", "model repository",
          "photos", "stub numpy")
#: Where the numpy the stubs import goes in the payload: stub-site/<X.Y>/, which `bench gpu` on Python X.Y
#: puts first in the environment its stubs use (gpu_steps.stub_python, gpu_env.overlay_python).
STUB_SITE = "stub-site"
#: Why the stubs get a numpy of their own. Triton 2.51's Python-backend stub is built with pybind11 2.10,
#: which predates numpy 2's array descriptor (numpy 2 moved `elsize`): under numpy 2 every array the stub
#: makes from a tensor has item size 0, so each element reads the tensor's first byte (a BYTES input's
#: length reads 0x45454545 from a JPEG whose length starts 0x45; FP32 tensors are silently wrong). Fixed in
#: Triton 2.52 (python_backend, pybind11 2.12). The GPU machine's python3 has numpy 2; the kit pins
#: numpy<2 (pyproject.toml), and the bundle carries that same version for the GPU machine's Python.
STUB_NUMPY_WHY = ("Triton 2.51's stub (pybind11 2.10) misreads numpy 2 arrays: each element reads the tensor's "
                  "first byte (fixed in 2.52)")


def numpy_fits_stub(version: str) -> bool:
    """Whether numpy `version` ("1.26.4") is one Triton 2.51's stub reads right: below 2 (STUB_NUMPY_WHY)."""
    return int(version.split(".")[0]) < 2
#: The zip's entry point: `bench gpu` with --bundle set to the zip itself (its source imported from the zip).
MAIN = '''"""resnet18-kit's GPU run, packed by `resnet18-kit bench gpu-pack`: python3 <this file> --out DIR [--dry-run]
runs `resnet18-kit bench gpu --bundle <this file>` from the source in this zip (docs/benchmarks.md)."""
import sys

from resnet18_kit.cli import main

arguments = sys.argv[1:]
if "--bundle" not in arguments:
    arguments = ["--bundle", sys.argv[0], *arguments]
sys.exit(main(["bench", "gpu", *arguments]))
'''


class PackError(RuntimeError):
    """A piece of the bundle is missing here, or the bundle exceeds its size limit: one line."""


@dataclass(frozen=True)
class Entry:
    """One file of the bundle: where it goes (`name`, in the payload or the zip), its group, and its source
    file (read at packing time), its text, or, for a link, the relative target."""

    name: str
    group: str
    source: Path | None = None
    link: str | None = None
    text: str | None = None

    @property
    def size_bytes(self) -> int:
        if self.text is not None:
            return len(self.text.encode())
        return 0 if self.source is None else self.source.stat().st_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """gpu-pack's options."""
    parser.add_argument("--out", type=Path, metavar="DIR", help="where the bundle goes (default: build/gpu of "
                        "the checkout, else ./build/gpu; build/ is git-ignored)")
    parser.add_argument("--limit-mib", type=float, default=64.0, metavar="MIB",
                        help="refuse a bundle larger than this, MiB (default 64: what a GPU machine may be sent)")
    parser.add_argument("--xz-preset", type=int, default=6, choices=range(10), metavar="0-9",
                        help="xz preset of the payload (xz -T0: every core): 6 (default) about 41 MiB in ~70 s on 2 "
                             "cores, 0 about 53 MiB in ~10 s")
    parser.add_argument("--stub-python", action="append", metavar="X.Y",
                        help=f"Python versions whose Python-backend stub goes in (repeatable; default {GPU_PYTHON} "
                             f"and this Python, {sys.version_info.major}.{sys.version_info.minor})")


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Write the bundle (module doc); 0, or 2 with one line naming what is missing or too big."""
    out = args.out or default_folder("build") / "gpu"
    this_python = f"{sys.version_info.major}.{sys.version_info.minor}"
    pythons = tuple(dict.fromkeys(args.stub_python or (GPU_PYTHON, this_python)))
    if args.limit_mib <= 0:
        print(f"bench gpu-pack: --limit-mib {args.limit_mib:g}: give a size above 0 MiB", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        entries = collect(settings.repository, pythons)
        path = write_bundle(entries, Path(out), int(args.limit_mib * MiB), args.xz_preset, pythons)
    except PackError as exc:
        print(f"bench gpu-pack: {exc}", file=sys.stderr)
        return 2
    print(f"{shown(path)}: {path.stat().st_size / MiB:.1f} MiB (limit {args.limit_mib:g} MiB), xz preset "
          f"{args.xz_preset}, stubs for Python {', '.join(pythons)}, packed in {time.monotonic() - started:.0f} s")
    print(describe(entries))
    print(f"on the GPU machine: python3 {path.name} --out gpu-results   (docs/benchmarks.md)")
    return 0


def describe(entries: list[Entry]) -> str:
    """The table of groups: files and unpacked MiB each."""
    lines = [f"  {'group':<22} {'files':>5} {'unpacked MiB':>13}"]
    for group in GROUPS:
        members = [e for e in entries if e.group == group]
        lines.append(f"  {group:<22} {len(members):>5} {sum(e.size_bytes for e in members) / MiB:>13.1f}")
    return "\n".join(lines)


def site_packages() -> Path:
    """The site-packages that holds nvidia-pytriton here. PackError when it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise PackError("nvidia-pytriton is not installed here (make setup): its tritonserver is the bundle's")
    return Path(list(spec.submodule_search_locations)[0]).parent


def collect(repository: ModelRepository, pythons: tuple[str, ...]) -> list[Entry]:
    """Every file of the bundle, by group (module doc). PackError naming the first piece missing here."""
    site = site_packages()
    server = site / "pytriton" / "tritonserver"
    binaries = [server / "bin" / "tritonserver", server / "backends" / "python" / "libtriton_python.so"]
    entries = [Entry("site/" + str(p.relative_to(site)), "tritonserver", p) for p in binaries]
    entries.append(Entry("site/pytriton/tritonserver/backends/python/triton_python_backend_utils.py", "tritonserver",
                         server / "backends" / "python" / "triton_python_backend_utils.py"))
    # A package of its own, so that sys.path finds this tritonserver before an installed nvidia-pytriton.
    entries.append(Entry("site/pytriton/__init__.py", "tritonserver",
                         text='"""The tritonserver folder of nvidia-pytriton 0.7.0, without its Python API."""\n'))
    for version in pythons:
        stub = server / "python_backend_stubs" / version / STUB_EXECUTABLE
        if not stub.is_file():
            raise PackError(f"--stub-python {version}: nvidia-pytriton ships no stub {stub}")
        binaries.append(stub)
        entries.append(Entry("site/" + str(stub.relative_to(site)), "tritonserver", stub))
    entries += [Entry("site/" + str(lib.relative_to(site)), "bundled libraries", lib)
                for lib in bundled_libraries(binaries, site / "nvidia_pytriton.libs")]
    entries += perf_analyzer_entries(site)
    entries += python_entries()
    entries += repository_entries(repository)
    entries += photo_entries()
    entries += stub_numpy_entries(GPU_PYTHON, default_folder("build") / "gpu" / "wheels")
    return entries


def bundled_libraries(binaries: list[Path], libs: Path) -> list[Path]:
    """The files of nvidia_pytriton.libs that `binaries` load, directly or not (ldd, through their RPATH)."""
    needed = set()
    for binary in binaries:
        try:
            result = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=60,
                                    env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"})
        except FileNotFoundError:
            raise PackError("ldd is not installed (Debian package libc-bin)") from None
        for line in result.stdout.splitlines():
            _, arrow, resolved = line.partition("=>")
            path = Path(resolved.split("(")[0].strip()) if arrow else None
            if path is not None and path.is_file() and path.resolve().parent == libs.resolve():
                needed.add(libs / path.name)
    if not needed:
        raise PackError(f"ldd found none of {libs} in {binaries[0].name}: is ldd installed?")
    return sorted(needed)


def perf_analyzer_entries(site: Path) -> list[Entry]:
    """perf_analyzer, libb64.so.0d and the libcudart.so.12 link. PackError when one is missing here."""
    from resnet18_kit.tools.load.perf_analyzer import perf_analyzer_binary

    try:
        binary = perf_analyzer_binary()
    except FileNotFoundError as exc:
        raise PackError(str(exc)) from None
    libb64 = Path("/usr/lib/x86_64-linux-gnu/libb64.so.0d")
    if not libb64.is_file():
        raise PackError(f"no {libb64}: perf_analyzer needs it (Debian package libb64-0d, scripts/setup.sh)")
    cudart = sorted((site / "nvidia_pytriton.libs").glob("libcudart-*.so.12*"))
    if not cudart:
        raise PackError(f"no libcudart-*.so.12* in {site / 'nvidia_pytriton.libs'}")
    return [Entry("bin/perf_analyzer", "perf_analyzer", binary), Entry("lib/libb64.so.0d", "perf_analyzer", libb64),
            Entry(CUDART_LINK, "perf_analyzer", link=f"../site/nvidia_pytriton.libs/{cudart[0].name}")]


def python_entries() -> list[Entry]:
    """This package's modules and PURE_PACKAGES' (the zip's, imported from it), .py files only."""
    import importlib.util

    import resnet18_kit

    roots = [Path(resnet18_kit.__file__).parent]
    for name in PURE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise PackError(f"{name} is not installed here: the run's log set-up imports it")
        roots.append(Path(spec.origin).parent)
    return [Entry(str(path.relative_to(root.parent)), "python (in the zip)", path) for root in roots
            for path in sorted(root.rglob("*.py")) if not {"__pycache__", "model_repository"} & set(path.parts)]


def repository_entries(repository: ModelRepository) -> list[Entry]:
    """GPU_MODELS' files (links followed), without what the export writes or Python's caches."""
    generated = {path.resolve() for path in repository.generated}
    entries = []
    for model in GPU_MODELS:
        for path in sorted((repository.root / model).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.resolve() not in generated \
                    and path.name != "provenance.json":
                entries.append(Entry("model_repository/" + str(path.relative_to(repository.root)),
                                     "model repository", path.resolve()))
    if not any(e.name.endswith(f"configs/{GPU_VARIANT}.pbtxt") for e in entries):
        raise PackError(f"{repository.root}: no configs/{GPU_VARIANT}.pbtxt (the variant the GPU run serves)")
    return entries


def photo_entries() -> list[Entry]:
    """The sample photos (client.samples.sample_photos). PackError without scikit-image."""
    from resnet18_kit.client.samples import sample_photos

    try:
        photos = sample_photos()
    except FileNotFoundError as exc:
        raise PackError(str(exc)) from None
    return [Entry(f"photos/{photo.name}", "photos", photo) for photo in photos]


def stub_numpy_entries(version: str, wheels: Path) -> list[Entry]:
    """The files of numpy's wheel for CPython `version` (manylinux x86-64), at the version installed here
    (the kit's pin, numpy<2: STUB_NUMPY_WHY), under STUB_SITE/<version>/, its tests left out. The wheel is
    downloaded once into `wheels` (pip download, PyPI) and unpacked there. PackError when pip cannot get it."""
    from importlib import metadata

    pin = metadata.version("numpy")
    if not numpy_fits_stub(pin):
        raise PackError(f"numpy {pin} is installed here: the stubs need numpy<2 ({STUB_NUMPY_WHY}); make setup")
    tag = "cp" + version.replace(".", "")
    pattern = f"numpy-{pin}-{tag}-{tag}-*manylinux*x86_64*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "--python-version", version, "--implementation", "cp", "--platform", "manylinux2014_x86_64",
             "--platform", "manylinux_2_17_x86_64", "--dest", str(wheels), f"numpy=={pin}"],
            capture_output=True, text=True, timeout=600)
        found = sorted(wheels.glob(pattern))
        if not found:
            why = (result.stderr.strip().splitlines() or ["no wheel written"])[-1]
            raise PackError(f"numpy=={pin} for Python {version} (the stub's, {STUB_NUMPY_WHY}): pip download: {why}")
    unpacked = wheels / found[-1].name.removesuffix(".whl")
    if not (unpacked / "numpy" / "__init__.py").is_file():
        with zipfile.ZipFile(found[-1]) as wheel:
            wheel.extractall(unpacked)
    return [Entry(f"{STUB_SITE}/{version}/{path.relative_to(unpacked)}", "stub numpy", path)
            for path in sorted(unpacked.rglob("*"))
            if path.is_file() and not {"tests", "__pycache__"} & set(path.relative_to(unpacked).parts)]


def check_size(path: Path, limit_bytes: int, what: str) -> None:
    """PackError when the file at `path` holds more than `limit_bytes` already."""
    if path.stat().st_size > limit_bytes:
        raise PackError(f"{what} is over the limit of {limit_bytes / MiB:g} MiB already "
                        f"(--limit-mib; --xz-preset 9 packs tightest)")


def xz_process(preset: int, out) -> subprocess.Popen:
    """`xz -<preset> -T0` writing to the open binary file `out`: every core compresses blocks of its own
    (Python's lzma module uses one: preset 0 took 12.3 s against 8.9 s for this payload on 2 cores). The
    result is an ordinary multi-block .xz stream that Python's lzma reads. PackError when xz is missing."""
    try:
        return subprocess.Popen(["xz", f"-{preset}", "-T0", "-c"], stdin=subprocess.PIPE, stdout=out)
    except FileNotFoundError:
        raise PackError("xz is not installed (Debian package xz-utils)") from None


def write_bundle(entries: list[Entry], out: Path, limit_bytes: int, preset: int, pythons: tuple[str, ...]) -> Path:
    """Write <out>/BUNDLE_NAME from `entries` (module doc) and return its path; PackError when it would exceed
    `limit_bytes` (the partial files are removed)."""
    out.mkdir(parents=True, exist_ok=True)
    final, payload = out / BUNDLE_NAME, out / f".{PAYLOAD}.partial"
    partial = out / f".{BUNDLE_NAME}.partial"
    try:
        with open(payload, "wb") as raw:
            xz = xz_process(preset, raw)
            try:
                with tarfile.open(fileobj=xz.stdin, mode="w|") as tar:
                    for entry in entries:
                        if entry.group != "python (in the zip)":
                            add_to_tar(tar, entry)
                            check_size(payload, limit_bytes, "the payload")
                xz.stdin.close()
                if xz.wait() != 0:
                    raise PackError(f"xz -{preset} exited with {xz.returncode} writing {payload.name}")
            finally:
                if xz.poll() is None:
                    xz.kill()
                    xz.wait()
        check_size(payload, limit_bytes, "the payload")
        manifest = {"triton_version": TRITON_VERSION, "gpu_variant": GPU_VARIANT, "gpu_python": GPU_PYTHON,
                    "stub_site": STUB_SITE,
                    "stub_pythons": list(pythons), "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "payload_bytes": payload.stat().st_size,
                    "groups": {group: {"files": sum(e.group == group for e in entries),
                                       "bytes": sum(e.size_bytes for e in entries if e.group == group)}
                               for group in GROUPS},
                    "photos": [e.name for e in entries if e.group == "photos"],
                    "files": {e.name: e.size_bytes for e in entries if e.group != "python (in the zip)"}}
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as bundle:
            bundle.writestr("__main__.py", MAIN)
            bundle.writestr(MANIFEST, json.dumps(manifest, indent=1))
            for entry in entries:
                if entry.group == "python (in the zip)":
                    bundle.write(entry.source, entry.name)
            bundle.write(payload, PAYLOAD, compress_type=zipfile.ZIP_STORED)
        if partial.stat().st_size > limit_bytes:
            raise PackError(f"the bundle is {partial.stat().st_size / MiB:.1f} MiB, over the limit of "
                            f"{limit_bytes / MiB:g} MiB (--limit-mib)")
        partial.replace(final)
    finally:
        payload.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return final


def add_to_tar(tar: tarfile.TarFile, entry: Entry) -> None:
    """`entry` as a member owned by root: a regular file with its source's mode, or a relative link."""
    info = tarfile.TarInfo(entry.name)
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    if entry.link is not None:
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, entry.link, 0o777
        tar.addfile(info)
        return
    if entry.text is not None:
        data = entry.text.encode()
        info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
        tar.addfile(info, io.BytesIO(data))
        return
    stat = entry.source.stat()
    info.size, info.mode, info.mtime = stat.st_size, stat.st_mode & 0o755, int(stat.st_mtime)
    with open(entry.source, "rb") as source:
        tar.addfile(info, source)
