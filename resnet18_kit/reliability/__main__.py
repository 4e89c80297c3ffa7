"""python -m resnet18_kit.reliability: overload, queue timeouts, readiness, bad input, faults and shutdown
against the real embedded tritonserver, with every request accounted for.

Each scenario sends requests, classifies every outcome (answered correctly, refused with 503 /
UNAVAILABLE, timed out in the queue, refused as bad input, wrong answer, other error, or lost: no
outcome at all within a generous client-side bound) and compares what the clients saw with what the
server counted (metrics endpoint and statistics extension). The tests (tests/test_reliability*.py) run
the same functions with small numbers; this command runs them bigger and prints the table of
docs/reliability.md (also written as JSON under results/reliability/):

    .venv/bin/python -m resnet18_kit.reliability                       # every scenario, about 3 minutes
    .venv/bin/python -m resnet18_kit.reliability --scenario burst --burst-requests 600
    .venv/bin/python -m resnet18_kit.reliability --scenario lifecycle      # the fault matrix, about 2 minutes
    .venv/bin/python -m resnet18_kit.reliability --scenario stops --stops 30   # `make serve` stopped 30 times

The 10-minute soak at 80% of capacity is `python -m resnet18_kit.reliability.soak`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from resnet18_kit.contract import PROTOCOLS, TRITON_VERSION
from resnet18_kit.observe.machine import cpu_share, cpu_ticks
from resnet18_kit.observe.process_memory import MemorySampler
from resnet18_kit.reliability import RELIABILITY_REPOSITORY, RESULTS_DIR
from resnet18_kit.reliability import (bad_input, burst, crash_request, lifecycle, queue_timeout, readiness, refusal,
                                      restricted_api, sigterm, stub_kill)
from resnet18_kit.reliability.loads import ensemble_load, onnx_load, reference_answers
from resnet18_kit.reliability.table import markdown_table
from resnet18_kit.server.embedded import MiB, EmbeddedTritonServer, ServerConfig, config_on_free_ports
from resnet18_kit.server.supervisor import SupervisorPolicy

SCENARIOS = ("burst", "refusal", "timeout", "readiness", "bad-input", "stub-kill", "crash-request", "sigterm",
             "security", "lifecycle", "stops")
#: Run only when named: `make serve` started and stopped --stops times (about 12 s a round).
ON_REQUEST = ("stops",)
#: The scenarios that share one server of the shipped models and the reliability models.
ON_ONE_SERVER = ("burst", "refusal", "timeout", "readiness", "bad-input")


def run_on_one_server(config: ServerConfig, server: EmbeddedTritonServer, args, rows: list, record: dict) -> None:
    """The scenarios of ON_ONE_SERVER that `args.scenario` names, against `server`; their rows appended
    to `rows`, their results to `record`."""
    onnx = reference_answers(config, onnx_load())
    ensemble = reference_answers(config, ensemble_load())
    if "burst" in args.scenario:
        for protocol, load in (("http", onnx), ("grpc", onnx), ("grpc", ensemble), ("http", ensemble)):
            result = burst.burst(config, protocol, load, args.burst_requests).summary()
            record.setdefault("burst", []).append(result)
            rows.append(burst.table_row(result, args.burst_requests))
    if "refusal" in args.scenario:
        for protocol in PROTOCOLS:
            result = refusal.refusal_latency(config, protocol, onnx)
            record.setdefault("refusal", []).append(result)
            rows.append(refusal.table_row(result))
    if "timeout" in args.scenario:
        for protocol in PROTOCOLS:
            result = queue_timeout.queue_timeouts(config, protocol)
            record.setdefault("timeout", []).append({k: v for k, v in result.items() if k != "outcomes"})
            rows.append(queue_timeout.table_row(result))
    if "readiness" in args.scenario:
        record["readiness"] = readiness.readiness_under_overload(config)
        rows.append(readiness.table_row(record["readiness"]))
    if "bad-input" in args.scenario:
        for protocol in PROTOCOLS:
            with MemorySampler(server) as memory:
                results = bad_input.bad_input_corpus(config, protocol)
            record.setdefault("bad_input", []).append({"protocol": protocol, "cases": [asdict(r) for r in results],
                                                        "memory_mib": [memory.start / MiB, memory.peak / MiB,
                                                                       memory.end / MiB]})
            rows.append(bad_input.table_row(protocol, results, memory))


def run_faults(args, out_dir: Path, rows: list, record: dict) -> None:
    """The scenarios that start servers of their own (stub-kill, crash-request, sigterm, security),
    those `args.scenario` names; logs in `out_dir`, rows appended to `rows`, results to `record`."""
    policy = SupervisorPolicy()  # what `serve` runs with
    if "stub-kill" in args.scenario:
        record["stub_kill"] = stub_kill.supervised_stub_kill(out_dir, policy)
        rows.append(stub_kill.table_row(record["stub_kill"]))
    if "crash-request" in args.scenario:
        record["crash_request"] = crash_request.supervised_crash(out_dir, policy)
        rows.append(crash_request.table_row(record["crash_request"]))
    if "sigterm" in args.scenario:
        record["sigterm"] = sigterm.sigterm_shipped_models(out_dir, args.sigterm_in_flight)
        rows.append(sigterm.table_row(record["sigterm"]))
    if "security" in args.scenario:
        record["security"] = restricted_api.checks_with_a_new_key(out_dir)
        rows.append(restricted_api.table_row(record["security"]))


def run_lifecycle(args, out_dir: Path, record: dict) -> list[str]:
    """The fault matrix (reliability.lifecycle) and the repeated stops, those `args.scenario` names;
    their Markdown tables (the columns differ from the main table's)."""
    tables = []
    if "lifecycle" in args.scenario:
        matrix = []
        for case in lifecycle.CASES:
            result = lifecycle.run_case(case, out_dir / "lifecycle" / case)
            record.setdefault("lifecycle", []).append(result)
            matrix.append(lifecycle.table_row(result))
            print(f"reliability: lifecycle {case}: {lifecycle.table_row(result)[1:]}", file=sys.stderr, flush=True)
        tables.append(markdown_table(matrix, lifecycle.MATRIX_COLUMNS))
    if "stops" in args.scenario:
        result = lifecycle.repeated_stops(out_dir / "stops", args.stops)
        record["stops"] = result
        tables.append(f"`make serve` stopped with `kill -TERM -- -<pgid>` (two SIGTERMs each), {result['rounds']} "
                      f"rounds: {result['hangs']} hung; serve's exit statuses {result['serve_statuses']}; "
                      f"exit after {result['exit_s']} s; left running: {result['left_running'] or 'none'}; "
                      f"/dev/shm regions {result['shm_before']} -> {result['shm_after']}")
    return tables


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios; print the table, write reliability.json and reliability.md under
    --out/<time>/; exit status 0."""
    parser = argparse.ArgumentParser(prog="python -m resnet18_kit.reliability", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", nargs="+", choices=SCENARIOS,
                        default=[s for s in SCENARIOS if s not in ON_REQUEST],
                        help=f"scenarios to run (default: all but {', '.join(ON_REQUEST)})")
    parser.add_argument("--stops", type=int, default=30,
                        help="rounds of the stops scenario (default 30: the hang it guards against was 1 in 7)")
    parser.add_argument("--burst-requests", type=int, default=400,
                        help="requests per burst (default 400: five times what the 64-request queue and a "
                             "batch of 16 hold)")
    parser.add_argument("--sigterm-in-flight", type=int, default=48)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = args.out / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    from resnet18_kit.observe.machine import machine_info

    record: dict = {"started": stamp, "machine": machine_info(TRITON_VERSION), "cpu_steal_share": None,
                    "args": {k: str(v) for k, v in vars(args).items()}}
    ticks_before = cpu_ticks()
    rows: list[list] = []
    if set(args.scenario) & set(ON_ONE_SERVER):
        config = config_on_free_ports(extra_model_repositories=(RELIABILITY_REPOSITORY,))
        with EmbeddedTritonServer(config, log_path=out_dir / "tritonserver.log") as server:
            run_on_one_server(config, server, args, rows, record)
    run_faults(args, out_dir, rows, record)
    extra_tables = run_lifecycle(args, out_dir, record)
    record["cpu_steal_share"] = round(cpu_share(ticks_before, cpu_ticks())["steal"], 3)
    table = "\n\n".join(([markdown_table(rows)] if rows else []) + extra_tables)
    record["table"] = table
    (out_dir / "reliability.json").write_text(json.dumps(record, indent=1, default=str))
    (out_dir / "reliability.md").write_text(table + "\n")
    print(table)
    print(f"\nCPU steal during the run: {record['cpu_steal_share']:.1%}; full record: {out_dir / 'reliability.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
