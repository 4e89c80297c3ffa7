"""The images of the CPU deployment, built from PyPI's wheels on a Debian 12 base, offline where needed.

    triton-resnet18:cpu        deploy/docker/Dockerfile: `resnet18-kit serve` (Triton 2.51 from the
                               nvidia-pytriton wheel) with the models' runtimes, installed from build/wheelhouse
    triton-resnet18:haproxy-2.6   deploy/docker/haproxy.Dockerfile: Debian's HAProxy 2.6 (the fleet profile)
    triton-resnet18:prometheus-2  deploy/docker/prometheus.Dockerfile: Debian's Prometheus 2.42 (monitoring)

Steps (ImageBuild.run), each skipped when its output is up to date; steps that need nothing of each other
run at the same time (the base beside the wheels, the HAProxy and Prometheus builds beside the Triton one):
  1. the base: BASE_IMAGE (default debian:bookworm-slim) when the engine has it or can pull it; otherwise,
     as where no registry answers (air-gapped sites), `mmdebstrap --variant=minbase bookworm` from the
     Debian mirror apt uses, imported as triton-resnet18:base-bookworm (once, 230 MB; mmdebstrap downloads
     with apt, about half of debootstrap's time);
  2. the wheels, with the host's pip (its index, proxy and certificates: pip inside a container has none of
     them): build/wheelhouse/ every wheel of the `server` extra pinned by constraints.txt, torch swapped for
     its CPU build (IMAGE_TORCH); build/kit-wheel/ the kit's own wheel;
  3. `docker compose build` of each image's service (docker-compose.yaml's build sections, BuildKit: the
     Triton image bind-mounts the wheels); the engine's build cache makes a rebuild with nothing changed
     take seconds. The Triton build has no network; HAProxy and Prometheus come from Debian's packages, so
     their builds use the host's network to reach the Debian mirror.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from resnet18_kit.containers.compose import ComposePorts, ComposeProject
from resnet18_kit.containers.engine import Engine, EngineError, last_line

#: The base a user with a registry gets (Docker Hub's Debian 12).
DEFAULT_BASE_IMAGE = "debian:bookworm-slim"
#: The base made locally with mmdebstrap when DEFAULT_BASE_IMAGE cannot be had.
LOCAL_BASE_IMAGE = "triton-resnet18:base-bookworm"
#: What the local base holds beyond minbase: the Python the venv and the stubs use, tini.
LOCAL_BASE_PACKAGES = ("python3", "python3-venv", "libpython3.11", "tini", "ca-certificates")
#: torch for the image: PyPI's Linux wheels of torch are CUDA builds (several GB with their libraries);
#: the CPU build of 2.13.0 (190 MB) loads the model.pt that constraints.txt's torch writes. Its index:
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
IMAGE_TORCH = "torch==2.13.0+cpu"
#: The image each service of docker-compose.yaml builds (its `image:`; the Dockerfiles are in deploy/docker/).
IMAGES = {
    "triton": "triton-resnet18:cpu",
    "haproxy": "triton-resnet18:haproxy-2.6",
    "prometheus": "triton-resnet18:prometheus-2",
}
#: The compose project name of the builds (a build starts no container).
BUILD_PROJECT = "resnet18-kit-build"
#: TRITON_ADMIN_KEY for the builds: docker-compose.yaml requires one to be set, no build reads it.
BUILD_ADMIN_KEY = "unused-by-the-build"


@dataclass
class BuildReport:
    """What ImageBuild.run did: the base used, seconds per step (steps run side by side overlap; `total`
    is the wall time of the whole run), each image's size in bytes."""
    base: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    sizes_bytes: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """Human-readable lines: one per step, then one per image."""
        out = [f"base image: {self.base}"]
        out += [f"{step}: {seconds:.1f} s" for step, seconds in self.seconds.items()]
        out += [f"{tag}: {size / 1e9:.2f} GB" for tag, size in self.sizes_bytes.items()]
        return out


class ImageBuild:
    """Builds the images of `names` (keys of IMAGES) from the checkout `root` on `engine`. `base_image`:
    the Debian 12 image to start from (DEFAULT_BASE_IMAGE; the local mmdebstrap base when it cannot be
    had). Raises EngineError with one line naming the failed step."""

    def __init__(self, engine: Engine, root: Path, base_image: str = DEFAULT_BASE_IMAGE,
                 names: tuple[str, ...] = ("triton",), log=print):
        self.engine, self.root, self.base_image, self.names, self.log = engine, root, base_image, names, log
        self.build_dir = root / "build"
        self.report = BuildReport()

    def run(self) -> BuildReport:
        """Every step (module doc); the report of what it took. The wheels are made while the base is, and
        the images that need no wheels are built while the Triton image is."""
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(self.names) + 1) as pool:
            wheels = pool.submit(self._timed, "wheels", self.wheels) if "triton" in self.names else None
            self.report.base = self._timed("base", self.base)
            builds = [pool.submit(self._timed, f"build {IMAGES[name]}", self.build, name)
                      for name in self.names if name != "triton"]
            if wheels is not None:
                wheels.result()
                self._timed(f"build {IMAGES['triton']}", self.build, "triton")
            for build in builds:
                build.result()
        self.report.seconds["total"] = time.monotonic() - start
        for name in self.names:
            tag = IMAGES[name]
            size = self.engine.docker("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip()
            self.report.sizes_bytes[tag] = int(size)
        return self.report

    def _timed(self, step: str, action, *args):
        start = time.monotonic()
        result = action(*args)
        self.report.seconds[step] = time.monotonic() - start
        return result

    def has_image(self, name: str) -> bool:
        """True when the engine holds the image `name` (name:tag)."""
        return self.engine.docker("image", "inspect", name, check=False).returncode == 0

    def base(self) -> str:
        """The base image's name: base_image when present or pullable, else the local mmdebstrap base."""
        if self.has_image(self.base_image):
            return self.base_image
        if self.base_image == DEFAULT_BASE_IMAGE and self.has_image(LOCAL_BASE_IMAGE):
            return LOCAL_BASE_IMAGE
        pulled = self.engine.docker("pull", "-q", self.base_image, timeout_s=600, check=False)
        if pulled.returncode == 0:
            return self.base_image
        if self.base_image != DEFAULT_BASE_IMAGE:
            raise EngineError(f"base image {self.base_image}: {last_line(pulled.stderr)}")
        self.log(f"docker image: {self.base_image} cannot be pulled ({last_line(pulled.stderr)}); "
                 f"making {LOCAL_BASE_IMAGE} with mmdebstrap")
        self.local_base()
        return LOCAL_BASE_IMAGE

    def local_base(self) -> None:
        """mmdebstrap a Debian 12 minbase with LOCAL_BASE_PACKAGES (apt's cache left out) straight into
        `docker import` as LOCAL_BASE_IMAGE. EngineError naming the step that failed."""
        if shutil.which("mmdebstrap") is None:
            raise EngineError("no base image: mmdebstrap is not installed (`scripts/setup.sh image` installs it as root)")
        with tempfile.TemporaryFile() as messages:  # a file, not a pipe: mmdebstrap never blocks on it
            rootfs = subprocess.Popen(
                ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(LOCAL_BASE_PACKAGES)}",
                 "bookworm", "-", debian_mirror()], stdout=subprocess.PIPE, stderr=messages)
            imported = subprocess.run(["docker", "import", "-", LOCAL_BASE_IMAGE], stdin=rootfs.stdout,
                                      env=self.engine.environment(), capture_output=True, text=True, check=False)
            rootfs.stdout.close()
            status = rootfs.wait()
            messages.seek(0)
            made_stderr = messages.read().decode(errors="replace")
        if status != 0:
            self.engine.docker("image", "rm", "-f", LOCAL_BASE_IMAGE, check=False)  # a cut-off tar imports too
            raise EngineError(f"mmdebstrap: {last_line(made_stderr)}")
        if imported.returncode != 0:
            raise EngineError(f"docker import: {last_line(imported.stderr)}")

    def wheels(self) -> None:
        """build/wheelhouse (refilled when constraints.txt or pyproject.toml changed) and build/kit-wheel."""
        wheelhouse, stamp = self.build_dir / "wheelhouse", self.build_dir / "wheelhouse.sha256"
        constraints = self.root / "constraints.txt"
        pins = [IMAGE_TORCH if line.startswith("torch==") else line
                for line in constraints.read_text().splitlines()]
        want = hashlib.sha256(("\n".join(pins) + (self.root / "pyproject.toml").read_text()).encode()).hexdigest()
        if not (wheelhouse.is_dir() and stamp.is_file() and stamp.read_text() == want):
            shutil.rmtree(wheelhouse, ignore_errors=True)
            image_constraints = self.build_dir / "constraints-image.txt"
            image_constraints.write_text("\n".join(pins) + "\n")
            extra = ["--extra-index-url", TORCH_CPU_INDEX] if reachable(TORCH_CPU_INDEX) else []
            self._pip("wheel", "-q", f"{self.root}[server]", "-c", str(image_constraints), "-w", str(wheelhouse),
                      *extra)
            for kit in wheelhouse.glob("triton_resnet18_kit-*.whl"):
                kit.unlink()
            stamp.write_text(want)
        kit_dir = self.build_dir / "kit-wheel"
        shutil.rmtree(kit_dir, ignore_errors=True)
        self._pip("wheel", "-q", "--no-deps", str(self.root), "-w", str(kit_dir))

    def _pip(self, *args: str) -> None:
        result = subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check"],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
            raise EngineError(f"pip {args[0]}: {errors[-1] if errors else last_line(result.stderr)}")

    def build(self, service: str) -> None:
        """`docker compose build` of `service` (a key of IMAGES) from BASE_IMAGE = the base of this run, with
        BuildKit whatever DOCKER_BUILDKIT says (the Triton image's bind mounts need it). ComposeError (an
        EngineError) with compose's last line when it fails."""
        project = ComposeProject(self.engine, BUILD_PROJECT, ComposePorts(), BUILD_ADMIN_KEY,
                                 profiles=("fleet", "monitoring"),
                                 settings={"BASE_IMAGE": self.report.base, "DOCKER_BUILDKIT": "1"})
        project.run("build", "--quiet", service, timeout_s=1800)


def debian_mirror() -> str:
    """The Debian mirror apt uses on this host (its first `deb` source), else deb.debian.org."""
    for source in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            for line in source.read_text().splitlines():
                words = line.split()
                if words[:1] == ["deb"] and len(words) > 1:
                    return next(w for w in words[1:] if "://" in w)
                if words[:1] == ["URIs:"] and len(words) > 1 and "security" not in words[1]:
                    return words[1]
        except (OSError, StopIteration):
            continue
    return "http://deb.debian.org/debian"


def reachable(url: str, timeout_s: float = 3.0) -> bool:
    """True when `url` answers an HTTP request within timeout_s (any status)."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False
    return True
