"""Command lines given bad arguments or no server: one line naming the problem, a non-zero exit, no
traceback (each command run as a user runs it, in a subprocess)."""
import subprocess
import sys

import pytest

from resnet18_kit.contract import PROTOCOLS
from resnet18_kit.contract import REPO_ROOT
from resnet18_kit.server.embedded import free_ports


@pytest.mark.parametrize("command, message", [
    (["resnet18_kit.bench", "--configs", "nosuch", "--quick"], "--configs: no such config of resnet18_onnx: nosuch"),
    (["resnet18_kit.bench.lone_client", "--served-repository", "/nonexistent"], "--served-repository: no model repository"),
])
def test_bench_commands_refuse_bad_arguments_in_one_line(command, message):
    result = subprocess.run([sys.executable, "-m", *command], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_pipeline_without_a_server_is_one_line_and_exit_2(protocol):
    (port,) = free_ports(1)
    result = subprocess.run([sys.executable, "-m", "resnet18_kit.client.async_pipeline", "--protocol", protocol,
                             "--url", f"127.0.0.1:{port}"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith(f"async_pipeline: {protocol} server at 127.0.0.1:{port}: ")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_async_pipeline_given_a_folder_without_images_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("not an image")
    result = subprocess.run([sys.executable, "-m", "resnet18_kit.client.async_pipeline", str(tmp_path)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"async_pipeline: no image files in {tmp_path}", result.stderr


def test_async_pipeline_sends_the_images_it_is_given(triton_server, tmp_path):
    from resnet18_kit.client.samples import sample_photos

    photo = tmp_path / "one.png"
    photo.write_bytes(sample_photos()[0].read_bytes())
    result = subprocess.run([sys.executable, "-m", "resnet18_kit.client.async_pipeline", str(tmp_path),
                             "--requests", "6", "--url", triton_server.config.grpc_url,
                             "--metrics-url", triton_server.config.metrics_url],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("6 answered, 0 failed"), result.stdout
