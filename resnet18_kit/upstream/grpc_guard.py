"""A gRPC front end that never passes a client's deadline or cancellation on to tritonserver.

Why: Triton 2.51 (the embedded server, NGC 24.10) crashes when gRPC inference requests are cancelled
while it holds them: a client deadline that expires, or a client that cancels, under a full queue ends in
SIGSEGV, or in heap corruption that leaves the process answering health checks while its threads are
stuck (server issue 7368, fixed in full in 2.59.0: defects.py; docs/reliability.md
"Deadlines and cancellation"). A proxy that passes cancellations on (HAProxy, nginx's grpc_pass) does not
help: it resets the upstream stream when its client goes.

What the guard does: it listens where gRPC clients connect and forwards every call of KServe v2's
`inference.GRPCInferenceService` to tritonserver's own gRPC port on 127.0.0.1, so that
  * ModelInfer and each request of ModelStreamInfer carry the client's remaining deadline as the request's
    `timeout` parameter (microseconds; the smaller one when the client set one too): Triton's queue
    refuses a request whose time is up ("Request timeout expired", UNAVAILABLE) without any
    cancellation. The queue honours it where the model's queue policy has `allow_timeout_override: true`
    and a non-zero `default_timeout_microseconds` (core src/scheduler_utils.cc, PolicyQueue::Enqueue);
  * a forwarded call carries no deadline of its own and is never cancelled. A client that cancels, or
    whose deadline passes, gets its status from its own gRPC library at once; the guard keeps waiting
    for Triton's answer and drops it. A stream whose client goes away is half-closed upstream and read
    to its end;
  * a ModelInfer whose client goes while Triton holds it is marked cancelled (upstream.cancel_marks): the
    kit's Python models answer it CANCELLED without computing it unless they have already begun;
  * a ModelInfer that arrives with its deadline already past is answered DEADLINE_EXCEEDED and not sent;
  * a ModelInfer to a model with the response cache that asks for some of its outputs asks for all of
    them upstream and gets its answer trimmed back (upstream.guard_requests: Triton 2.51's cache key
    ignores the outputs asked for);
  * every other call (health, metadata, config, statistics, model control, shared memory) is forwarded
    byte for byte, with the client's metadata (the admin-key header included).
Forwarded calls end when Triton answers; a wedged server is the supervisor's to restart
(server.supervisor), which closes the connection and fails them with UNAVAILABLE.

The guard is a process of its own, `resnet18-kit grpc-guard` (its own interpreter: no GIL shared with the
program that starts it, which may be a load generator): `GrpcGuard` (upstream.guard_process) starts it,
waits until it listens and stops it (SIGTERM: it stops listening, gives calls in flight --grace-s, exits
0); EmbeddedTritonServer does that for every server whose config has `triton_grpc_port`. Alone, in front
of any Triton 2.51 server:

    resnet18-kit grpc-guard --listen 0.0.0.0:8001 --upstream 127.0.0.1:18001

Exit status: 0 after SIGTERM or SIGINT; 2 when --listen cannot be bound (one line names the port and its
holder).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from resnet18_kit.upstream.guard_requests import (TIMEOUT_PARAMETER, CachedOutputs, set_timeout, trim,  # noqa: F401
                                                widen, with_timeout)
from resnet18_kit.upstream.cancel_marks import Marks, new_token, tagged
from resnet18_kit.server.config import PortBusyError
from resnet18_kit.server.resources import busy_port

#: The KServe v2 gRPC service (tritonclient.grpc.service_pb2).
SERVICE = "inference.GRPCInferenceService"
#: Message sizes are Triton's business (an encoded image may be 20 MB): no limit here (gRPC's default
#: receive limit is 4 MiB). SO_REUSEPORT off, so that a second listener on the port fails to bind
#: instead of silently sharing it.
MESSAGE_OPTIONS = (("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1))
SERVER_OPTIONS = MESSAGE_OPTIONS + (("grpc.so_reuseport", 0),)
#: The channel to tritonserver retries a refused connection every 0.1-0.5 s. gRPC's default backoff (1 s,
#: x1.6 per try, up to 120 s) is for remote servers: the guard listens while tritonserver loads, and a
#: client calling then pushed the next try 15-40 s past the moment tritonserver listened (after a start, a
#: container re-create or a supervisor restart), every call in between failing with UNAVAILABLE.
CHANNEL_OPTIONS = MESSAGE_OPTIONS + (("grpc.initial_reconnect_backoff_ms", 100),
                                     ("grpc.min_reconnect_backoff_ms", 100),
                                     ("grpc.max_reconnect_backoff_ms", 500))
#: Metadata keys that belong to the client's own connection and are not forwarded.
HOP_BY_HOP = ("user-agent",)


@dataclass
class GuardCounts:
    """What the guard did since it started (read them any time; written by its loop only)."""

    forwarded: int = 0        # calls sent on to tritonserver
    client_gone: int = 0      # of those, calls whose client cancelled or timed out first: answer dropped
    expired_on_arrival: int = 0  # ModelInfer calls whose deadline had passed: answered, not forwarded
    streams_drained: int = 0  # streams whose client went away, read to their end upstream
    marked: int = 0           # ModelInfer calls whose client went while Triton held them: marked cancelled


def _forwarded_metadata(context) -> tuple:
    return tuple((key, value) for key, value in (context.invocation_metadata() or ())
                 if key not in HOP_BY_HOP and not key.startswith(("grpc-", ":")))


def _methods() -> list:
    from tritonclient.grpc import service_pb2

    return list(service_pb2.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[1]].methods)


class GuardServer:
    """The guard's gRPC server, on the running asyncio loop: `await start()` binds (PortBusyError) and
    serves, `await stop(grace_s)` stops; `counts` says what it did."""

    def __init__(self, listen_host: str, listen_port: int, upstream: str, port_flag: str = "--listen",
                 marks: Marks | None = None):
        self.listen = f"[{listen_host}]:{listen_port}" if ":" in listen_host else f"{listen_host}:{listen_port}"
        self.port_flag = port_flag  # named in the message when the port is taken
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.upstream = upstream
        self.marks = marks  # where cancelled ModelInfer calls are marked for the models (upstream.cancel_marks)
        self.counts = GuardCounts()
        self._server = None
        self._channel = None
        self._pending: set[asyncio.Task] = set()
        self._cached: CachedOutputs | None = None

    async def start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.upstream, options=CHANNEL_OPTIONS)
        self._cached = CachedOutputs(self._channel.unary_unary(f"/{SERVICE}/ModelConfig"))
        handlers = {}
        for method in _methods():
            path = f"/{SERVICE}/{method.name}"
            if method.client_streaming and method.server_streaming:
                upstream = self._channel.stream_stream(path)
                handlers[method.name] = grpc.stream_stream_rpc_method_handler(self._stream_handler(upstream))
            elif not method.client_streaming and not method.server_streaming:
                upstream = self._channel.unary_unary(path)
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    self._unary_handler(upstream, infer=method.name == "ModelInfer"))
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        try:
            bound = self._server.add_insecure_port(self.listen)
        except RuntimeError:
            bound = 0
        if not bound:
            await self._channel.close()
            raise PortBusyError(busy_port(self.listen_host, (("gRPC", self.port_flag, self.listen_port),))
                                or f"gRPC port {self.listen_port} on {self.listen_host} cannot be bound")
        await self._server.start()

    async def stop(self, grace_s: float) -> None:
        """Stop listening; calls in flight get `grace_s` seconds, then the upstream connection closes."""
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=grace_s)
        if self._channel is not None:
            await self._channel.close()

    def _keep(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    # -- handlers --------------------------------------------------------------------------------------------

    def _unary_handler(self, upstream, infer: bool):
        async def handle(raw_request: bytes, context):
            remaining_s, asked, token = context.time_remaining(), None, None
            if infer:
                if remaining_s is not None and remaining_s <= 0:
                    self.counts.expired_on_arrival += 1
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the request was sent")
                raw_request, asked = await self._prepared(raw_request, remaining_s)
                if self.marks is not None:
                    token = new_token()
                    raw_request = tagged(raw_request, token)
            self.counts.forwarded += 1
            call = self._keep(_awaited(upstream(raw_request, metadata=_forwarded_metadata(context))))
            try:
                answer = await asyncio.shield(call)
                return trim(answer, asked) if asked else answer
            except asyncio.CancelledError:  # the client went: the forwarded call goes on, its answer dropped
                self.counts.client_gone += 1
                if token is not None and not call.done():  # the models skip it if they have not begun it
                    self.counts.marked += 1
                    self.marks.mark(token)
                    call.add_done_callback(lambda _: self.marks.clear(token))
                call.add_done_callback(_consume)
                raise
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details() or "",
                                    trailing_metadata=error.trailing_metadata() or ())
        return handle

    async def _prepared(self, raw_request: bytes, remaining_s: float | None) -> tuple[bytes, list[str] | None]:
        """A ModelInfer as it is sent on: its timeout set (with_timeout), every output asked for when its
        model is cached (guard_requests.widen); and the outputs the client asked for (None: all it gets)."""
        from tritonclient.grpc import service_pb2

        request = service_pb2.ModelInferRequest.FromString(raw_request)
        asked = widen(request, await self._cached.outputs_of(request.model_name))
        if remaining_s is not None:
            set_timeout(request, remaining_s)
        elif asked is None:
            return raw_request, None
        return request.SerializeToString(), asked

    def _stream_handler(self, upstream):
        async def handle(request_iterator, context):
            call = upstream(metadata=_forwarded_metadata(context))
            self.counts.forwarded += 1

            async def pump() -> None:
                try:
                    async for raw_request in request_iterator:
                        await call.write(with_timeout(raw_request, context.time_remaining()))
                except (asyncio.CancelledError, grpc.aio.AioRpcError, grpc.RpcError):
                    pass
                finally:
                    await call.done_writing()

            pump_task = self._keep(pump())
            try:
                while True:
                    response = await call.read()
                    if response is grpc.aio.EOF:
                        break
                    yield response
            except asyncio.CancelledError:  # the client went: half-close upstream and read to the end
                self.counts.client_gone += 1
                self.counts.streams_drained += 1
                self._keep(self._drain(call, pump_task))
                raise
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details() or "")
        return handle

    @staticmethod
    async def _drain(call, pump_task: asyncio.Task) -> None:
        await pump_task
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError:
            pass


async def _awaited(call):
    return await call


def _consume(task: asyncio.Task) -> None:
    """Retrieve a dropped answer's outcome, so asyncio does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()


# -- the process: resnet18-kit grpc-guard ----------------------------------------------------------------------

#: How often the guard process writes its counts to --counts-file (when they changed), seconds.
COUNTS_INTERVAL_S = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The grpc-guard command's options."""
    parser.add_argument("--listen", required=True, metavar="HOST:PORT", help="where gRPC clients connect")
    parser.add_argument("--upstream", required=True, metavar="HOST:PORT", help="tritonserver's own gRPC address")
    parser.add_argument("--grace-s", type=float, default=5.0,
                        help="seconds calls in flight get after SIGTERM (default 5)")
    parser.add_argument("--port-flag", default="--listen", help=argparse.SUPPRESS)  # the starter's flag for the port
    parser.add_argument("--counts-file", type=Path,
                        help="a JSON file kept up to date with what the guard did (GuardCounts) while it "
                             "runs; removed at exit, with its folder if nothing else is left in it (the final "
                             "counts are the last line of the guard's output)")
    parser.add_argument("--cancel-marks", type=Path, metavar="FOLDER",
                        help="an existing folder where a ModelInfer whose client went away is marked "
                             "cancelled, for models that look (upstream.cancel_marks; tritonserver gets the "
                             "folder as RESNET18_KIT_CANCEL_MARKS); emptied and removed at exit")


def _address(text: str, flag: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{flag} {text}: give HOST:PORT with a port of 1 to 65535")
    return host.strip("[]"), int(port)


def run(settings, args: argparse.Namespace) -> int:
    """Forward until SIGTERM or SIGINT (module doc); the exit status."""
    try:
        host, port = _address(args.listen, "--listen")
        _address(args.upstream, "--upstream")
    except ValueError as exc:
        print(f"grpc-guard: {exc}", file=sys.stderr)
        return 2
    if args.cancel_marks is not None and not args.cancel_marks.is_dir():
        print(f"grpc-guard: --cancel-marks {args.cancel_marks}: not a folder", file=sys.stderr)
        return 2
    problem = busy_port(host, (("gRPC", args.port_flag, port),))  # before gRPC, whose failed bind logs a line of its own
    if problem:
        print(f"grpc-guard: {problem}", file=sys.stderr)
        return 2
    marks = Marks(args.cancel_marks) if args.cancel_marks is not None else None
    try:
        return asyncio.run(_serve(GuardServer(host, port, args.upstream, args.port_flag, marks), args.grace_s,
                                  args.counts_file))
    except PortBusyError as exc:
        print(f"grpc-guard: {exc}", file=sys.stderr)
        return 2


async def _serve(guard: GuardServer, grace_s: float, counts_file: Path | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)  # records only; this loop acts
    await guard.start()
    print(f"grpc-guard: listening on {guard.listen}, forwarding to {guard.upstream}", file=sys.stderr, flush=True)
    written = None
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), COUNTS_INTERVAL_S)
        written = _write_counts(counts_file, guard.counts, written)
    await guard.stop(grace_s)
    counts = ", ".join(f"{name} {value}" for name, value in asdict(guard.counts).items())
    print(f"grpc-guard: stopped; {counts}", file=sys.stderr, flush=True)
    if guard.marks is not None:  # nothing is in flight any more; like the counts, gone even when the process
        guard.marks.remove()     # that started the guard is (it got pdeathsig)
    if counts_file is not None:  # like a pid file: the state of a running guard
        with contextlib.suppress(OSError):
            counts_file.unlink()
            counts_file.parent.rmdir()  # the folder it was given, when nothing else is left in it
    return 0


def _write_counts(path: Path | None, counts: GuardCounts, last: dict | None) -> dict | None:
    now = asdict(counts)
    if path is not None and now != last:
        partial = path.with_name(path.name + ".part")
        partial.write_text(json.dumps(now))
        partial.replace(path)
    return now
