"""Load through a fleet's front end, as a gateway sends it: long-lived connections, retries, every request
accounted for.

`FleetLoad` runs `workers` threads sending requests of a TensorLoad closed-loop (each worker sends its next
request once the last one has an outcome) until stopped:
  * over gRPC every worker shares ONE client, so one HTTP/2 connection carries every call;
  * over HTTP each worker has its own client with one keep-alive connection (HTTP/1.1 has one request
    in flight per connection), opened once and kept for the whole run.

A try that was not executed is tried again after a backoff (client.backoff: full jitter, 5 ms doubling to
0.5 s), within the request's deadline (`deadline_s`):
  * a refusal: 503 / UNAVAILABLE "Exceeds maximum queue size" (back-pressure);
  * the gateway had no replica for it: HTTP 502 / 503 / 504 from HAProxy, gRPC UNAVAILABLE;
  * a connection that failed or was reset (a replica or the proxy went away mid-request);
  * when `retry_dead_stub`: Triton's "Stub process ... is not healthy" (HTTP 500 / INTERNAL), which a
    replica with a dead Python-backend stub answers; the request never ran (inference is idempotent).
Each request ends as one of: answered (the right answer, possibly after retries), refused (still refused
when its deadline passed), failed (any other error, a wrong answer, or a deadline passed on errors) or
lost (no outcome when the run ended). Every try's latency is kept by what it got, so the time a refusal
takes at the client (`try_ms["refused"]`) is reported beside the requests' outcomes.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from resnet18_kit.client.backoff import RetryPolicy
from resnet18_kit.client.core import protocol_module
from resnet18_kit.tools.load.outcomes import percentile
from resnet18_kit.tools.reliability.loads import TensorLoad, infer_input
from resnet18_kit.server.config import ServerConfig

#: Seconds one try may take before the client gives up on it (then it counts as a connection failure).
TRY_TIMEOUT_S = 20.0
#: HTTP statuses of a gateway with no replica for the request (never executed).
GATEWAY_STATUSES = ("502", "503", "504")


@dataclass
class Tally:
    """Counts of one run. sent: requests started; answered / refused / failed: their outcomes; retried:
    requests that needed more than one try; tries: every try by what it got ("answered", "refused",
    "unavailable", "dead-stub", "error"), with latencies in ms; errors: the first messages of failures."""

    sent: int = 0
    answered: int = 0
    refused: int = 0
    failed: int = 0
    retried: int = 0
    tries: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    #: (time.monotonic() when it was answered, latency in ms) of every answered try, in order.
    answered_at: list[tuple[float, float]] = field(default_factory=list)
    #: (time.monotonic() when it failed, its message) of every failed request, in order.
    failed_at: list[tuple[float, str]] = field(default_factory=list)

    @property
    def lost(self) -> int:
        """Requests started that have no outcome."""
        return self.sent - self.answered - self.refused - self.failed

    def try_ms(self, kind: str, q: float) -> float:
        """The `q`-th percentile (0..100) of the latencies in ms of the tries that got `kind`; NaN if none."""
        return percentile(sorted(self.tries.get(kind, [])), q)

    def row(self) -> dict:
        """The counts and the tries' p99 latencies (ms) as a table row."""
        out = {"sent": self.sent, "answered": self.answered, "refused": self.refused, "failed": self.failed,
               "lost": self.lost, "retried": self.retried}
        for kind, values in sorted(self.tries.items()):
            out[f"{kind}_tries"] = len(values)
            out[f"{kind}_p99_ms"] = round(self.try_ms(kind, 99), 1)
        return out


#: Seconds after a SIGKILL within which an answer it cut in transit reaches the client as an error.
CUT_WITHIN_S = 2.0
#: What a client gets for an answer a replica had begun to send when it died: HAProxy ends the gRPC stream
#: without trailers (tritonclient: "Stream removed"), or closes the HTTP connection mid-answer.
CUT_MARKERS = ("Stream removed", "unavailable (no retry)")


def not_cut_at(tally: Tally, killed_at: float, in_flight: int) -> list[str]:
    """The failures of `tally` that are NOT answers cut in transit by a kill at `killed_at`
    (time.monotonic()): every failure must come within CUT_WITHIN_S of the kill with a CUT_MARKERS message,
    and there can be no more of them than requests in flight (`in_flight`, the load's workers). A proxy
    replays a request whose replica died before answering; an answer already on its way to the client when
    the process died cannot be replayed by any proxy (only a client that retries hides it)."""
    bad = [f"{at - killed_at:+.2f} s from the kill: {message}" for at, message in tally.failed_at
           if not (-0.25 <= at - killed_at <= CUT_WITHIN_S and any(m in message for m in CUT_MARKERS))]
    if len(tally.failed_at) > in_flight:
        bad.append(f"{len(tally.failed_at)} cut answers, more than the {in_flight} requests in flight")
    return bad


def try_kind(exc: Exception, retry_dead_stub: bool) -> str:
    """What a failed try got: "refused", "unavailable" (gateway, connection or a stopping server's unloaded
    model: not executed), "dead-stub"
    (when retried) or "error"."""
    from resnet18_kit.client.errors import UNLOADED_MESSAGE, QueueFullError, from_triton
    from tritonclient.utils import InferenceServerException

    if isinstance(exc, InferenceServerException):
        error = from_triton(exc)
        if isinstance(error, QueueFullError):
            return "refused"
        status, message = str(error.status or ""), error.message or ""
        if retry_dead_stub and "is not healthy" in message:
            return "dead-stub"
        if (status in GATEWAY_STATUSES or status == "StatusCode.UNAVAILABLE" or "onnect" in message
                or UNLOADED_MESSAGE in message):  # a server that is stopping: not run
            return "unavailable"
        return "error"
    if isinstance(exc, (OSError, ConnectionError, TimeoutError)) or "onnect" in str(exc):
        return "unavailable"
    return "error"


class FleetLoad:
    """`workers` closed-loop senders of `load` to the front end `front` over `protocol` (module doc), until
    stopped or, with `limit`, until `limit` requests were sent (`wait()`). Use as a context manager;
    `tally` holds the counts; `stop()` waits for the requests under way. pause_s: seconds each worker waits
    between its requests (0: closed loop at full speed). retry=False: a plain client that never retries,
    whose request ends with its first try (refused, or failed on any error). keep_alive=False: over HTTP
    every request asks the server to close its connection afterwards (`Connection: close`)."""

    def __init__(self, front: ServerConfig, protocol: str, load: TensorLoad, workers: int = 4,
                 deadline_s: float = 30.0, retry_dead_stub: bool = False, pause_s: float = 0.0,
                 limit: int | None = None, retry: bool = True, keep_alive: bool = True):
        self.front, self.protocol, self.load, self.workers, self.limit = front, protocol, load, workers, limit
        self.deadline_s, self.retry_dead_stub, self.pause_s, self.retry = deadline_s, retry_dead_stub, pause_s, retry
        self.keep_alive = keep_alive
        self.tally = Tally()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._next = 0
        self._module = protocol_module(protocol)
        self._shared = self._client() if protocol == "grpc" else None

    def _client(self):
        if self.protocol == "grpc":
            return self._module.InferenceServerClient(self.front.grpc_url)
        return self._module.InferenceServerClient(self.front.http_url, concurrency=1, connection_timeout=TRY_TIMEOUT_S,
                                                  network_timeout=TRY_TIMEOUT_S)

    def _record_try(self, kind: str, latency_s: float) -> None:
        with self._lock:
            self.tally.tries.setdefault(kind, []).append(latency_s * 1000)
            if kind == "answered":
                self.tally.answered_at.append((time.monotonic(), latency_s * 1000))

    def _one(self, client, index: int) -> str:
        """Send request `index` until it has an outcome; returns "answered", "refused" or "failed"."""
        policy, started, attempt, last = RetryPolicy(deadline_s=self.deadline_s), time.monotonic(), 0, "error"
        while True:
            request = infer_input(self._module, self.load, index)
            output = self._module.InferRequestedOutput(self.load.output_name)
            t0 = time.monotonic()
            try:
                options = ({"client_timeout": TRY_TIMEOUT_S} if self.protocol == "grpc"
                           else {} if self.keep_alive else {"headers": {"Connection": "close"}})
                result = client.infer(self.load.model, [request], outputs=[output], request_id=str(index), **options)
                self._record_try("answered", time.monotonic() - t0)
                if self.load.expected and not self.load.correct(index, result.as_numpy(self.load.output_name)):
                    self._note(f"request {index}: a wrong answer")
                    return "failed"
                return "answered"
            except Exception as exc:  # classified: every try ends in one kind
                last, message = try_kind(exc, self.retry_dead_stub), f"{type(exc).__name__}: {str(exc)[:200]}"
                self._record_try(last, time.monotonic() - t0)
                if last == "error":
                    self._note(f"request {index}: {message}")
                    return "failed"
            if not self.retry:  # a plain client: the first try's outcome is the request's
                if last != "refused":
                    self._note(f"request {index}: {last} (no retry): {message}")
                return "refused" if last == "refused" else "failed"
            if attempt == 0:
                with self._lock:
                    self.tally.retried += 1
            wait_s = policy.backoff_s(attempt)
            attempt += 1
            if time.monotonic() - started + wait_s > self.deadline_s:
                if last != "refused":
                    self._note(f"request {index}: deadline passed after {attempt} tries, last {last}")
                return "refused" if last == "refused" else "failed"
            time.sleep(wait_s)

    def _note(self, message: str) -> None:
        """Keep a failed request's message (the first 20 in `errors`) and its time (`failed_at`)."""
        with self._lock:
            self.tally.failed_at.append((time.monotonic(), message))
            if len(self.tally.errors) < 20:
                self.tally.errors.append(message)

    def _worker(self) -> None:
        client = self._shared or self._client()
        try:
            while not self._stop.is_set():
                with self._lock:
                    if self.limit is not None and self._next >= self.limit:
                        return
                    index, self._next = self._next, self._next + 1
                    self.tally.sent += 1
                outcome = self._one(client, index)
                with self._lock:
                    setattr(self.tally, outcome, getattr(self.tally, outcome) + 1)
                if self.pause_s:
                    self._stop.wait(self.pause_s)
        finally:
            if client is not self._shared:
                client.close()

    def start(self) -> "FleetLoad":
        self._threads = [threading.Thread(target=self._worker, name=f"fleet-load-{i}", daemon=True)
                         for i in range(self.workers)]
        for thread in self._threads:
            thread.start()
        return self

    def wait(self, timeout_s: float = 600.0) -> Tally:
        """Wait until the `limit` requests have their outcomes (or `timeout_s` passed), then stop()."""
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        return self.stop(0)

    def stop(self, timeout_s: float | None = None) -> Tally:
        """Stop sending, wait up to `timeout_s` (default deadline + one try) for the requests under way;
        those still without an outcome count as lost."""
        self._stop.set()
        end = time.monotonic() + (self.deadline_s + TRY_TIMEOUT_S if timeout_s is None else timeout_s)
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        if self._shared is not None and not any(t.is_alive() for t in self._threads):
            self._shared.close()
        return self.tally

    def __enter__(self) -> "FleetLoad":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
