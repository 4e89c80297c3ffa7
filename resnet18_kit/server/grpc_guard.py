"""A gRPC front end that never passes a client's deadline or cancellation on to tritonserver.

Why: Triton 2.51 (the embedded server, NGC 24.10) crashes when gRPC inference requests are cancelled
while it holds them: a client deadline that expires, or a client that cancels, under a full queue ends in
SIGSEGV, or in heap corruption that leaves the process answering health checks while its threads are
stuck (server issue 7368, fixed by server PR 7840 in 24.12 = Triton 2.53.0; docs/reliability.md
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
  * a ModelInfer that arrives with its deadline already past is answered DEADLINE_EXCEEDED and not sent;
  * every other call (health, metadata, config, statistics, model control, shared memory) is forwarded
    byte for byte, with the client's metadata (the admin-key header included).
Forwarded calls end when Triton answers; a wedged server is the supervisor's to restart
(server.supervisor), which closes the connection and fails them with UNAVAILABLE.

The guard runs in a thread of the process that starts it, with its own asyncio loop (`start`, `stop`).
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import grpc

from resnet18_kit.server.embedded import PortBusyError
from resnet18_kit.server.resources import busy_port

#: The KServe v2 gRPC service (tritonclient.grpc.service_pb2).
SERVICE = "inference.GRPCInferenceService"
#: Message sizes are Triton's business (an encoded image may be 20 MB): no limit here (gRPC's default
#: receive limit is 4 MiB). SO_REUSEPORT off, so that a second listener on the port fails to bind
#: instead of silently sharing it.
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1))
SERVER_OPTIONS = CHANNEL_OPTIONS + (("grpc.so_reuseport", 0),)
#: Metadata keys that belong to the client's own connection and are not forwarded.
HOP_BY_HOP = ("user-agent",)
#: The request parameter Triton reads as the request's queue timeout (microseconds).
TIMEOUT_PARAMETER = "timeout"


@dataclass
class GuardCounts:
    """What the guard did since it started (read them any time; written by its loop only)."""

    forwarded: int = 0        # calls sent on to tritonserver
    client_gone: int = 0      # of those, calls whose client cancelled or timed out first: answer dropped
    expired_on_arrival: int = 0  # ModelInfer calls whose deadline had passed: answered, not forwarded
    streams_drained: int = 0  # streams whose client went away, read to their end upstream


def with_timeout(raw_request: bytes, remaining_s: float | None) -> bytes:
    """A serialized ModelInferRequest with `timeout` (microseconds) set to the client's remaining time,
    or to the request's own timeout when that is smaller; unchanged without a deadline."""
    if remaining_s is None:
        return raw_request
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest.FromString(raw_request)
    remaining_us = max(1, int(remaining_s * 1e6))
    own_us = request.parameters[TIMEOUT_PARAMETER].int64_param if TIMEOUT_PARAMETER in request.parameters else 0
    request.parameters[TIMEOUT_PARAMETER].int64_param = min(own_us, remaining_us) if own_us > 0 else remaining_us
    return request.SerializeToString()


def _forwarded_metadata(context) -> tuple:
    return tuple((key, value) for key, value in (context.invocation_metadata() or ())
                 if key not in HOP_BY_HOP and not key.startswith(("grpc-", ":")))


def _methods() -> list:
    from tritonclient.grpc import service_pb2

    return list(service_pb2.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[1]].methods)


class GrpcGuard:
    """Forward gRPC calls from `listen_host`:`listen_port` to `upstream` ("127.0.0.1:port") as the
    module doc says: start() returns once it listens, stop(grace_s) stops it; `counts` says what it did."""

    def __init__(self, listen_host: str, listen_port: int, upstream: str):
        self.listen = f"[{listen_host}]:{listen_port}" if ":" in listen_host else f"{listen_host}:{listen_port}"
        self.listen_port = listen_port
        self.upstream = upstream
        self.counts = GuardCounts()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server = None
        self._channel = None
        self._pending: set[asyncio.Task] = set()
        self._started = threading.Event()
        self._failure: BaseException | None = None

    # -- life cycle (called from any thread) -------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> None:
        """Listen and forward, in a thread of its own. Raises PortBusyError naming the port and its
        holder when it cannot be bound (taken, or not an address of this machine)."""
        self._thread = threading.Thread(target=self._run, name=f"grpc-guard-{self.listen_port}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(f"gRPC guard on {self.listen} did not start within {timeout_s:.0f} s")
        if self._failure is not None:
            self._thread.join()
            raise self._failure

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop listening; calls in flight get `grace_s` seconds to be answered, then the upstream
        connection closes (idempotent)."""
        loop = self._loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(grace_s), loop)
        try:
            future.result(grace_s + 5.0)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(5.0)

    def __enter__(self) -> "GrpcGuard":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the loop ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start()
            self._failure = exc
            self._started.set()
            self._loop.close()
            return
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.upstream, options=CHANNEL_OPTIONS)
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
            host = self.listen.rsplit(":", 1)[0].strip("[]")
            raise PortBusyError(busy_port(host, (("gRPC", "--grpc-port", self.listen_port),))
                                or f"gRPC port {self.listen_port} on {host} cannot be bound")
        await self._server.start()

    async def _shutdown(self, grace_s: float) -> None:
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
            remaining_s = context.time_remaining()
            if infer:
                if remaining_s is not None and remaining_s <= 0:
                    self.counts.expired_on_arrival += 1
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the request was sent")
                raw_request = with_timeout(raw_request, remaining_s)
            self.counts.forwarded += 1
            call = self._keep(_awaited(upstream(raw_request, metadata=_forwarded_metadata(context))))
            try:
                return await asyncio.shield(call)
            except asyncio.CancelledError:  # the client went: the forwarded call goes on, its answer dropped
                self.counts.client_gone += 1
                call.add_done_callback(_consume)
                raise
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details() or "",
                                    trailing_metadata=error.trailing_metadata() or ())
        return handle

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
