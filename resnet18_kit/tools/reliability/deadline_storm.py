"""Short gRPC deadlines under overload: the client behaviour that crashes Triton 2.51, sent on purpose.

A client the kit does not control: plain `tritonclient.grpc` `infer` calls to the `resnet18` ensemble,
`threads` at once, each with a `client_timeout` drawn uniformly from `deadline_ms` (e.g. 1-50 ms), so
most of them expire, and the RPC is cancelled, while the request waits in a full queue or runs. Against
an unprotected 2.51 server this ends in SIGSEGV or heap corruption within a few rounds (server issue 7368;
docs/reliability.md "Deadlines and cancellation"); against the kit's gRPC guard (upstream.grpc_guard) the
server must live through it.

`storm` sends one round and says what came back; `cancel_storm` is the same round sent by the kit's own
asyncio client over HTTP or gRPC, each request cancelled by its caller (`cancel` event) 1-50 ms after it
was sent, the cancellation paths docs/usage.md "Traffic controls" offers. `rounds` repeats either against a
supervised server and counts crashes (the server process ended or was replaced by the supervisor), hangs (no answer to a probe
sent without a deadline after the round) and lost requests (no outcome from the client within
HANG_BOUND_S).
"""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from resnet18_kit.contract import ENSEMBLE_MODEL, IMAGE_INPUT, PROBABILITIES_OUTPUT
from resnet18_kit.tools.load.photos import tagged
from resnet18_kit.tools.reliability.loads import HANG_BOUND_S

#: gRPC codes a storm's requests end with: answered, DEADLINE_EXCEEDED (the client gave up), UNAVAILABLE
#: (queue full, timeout expired in the queue, or the server gone), anything else; a cancel storm's requests
#: also end cancelled (in flight) or not_sent (cancelled before they were sent).
STORM_KINDS = ("answered", "deadline", "unavailable", "cancelled", "not_sent", "other")


@dataclass
class StormResult:
    """One round: `sent` requests, the count of each of STORM_KINDS, and `lost` (no outcome within
    HANG_BOUND_S); `seconds` the round's wall time; `messages` one example message per kind."""

    sent: int
    counts: dict
    lost: int
    seconds: float
    messages: dict


def unique_photo(photos: list[bytes], index: int, seed: int) -> bytes:
    """Photo `index` of a round (taken in turn), tagged (load.photos.tagged) with the round and the index:
    no two requests of the storms share an input, so none is answered from a response cache."""
    return tagged(photos[index % len(photos)], f"storm-{seed}-{index}")


def storm(grpc_url: str, photos: list[bytes], requests: int = 600, threads: int = 128,
          deadline_ms: tuple[float, float] = (1.0, 50.0), model: str = ENSEMBLE_MODEL, seed: int = 0) -> StormResult:
    """Send `requests` inferences of `photos` (encoded images, taken in turn) to `model` at `grpc_url`
    from `threads` threads, each with a gRPC deadline drawn uniformly from `deadline_ms` (milliseconds,
    (low, high)); one client (channel) per thread. Returns the round's StormResult."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    import numpy as np

    rng = random.Random(seed)
    deadlines_s = [rng.uniform(*deadline_ms) / 1000 for _ in range(requests)]
    local = threading.local()
    clients = []
    lock = threading.Lock()

    def send(index: int) -> tuple[str, str]:
        if not hasattr(local, "client"):
            local.client = grpcclient.InferenceServerClient(grpc_url)
            with lock:
                clients.append(local.client)
        array = np.array([[unique_photo(photos, index, seed)]], dtype=np.object_)
        request = grpcclient.InferInput(IMAGE_INPUT, [1, 1], "BYTES")
        request.set_data_from_numpy(array)
        try:
            local.client.infer(model, [request], outputs=[grpcclient.InferRequestedOutput(PROBABILITIES_OUTPUT)],
                               client_timeout=deadlines_s[index])
            return "answered", ""
        except InferenceServerException as exc:
            status = exc.status() or ""
            kind = ("deadline" if "DEADLINE_EXCEEDED" in status else
                    "unavailable" if "UNAVAILABLE" in status else "other")
            return kind, f"{status} {exc.message()}"

    started = time.monotonic()
    counts = dict.fromkeys(STORM_KINDS, 0)
    messages: dict = {}
    lost = 0
    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(send, i) for i in range(requests)]
        for future in futures:
            try:
                kind, message = future.result(timeout=max(0.0, started + HANG_BOUND_S - time.monotonic()))
            except Exception:
                lost += 1
                continue
            counts[kind] += 1
            messages.setdefault(kind, message)
    for client in clients:
        client.close()
    return StormResult(requests, counts, lost, round(time.monotonic() - started, 2), messages)


def cancel_storm(url: str, photos: list[bytes], protocol: str = "grpc", requests: int = 600, threads: int = 128,
                 deadline_ms: tuple[float, float] = (1.0, 50.0), model: str = ENSEMBLE_MODEL, seed: int = 0) -> StormResult:
    """`requests` classify calls of `photos` to `model` at `url` over `protocol` from one asyncio client
    (client.async_client), `threads` in flight at once, each cancelled by its caller after a delay drawn
    uniformly from `deadline_ms` (milliseconds). Returns the round's StormResult ("cancelled": the
    caller's RequestCancelledError)."""
    import asyncio

    from resnet18_kit.client.async_client import AsyncTritonClassifierClient
    from resnet18_kit.client.errors import DeadlineExceededError, RequestCancelledError, ServerUnavailableError

    rng = random.Random(seed)
    delays_s = [rng.uniform(*deadline_ms) / 1000 for _ in range(requests)]

    async def round_() -> list[tuple[str, str]]:
        slots = asyncio.Semaphore(threads)
        async with AsyncTritonClassifierClient(url, protocol) as client:
            await client.classify([photos[0]], top_k=1, model=model)  # configs read: every timer runs on a send

            async def one(index: int) -> tuple[str, str]:
                async with slots:
                    cancel = asyncio.Event()
                    asyncio.get_running_loop().call_later(delays_s[index], cancel.set)
                    try:
                        await client.classify([unique_photo(photos, index, seed)], top_k=1, model=model,
                                              cancel=cancel)
                        return "answered", ""
                    except RequestCancelledError as exc:
                        return ("not_sent" if "before it was sent" in str(exc) else "cancelled"), str(exc)
                    except DeadlineExceededError as exc:
                        return "deadline", str(exc)
                    except ServerUnavailableError as exc:
                        return "unavailable", str(exc)
                    except Exception as exc:  # any other failure: counted, the round goes on
                        return "other", f"{type(exc).__name__}: {exc}"
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(requests))), HANG_BOUND_S)

    started = time.monotonic()
    counts = dict.fromkeys(STORM_KINDS, 0)
    messages: dict = {}
    try:
        outcomes = asyncio.run(round_())
    except asyncio.TimeoutError:
        return StormResult(requests, counts, requests, round(time.monotonic() - started, 2), {"lost": "no outcome"})
    for kind, message in outcomes:
        counts[kind] += 1
        messages.setdefault(kind, message)
    return StormResult(requests, counts, 0, round(time.monotonic() - started, 2), messages)


def probe(grpc_url: str, photo: bytes, model: str = ENSEMBLE_MODEL, timeout_s: float = 30.0) -> str | None:
    """One inference without a short deadline (bounded by `timeout_s`): None when answered, else why not."""
    import tritonclient.grpc as grpcclient
    import numpy as np

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        request = grpcclient.InferInput(IMAGE_INPUT, [1, 1], "BYTES")
        request.set_data_from_numpy(np.array([[photo]], dtype=np.object_))
        client.infer(model, [request], client_timeout=timeout_s)
        return None
    except Exception as exc:  # any failure: the caller counts it
        return " ".join(str(exc).split())[:200]
    finally:
        client.close()


def rounds(run, photos: list[bytes], count: int, stop_on_crash: bool = False, send=None, url: str | None = None,
           **storm_options) -> dict:
    """`count` storms against the server of `run` (reliability.lifecycle.ServeRun, ready), sent to its
    config's gRPC address. After each round: a crash is the tritonserver process gone or replaced (its pid
    changed, or serve reported a fault; the next round waits until serve has it ready again); a hang is a
    probe without a short deadline that fails on a server still running. Returns {"rounds", "crashes"
    (rounds with one), "hangs", "lost", "sent", "counts" (summed over rounds), "seconds" (per round),
    "crash_rounds", "faults" (serve's fault lines), "messages" (one example per kind)}; stop_on_crash: end
    after the first round with a crash ("rounds" then says how many ran). send: the round (default `storm`;
    or `cancel_storm`), sent to `url` (default the config's gRPC address)."""
    from resnet18_kit.tools.reliability.lifecycle import wait_for_restart

    def mark() -> tuple[int | None, int]:
        return run.server_pid(), len(run.stderr_lines())

    def faults_since(since: tuple[int | None, int]) -> list[str]:
        pid, lines_before = since
        faults = [line for line in run.stderr_lines()[lines_before:] if line.startswith("serve: fault: ")]
        if faults or run.server_pid() != pid:
            wait_for_restart(run, lines_before)
            return ["; ".join(faults) or f"tritonserver pid {pid} replaced"]  # one crash per round
        return []

    return _rounds(run.config.grpc_url, photos, count, mark, faults_since, stop_on_crash, storm_options,
                   send or storm, url)


def fleet_rounds(fleet, photos: list[bytes], count: int, **storm_options) -> dict:
    """`count` storms against the gRPC front end of `fleet` (fleet.Fleet, started). A crash is a fault any
    replica's supervisor reported during the round (the next round waits until every replica is UP in
    HAProxy again); a hang is a probe through the front end that fails. Returns rounds()'s record, with
    "crashes" counting faults (several replicas may fail in one round)."""
    def mark() -> list[int]:
        return [len(s.events) for s in fleet.supervisors]

    def faults_since(marks: list[int]) -> list[str]:
        faults = [f"replica {i + 1}: {e.detail}" for i, s in enumerate(fleet.supervisors)
                  for e in s.events[marks[i]:] if e.kind == "fault"]
        if faults:
            for index, supervisor in enumerate(fleet.supervisors):
                supervisor.wait_serving(120.0)
                fleet.wait_status(index, "UP", 120.0)
        return faults

    return _rounds(fleet.config.front.server_config().grpc_url, photos, count, mark, faults_since, False,
                   storm_options)


def _rounds(grpc_url: str, photos: list[bytes], count: int, mark, faults_since, stop_on_crash: bool,
            storm_options: dict, send=storm, storm_url: str | None = None) -> dict:
    """The loop of rounds() and fleet_rounds(): mark() before a round, faults_since(mark) after it (the
    faults seen, once the server serves again). Each round is send(storm_url or grpc_url, ...); the probe
    after it goes to grpc_url."""
    totals = dict.fromkeys(STORM_KINDS, 0)
    record = {"rounds": count, "crashes": 0, "hangs": 0, "lost": 0, "sent": 0, "seconds": [], "crash_rounds": [],
              "faults": [], "messages": {}}
    for number in range(count):
        since = mark()
        result = send(storm_url or grpc_url, photos, seed=number, **storm_options)
        time.sleep(0.5)  # a crash takes a moment to end the process
        hung = probe(grpc_url, photos[0])
        faults = faults_since(since)
        if faults:
            record["crashes"] += len(faults)
            record["crash_rounds"].append(number)
            record["faults"] += faults
        elif hung is not None:
            record["hangs"] += 1
            record["messages"].setdefault("hang", hung)
        record["lost"] += result.lost
        record["sent"] += result.sent
        record["seconds"].append(result.seconds)
        for kind in STORM_KINDS:
            totals[kind] += result.counts[kind]
        for kind, message in result.messages.items():
            record["messages"].setdefault(kind, message)
        if faults and stop_on_crash:
            record["rounds"] = number + 1
            break
    record["counts"] = totals
    return record
