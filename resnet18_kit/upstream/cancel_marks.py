"""Cancellation that Triton 2.51 survives: the marks the gRPC guard leaves for the kit's Python models.

A gRPC cancellation reaching Triton 2.51 under load crashes it (upstream.grpc_guard), so the guard never
passes one on, and a request whose client went away used to run to its end. With marks it does not:
  * every ModelInfer the guard forwards gets the request parameter PARAMETER, a fresh token of 32 hex
    digits (`tagged`: a map entry appended to the serialized request, so the request is not re-encoded;
    the last entry of a key wins, so a client's own `cancel_mark` is replaced);
  * when its client cancels or its deadline passes while Triton holds it, the guard creates the empty file
    <folder>/<token> (`Marks.mark`), and removes it once Triton has answered (`Marks.clear`);
  * tritonserver starts with the folder in its environment (ENVIRONMENT), which its Python stubs inherit:
    preprocess and the network (model_repository/preprocess/1/cancellation.py) answer a marked request
    CANCELLED without computing it. The ensemble copies its request's parameters onto each step.
A request already running when its mark appears is computed, and its answer dropped, as before.

The folder is the guard's: GrpcGuard creates it before tritonserver starts, the guard process empties and
removes it at exit, GrpcGuard.stop removes what is left.
"""
from __future__ import annotations

import contextlib
import secrets
from pathlib import Path

#: The request parameter carrying the mark, and the environment variable naming the folder, as the
#: served cancellation.py reads them (tests/test_traffic_controls.py checks that they agree).
PARAMETER = "cancel_mark"
ENVIRONMENT = "RESNET18_KIT_CANCEL_MARKS"


def new_token() -> str:
    """A mark: 32 lowercase hex digits (128 random bits)."""
    return secrets.token_hex(16)


def tagged(raw_request: bytes, token: str) -> bytes:
    """A serialized ModelInferRequest with parameters[PARAMETER] = `token` (a string parameter)."""
    from tritonclient.grpc import service_pb2

    entry = service_pb2.ModelInferRequest()
    entry.parameters[PARAMETER].string_param = token
    return raw_request + entry.SerializeToString()


class Marks:
    """The marks in `folder` (an existing folder that only the guard writes)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def mark(self, token: str) -> None:
        """The request tagged `token` has lost its client: the models skip it from now on."""
        with contextlib.suppress(OSError):
            (self.folder / token).touch()

    def clear(self, token: str) -> None:
        """Triton has answered the request tagged `token`: its mark, if any, goes."""
        with contextlib.suppress(OSError):
            (self.folder / token).unlink()

    def remove(self) -> None:
        """Every mark, then the folder (at exit: nothing is in flight any more)."""
        with contextlib.suppress(OSError):
            for path in self.folder.iterdir():
                path.unlink()
            self.folder.rmdir()
