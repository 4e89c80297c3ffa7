"""resnet18-kit demo: the main job. Serve the model repository with Triton and classify real photos.

Exports ResNet-18 if needed, starts the embedded tritonserver, sends the sample photos (from the
scikit-image wheel) to the `resnet18` ensemble as concurrent single-image requests over HTTP and gRPC,
prints each photo's top-5, shows how the dynamic batcher grouped them (metrics endpoint) and how fast the
photos were answered (img/s; the average time a photo took, by Little's law: elapsed / photos x photos in
flight), and stops.
"""
from __future__ import annotations

import argparse
import time

from resnet18_kit.client.command import classify_files, format_predictions
from resnet18_kit.observe.metrics import average_batch_size, model_counters
from resnet18_kit.client.samples import sample_photos
from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL, PREPROCESS_MODEL
from resnet18_kit.server.__main__ import add_server_arguments, prepared_server_config
from resnet18_kit.settings import Settings, shown
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.observe.server_log import cpu_only_explanation, is_cuda_notice


#: The ensemble's counter of answers the response cache gave (Triton's per-model cache metric).
CACHE_HITS = "nv_cache_num_hits_per_model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's options (serve's) and the number of requests in flight."""
    add_server_arguments(parser)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Run the demo (module doc); exit status 0, 1 when a photo got no answer, 2 for a bad environment
    (a refused --host, a port taken, a failed export)."""
    config = prepared_server_config(settings, args, command="demo")
    if config is None:
        return 2
    provenance = settings.repository.provenance()
    weights = provenance["weights"]
    random_weights = weights.startswith("random:")
    if random_weights:  # said first, before any label is printed
        reason = provenance.get("weights_unavailable_reason") or "not recorded"
        print(f"demo: NOTE the model's weights are a seeded RANDOM init ({weights}): ImageNet weights were not "
              f"available\n      (reason: {reason}).\n      Every label below is meaningless and marked "
              f"[random weights]; see docs/usage.md 'Weights'.", flush=True)

    photos = sample_photos()
    failures, speeds = 0, []
    log_path = settings.results_dir("demo-tritonserver.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"demo: starting tritonserver (log: {shown(log_path)})", flush=True)
    log_start = log_path.stat().st_size if log_path.exists() else 0  # the log file is appended to
    with EmbeddedTritonServer(config, log_path=log_path):
        with open(log_path, "rb") as log_file:
            log_file.seek(log_start)
            if any(is_cuda_notice(line) for line in log_file.read().decode(errors="replace").splitlines()):
                print(f"demo: {cpu_only_explanation(shown(log_path))}", flush=True)
        print(f"\ndemo: tritonserver ready (HTTP {config.http_url}, gRPC {config.grpc_url}); "
              f"model weights: {weights}")
        before = {m: model_counters(config.metrics_url, m) for m in (PREPROCESS_MODEL, ONNX_MODEL)}
        for protocol, url in (("http", config.http_url), ("grpc", config.grpc_url)):
            print(f"\n=== {len(photos)} photos -> ensemble '{ENSEMBLE_MODEL}' over {protocol.upper()} "
                  f"({args.concurrency} in flight) ===")
            hits_before = model_counters(config.metrics_url, ENSEMBLE_MODEL).get(CACHE_HITS, 0.0)
            started = time.perf_counter()
            lines = []
            for path, result in classify_files(photos, url, protocol, 5, args.concurrency):
                if isinstance(result, Exception):
                    failures += 1
                    lines.append(f"{path.name}: ERROR {result}")
                else:
                    lines.append(format_predictions(path.name, result, "[random weights]" if random_weights else ""))
            took_s = time.perf_counter() - started
            print("\n".join(lines))
            hits = model_counters(config.metrics_url, ENSEMBLE_MODEL).get(CACHE_HITS, 0.0) - hits_before
            in_flight = min(args.concurrency, len(photos))
            speeds.append(f"{protocol.upper():<5} {len(photos)} photos in {took_s:.2f} s: {len(photos) / took_s:.1f} img/s, "
                          f"about {took_s / len(photos) * in_flight * 1000:.0f} ms each ({in_flight} in flight)"
                          + (f"; {hits:.0f} answered from the response cache" if hits else ""))
        print("\n=== dynamic batching (metrics endpoint, this demo's requests) ===")
        for model in (PREPROCESS_MODEL, ONNX_MODEL):
            after = model_counters(config.metrics_url, model)
            delta = {k: after.get(k, 0.0) - before[model].get(k, 0.0)
                     for k in ("nv_inference_count", "nv_inference_exec_count")}
            print(f"{model:<15} inferences {delta['nv_inference_count']:.0f}, "
                  f"executions {delta['nv_inference_exec_count']:.0f}, "
                  f"average batch {average_batch_size(delta):.2f}")
        print("\n=== speed (these few photos, the server's first requests included; a benchmark: docs/benchmarks.md) ===")
        print("\n".join(speeds))
        print("\ndemo: stopping the server")
    if random_weights:
        print("\ndemo: NOTE the weights are a seeded RANDOM init, so the labels above are meaningless; "
              "see docs/usage.md 'Weights'.")
    return 1 if failures else 0

