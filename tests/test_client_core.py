"""The sans-I/O client core (resnet18_kit.client.core.ClientCore) driven against a fake transport and a fake
clock: no server, no network, no real sleeps.

Covers: queue-full retries with capped, fully jittered exponential backoff (the Sleep sequence the
RetryPolicy gives, then success; giving up with QueueFullError once the next wait would pass the deadline;
other failures never retried); deadlines (the request's `timeout` parameter, Call.timeout_s and
rpc_timeout_s from the remaining time; DeadlineExceededError once it runs out, before a send or from a
client-side timeout); error mapping (each HTTP status / gRPC code / message that client.errors maps,
thrown in as tritonclient's InferenceServerException, comes out as its typed error with status and
message; other exceptions of an exchange); and classify / infer_tensor end to end (requests built, fake
`as_numpy` results parsed into Prediction rows and logits).
"""
from __future__ import annotations

import math
import random
import types

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from resnet18_kit.client import backoff
from resnet18_kit.client.backoff import RetryPolicy
from resnet18_kit.client.core import Call, ClientCore, Prediction, Sleep, advance, rpc_deadline_s
from resnet18_kit.client.errors import (DeadlineExceededError, InferenceError, InvalidInputError,
                                        ModelNotFoundError, NotTritonError, QueueFullError, RequestCancelledError,
                                        ServerUnavailableError)

MODEL = "resnet18"
QUEUE_FULL = "Exceeds maximum queue size"


class CapRng:
    """A jitter source that records each uniform(a, b) it is asked for and answers `fraction` of the way."""

    def __init__(self, fraction: float = 1.0):
        self.fraction, self.asked = fraction, []

    def uniform(self, a, b):
        self.asked.append((a, b))
        return a + (b - a) * self.fraction


class Clock:
    now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    """Fake monotonic clock for client.backoff.Deadline (the only clock the core reads)."""
    fake = Clock()
    monkeypatch.setattr(backoff, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


class FakeResult(dict):
    """What tritonclient's InferResult offers the core: as_numpy(name)."""

    def as_numpy(self, name):
        return self[name]


class FakeServer:
    """Answers the core's Calls: the model config, and scripted infer answers (an exception is raised,
    anything else returned). Each infer takes `infer_s` on the clock; each Sleep takes its seconds plus
    `oversleep_s`."""

    def __init__(self, clock: Clock | None, infer_answers=(), config: dict | None = None, infer_s: float = 0.0,
                 oversleep_s: float = 0.0, answers: dict | None = None):
        self.clock, self.infer_answers = clock or Clock(), list(infer_answers)
        self.config = config if config is not None else {"name": MODEL, "max_batch_size": 16}
        self.infer_s, self.oversleep_s, self.answers = infer_s, oversleep_s, answers or {}
        self.calls: list[Call] = []
        self.sleeps: list[float] = []

    def perform(self, call: Call):
        self.calls.append(call)
        if call.name == "get_model_config":
            return {"config": self.config} if call.kwargs.get("as_json") else self.config
        if call.name == "infer":
            self.clock.now += self.infer_s
            answer = self.infer_answers.pop(0)
        else:
            answer = self.answers[call.name]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def infers(self) -> list[Call]:
        return [call for call in self.calls if call.name == "infer"]


def drive(steps, server: FakeServer):
    """What the shells do (client.sync_client._run), with the fake transport and clock."""
    done, step = advance(steps)
    while not done:
        if isinstance(step, Sleep):
            server.sleeps.append(step.seconds)
            server.clock.now += step.seconds + server.oversleep_s
            done, step = advance(steps)
            continue
        assert isinstance(step, Call), step
        try:
            answer = server.perform(step)
        except Exception as exc:
            done, step = advance(steps, failure=exc)
        else:
            done, step = advance(steps, answer)
    return step


def logits_result(n: int) -> FakeResult:
    return FakeResult({"logits": np.arange(n * 1000, dtype=np.float32).reshape(n, 1000)})


def queue_full(status: str = "503") -> InferenceServerException:
    return InferenceServerException(QUEUE_FULL, status=status)


BATCH = np.zeros((1, 3, 224, 224), np.uint8)


# -- retries with backoff --------------------------------------------------------------------------------

@pytest.mark.parametrize("protocol,status", [("http", "503"), ("grpc", "StatusCode.UNAVAILABLE")])
def test_queue_full_is_retried_with_growing_capped_waits_then_succeeds(clock, protocol, status):
    rng = CapRng(1.0)  # every wait at its cap: the caps themselves are visible
    policy = RetryPolicy(initial_backoff_s=0.01, multiplier=2.0, max_backoff_s=0.05, deadline_s=10.0, rng=rng)
    core = ClientCore(protocol=protocol, retry=policy)
    server = FakeServer(clock, [queue_full(status)] * 6 + [logits_result(1)])
    logits = drive(core._infer_tensor(BATCH, MODEL, None), server)
    assert server.sleeps == pytest.approx([0.01, 0.02, 0.04, 0.05, 0.05, 0.05])
    assert [low for low, _ in rng.asked] == [0.0] * 6  # full jitter: drawn from 0 up to the cap
    assert [cap for _, cap in rng.asked] == pytest.approx(server.sleeps)
    assert len(server.infers()) == 7 and core.retries == 6
    assert logits.shape == (1, 1000) and logits[0, 7] == 7.0


def test_seeded_jitter_stays_within_the_caps_and_is_the_policys_draw(clock):
    policy = RetryPolicy(initial_backoff_s=0.004, multiplier=3.0, max_backoff_s=0.1, deadline_s=10.0,
                         rng=random.Random(7))
    server = FakeServer(clock, [queue_full()] * 8 + [logits_result(1)])
    drive(ClientCore(retry=policy)._infer_tensor(BATCH, MODEL, None), server)
    reference = random.Random(7)
    caps = [min(0.1, 0.004 * 3.0 ** n) for n in range(8)]
    assert server.sleeps == [reference.uniform(0.0, cap) for cap in caps]
    assert all(0.0 <= wait <= cap for wait, cap in zip(server.sleeps, caps))
    assert len(set(server.sleeps)) == 8  # jittered, not a fixed schedule


def test_queue_full_gives_up_with_queue_full_error_when_the_next_wait_passes_the_deadline(clock):
    policy = RetryPolicy(initial_backoff_s=0.01, multiplier=2.0, max_backoff_s=1.0, deadline_s=0.1, rng=CapRng())
    core = ClientCore(retry=policy)
    server = FakeServer(clock, [queue_full()] * 10)
    with pytest.raises(QueueFullError) as caught:
        drive(core._infer_tensor(BATCH, MODEL, None), server)
    # waits 0.01 + 0.02 + 0.04 leave 0.03 s; the next (0.08 s) would pass the deadline
    assert server.sleeps == pytest.approx([0.01, 0.02, 0.04])
    assert len(server.infers()) == 4
    assert caught.value.retries == 3 and core.retries == 3
    assert caught.value.status == "503" and caught.value.message == QUEUE_FULL


@pytest.mark.parametrize("failure,error", [
    (InferenceServerException("server is not ready", status="503"), ServerUnavailableError),
    (InferenceServerException("bad image", status="400"), InvalidInputError),
    (InferenceServerException("Request timeout expired", status="400"), DeadlineExceededError),
])
def test_other_failures_are_never_retried(clock, failure, error):
    core = ClientCore(retry=RetryPolicy(rng=CapRng()))
    server = FakeServer(clock, [failure, logits_result(1)])
    with pytest.raises(error) as caught:
        drive(core._infer_tensor(BATCH, MODEL, None), server)
    assert type(caught.value) is error and caught.value.retries == 0
    assert server.sleeps == [] and len(server.infers()) == 1 and core.retries == 0


# -- deadlines --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_remaining_time_is_the_requests_timeout_and_bounds_the_rpc(clock, protocol):
    core = ClientCore(protocol=protocol, retry=RetryPolicy(initial_backoff_s=0.5, max_backoff_s=0.5, rng=CapRng()))
    server = FakeServer(clock, [queue_full(), logits_result(1)], infer_s=0.25)
    drive(core._infer_tensor(BATCH, MODEL, deadline_s=2.0), server)
    first, second = server.infers()
    # 2 s at the first send; 2 - 0.25 (first try) - 0.5 (backoff) = 1.25 s at the second
    for call, remaining in ((first, 2.0), (second, 1.25)):
        assert call.timeout_s == pytest.approx(remaining)
        assert call.kwargs["timeout"] == int(remaining * 1e6)  # microseconds
        assert call.rpc_timeout_s == pytest.approx(2 * remaining + 30.0)  # STEP_QUEUES x T + RPC_GRACE_S
        assert call.kwargs.get("client_timeout") == (call.rpc_timeout_s if protocol == "grpc" else None)
        assert call.args[0] == MODEL and "priority" not in call.kwargs


def test_the_policys_deadline_is_the_default_and_none_means_unbounded(clock):
    server = FakeServer(clock, [logits_result(1), logits_result(1)])
    drive(ClientCore(retry=RetryPolicy(deadline_s=7.0))._infer_tensor(BATCH, MODEL, None), server)
    drive(ClientCore(retry=RetryPolicy(deadline_s=None))._infer_tensor(BATCH, MODEL, None), server)
    bounded, unbounded = server.infers()
    assert bounded.timeout_s == pytest.approx(7.0) and bounded.kwargs["timeout"] == 7_000_000
    assert unbounded.timeout_s is None and unbounded.rpc_timeout_s is None and "timeout" not in unbounded.kwargs
    assert rpc_deadline_s(None) is None and rpc_deadline_s(1.5) == pytest.approx(33.0)


def test_a_deadline_spent_while_backing_off_raises_before_sending_again(clock):
    core = ClientCore(retry=RetryPolicy(initial_backoff_s=0.5, max_backoff_s=0.5, rng=CapRng()))
    server = FakeServer(clock, [queue_full(), logits_result(1)], oversleep_s=0.6)  # the sleep overshoots
    with pytest.raises(DeadlineExceededError) as caught:
        drive(core._infer_tensor(BATCH, MODEL, deadline_s=1.0), server)
    assert len(server.infers()) == 1 and server.sleeps == [0.5] and caught.value.retries == 1


def test_no_answer_within_the_deadline_is_deadline_exceeded_and_not_retried(clock):
    core = ClientCore(retry=RetryPolicy(rng=CapRng()))
    server = FakeServer(clock, [TimeoutError("1.000 s"), logits_result(1)], infer_s=1.0)
    with pytest.raises(DeadlineExceededError, match="no response within the deadline"):
        drive(core._infer_tensor(BATCH, MODEL, deadline_s=1.0), server)
    assert len(server.infers()) == 1 and server.sleeps == []


@pytest.mark.parametrize("infer_s,error", [(0.5, ServerUnavailableError), (1.5, DeadlineExceededError)])
def test_a_lost_connection_after_the_deadline_is_deadline_exceeded(clock, infer_s, error):
    server = FakeServer(clock, [ConnectionRefusedError("refused")], infer_s=infer_s)
    with pytest.raises(error) as caught:
        drive(ClientCore()._infer_tensor(BATCH, MODEL, deadline_s=1.0), server)
    assert type(caught.value) is error and caught.value.status is None


@pytest.mark.parametrize("operation,match", [
    (lambda core: core._infer_tensor(BATCH, MODEL, deadline_s=0), "deadline_s"),
    (lambda core: core._infer_tensor(BATCH, MODEL, deadline_s=-1.0), "deadline_s"),
    (lambda core: core._classify([b"x"], 0, MODEL, None), "top_k"),
    (lambda core: core._classify([b"x"], 1001, MODEL, None), "top_k"),
])
def test_bad_arguments_are_refused_before_any_call(operation, match):
    server = FakeServer(None)
    with pytest.raises(ValueError, match=match):
        drive(operation(ClientCore()), server)
    assert server.calls == []


# -- error mapping ----------------------------------------------------------------------------------------

#: (protocol, status, server message, typed error): what client.errors.from_triton documents.
MAPPING = [
    ("http", "400", "failed to decode image", InvalidInputError),
    ("grpc", "StatusCode.INVALID_ARGUMENT", "failed to decode image", InvalidInputError),
    ("http", "503", QUEUE_FULL, QueueFullError),
    ("grpc", "StatusCode.UNAVAILABLE", f"in model 'x': {QUEUE_FULL}", QueueFullError),
    ("http", "503", "Server not ready", ServerUnavailableError),
    ("grpc", "StatusCode.UNAVAILABLE", "failed to connect to all addresses", ServerUnavailableError),
    ("http", None, "connection reset", ServerUnavailableError),
    ("grpc", "StatusCode.CANCELLED", "Locally cancelled by application!", RequestCancelledError),
    ("http", "499", "client closed request", RequestCancelledError),
    ("grpc", "StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", DeadlineExceededError),
    ("http", "504", "gateway timeout", DeadlineExceededError),
    ("http", "400", "Request timeout expired", DeadlineExceededError),
    ("grpc", "StatusCode.UNAVAILABLE", "Request timeout expired", DeadlineExceededError),
    ("http", "404", "Request for unknown model: 'resnet18' has no available versions", ServerUnavailableError),
    ("grpc", "StatusCode.NOT_FOUND", "Request for unknown model: 'x' has no available versions",
     ServerUnavailableError),
    ("http", "404", "Request for unknown model: 'nope' is not found", ModelNotFoundError),
    ("grpc", "StatusCode.NOT_FOUND", "model not found", ModelNotFoundError),
    ("http", "400", "Request for unknown model: 'nope'", ModelNotFoundError),
    ("grpc", "StatusCode.INVALID_ARGUMENT", "Request for model 'nope' is not found", ModelNotFoundError),
    ("http", "500", "internal error", InferenceError),
    ("grpc", "StatusCode.INTERNAL", "internal error", InferenceError),
]


@pytest.mark.parametrize("path", ["health", "infer"])
@pytest.mark.parametrize("protocol,status,message,error", MAPPING)
def test_each_triton_status_maps_to_its_typed_error(clock, path, protocol, status, message, error):
    # initial backoff far beyond the deadline: a queue-full refusal is raised at once, not retried
    core = ClientCore(protocol=protocol, retry=RetryPolicy(initial_backoff_s=100.0, max_backoff_s=100.0,
                                                           deadline_s=5.0, rng=CapRng()))
    failure = InferenceServerException(message, status=status)
    server = FakeServer(clock, [failure], answers={"is_model_ready": failure})
    steps = core._is_model_ready(MODEL) if path == "health" else core._infer_tensor(BATCH, MODEL, None)
    with pytest.raises(InferenceError) as caught:
        drive(steps, server)
    assert type(caught.value) is error
    assert caught.value.status == status and caught.value.message == message
    assert str(caught.value) == (f"{message} (status {status})" if status else message)
    assert server.calls[-1].name == ("is_model_ready" if path == "health" else "infer") and server.sleeps == []
    if path == "health" and protocol == "grpc":
        assert server.calls[-1].kwargs["client_timeout"] == core.connection_timeout_s


@pytest.mark.parametrize("failure,path,error,text", [
    (TimeoutError("timed out"), "health", DeadlineExceededError, "no response within the deadline (timed out)"),
    (ConnectionRefusedError("refused"), "health", ServerUnavailableError, "cannot connect to 127.0.0.1:8000"),
    (InferenceServerException("Socket closed", status=None), "health", NotTritonError, "Triton HTTP endpoint"),
    (InferenceServerException("Socket closed", status=None), "infer", ServerUnavailableError, "Socket closed"),
    (KeyError("version"), "health", NotTritonError, "KeyError"),
])
def test_other_failures_of_an_exchange_are_typed(clock, failure, path, error, text):
    core = ClientCore()
    server = FakeServer(clock, [failure], answers={"is_server_live": failure})
    steps = core._is_server_live() if path == "health" else core._infer_tensor(BATCH, MODEL, None)
    with pytest.raises(error) as caught:
        drive(steps, server)
    assert type(caught.value) is error and text in str(caught.value) and "\n" not in str(caught.value)


def test_a_bug_is_raised_as_itself_not_typed(clock):
    server = FakeServer(clock, answers={"is_server_live": RuntimeError("bug")})
    with pytest.raises(RuntimeError, match="bug"):
        drive(ClientCore()._is_server_live(), server)


# -- exchanges end to end ---------------------------------------------------------------------------------

def test_classify_builds_the_request_and_parses_the_classification_strings(clock):
    probabilities = np.array([[b"0.75:281:tabby", b"0.125:282:tiger cat", b"0.0625:285:Egyptian cat"],
                              [b"0.5:1:goldfish", b"0.25:0:tench", b"0.125:2:great white shark"]], dtype=np.object_)
    logits = np.array([[b"9.5:281:tabby", b"8.25:282:tiger cat", b"7.0:999:toilet tissue"],
                       [b"3.0:0:tench", b"4.0:1:goldfish", b"1.5:2:great white shark"]], dtype=np.object_)
    core = ClientCore()
    server = FakeServer(clock, [FakeResult({"probabilities": probabilities, "logits": logits})])
    rows = drive(core._classify([b"jpeg-0", b"jpeg-1"], 3, MODEL, deadline_s=5.0), server)
    assert [call.name for call in server.calls] == ["get_model_config", "infer"]
    model, inputs = server.infers()[0].args
    assert model == MODEL and [(i.name(), i.shape(), i.datatype()) for i in inputs] == [("image", [2, 1], "BYTES")]
    outputs = server.infers()[0].kwargs["outputs"]
    assert [o.name() for o in outputs] == ["probabilities", "logits"]
    assert all(o._parameters.get("classification") == 3 for o in outputs)
    assert [len(row) for row in rows] == [3, 3]
    assert rows[0][0] == Prediction(label="tabby", class_index=281, probability=0.75, logit=9.5)
    assert rows[0][1] == Prediction(label="tiger cat", class_index=282, probability=0.125, logit=8.25)
    assert rows[0][2].class_index == 285 and math.isnan(rows[0][2].logit)  # not in the logits' top k
    assert [(p.class_index, p.probability, p.logit) for p in rows[1]] == [(1, 0.5, 4.0), (0, 0.25, 3.0),
                                                                          (2, 0.125, 1.5)]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_infer_tensor_sends_the_batch_and_returns_the_logits(clock, protocol):
    batch = np.random.default_rng(0).integers(0, 256, (2, 3, 224, 224), dtype=np.uint8)
    core = ClientCore(protocol=protocol)
    server = FakeServer(clock, [logits_result(2), logits_result(2)])
    first = drive(core._infer_tensor(batch, "resnet18_onnx", None), server)
    drive(core._infer_tensor(batch, "resnet18_onnx", None), server)
    assert [call.name for call in server.calls] == ["get_model_config", "infer", "infer"]  # config cached
    assert first.shape == (2, 1000) and first.dtype == np.float32 and first[1, 999] == 1999.0
    (request,), (output,) = server.infers()[0].args[1], server.infers()[0].kwargs["outputs"]
    assert (request.name(), request.shape(), request.datatype()) == ("input", [2, 3, 224, 224], "UINT8")
    assert output.name() == "logits"
    with pytest.raises(ValueError, match="UINT8 pixels \\[N, 3, 224, 224\\], got uint8 \\[2, 1, 224, 224\\]"):
        drive(core._infer_tensor(batch[:, :1], "resnet18_onnx", None), server)
    with pytest.raises(ValueError, match="got float32 \\[2, 3, 224, 224\\]"):  # normalized FP32: not the input
        drive(core._infer_tensor(batch.astype(np.float32), "resnet18_onnx", None), server)


def test_priority_is_sent_when_served_and_refused_when_not(clock):
    config = {"name": MODEL, "max_batch_size": 16, "dynamic_batching": {"priority_levels": 2}}
    server = FakeServer(clock, [logits_result(1)], config=config)
    core = ClientCore()
    drive(core._infer_tensor(BATCH, MODEL, None, priority=1), server)
    assert server.infers()[0].kwargs["priority"] == 1
    with pytest.raises(ValueError, match="priority 3"):
        drive(core._infer_tensor(BATCH, MODEL, None, priority=3), server)
    assert len(server.infers()) == 1
