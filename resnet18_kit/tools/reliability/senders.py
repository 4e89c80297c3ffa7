"""How the scenarios send requests. Every request sent ends in one Outcome (load.outcomes), whatever
happens to it, so nothing goes unaccounted:

* `send_all`: every request of a range at once (asyncio, one connection or stream each);
* `infer_async`: one request on an asyncio client; LOST when it has no outcome within HANG_BOUND_S;
* `send_fresh`: one request on a fresh connection, which survives a server restart;
* `SteadyLoad`: one request at a time on a thread, each on a fresh connection, until stopped
  (`recovered_at`: when it was answered again after failures);
* `http_raw`, `grpc_raw_infer`: bytes as they are, past the client library's checks (no outcome
  classification: their callers compare status and message themselves).
"""
from __future__ import annotations

import asyncio
import threading
import time

from resnet18_kit.client.core import protocol_module
from resnet18_kit.tools.load.outcomes import ANSWERED, LOST, Outcome, failed
from resnet18_kit.tools.reliability.loads import HANG_BOUND_S, TensorLoad, infer_input, judge
from resnet18_kit.server.config import ServerConfig


def async_client(config: ServerConfig, protocol: str, connections: int):
    """(tritonclient asyncio module, client) for `protocol`; over HTTP with room for `connections`
    connections at once, each given HANG_BOUND_S to connect."""
    module = protocol_module(protocol, asyncio_api=True)
    if protocol == "http":
        return module, module.InferenceServerClient(config.http_url, conn_limit=connections + 1,
                                                    conn_timeout=HANG_BOUND_S)
    return module, module.InferenceServerClient(config.grpc_url)


async def infer_async(client, module, load: TensorLoad, index: int, request=None,
                      timeout_us: int | None = None) -> Outcome:
    """Send request `index` of `load` (`request`: its InferInput, built now when None) on the asyncio
    `client` of `module`, with the server-side queue timeout `timeout_us` (microseconds) when given;
    its outcome, LOST after HANG_BOUND_S without one."""
    request = infer_input(module, load, index) if request is None else request
    options = {} if timeout_us is None else {"timeout": timeout_us}
    started = time.perf_counter()
    try:
        result = await asyncio.wait_for(
            client.infer(load.model, [request], outputs=[module.InferRequestedOutput(load.output_name)],
                         request_id=str(index), **options), HANG_BOUND_S)
    except asyncio.TimeoutError:
        return Outcome(index, LOST, time.perf_counter() - started, message="no outcome (hung)")
    except Exception as exc:  # a Triton error, connection reset, ...
        return failed(index, exc, time.perf_counter() - started)
    return judge(load, index, result, started)


async def send_all(config: ServerConfig, protocol: str, load: TensorLoad, indices: range,
                   timeout_us: int | None = None) -> list[Outcome]:
    """Send every request of `indices` at once (asyncio, one connection or stream each) and wait for
    all outcomes, in the order of `indices`. Requests are built before the first is sent, so they
    leave together. timeout_us: each request's queue timeout (microseconds), the model's default when None."""
    module, client = async_client(config, protocol, len(indices))
    prepared = [(i, infer_input(module, load, i)) for i in indices]
    try:
        return list(await asyncio.gather(*(infer_async(client, module, load, i, request, timeout_us)
                                           for i, request in prepared)))
    finally:
        await client.close()


def infer(client, module, load: TensorLoad, index: int, **options):
    """Request `index` of `load` on the synchronous `client` of `module`, with its request id; the
    InferResult. Raises tritonclient's InferenceServerException (or a connection error)."""
    return client.infer(load.model, [infer_input(module, load, index)],
                        outputs=[module.InferRequestedOutput(load.output_name)], request_id=str(index), **options)


def send_fresh(config: ServerConfig, protocol: str, load: TensorLoad, index: int,
               grpc_timeout_s: float | None = None) -> Outcome:
    """Request `index` of `load` on a connection of its own, closed after it; any failure is an outcome,
    connection refused included (a server restarting or stopping). grpc_timeout_s: the gRPC client's
    own deadline, seconds (none when None; HTTP has none)."""
    module = protocol_module(protocol)
    options = {"client_timeout": grpc_timeout_s} if grpc_timeout_s is not None and protocol == "grpc" else {}
    started = time.perf_counter()
    try:
        client = module.InferenceServerClient(config.url(protocol))
    except Exception as exc:
        return failed(index, exc, 0.0)
    try:
        return judge(load, index, infer(client, module, load, index, **options), started)
    except Exception as exc:
        return failed(index, exc, time.perf_counter() - started)
    finally:
        try:
            client.close()
        except Exception:
            pass


class SteadyLoad:
    """One request at a time to `load.model` on a thread, every `interval_s` seconds, each on a fresh
    connection (`send_fresh`), recording every outcome until the `with` block ends. Connection failures
    (server restarting) are outcomes too (ERROR), so nothing goes unaccounted.
    outcomes: [(time.monotonic() of the outcome, Outcome)]."""

    def __init__(self, config: ServerConfig, protocol: str, load: TensorLoad, interval_s: float = 0.05):
        self.config, self.protocol, self.load, self.interval_s = config, protocol, load, interval_s
        self.outcomes: list[tuple[float, Outcome]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        index = 0
        while not self._stop.is_set():
            outcome = send_fresh(self.config, self.protocol, self.load, index)
            self.outcomes.append((time.monotonic(), outcome))
            index += 1
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "SteadyLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(HANG_BOUND_S)

    @property
    def sent(self) -> int:
        return len(self.outcomes)


def http_raw(config: ServerConfig, path: str, body: bytes, headers: dict | None = None) -> tuple[int, str]:
    """POST `body` to `path` (e.g. "/v2/models/m/infer") as it is, no client library checks; (HTTP
    status, body text). Raises OSError / http.client's errors when the connection fails."""
    import http.client

    host, port = config.http_url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=HANG_BOUND_S)
    try:
        connection.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        connection.close()


def grpc_raw_infer(config: ServerConfig, request_bytes: bytes) -> tuple[str, str]:
    """Send a serialized ModelInferRequest as it is; (status code name, details), ("OK", "") on success."""
    import grpc

    channel = grpc.insecure_channel(config.grpc_url)
    try:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
        call(request_bytes, timeout=HANG_BOUND_S)
        return "OK", ""
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""
    finally:
        channel.close()


def recovered_at(timed: list[tuple[float, Outcome]]) -> float | None:
    """The time of the first answer after the last failure among `timed` ((time, Outcome) in time
    order, as SteadyLoad.outcomes); None when no answer follows it."""
    last_failure = max((t for t, o in timed if o.kind != ANSWERED), default=0)
    return next((t for t, o in timed if o.kind == ANSWERED and t > last_failure), None)
