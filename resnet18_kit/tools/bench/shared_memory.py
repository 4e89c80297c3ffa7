"""What system shared memory saves over plain transfer, batch of 32 (resnet18-kit bench shared-memory).

Starts the embedded tritonserver with the `throughput` variant (resnet18_onnx accepts batches of 32),
then, in the same run and interleaved, sends the same UINT8 [32, 3, 224, 224] batch (4.8 MB in, 128 kB
out) with `TritonClassifierClient(shared_memory=False)` and `(shared_memory=True)`, over HTTP and gRPC.
Prints per call: wall time (ms, mean and p50) and the client process's CPU time (ms), and what shared
memory changes (stdout). The server's log: <results>/bench-shared-memory-tritonserver.log. Not a test: figures depend on the machine; docs/records/benchmarks.md quotes a run.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import numpy as np

from resnet18_kit.client.sync_client import TritonClassifierClient
from resnet18_kit.contract import ONNX_MODEL, PROTOCOLS
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.settings import Settings, shown

log = logging.getLogger(__name__)


def time_calls(client: TritonClassifierClient, batch: np.ndarray, repeats: int) -> tuple[list[float], list[float]]:
    """(wall seconds, client CPU seconds) of each of `repeats` infer_tensor calls."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        client.infer_tensor(batch, model=ONNX_MODEL)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return walls, cpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """shared-memory's options."""
    parser.add_argument("--batch-size", type=int, default=32, help="rows of UINT8 [3, 224, 224] per call (default 32)")
    parser.add_argument("--repeats", type=int, default=10, help="calls per mode and round (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations plain/shared (default 3)")


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Measure and print (module doc); exit status 0, 2 for a bad command line."""
    if args.batch_size < 1 or args.repeats < 1 or args.rounds < 1:
        print("resnet18-kit bench shared-memory: --batch-size, --repeats and --rounds must be >= 1", file=sys.stderr)
        return 2
    batch = np.random.default_rng(0).integers(0, 256, (args.batch_size, 3, 224, 224), dtype=np.uint8)
    server_log = settings.results_dir("bench-shared-memory-tritonserver.log")
    server_log.parent.mkdir(parents=True, exist_ok=True)
    config = config_on_free_ports(model_config_name="throughput", model_repository=settings.model_repository)
    print(f"batch UINT8 {list(batch.shape)}: {batch.nbytes / 1e6:.1f} MB in, "
          f"{args.batch_size * 4000 / 1e3:.0f} kB out; {args.rounds} rounds x {args.repeats} calls per mode")
    log.info("starting tritonserver with the throughput variant (log: %s)", shown(server_log))
    with EmbeddedTritonServer(config, log_path=server_log):
        for protocol in PROTOCOLS:
            log.info("%s: %d rounds", protocol, args.rounds)
            url = config.url(protocol)
            samples = {False: ([], []), True: ([], [])}
            with TritonClassifierClient(url, protocol) as plain, \
                    TritonClassifierClient(url, protocol, shared_memory=True) as shared:
                clients = {False: plain, True: shared}
                np.testing.assert_array_equal(plain.infer_tensor(batch), shared.infer_tensor(batch))  # + warm
                for _ in range(args.rounds):
                    for mode, client in clients.items():
                        walls, cpus = time_calls(client, batch, args.repeats)
                        samples[mode][0].extend(walls)
                        samples[mode][1].extend(cpus)
            print(f"\n{protocol.upper():<5} {'mode':<14} {'wall mean':>10} {'wall p50':>9} {'client CPU':>11}")
            for mode, label in ((False, "plain"), (True, "shared memory")):
                walls, cpus = samples[mode]
                print(f"{'':<5} {label:<14} {statistics.mean(walls) * 1e3:8.1f} ms "
                      f"{statistics.median(walls) * 1e3:6.1f} ms {statistics.mean(cpus) * 1e3:8.1f} ms")
            saved_wall = statistics.mean(samples[False][0]) - statistics.mean(samples[True][0])
            saved_cpu = statistics.mean(samples[False][1]) - statistics.mean(samples[True][1])
            print(f"{'':<5} {'saved':<14} {saved_wall * 1e3:8.1f} ms "
                  f"({saved_wall / statistics.mean(samples[False][0]):.1%} of the plain wall time), "
                  f"client CPU {saved_cpu * 1e3:.1f} ms per call")
    return 0
