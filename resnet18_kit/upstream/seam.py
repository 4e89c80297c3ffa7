"""The seam between the product and the wing: the only names the product imports from resnet18_kit.upstream.

Two calls, each switched by the Triton release that runs:
  * `switches(release, grpc_guard, refuse_first)`: which workarounds a server gets; `serve`'s --grpc-guard /
    --refuse-first override the release's answer (None: as the release needs, `defects.needs`);
  * `ServerHelpers(config, log_path)`: what runs beside one tritonserver for them: the gRPC guard (when
    config.triton_grpc_port is set), the cancel-marks folder its models read, the admission stop before
    SIGTERM (when config.refuse_first). With neither on it starts nothing and changes nothing: the request
    path is tritonserver's own.
`banner(release, guarded)` says which are on (serve's ready banner). The supervisor watches with two more:
`StubWatch` finds a dead stub (dead_stub), `QueueWatch` a queue about to refuse (overload).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from resnet18_kit.server.config import ServerConfig
from resnet18_kit.upstream.cancel_marks import ENVIRONMENT as CANCEL_MARKS_ENVIRONMENT
from resnet18_kit.upstream.dead_stub import StubWatch
from resnet18_kit.upstream.defects import banner_line as banner
from resnet18_kit.upstream.defects import needs
from resnet18_kit.upstream.overload import QueueWatch

__all__ = ["ServerHelpers", "Switches", "QueueWatch", "StubWatch", "banner", "switches"]


@dataclass(frozen=True)
class Switches:
    """grpc_guard: the gRPC guard in front of tritonserver (defect grpc-cancellation); refuse_first: the
    models unloaded before SIGTERM (defect keep-alive-stop)."""

    grpc_guard: bool
    refuse_first: bool


def switches(release: str, grpc_guard: bool | None = None, refuse_first: bool | None = None) -> Switches:
    """The workarounds for Triton `release` ("2.51.0"): each given value as given, each None as the
    release needs it (defects.needs). ValueError for a malformed release."""
    return Switches(needs("grpc-cancellation", release) if grpc_guard is None else grpc_guard,
                    needs("keep-alive-stop", release) if refuse_first is None else refuse_first)


class ServerHelpers:
    """What runs beside one tritonserver started with `config` (module doc). Call, in this order:
    environment() for the server's environment, start() once its process runs, before_sigterm() when it
    is to stop, stop() once it has exited. log_path: the guard's output (None: this process's)."""

    def __init__(self, config: ServerConfig, log_path: Path | None = None):
        self.config = config
        self.guard = None
        if config.triton_grpc_port is not None:
            from resnet18_kit.upstream.guard_process import GrpcGuard

            self.guard = GrpcGuard(config.host, config.grpc_port, config.triton_grpc_url, log_path,
                                   grace_s=config.exit_timeout_s)

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with the cancel-marks folder the models read (only with the guard), a copy."""
        env = dict(env)
        env.pop(CANCEL_MARKS_ENVIRONMENT, None)
        if self.guard is not None:
            env[CANCEL_MARKS_ENVIRONMENT] = str(self.guard.marks_folder)
        return env

    def start(self) -> None:
        """The guard listening (before tritonserver is ready, as its own gRPC would). PortBusyError,
        RuntimeError as GrpcGuard.start."""
        if self.guard is not None:
            self.guard.start()

    def before_sigterm(self, control_key: str | None, timeout_s: float,
                       hurry: Callable[[], bool] | None = None) -> bool | None:
        """With config.refuse_first: unload every model (admission.stop_admitting), for up to `timeout_s`
        seconds; True when nothing was left in flight. None when off."""
        if not self.config.refuse_first:
            return None
        from resnet18_kit.upstream.admission import stop_admitting

        return stop_admitting(self.config.http_url, control_key, timeout_s, hurry)

    def processes(self) -> dict[str, int]:
        """{"grpc guard": pid} while the guard runs, else {}."""
        if self.guard is not None and self.guard.process is not None and self.guard.process.poll() is None:
            return {"grpc guard": self.guard.process.pid}
        return {}

    def stop(self) -> None:
        """Stop the guard (after tritonserver's drain, during which it forwarded what clients still sent)."""
        if self.guard is not None:
            self.guard.stop(grace_s=0.0)
