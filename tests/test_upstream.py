"""The upstream defects' registry (resnet18_kit.upstream): each workaround on only where the running release
lacks the fix, the registry and the docs' one table in step, and `serve`'s gRPC guard switched by it."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from resnet18_kit.contract import REPO_ROOT, TRITON_VERSION
from resnet18_kit.server.__main__ import add_server_arguments, config_from_args
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.tritonserver import (backend_directory, library_path, release_of, server_command,
                                              tritonserver_binary)
from resnet18_kit.server.resources import busy_port
from resnet18_kit.settings import TRITON_VERSION_ENV, Settings, SettingsError
from resnet18_kit.tools.reliability import ECHO_MODEL, repository_with
from resnet18_kit.tools.reliability.lifecycle import ServeRun
from resnet18_kit.tools.reliability.loads import echo_load
from resnet18_kit.tools.reliability.senders import send_fresh
from resnet18_kit.tools.reliability.sigterm import environment_without_admin_key, serve_command
from resnet18_kit.upstream import DEFECTS, banner_line, needs, parse_version, workarounds
from resnet18_kit.upstream.cancel_marks import ENVIRONMENT as CANCEL_MARKS_ENVIRONMENT
from resnet18_kit.upstream.seam import StubWatch


RELIABILITY = REPO_ROOT / "docs" / "reliability.md"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_workaround_is_on_for_251_and_only_the_unfixed_ones_on_a_later_release():
    assert [d.key for d in workarounds(TRITON_VERSION)] == [d.key for d in DEFECTS]
    later = workarounds("2.72.0")
    assert later and all(d.fixed_in is None for d in later)
    assert needs("grpc-cancellation", "2.58.1") and not needs("grpc-cancellation", "2.59.0")
    assert needs("numpy2-stub", "2.51") and not needs("numpy2-stub", "2.52.0")
    assert parse_version("2.72.0dev") == (2, 72, 0)
    with pytest.raises(ValueError, match="not a Triton version"):
        parse_version("latest")
    with pytest.raises(KeyError):
        needs("no-such-defect", TRITON_VERSION)


def test_the_registry_and_the_docs_table_agree():
    """Each defect has a row in reliability.md's table naming its upstream references and its fix release,
    and a test that exists."""
    table = RELIABILITY.read_text().split("## Triton 2.51 defects and what the kit does")[1].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| defect")]
    for defect in DEFECTS:
        references = re.findall(r"#\d+", defect.upstream)
        row = next((r for r in rows if all(reference in r for reference in references)), None)
        assert references and row is not None, f"{defect.key}: no row of the table names all of {references}"
        fixed = defect.fixed_in_text if defect.fixed_in else "no"
        assert fixed in row or (defect.fixed_in is None and "in no release" in row), (defect.key, row)
        assert (REPO_ROOT / defect.reproduced_by).is_file(), defect.reproduced_by


def test_serve_puts_the_guard_in_front_only_where_the_release_lacks_the_fix(settings):
    old = config_from_args(settings, parse(), environ={}, triton_version="2.51.0")
    assert old.triton_grpc_port is not None and f"--grpc-port={old.triton_grpc_port}" in server_command(old, control_key="k" * 32)
    fixed = config_from_args(settings, parse(), environ={}, triton_version="2.72.0")
    assert fixed.triton_grpc_port is None  # no guard: tritonserver's own gRPC on the client-facing port
    assert f"--grpc-port={fixed.grpc_port}" in server_command(fixed, control_key="k" * 32) and fixed.triton_grpc_url == fixed.grpc_url
    assert config_from_args(settings, parse("--grpc-guard"), environ={}, triton_version="2.72.0").triton_grpc_port
    assert config_from_args(settings, parse("--no-grpc-guard"), environ={}, triton_version="2.51.0"
                            ).triton_grpc_port is None


def test_the_stop_unloads_first_on_every_release_known_and_is_turned_off_by_its_flag(settings):
    """keep-alive-stop has no fix release: the unload before SIGTERM is on for 2.51 and 2.72 alike."""
    assert needs("keep-alive-stop", "2.72.0") and "keep-alive-stop" in banner_line("2.72.0", guarded=False)
    for version in ("2.51.0", "2.72.0"):
        assert config_from_args(settings, parse(), environ={}, triton_version=version).refuse_first
        assert not config_from_args(settings, parse("--no-refuse-first"), environ={},
                                    triton_version=version).refuse_first


def test_the_banner_names_the_workarounds_and_a_guard_turned_off():
    assert banner_line("2.51.0", guarded=True).startswith("2.51.0: workarounds on for grpc-cancellation, dead-stub")
    assert "grpc-cancellation (guard OFF: --no-grpc-guard)" in banner_line("2.51.0", guarded=False)
    assert "grpc-cancellation" not in banner_line("2.72.0", guarded=False)


def test_the_release_is_the_images_variable_else_the_wheels():
    assert Settings.build(environ={}).triton_version is None  # serve takes the wheel's, or asks --tritonserver
    assert Settings.build(environ={TRITON_VERSION_ENV: "2.72.0"}).triton_version == "2.72.0"
    with pytest.raises(SettingsError, match=rf"\${TRITON_VERSION_ENV}: not a Triton version: 'latest'"):
        Settings.build(environ={TRITON_VERSION_ENV: "latest"})


def _grpc_holder(config) -> str:
    return busy_port(config.host, (("gRPC", "--grpc-port", config.grpc_port),)) or "free"


@pytest.mark.live
@pytest.mark.parametrize("reported", [None, "2.72.0"])
def test_the_wing_is_on_for_the_real_251_and_off_for_a_reported_later_release(tmp_path, reported):
    """`serve` on the real 2.51 binary: with the release it reports, the gRPC guard holds the client-facing
    gRPC port and the models get the cancel marks' folder; told by $TRITON_SERVER_VERSION that the release
    is 2.72.0, nothing of the wing starts: tritonserver's own gRPC holds that port, the request path is
    direct, and serve warns that the server reports another release."""
    config = config_on_free_ports(model_repository=repository_with([ECHO_MODEL], tmp_path / "repository"))
    run = ServeRun(config, tmp_path, environ={TRITON_VERSION_ENV: reported} if reported else {})
    try:
        run.wait_ready()
        holder, answer = _grpc_holder(config), send_fresh(config, "grpc", echo_load(), 3)
        server_pid = run.server_pid()
        environ = (Path(f"/proc/{server_pid}/environ").read_bytes().split(b"\0") if server_pid else [])
        marks = any(item.startswith(CANCEL_MARKS_ENVIRONMENT.encode() + b"=") for item in environ)
    finally:
        status = run.terminate()
    lines = run.stderr_lines()
    banner = run.log_path.read_text(errors="replace")
    print(f"\nreported {reported or 'nothing (2.51.0)'}: gRPC port held by {holder}; cancel marks: {marks}")
    assert answer.kind == "answered", answer
    assert status == {"exit_status": 0, "leftovers": []}
    if reported is None:
        assert "(tritonserver)" not in holder and "taken by pid" in holder and marks
        assert "the kit's gRPC guard" in banner and not any("WARNING: tritonserver reports" in li for li in lines)
    else:
        assert "(tritonserver)" in holder and not marks
        assert "tritonserver's own: no guard" in banner and "grpc-cancellation" not in banner
        assert any(f"reports release {TRITON_VERSION}, but the workarounds are those of 2.72.0" in line
                   for line in lines), lines


def _installed_triton(root: Path) -> Path:
    """The wheel's tritonserver laid out as NVIDIA's images lay it out: <root>/bin/tritonserver (a script
    that execs the wheel's binary with its libraries, so the pid stays tritonserver's), <root>/backends
    (the Python backend with this interpreter's stub), <root>/caches."""
    (root / "bin").mkdir(parents=True)
    binary = root / "bin" / "tritonserver"
    binary.write_text(f"#!/bin/sh\nLD_LIBRARY_PATH={library_path()} exec {tritonserver_binary()} \"$@\"\n")
    binary.chmod(0o755)
    (root / "backends").symlink_to(backend_directory())
    (root / "caches").symlink_to(tritonserver_binary().parent.parent / "caches")
    return binary


@pytest.mark.live
def test_serve_runs_an_installed_tritonserver_and_switches_the_wing_by_the_release_it_reports(tmp_path):
    """`serve --tritonserver PATH`: PATH's release is read from its server metadata (2.51.0 here, no
    $TRITON_SERVER_VERSION), so the wing is on: the guard holds the client-facing gRPC port, the banner
    names the workarounds; the server answers and serve exits 0 leaving nothing."""
    binary = _installed_triton(tmp_path / "opt" / "tritonserver")
    assert release_of(binary) == TRITON_VERSION
    config = config_on_free_ports(model_repository=repository_with([ECHO_MODEL], tmp_path / "repository"))
    run = ServeRun(config, tmp_path / "serve",
                   serve_command(config, tmp_path / "serve" / "tritonserver.log", ("--tritonserver", str(binary))))
    try:
        run.wait_ready()
        holder, answer = _grpc_holder(config), send_fresh(config, "grpc", echo_load(), 3)
        server_argv = Path(f"/proc/{run.server_pid()}/cmdline").read_bytes().split(b"\0")
    finally:
        status = run.terminate()
    banner = run.log_path.read_text(errors="replace")
    assert answer.kind == "answered", answer
    assert status == {"exit_status": 0, "leftovers": []}
    assert f"--backend-directory={binary.parent.parent / 'backends'}".encode() in server_argv, server_argv
    assert "(tritonserver)" not in holder and "the kit's gRPC guard" in banner
    assert f"{TRITON_VERSION}: workarounds on for grpc-cancellation" in banner, banner


@pytest.mark.parametrize("script, message", [
    (None, "--tritonserver {path}: not an executable file"),
    ("#!/bin/sh\necho 'error: no such option' >&2\nexit 1\n", "did not report its release: error: no such option"),
])
def test_a_tritonserver_that_is_missing_or_reports_no_release_is_one_line_and_exit_2(tmp_path, script, message):
    path = tmp_path / "bin" / "tritonserver"
    if script:
        path.parent.mkdir()
        path.write_text(script)
        path.chmod(0o755)
    result = subprocess.run([sys.executable, "-m", "resnet18_kit", "serve", "--check", "--tritonserver", str(path)],
                            capture_output=True, text=True, timeout=60, env=environment_without_admin_key())
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert message.format(path=path) in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("release, guarded", [("2.51.0", True), ("2.72.0", False)])
def test_the_fleets_replicas_get_the_guard_by_the_release_as_serve_does(settings, release, guarded):
    from dataclasses import replace

    from resnet18_kit.fleet.__main__ import add_arguments, fleet_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    fleet = fleet_config(replace(settings, triton_version=release), parser.parse_args([]))
    assert [c.triton_grpc_port is not None for c in fleet.replicas] == [guarded] * len(fleet.replicas)


def test_a_stub_that_leaves_the_listing_before_it_has_exited_is_still_reported_dead():
    """A SIGKILLed stub's argv vanishes from /proc a moment before it turns zombie: the listing drops it
    while it still exists. The watch keeps following it, and reports it once it is gone."""
    stub = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    listed = [("echo_0_0", stub.pid)]
    watch = StubWatch(lambda: list(listed))
    try:
        watch.follow()
        listed.clear()  # out of the listing, still running (exiting)
        assert watch.dead() is None and watch.instances == {"echo_0_0"}
    finally:
        stub.kill()
        stub.wait()
    assert watch.dead() == f"Python-backend stub of instance 'echo_0_0' (pid {stub.pid}) died"
    assert watch.dead() is None and watch.instances == set()
