"""Traffic controls measured live (resnet18-kit bench traffic): priority levels under a bulk flood, the
response cache, and request cancellation, each against a server this command starts on free ports.

    resnet18-kit bench traffic                       all three, about 7 minutes on 2 cores
    resnet18-kit bench traffic --only cache          one of priority, cache, cancel (repeatable)
    resnet18-kit bench traffic --variant int8        the servers load that config variant

* priority: an interactive trickle (one photo every --interval-s, the kit's gRPC client, its own bytes so
  never a cache hit) alone, then a bulk flood (perf_analyzer, --concurrency requests of the sample photos
  in flight to the `resnet18` ensemble at the default priority level, three --window-s windows) alone,
  with the trickle at priority 1, with the trickle at the default level (what it gets without priority
  levels) and alone again. Reports the trickle's p50 / p99 / max, the flood's infer/s, and the network's
  execution time for a full batch (16 tensors on the idle server, from the statistics extension); the
  server runs without the response cache.
* cache: per sample photo, the latency computed (its bytes made unique: a miss) and answered from the
  cache (the same bytes again), over HTTP and over gRPC (the guard), both outputs asked for as `classify`
  does; the answers compared; the cache's counters and fill from the metrics port.
* cancel: --requests single-photo requests sent at once, every other one of the last --cancel x 2 then
  cancelled by the caller (asyncio client, `cancel` event) 50 ms later; beside a round where none is
  cancelled. Once through the kit's gRPC guard (the caller is freed; the guard never cancels upstream,
  since Triton 2.51 crashes on gRPC cancellations under load, but marks the request, and the kit's models
  skip a marked request they have not begun: upstream.cancel_marks) and once straight to tritonserver's own
  gRPC port (the ensemble drops a cancelled request between its steps; safe only where the release has the fix of grpc-cancellation).

Writes <results>/traffic-<UTC time>/traffic.json (--out to choose the folder) and prints one line per figure.
Exit status 0; 2 for a bad command line or missing model files.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from resnet18_kit.client.async_client import AsyncTritonClassifierClient
from resnet18_kit.client.sync_client import TritonClassifierClient
from resnet18_kit.client.core import protocol_module
from resnet18_kit.client.errors import RequestCancelledError
from resnet18_kit.client.samples import sample_photos
from resnet18_kit.contract import (DEFAULT_VARIANT, ENSEMBLE_MODEL, IMAGE_INPUT, IMAGE_SHAPE, LOGITS_OUTPUT,
                                   ONNX_MODEL, PREPROCESS_MODEL, PROBABILITIES_OUTPUT)
from resnet18_kit.tools.load.outcomes import percentile
from resnet18_kit.tools.load.perf_analyzer import LoadSpec, run_level
from resnet18_kit.tools.load.photos import tagged, write_input_data
from resnet18_kit.observe.metrics import cache_counters
from resnet18_kit.observe.statistics import model_statistics
from resnet18_kit.server.config import DEFAULT_CACHE_BYTES, ServerConfig, config_on_free_ports, free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.settings import Settings

PREFIX = "resnet18-kit bench traffic"
SCENARIOS = ("priority", "cache", "cancel")
#: Seconds between the trickle's requests when it runs alone (its idle latency; no flood to disturb).
IDLE_INTERVAL_S = 0.1
#: Triton refreshes the response cache's metrics every --metrics-interval-ms (2000 by default); a reading
#: this long after the last request includes it.
METRICS_REFRESH_S = 2.5
#: The network's largest batch: the "one full batch" of the priority target.
FULL_BATCH = 16


def latency_summary_ms(latencies_s: list[float]) -> dict:
    """{"requests", "p50_ms", "p99_ms", "max_ms"} of latencies in seconds (nearest-rank percentiles)."""
    ordered = sorted(x * 1e3 for x in latencies_s)
    return {"requests": len(ordered), "p50_ms": percentile(ordered, 50), "p99_ms": percentile(ordered, 99),
            "max_ms": ordered[-1] if ordered else float("nan")}


class Trickle(threading.Thread):
    """One interactive client: a photo every `interval_s` (classify, top 1, over gRPC) at `priority` until
    stop(); `latencies_s` of the answered ones, `errors` the messages of the others."""

    def __init__(self, url: str, photos: list[bytes], priority: int, interval_s: float, limit: int = 0,
                 delay_s: float = 0.0):
        super().__init__(daemon=True)
        self.url, self.photos, self.priority, self.interval_s = url, photos, priority, interval_s
        self.limit, self.delay_s = limit, delay_s
        self.latencies_s: list[float] = []
        self.errors: list[str] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        with TritonClassifierClient(self.url, "grpc") as client:
            client.classify([self.photos[0]], top_k=1)  # connection and configs, untimed
            if self._stop_event.wait(self.delay_s):
                return
            sent = 0
            while not self._stop_event.is_set() and (not self.limit or sent < self.limit):
                started = time.perf_counter()
                image = tagged(self.photos[sent % len(self.photos)], f"trickle-{sent}-{started}")
                try:
                    client.classify([image], top_k=1, priority=self.priority)
                    self.latencies_s.append(time.perf_counter() - started)
                except Exception as exc:  # counted, and the trickle goes on
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                sent += 1
                self._stop_event.wait(max(0.0, self.interval_s - (time.perf_counter() - started)))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def full_batch_ms(config: ServerConfig, tries: int = 5) -> float:
    """The network's execution time (input + infer + output, ms) of a FULL_BATCH batch on an otherwise
    idle server: the mean over `tries` tensor requests of that size, from the statistics extension."""
    batch = np.random.default_rng(0).integers(0, 256, (FULL_BATCH, *IMAGE_SHAPE), dtype=np.uint8)

    def totals() -> tuple[int, int]:
        for entry in model_statistics(config.http_url, ONNX_MODEL)["batch_stats"]:
            if int(entry["batch_size"]) == FULL_BATCH:
                stages = [entry[name] for name in ("compute_input", "compute_infer", "compute_output")]
                return int(stages[1]["count"]), sum(int(stage["ns"]) for stage in stages)
        return 0, 0
    count_b, ns_b = totals()
    with TritonClassifierClient(config.http_url, "http") as client:
        for _ in range(tries):
            client.infer_tensor(batch)
    count_a, ns_a = totals()
    return (ns_a - ns_b) / 1e6 / (count_a - count_b)


def priority_run(config: ServerConfig, photo_paths: list[Path], out: Path, concurrency: int = 32,
                 window_s: float = 10.0, interval_s: float = 0.4, idle_requests: int = 40,
                 alone_again: bool = True, together: bool = False) -> dict:
    """The priority scenario (module doc) against the running server of `config`; perf_analyzer's files
    under out/. The flood runs alone before and, with `alone_again` (the machine drifts), after the runs
    with the trickles; without it the one run before is the flood alone. The trickle at priority 1 and the
    one at the default level run beside one flood each, or with `together` beside the same flood, side by
    side (the tests: two floods fewer, and both trickles see the same flood).
    Returns {"idle", "bulk_alone", "with_priority", "without_priority", "bulk_alone_again" (with alone_again),
    "together", "bulk_ratio" (flood infer/s beside the priority trickle / the mean alone), "served_ratio"
    (the same with the answers per second of the trickles beside that flood added: what the server served
    in all, the trickles' share included), "full_batch_ms"}."""
    photos = [path.read_bytes() for path in photo_paths]
    # Three windows of window_s each, whatever their spread: a flood of a fixed length for every config.
    spec = LoadSpec("concurrency", (concurrency,), input_data=write_input_data(photo_paths, out / "photos.json"),
                    profile_export=False, measurement_ms=int(window_s * 1000), stability_pct=100, max_trials=3)
    idle = Trickle(config.grpc_url, photos, 1, IDLE_INTERVAL_S, limit=idle_requests)
    idle.start()
    idle.join()
    record = {"idle": {**latency_summary_ms(idle.latencies_s), "errors": len(idle.errors)}}
    # (perf_analyzer's folder, the trickles beside its flood as (record key, priority))
    urgent, default = ("with_priority", 1), ("without_priority", 0)
    runs = [("bulk_alone", ())]
    runs += [("trickles", (urgent, default))] if together else [(urgent[0], (urgent,)), (default[0], (default,))]
    runs += [("bulk_alone_again", ())] if alone_again else []
    for folder, beside in runs:
        trickles = {name: Trickle(config.grpc_url, photos, priority, interval_s, delay_s=1.0)
                    for name, priority in beside}
        for trickle in trickles.values():
            trickle.start()
        started = time.monotonic()
        row = run_level(ENSEMBLE_MODEL, config.grpc_url, "grpc", spec, concurrency, out / folder)
        for name, trickle in trickles.items():
            trickle.stop()
            record[name] = {"bulk_infer_per_s": row.throughput, **latency_summary_ms(trickle.latencies_s),
                            "errors": len(trickle.errors), "error_examples": trickle.errors[:2],
                            "trickle_per_s": len(trickle.latencies_s) / (time.monotonic() - started)}
        if not trickles:
            record[folder] = {"bulk_infer_per_s": row.throughput}
    record["together"] = together
    record["full_batch_ms"] = full_batch_ms(config)
    floods = [record[name]["bulk_infer_per_s"] for name in ("bulk_alone", "bulk_alone_again") if name in record]
    alone = sum(floods) / len(floods)
    with_priority = record["with_priority"]
    record["bulk_ratio"] = with_priority["bulk_infer_per_s"] / alone
    beside = with_priority["trickle_per_s"] + (record["without_priority"]["trickle_per_s"] if together else 0.0)
    record["served_ratio"] = (with_priority["bulk_infer_per_s"] + beside) / alone
    return record


def _infer_both(client, module, image: bytes):
    """One request of `image` to the ensemble asking for both outputs (as classify does); (latency s,
    {output: array})."""
    request = module.InferInput(IMAGE_INPUT, [1, 1], "BYTES")
    request.set_data_from_numpy(np.array([[image]], dtype=np.object_))
    outputs = [module.InferRequestedOutput(name) for name in (PROBABILITIES_OUTPUT, LOGITS_OUTPUT)]
    started = time.perf_counter()
    result = client.infer(ENSEMBLE_MODEL, [request], outputs=outputs)
    return time.perf_counter() - started, {name: result.as_numpy(name) for name in (PROBABILITIES_OUTPUT, LOGITS_OUTPUT)}


def cache_run(config: ServerConfig, photo_paths: list[Path], computed_tries: int = 5, cached_tries: int = 20) -> dict:
    """The cache scenario (module doc) against the running server of `config` (started with a cache).
    Returns {"photos": [{"bytes", "protocol", "computed_ms", "cached_ms", "ratio", "identical"}],
    "counters_before", "counters_after"} (counters: observe.metrics.cache_counters)."""
    record = {"cache_bytes": config.response_cache_bytes, "photos": [],
              "counters_before": cache_counters(config.metrics_url)}
    for protocol in ("http", "grpc"):
        module = protocol_module(protocol)
        client = module.InferenceServerClient(config.url(protocol))
        try:
            for number, path in enumerate(photo_paths):
                photo = path.read_bytes()
                computed = [_infer_both(client, module, tagged(photo, f"{protocol}-{number}-{i}-{time.time()}"))
                            for i in range(computed_tries)]
                repeated = tagged(photo, f"{protocol}-{number}-repeated-{time.time()}")
                _, first = _infer_both(client, module, repeated)  # computed once, then cached
                cached = [_infer_both(client, module, repeated) for _ in range(cached_tries)]
                identical = all(np.array_equal(first[name], answer[name]) for _, answer in cached for name in first)
                computed_ms = statistics.median(seconds for seconds, _ in computed) * 1e3
                cached_ms = statistics.median(seconds for seconds, _ in cached) * 1e3
                record["photos"].append({"photo": path.name, "bytes": len(photo), "protocol": protocol,
                                         "computed_ms": computed_ms, "cached_ms": cached_ms,
                                         "ratio": cached_ms / computed_ms, "identical": identical})
        finally:
            client.close()
    time.sleep(METRICS_REFRESH_S)  # the cache's metrics are refreshed every 2 s (--metrics-interval-ms)
    record["counters_after"] = cache_counters(config.metrics_url)
    return record


def _step_counts(config: ServerConfig) -> dict:
    return {model: model_statistics(config.http_url, model) for model in (ENSEMBLE_MODEL, PREPROCESS_MODEL, ONNX_MODEL)}


async def _cancel_round(url: str, photos: list[bytes], requests: int, cancelled: set[int], wait_s: float) -> dict:
    """`requests` classify calls at once on one asyncio gRPC client; those in `cancelled` cancelled
    `wait_s` after all were sent. {"answered", "cancelled", "other", "last_answer_s", "cancel_ms"}."""
    async with AsyncTritonClassifierClient(url, "grpc") as client:
        await client.classify([photos[0]], top_k=1)  # connection and configs
        events = [asyncio.Event() for _ in range(requests)]
        started = time.perf_counter()
        set_at: dict[int, float] = {}

        async def one(index: int):
            image = tagged(photos[index % len(photos)], f"cancel-{index}-{started}")
            try:
                await client.classify([image], top_k=1, cancel=events[index])
                return "answered", time.perf_counter() - started
            except RequestCancelledError:
                return "cancelled", time.perf_counter() - set_at[index]
            except Exception as exc:
                return f"other: {type(exc).__name__}: {exc}", 0.0
        tasks = [asyncio.ensure_future(one(index)) for index in range(requests)]
        await asyncio.sleep(wait_s)
        for index in cancelled:
            set_at[index] = time.perf_counter()
            events[index].set()
        results = await asyncio.gather(*tasks)
    kinds = [kind for kind, _ in results]
    return {"answered": kinds.count("answered"), "cancelled": kinds.count("cancelled"),
            "other": [kind for kind in kinds if kind.startswith("other")][:3],
            "last_answer_s": max((t for kind, t in results if kind == "answered"), default=float("nan")),
            "cancel_ms": max((t * 1e3 for kind, t in results if kind == "cancelled"), default=float("nan"))}


def cancel_run(config: ServerConfig, photo_paths: list[Path], url: str, requests: int = 48, cancel: int = 16,
               wait_s: float = 0.05) -> dict:
    """The cancel scenario (module doc) against `url` (the guard's config.grpc_url or tritonserver's own
    config.triton_grpc_url). Returns {"baseline", "with_cancel"}, each its round plus the requests each
    step executed ("executed": {model: inference_count}) and the ensemble's successes."""
    photos = [path.read_bytes() for path in photo_paths]
    chosen = set(range(requests - 2 * cancel + 1, requests, 2))  # every other one of the back of the queue
    record = {"requests": requests, "cancel": len(chosen)}
    for name, cancelled in (("baseline", set()), ("with_cancel", chosen)):
        before = _step_counts(config)
        entry = asyncio.run(_cancel_round(url, photos, requests, cancelled, wait_s))
        time.sleep(1.0)  # what the server still computes for cancelled callers ends
        after = _step_counts(config)
        # less the round's first, untimed request
        entry["executed"] = {model: int(after[model]["inference_count"]) - int(before[model]["inference_count"]) - 1
                             for model in after}
        entry["ensemble_success"] = (int(after[ENSEMBLE_MODEL]["inference_stats"]["success"]["count"])
                                     - int(before[ENSEMBLE_MODEL]["inference_stats"]["success"]["count"]) - 1)
        record[name] = entry
    return record


def summary_lines(record: dict) -> list[str]:
    """The figures of a `measure` record, one line each, with the targets of docs/records/usage.md."""
    lines = []
    if "priority" in record:
        p = record["priority"]
        bound = p["idle"]["p99_ms"] + p["full_batch_ms"]
        lines.append(f"priority: interactive p99 idle {p['idle']['p99_ms']:.1f} ms; under the flood "
                     f"{p['with_priority']['p99_ms']:.1f} ms at priority 1 (target <= {bound:.1f} = idle p99 + "
                     f"one full batch {p['full_batch_ms']:.1f} ms: {'met' if p['with_priority']['p99_ms'] <= bound else 'MISSED'}), "
                     f"{p['without_priority']['p99_ms']:.1f} ms at the default level; p50 "
                     f"{p['with_priority']['p50_ms']:.1f} / {p['without_priority']['p50_ms']:.1f} ms "
                     f"({p['with_priority']['requests']} / {p['without_priority']['requests']} requests)")
        alone = (f"{p['bulk_alone']['bulk_infer_per_s']:.1f} / {p['bulk_alone_again']['bulk_infer_per_s']:.1f} infer/s "
                 "alone (before / after)" if "bulk_alone_again" in p else
                 f"{p['bulk_alone']['bulk_infer_per_s']:.1f} infer/s alone")
        added = (f"the trickles' {p['with_priority']['trickle_per_s']:.1f} + "
                 f"{p['without_priority']['trickle_per_s']:.1f} answers/s" if p.get("together") else
                 f"the trickle's {p['with_priority']['trickle_per_s']:.1f} answers/s")
        lines.append(f"priority: flood {alone}, {p['with_priority']['bulk_infer_per_s']:.1f} beside the priority "
                     f"trickle{'s' if p.get('together') else ''} ({p['bulk_ratio']:.3f}); served in all, {added} "
                     f"added: {p['served_ratio']:.3f} of the flood alone "
                     f"(target >= 0.95: {'met' if p['served_ratio'] >= 0.95 else 'MISSED'})")
    if "cache" in record:
        c = record["cache"]
        for entry in c["photos"]:
            lines.append(f"cache: {entry['protocol']:<4} {entry['photo']:<22} {entry['bytes'] / 1e3:6.0f} KB computed "
                         f"{entry['computed_ms']:6.2f} ms, cached {entry['cached_ms']:5.2f} ms = {entry['ratio']:.3f} "
                         f"(target < 0.05){'' if entry['identical'] else ' ANSWERS DIFFER'}")
        before, after = c["counters_before"], c["counters_after"]
        hits = after["num_hits"] - before["num_hits"]
        misses = after["num_misses"] - before["num_misses"]
        lines.append(f"cache: {hits:.0f} hits, {misses:.0f} misses (hit ratio {hits / max(1.0, hits + misses):.2f}); "
                     f"{after['num_entries']:.0f} entries fill {100 * after['util']:.3f} % of "
                     f"{c['cache_bytes'] / (1 << 20):.0f} MiB")
    if "cancel" in record:
        for where, r in record["cancel"].items():
            base, cut = r["baseline"], r["with_cancel"]
            lines.append(f"cancel ({where.replace('_', ' ')}): {cut['cancelled']} of {r['requests']} cancelled, "
                         f"callers freed within {cut['cancel_ms']:.1f} ms; the network ran {cut['executed'][ONNX_MODEL]} "
                         f"(none cancelled: {base['executed'][ONNX_MODEL]}); last answer at {cut['last_answer_s']:.2f} s "
                         f"(none cancelled: {base['last_answer_s']:.2f} s)")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """traffic's options."""
    parser.add_argument("--variant", default=DEFAULT_VARIANT,
                        help="config variant the servers load (default: every model's config.pbtxt)")
    parser.add_argument("--only", choices=SCENARIOS, action="append",
                        help="run this scenario only (repeatable; default: all three)")
    parser.add_argument("--concurrency", type=int, default=32,
                        help="priority: the bulk flood's requests in flight (default 32)")
    parser.add_argument("--window-s", type=float, default=10.0,
                        help="priority: perf_analyzer's measurement window; each flood runs 3 (default 10 s)")
    parser.add_argument("--interval-s", type=float, default=0.4,
                        help="priority: seconds between the trickle's requests (default 0.4)")
    parser.add_argument("--requests", type=int, default=48, help="cancel: requests sent at once (default 48)")
    parser.add_argument("--cancel", type=int, default=16, help="cancel: how many of them are cancelled (default 16)")
    parser.add_argument("--out", type=Path, help="results folder (default <results>/traffic-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    """The first problem with the options, one line, or None."""
    if args.concurrency < 1 or args.requests < 2:
        return "--concurrency must be >= 1, --requests >= 2"
    if args.interval_s <= 0 or args.window_s <= 0:
        return "--interval-s and --window-s must be > 0 seconds"
    if not 1 <= args.cancel <= args.requests // 2:
        return f"--cancel must be 1..{args.requests // 2} (half of --requests), not {args.cancel}"
    return None


def measure(settings: Settings, args: argparse.Namespace, out: Path) -> dict:
    """Every scenario asked for, each on its own server; the record `run` writes."""
    photos = sample_photos()
    record: dict = {}
    for name in args.only or SCENARIOS:
        cache_bytes = DEFAULT_CACHE_BYTES if name == "cache" else 0
        config = config_on_free_ports(model_repository=settings.model_repository, response_cache_bytes=cache_bytes,
                                      triton_grpc_port=free_ports(1)[0],
                                      model_config_name=None if args.variant == DEFAULT_VARIANT else args.variant)
        with EmbeddedTritonServer(config, log_path=out / f"tritonserver-{name}.log"):
            if name == "priority":
                record[name] = priority_run(config, photos, out, args.concurrency, args.window_s, args.interval_s)
            elif name == "cache":
                record[name] = cache_run(config, photos)
            else:
                record[name] = {"through_guard": cancel_run(config, photos, config.grpc_url, args.requests, args.cancel),
                                "straight_to_triton": cancel_run(config, photos, config.triton_grpc_url,
                                                                 args.requests, args.cancel)}
    return record


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Measure (module doc); exit status 0, 2 for a bad command line or missing model files."""
    problem = check_arguments(args)
    if problem is None:
        problem = ("model files missing: run `resnet18-kit export` first" if settings.repository.missing_artifacts()
                   else settings.repository.unknown_variant(args.variant))
    if problem:
        print(f"{PREFIX}: {problem}", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or settings.results_dir(f"traffic-{stamp:%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    record = measure(settings, args, out)
    record["command"] = "resnet18-kit " + shlex.join(sys.argv[1:])
    (out / "traffic.json").write_text(json.dumps(record, indent=2) + "\n")
    for line in summary_lines(record):
        print(line)
    print(f"{PREFIX}: {out / 'traffic.json'}", file=sys.stderr)
    return 0
