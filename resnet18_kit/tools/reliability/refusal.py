"""The server's own time to refuse: single requests that meet a queue other senders keep full."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from resnet18_kit.client.core import protocol_module
from resnet18_kit.tools.load.outcomes import ANSWERED, LOST, REFUSED, WRONG, Outcome, failed, summarize
from resnet18_kit.tools.reliability.loads import HANG_BOUND_S, TensorLoad, judge
from resnet18_kit.tools.reliability.senders import async_client, infer, infer_async
from resnet18_kit.tools.reliability.table import ms_cell, unaccounted
from resnet18_kit.server.config import ServerConfig

#: Seconds a filler waits after a refusal before its next request.
FILLER_PAUSE_S = 0.02


#: Request ids of probe thread k start at PROBE_ID_STRIDE * (k + 1): apart from the fillers' and each other's.
PROBE_ID_STRIDE = 10_000_000
#: Seconds each probe thread waits between its requests.
PROBE_INTERVAL_S = 0.02


def refusal_latency(config: ServerConfig, protocol: str, load: TensorLoad, seconds: float = 4.0,
                    probes: int = 4) -> dict:
    """The server's time to refuse a request that meets a full queue.

    Fillers (asyncio, max_queue_size + max_batch_size + 16 of them, each sending its next request as
    soon as the previous one is answered, FILLER_PAUSE_S after a refusal) keep `load.model`'s queue
    full; once they are being refused, `probes` threads send single requests one after another for
    `seconds`, each alone on its connection (a probe that finds room waits its turn, seconds). Every
    outcome, fillers' and probes', is accounted for.

    Returns {"protocol", "model", "fillers" (how many), "probe_threads", "probes", "fillers_outcomes"} (both summarize()
    dicts: counts, "refused_ms" p50 / p99 / max). RuntimeError when the queue never fills in 60 s.
    """
    from resnet18_kit.upstream.overload import queue_limits

    limit = queue_limits((Path(config.model_repository), *map(Path, config.extra_model_repositories)))[load.model]
    fillers = limit.max_queue_size + limit.max_batch_size + 16
    stop = threading.Event()
    filler_outcomes: list[Outcome] = []

    async def fill():
        module, client = async_client(config, protocol, fillers)

        async def worker(index: int):
            while not stop.is_set():
                outcome = await infer_async(client, module, load, index)
                filler_outcomes.append(outcome)
                if outcome.kind not in (ANSWERED, WRONG, LOST):  # refused or failed
                    await asyncio.sleep(FILLER_PAUSE_S)
                index += fillers

        try:
            await asyncio.gather(*(worker(k) for k in range(fillers)))
        finally:
            await client.close()

    filler = threading.Thread(target=lambda: asyncio.run(fill()), daemon=True)
    filler.start()
    probe_outcomes: list[Outcome] = []
    try:
        deadline = time.monotonic() + 60  # probe once the fillers are being refused: the queue is full
        while sum(o.kind == REFUSED for o in filler_outcomes) < 20:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{load.model}'s queue never filled")
            time.sleep(0.01)
        probe_stop = threading.Event()
        threads = [threading.Thread(target=_probe, args=(config, protocol, load, PROBE_ID_STRIDE * (k + 1), probe_stop,
                                                          PROBE_INTERVAL_S, probe_outcomes)) for k in range(probes)]
        for thread in threads:
            thread.start()
        started = time.monotonic()  # `seconds`, longer while fewer than 10 probes met the full queue
        while time.monotonic() - started < seconds or (
                sum(o.kind == REFUSED for o in list(probe_outcomes)) < 10 and time.monotonic() - started < 30):
            time.sleep(0.05)
        probe_stop.set()
        for thread in threads:
            thread.join(HANG_BOUND_S)
    finally:
        stop.set()
        filler.join(HANG_BOUND_S)
    return {"protocol": protocol, "model": load.model, "fillers": fillers, "probe_threads": probes,
            "probes": summarize(probe_outcomes, len(probe_outcomes)),
            "fillers_outcomes": summarize(filler_outcomes, len(filler_outcomes))}


def _probe(config: ServerConfig, protocol: str, load: TensorLoad, first_index: int, stop: threading.Event,
           interval_s: float, outcomes: list[Outcome]) -> None:
    """Send one request at a time until `stop`, appending each outcome to `outcomes`: each request alone
    on its connection, so a refusal's latency is the server's time to refuse (plus loopback)."""
    from tritonclient.utils import InferenceServerException

    module = protocol_module(protocol)
    client = module.InferenceServerClient(config.url(protocol))
    index = first_index
    try:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                outcomes.append(judge(load, index, infer(client, module, load, index), started))
            except InferenceServerException as exc:
                outcomes.append(failed(index, exc, time.perf_counter() - started))
            index += 1
            stop.wait(interval_s)
    finally:
        client.close()


def table_row(result: dict) -> list:
    """The table's row of one refusal_latency run."""
    probes, fill = result["probes"], result["fillers_outcomes"]
    return [f"a request meeting a full queue, {result['model']}, {result['protocol']} ({result['fillers']} senders "
            f"keep it full)", "--scenario refusal", probes["sent"] + fill["sent"],
            probes[ANSWERED] + fill[ANSWERED], probes[REFUSED] + fill[REFUSED], unaccounted(probes) + unaccounted(fill),
            f"single-request refusals ({probes[REFUSED]}): p50 {ms_cell(probes.get('refused_ms'))} / p99 "
            f"{ms_cell(probes.get('refused_ms'), 'p99')} / max {ms_cell(probes.get('refused_ms'), 'max')} ms",
            f"probe requests sent one at a time, {result['probe_threads']} threads"]
