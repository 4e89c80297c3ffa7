"""Security of the embedded server: loopback by default, a wider bind only with an admin key and a
warning, the model-control / shared-memory / trace / logging APIs refused without the key (HTTP 403,
gRPC UNAVAILABLE) and served with it, and no secrets in the repository."""
from __future__ import annotations

import re
import secrets
import subprocess
import sys
from dataclasses import replace

import pytest

from resnet18_kit.tools.reliability import ECHO_MODEL, repository_with
from resnet18_kit.tools.reliability.restricted_api import restricted_api_checks
from resnet18_kit.contract import REPO_ROOT
from resnet18_kit.server.__main__ import InsecureBindError, add_server_arguments, config_from_args
from resnet18_kit.server.config import ServerConfig, config_on_free_ports
from resnet18_kit.server.config import ADMIN_KEY_ENV, RESTRICTED_APIS
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.server.tritonserver import server_command


def parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return parser.parse_args(list(argv))


def test_default_bind_is_loopback_only(settings):
    config = config_from_args(settings, parse(), environ={})
    assert config.host == ServerConfig().host == "127.0.0.1" and config.loopback_only
    command = server_command(config, control_key="k" * 32)
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert f"{flag}=127.0.0.1" in command
    # Model control "none": only the model-control API is locked, by the key of the process that started
    # the server (it unloads the models before a stop); every other API is open on loopback.
    assert [arg for arg in command if "restricted" in arg] == [
        f"--http-restricted-api=model-repository:admin-key={'k' * 32}",
        f"--grpc-restricted-protocol=model-repository:admin-key={'k' * 32}"]
    with pytest.raises(ValueError, match="control_key"):
        server_command(config)


def test_wider_bind_without_an_admin_key_is_refused(settings):
    with pytest.raises(InsecureBindError, match=ADMIN_KEY_ENV):
        config_from_args(settings, parse("--host", "0.0.0.0"), environ={})
    result = subprocess.run([sys.executable, "-m", "resnet18_kit", "serve", "--host", "0.0.0.0"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(REPO_ROOT)})
    assert result.returncode == 2 and "refusing to listen on 0.0.0.0" in result.stderr, result.stderr


def test_wider_bind_with_a_key_warns_and_restricts_the_admin_apis(capsys, settings):
    key = secrets.token_hex(16)
    config = config_from_args(settings, parse("--host", "0.0.0.0"), environ={ADMIN_KEY_ENV: key})
    assert "WARNING: listening on 0.0.0.0" in capsys.readouterr().err
    assert config.admin_key == key and key not in repr(config)  # not printed with the config
    command = server_command(config, control_key="k" * 32)
    # Model control "none": the user's key opens the admin APIs but not model control.
    restriction = f"{','.join(api for api in RESTRICTED_APIS if api != 'model-repository')}:admin-key={key}"
    assert f"--http-restricted-api={restriction}" in command
    assert f"--grpc-restricted-protocol={restriction}" in command
    assert f"--http-restricted-api=model-repository:admin-key={'k' * 32}" in command
    command = server_command(replace(config, model_control="explicit"))
    restriction = f"{','.join(RESTRICTED_APIS)}:admin-key={key}"
    assert [arg for arg in command if "restricted" in arg] == [
        f"--http-restricted-api={restriction}", f"--grpc-restricted-protocol={restriction}"]


@pytest.mark.live
@pytest.mark.parametrize("model_control", ["explicit", "none"])
def test_restricted_apis_refuse_requests_without_the_key_and_serve_those_with_it(tmp_path, model_control):
    """With model control "none" the user's key opens every restricted API but model control."""
    key = secrets.token_hex(16)
    config = config_on_free_ports(model_repository=repository_with([ECHO_MODEL], tmp_path / "repository"),
                                  admin_key=key, exit_timeout_s=5, model_control=model_control)
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(b"never sent")
    with EmbeddedTritonServer(config, log_path=tmp_path / "tritonserver.log"):
        rows = restricted_api_checks(config)
        # classify --shared-memory without the key: one line and exit 2 before any image is sent
        refused = subprocess.run([sys.executable, "-m", "resnet18_kit", "classify", "--url", config.http_url,
                                  "--model", ECHO_MODEL, "--shared-memory", str(photo)], cwd=REPO_ROOT,
                                 capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert refused.stderr.startswith(f"resnet18-kit classify: --shared-memory: the Triton server at {config.http_url}"
                                     " (http) cannot use this host's shared memory ("), refused.stderr
    assert "leave --shared-memory out" in refused.stderr
    for row in rows:
        print(row)
    for row in rows:
        if "open" in row["api"]:
            assert row["outcome"] == "OK", row
        elif row["key"] and (model_control == "explicit" or not row["api"].startswith("model-repository")):
            assert row["outcome"] == "OK", row
        elif row["protocol"] == "http":
            assert row["outcome"].startswith("403"), row
        else:
            assert row["outcome"].startswith("StatusCode.UNAVAILABLE"), row
    assert key not in (tmp_path / "tritonserver.log").read_text(errors="replace")


#: What a committed secret looks like: a private key block, or a key-like name given a literal value
#: of 16+ letters and digits (a real key; placeholders such as "test-admin-key" or $VAR do not match).
SECRET_PATTERNS = [
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"(?i)(admin[-_]?key|api[-_]?key|secret|token|password)[\"']?[ \t]*[:=][ \t]*[\"']?[A-Za-z0-9+/]{16,}"),
    re.compile(r"AKIA[0-9A-Z]{16}"),  # AWS access key id
]


def test_no_secrets_in_the_repository():
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True,
                               timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    hits = []
    for name in filter(None, files):
        path = REPO_ROOT / name
        if not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # binary
            continue
        for pattern in SECRET_PATTERNS:
            hits += [f"{name}: {m.group(0)[:60]}" for m in pattern.finditer(text)]
    assert not hits, hits
