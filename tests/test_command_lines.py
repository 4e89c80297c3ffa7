"""Command lines given bad arguments or no server: one line naming the problem, a non-zero exit, no
traceback (each command run as a user runs it, `resnet18-kit <command>` in a subprocess); and the asyncio
pipeline (`resnet18-kit bench async-pipeline`, module client.async_pipeline) against the real server."""
import argparse
import subprocess
import sys

import pytest

from resnet18_kit.tools.bench import async_pipeline
from resnet18_kit.client.samples import sample_photos
from resnet18_kit.contract import PROTOCOLS, REPO_ROOT
from resnet18_kit.server.config import free_ports
from resnet18_kit.settings import Settings

PIPELINE = "resnet18-kit bench async-pipeline"


def run_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resnet18_kit", "--log-level", "WARNING", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command, message", [
    (["bench", "run", "--configs", "nosuch", "--quick"], "--configs: no such config of resnet18_onnx: nosuch"),
    (["bench", "run", "--quick", "--out", "docs"], "--out docs: exists already"),
    (["bench", "run", "--pipeline-transports", "udp"], "--pipeline-transports: invalid choice: 'udp'"),
    (["bench", "lone-client", "--served-repository", "/nonexistent"], "--served-repository: no model repository"),
    (["classify", "/nonexistent/photo.jpg"], "no such file or folder: /nonexistent/photo.jpg"),
    (["serve", "--no-such-flag"], "resnet18-kit serve: error: unrecognized arguments: --no-such-flag (see resnet18-kit serve --help)"),
])
def test_commands_refuse_bad_arguments_in_one_line(command, message):
    result = run_command(*command)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def pipeline(settings_flags: dict, *argv: str) -> int:
    """Run client.async_pipeline in this process as `resnet18-kit bench async-pipeline` would."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    async_pipeline.add_arguments(parser)
    args = parser.parse_args(list(argv))
    return async_pipeline.run(Settings.build(settings_flags), args)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_pipeline_without_a_server_is_one_line_and_exit_2(protocol, capsys):
    (port,) = free_ports(1)
    assert pipeline({"protocol": protocol, "url": f"127.0.0.1:{port}"}) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{PIPELINE}: {protocol} server at 127.0.0.1:{port}: "), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_async_pipeline_given_a_folder_without_images_says_so(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not an image")
    assert pipeline({}, str(tmp_path)) == 2
    assert capsys.readouterr().err.strip() == f"{PIPELINE}: no image files in {tmp_path}"


def test_async_pipeline_sends_the_images_it_is_given(triton_server, tmp_path, capsys):
    photo = tmp_path / "one.png"
    photo.write_bytes(sample_photos()[0].read_bytes())
    flags = {"protocol": "grpc", "url": triton_server.config.grpc_url, "metrics_url": triton_server.config.metrics_url}
    assert pipeline(flags, str(tmp_path), "--requests", "6") == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("6 answered, 0 failed")


def test_async_pipeline_is_the_bench_async_pipeline_command():
    """The one route: `resnet18-kit bench async-pipeline` (wired in bench/commands.py)."""
    (port,) = free_ports(1)
    result = run_command("bench", "async-pipeline", "--protocol", "http", "--url", f"127.0.0.1:{port}")
    assert result.returncode == 2 and result.stderr.startswith(f"{PIPELINE}: http server at 127.0.0.1:{port}: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
