"""resnet18-kit docker: the images of docker-compose.yaml, and a Docker engine where the machine has none.

    resnet18-kit docker image [--with fleet,monitoring] [--base-image NAME]
        builds triton-resnet18:cpu (and the HAProxy and Prometheus images of those profiles) on the engine
        DOCKER_HOST names (else Docker's default socket, else the private engine when it runs); prints the
        time of each step and each image's size. Steps and caching: resnet18_kit/containers/image.py.
    resnet18-kit docker engine start|stop|status
        a private dockerd (resnet18_kit/containers/engine.py): its image cache in build/docker/ of the
        checkout; `start` prints the DOCKER_HOST line to export for docker and docker compose.

Exit status: 0 done; 1 a build step failed (one line names it); 2 no engine (one line says what to do).
"""
from __future__ import annotations

import argparse
import sys

from resnet18_kit.containers.engine import EngineError, PrivateEngine, users_engine
from resnet18_kit.containers.image import DEFAULT_BASE_IMAGE, IMAGES, ImageBuild
from resnet18_kit.contract import REPO_ROOT
from resnet18_kit.settings import Settings

#: The private engine's image cache: a build output of the checkout (git-ignored build/).
ENGINE_DATA = REPO_ROOT / "build" / "docker" / "data"
#: Profile of docker-compose.yaml -> the images it adds to triton-resnet18:cpu.
PROFILE_IMAGES = {"fleet": "haproxy", "monitoring": "prometheus"}


def private_engine() -> PrivateEngine:
    """The checkout's private engine (not started)."""
    return PrivateEngine(ENGINE_DATA)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`image` and `engine start|stop|status` (module doc)."""
    sub = parser.add_subparsers(dest="docker_command", required=True, metavar="{image,engine}")
    image = sub.add_parser("image", help="build the CPU images of docker-compose.yaml from PyPI's wheels")
    image.add_argument("--with", dest="profiles", default="",
                       help="also the images of these compose profiles, comma-separated: fleet (HAProxy), "
                            "monitoring (Prometheus)")
    image.add_argument("--base-image", default=DEFAULT_BASE_IMAGE,
                       help=f"the Debian 12 image to build on (default {DEFAULT_BASE_IMAGE}; made with "
                            "mmdebstrap when it cannot be pulled)")
    engine = sub.add_parser("engine", help="a private dockerd for machines without a Docker engine")
    engine.add_argument("action", choices=("start", "stop", "status"))


def run(settings: Settings, args: argparse.Namespace) -> int:
    """The subcommand's exit status (module doc)."""
    del settings  # the images are built from this checkout, whatever the model repository
    if args.docker_command == "engine":
        return engine_command(args.action)
    profiles = [p for p in args.profiles.split(",") if p]
    unknown = [p for p in profiles if p not in PROFILE_IMAGES]
    if unknown:
        print(f"docker image: --with {','.join(unknown)}: not a profile with images of its own "
              f"(known: {', '.join(PROFILE_IMAGES)})", file=sys.stderr)
        return 2
    private = private_engine()
    engine = users_engine() or (private.engine if private.pid() else None)
    if engine is None:
        print("docker image: no Docker engine answers: start Docker, set DOCKER_HOST, or run "
              "`resnet18-kit docker engine start`", file=sys.stderr)
        return 2
    names = ("triton", *(PROFILE_IMAGES[p] for p in profiles))
    try:
        report = ImageBuild(engine, REPO_ROOT, args.base_image, names,
                            log=lambda line: print(line, file=sys.stderr)).run()
    except EngineError as exc:
        print(f"docker image: {exc}", file=sys.stderr)
        return 1
    for line in report.lines():
        print(f"docker image: {line}", file=sys.stderr)
    print(" ".join(IMAGES[name] for name in names))
    return 0


def engine_command(action: str) -> int:
    """engine start|stop|status."""
    engine = private_engine()
    if action == "status":
        pid = engine.pid()
        print(f"docker engine: {'running, pid ' + str(pid) if pid else 'not running'} "
              f"(DOCKER_HOST={engine.engine.host})")
        return 0
    if action == "stop":
        stopped = engine.stop()
        print(f"docker engine: {'stopped' if stopped else 'was not running'}", file=sys.stderr)
        return 0
    try:
        started = engine.start()
    except EngineError as exc:
        print(f"docker engine: {exc}", file=sys.stderr)
        return 2
    print(f"docker engine: running, pid {engine.pid()}, images in {engine.data_root}", file=sys.stderr)
    print(f"export DOCKER_HOST={started.host}")
    return 0
