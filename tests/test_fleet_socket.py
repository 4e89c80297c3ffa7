"""Where a fleet's HAProxy runtime API listens (resnet18_kit/fleet/haproxy.py, runtime_socket_in): inside its
results folder when the path fits a UNIX socket, else a short path that every command given the same folder
computes alike (HAProxy refused to start under a long results path: "socket path ... too long (max 97)")."""
import os
import socket

from resnet18_kit.fleet.haproxy import SOCKET_PATH_MAX_BYTES, runtime_socket_in


def test_a_short_results_folder_holds_the_socket(tmp_path):
    assert runtime_socket_in(tmp_path / "fleet") == (tmp_path / "fleet").resolve() / "haproxy.sock"


def test_a_long_results_folder_gets_a_short_socket_path_the_same_for_every_command(tmp_path):
    workdir = tmp_path / ("results-" + "x" * 80) / "fleet"
    path = runtime_socket_in(workdir)
    assert len(os.fsencode(str(workdir / "haproxy.sock"))) > SOCKET_PATH_MAX_BYTES
    assert len(os.fsencode(str(path))) <= SOCKET_PATH_MAX_BYTES and path == runtime_socket_in(workdir)
    assert path != runtime_socket_in(tmp_path / ("results-" + "y" * 80) / "fleet")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                listener.listen(1)
                client.connect(str(path))
        finally:
            path.unlink()
