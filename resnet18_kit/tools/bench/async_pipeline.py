"""An asyncio producer/consumer pipeline against the `resnet18` ensemble (resnet18-kit bench async-pipeline).

One producer task sends single-image requests at --rate requests/s (Poisson arrivals; 0 = as fast as the
in-flight limit allows), with at most --max-in-flight outstanding; the server's dynamic batcher, not the
client, forms the batches. Each request runs in its own task of one asyncio.TaskGroup, so the pipeline
ends when the producer has sent everything and the last answer is in: no sentinel values, no task left
behind, and any unexpected error cancels the rest and is raised.

Prints client-side latency percentiles (ms, from send to answer, retries of a full queue included),
throughput (requests/s), queue-full retries, and the average batch size the server formed per model
(nv_inference_count / nv_inference_exec_count from --metrics-url, this run's increase), and the response
cache's hits, misses, entries and fill over the run (the same photos sent again are answered from it: a
server started with `serve --response-cache-bytes 0` measures the models). --priority sends every request
at that level (1 = served first).

Exit status: 0 every request answered; 1 some failed (each one line on stderr); 2 nothing measured: bad
options, no image files, the server unreachable or the model not ready, the metrics unreadable (one line).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time
from pathlib import Path

import numpy as np

from resnet18_kit.client.backoff import RetryPolicy
from resnet18_kit.client.async_client import AsyncTritonClassifierClient
from resnet18_kit.client.errors import InferenceError
from resnet18_kit.observe.metrics import average_batch_size, cache_counters, model_counters
from resnet18_kit.client.samples import expand_paths, sample_photos
from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL, PREPROCESS_MODEL
from resnet18_kit.options import add_server_address_options

BATCHED_MODELS = (PREPROCESS_MODEL, ONNX_MODEL)
PREFIX = "resnet18-kit bench async-pipeline"


async def run_pipeline(client: AsyncTritonClassifierClient, images: list[bytes], requests: int,
                       rate_per_s: float, max_in_flight: int, seed: int = 0,
                       priority: int = 0) -> tuple[list[float], int]:
    """Send `requests` single-image classify calls at `priority` (0 = the model's default level); return
    (latencies in seconds, failed count).

    rate_per_s: mean arrival rate of the Poisson producer (exponential gaps); 0 = no pacing.
    max_in_flight: the producer waits for a free slot before sending beyond this many.
    """
    slots = asyncio.Semaphore(max_in_flight)
    latencies: list[float] = []
    failures = 0
    rng = random.Random(seed)

    async def one_request(image: bytes) -> None:
        nonlocal failures
        started = time.perf_counter()
        try:
            await client.classify([image], top_k=1, priority=priority)
            latencies.append(time.perf_counter() - started)
        except InferenceError as exc:
            failures += 1
            print(f"request failed: {exc}", file=sys.stderr)
        finally:
            slots.release()

    async with asyncio.TaskGroup() as group:  # exits once every request task has finished
        next_send = time.perf_counter()
        for image in itertools.islice(itertools.cycle(images), requests):
            if rate_per_s > 0:
                next_send += rng.expovariate(rate_per_s)
                await asyncio.sleep(max(0.0, next_send - time.perf_counter()))
            await slots.acquire()
            group.create_task(one_request(image))
    return latencies, failures


def percentiles_ms(latencies_s: list[float]) -> dict[str, float]:
    """p50/p90/p95/p99/max of the latencies, in milliseconds (numpy's linear interpolation)."""
    values = np.asarray(latencies_s) * 1000.0
    marks = {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 95, 99)}
    return {**marks, "max": float(values.max()), "mean": float(values.mean())}


async def measure(args: argparse.Namespace, url: str, protocol: str, metrics_url: str) -> int:
    """Run the pipeline against the server at `url` and print its figures (module doc); the exit status.
    Raises InferenceError (server), FileNotFoundError (no images), OSError (metrics endpoint)."""
    images = [p.read_bytes() for p in (expand_paths(args.paths) if args.paths else sample_photos())]
    if not images:
        raise FileNotFoundError(f"no image files in {' '.join(map(str, args.paths))}")
    retry = RetryPolicy(deadline_s=args.deadline_s)
    async with AsyncTritonClassifierClient(url, protocol, retry=retry) as client:
        await client.server_metadata()
        if not await client.is_model_ready(ENSEMBLE_MODEL):
            print(f"{PREFIX}: model '{ENSEMBLE_MODEL}' is not ready at {url} ({protocol})", file=sys.stderr)
            return 2
        await client.check_priority(ENSEMBLE_MODEL, args.priority)  # ValueError: a level it does not serve
        before = {m: await asyncio.to_thread(model_counters, metrics_url, m) for m in BATCHED_MODELS}
        cached_before = await asyncio.to_thread(model_counters, metrics_url, ENSEMBLE_MODEL)
        started = time.perf_counter()
        latencies, failures = await run_pipeline(client, images, args.requests, args.rate,
                                                 args.max_in_flight, args.seed, args.priority)
        elapsed = time.perf_counter() - started
        retries = client.retries
    after = {m: await asyncio.to_thread(model_counters, metrics_url, m) for m in BATCHED_MODELS}
    cached_after = await asyncio.to_thread(model_counters, metrics_url, ENSEMBLE_MODEL)
    cache = await asyncio.to_thread(cache_counters, metrics_url)

    print(f"{len(latencies)} answered, {failures} failed, {retries} queue-full retries, "
          f"in {elapsed:.2f} s = {len(latencies) / elapsed:.1f} requests/s "
          f"({protocol}, {args.max_in_flight} in flight, rate "
          f"{'unpaced' if args.rate <= 0 else f'{args.rate:g}/s Poisson'})")
    if latencies:
        print("latency ms: " + "  ".join(f"{k} {v:.1f}" for k, v in percentiles_ms(latencies).items()))
    for model in BATCHED_MODELS:
        delta = {k: after[model].get(k, 0.0) - before[model].get(k, 0.0)
                 for k in ("nv_inference_count", "nv_inference_exec_count")}
        print(f"server batches {model:<14} {delta['nv_inference_count']:.0f} inferences in "
              f"{delta['nv_inference_exec_count']:.0f} executions: average batch {average_batch_size(delta):.2f}")
    print(cache_line(cached_before, cached_after, cache))
    return 1 if failures else 0


def cache_line(before: dict[str, float], after: dict[str, float], cache: dict[str, float]) -> str:
    """One line on the response cache: the ensemble's hits and misses between two model_counters readings
    (nv_cache_num_hits_per_model, ..._misses_...), its hit ratio, and the server's entries, fill
    (nv_cache_util) and evictions from observe.metrics.cache_counters (refreshed every 2 s); or that the
    server runs without a cache."""
    if not cache:
        return "response cache: none on this server (serve --response-cache-bytes 0, or a server started without one)"
    hits, misses = (after.get(name, 0.0) - before.get(name, 0.0)
                    for name in ("nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model"))
    ratio = f"{hits / (hits + misses):.2f}" if hits + misses else "-"
    return (f"response cache: {hits:.0f} hits, {misses:.0f} misses (hit ratio {ratio}); {cache.get('num_entries', 0):.0f} "
            f"entries, {100 * cache.get('util', 0.0):.2f} % of its size in use, {cache.get('num_evictions', 0):.0f} "
            f"evictions (these three as of Triton's last 2-s refresh)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The pipeline's options; the server address options come from settings.add_server_address_options."""
    parser.add_argument("paths", nargs="*", type=Path,
                        help="image files or folders to send, cycled (default: the sample photos of scikit-image)")
    parser.add_argument("--requests", type=int, default=512, help="requests to send (default 512)")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="mean requests/s, Poisson arrivals; 0 = unpaced (default)")
    parser.add_argument("--max-in-flight", type=int, default=64, help="outstanding requests (default 64)")
    parser.add_argument("--deadline-s", type=float, default=60.0, help="per request, retries included, seconds")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    parser.add_argument("--priority", type=int, default=0,
                        help="priority level of every request, 1 = served first (default 0: the model's default)")
    add_server_address_options(parser)


def run(settings, args: argparse.Namespace) -> int:
    """Run the pipeline against settings.url / settings.protocol, batches from settings.metrics_url."""
    if args.requests < 1 or args.max_in_flight < 1 or args.rate < 0 or not args.deadline_s > 0 or args.priority < 0:
        print(f"{PREFIX}: --requests and --max-in-flight must be >= 1, --rate >= 0, --deadline-s > 0, --priority >= 0",
              file=sys.stderr)
        return 2
    url, protocol = settings.url, settings.protocol
    try:
        return asyncio.run(measure(args, url, protocol, settings.metrics_url))
    except InferenceError as exc:
        print(f"{PREFIX}: {protocol} server at {url}: {' '.join(exc.message.split())}", file=sys.stderr)
    except FileNotFoundError as exc:  # the images
        print(f"{PREFIX}: {exc}", file=sys.stderr)
    except OSError as exc:  # the metrics endpoint (urllib.error.URLError is an OSError)
        print(f"{PREFIX}: cannot read the metrics at {settings.metrics_url}: {exc}", file=sys.stderr)
    except ValueError as exc:  # contract.host_port, or the metrics endpoint's text
        print(f"{PREFIX}: {exc}", file=sys.stderr)
    return 2
