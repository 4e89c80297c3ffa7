"""Overload, queue timeouts, readiness, bad input, faults and shutdown against the real embedded
tritonserver, with every request accounted for.

Each scenario sends requests, classifies every outcome (answered correctly, refused with 503 /
UNAVAILABLE, timed out in the queue, refused as bad input, wrong answer, other error, or lost: no
outcome at all within a generous client-side bound) and compares what the clients saw with what the
server counted (metrics endpoint and statistics extension). The tests (tests/test_reliability*.py) run
the same functions with small numbers; `run` runs them bigger and prints the table of
docs/records/reliability.md (also written as JSON under <results>/reliability/<time>/):

    resnet18-kit reliability run                                   # every scenario, about 3 minutes
    resnet18-kit reliability run --scenario burst --burst-requests 600
    resnet18-kit reliability run --scenario lifecycle              # the fault matrix, about 2 minutes
    resnet18-kit reliability run --scenario stops --stops 30       # `make serve` stopped 30 times
    resnet18-kit reliability run --scenario fleet                  # replicas behind HAProxy, about 3 minutes
    resnet18-kit reliability run --scenario swap                   # config swaps under load, about 90 s
    resnet18-kit reliability soak                                  # 10 minutes at 80 % of capacity
    resnet18-kit reliability soak --minutes 1 --load 0.5

The servers serve the model repository (--model-repository) beside the scenarios' own models.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

from resnet18_kit.options import add_global_options
from resnet18_kit.contract import PROTOCOLS, TRITON_VERSION
from resnet18_kit.observe.machine import cpu_share, cpu_ticks
from resnet18_kit.observe.process_memory import MemorySampler
from resnet18_kit.tools.reliability import RELIABILITY_REPOSITORY, RESULTS_NAME
from resnet18_kit.tools.reliability import (bad_input, burst, crash_request, deadlines, lifecycle, queue_timeout, readiness,
                                      refusal, restricted_api, sigterm, soak, stub_kill, wedge)
from resnet18_kit.tools.reliability.loads import ensemble_load, onnx_load, reference_answers
from resnet18_kit.tools.reliability.table import markdown_table
from resnet18_kit.server.config import MiB, ServerConfig, config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.server.supervisor import SupervisorPolicy
from resnet18_kit.settings import Settings, shown

log = logging.getLogger(__name__)

SCENARIOS = ("burst", "refusal", "timeout", "readiness", "bad-input", "stub-kill", "crash-request", "sigterm",
             "security", "wedge", "lifecycle", "stops", "fleet", "deadlines", "swap")
#: Run only when named: `make serve` started and stopped --stops times (about 12 s a round); the fleet's
#: scenarios (about 3 minutes: fleets of 2 and 3 replicas behind HAProxy, reliability.fleet_scenarios);
#: short gRPC deadlines under overload, with and without the guard, and the kit's classify
#: (reliability.deadlines; about 15 minutes at 20 rounds and runs); config swaps under load on one server
#: and a fleet of 3 (reliability.swap_scenarios; about 90 s).
ON_REQUEST = ("stops", "fleet", "deadlines", "swap")
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


def run_faults(repository: Path, args, out_dir: Path, rows: list, record: dict) -> None:
    """The scenarios that start servers of their own (stub-kill, crash-request, sigterm, security) on the
    model repository `repository`, those `args.scenario` names; logs in `out_dir`, rows appended to
    `rows`, results to `record`."""
    policy = SupervisorPolicy()  # what `serve` runs with
    if "stub-kill" in args.scenario:
        record["stub_kill"] = stub_kill.supervised_stub_kill(repository, out_dir, policy)
        rows.append(stub_kill.table_row(record["stub_kill"]))
    if "crash-request" in args.scenario:
        record["crash_request"] = crash_request.supervised_crash(repository, out_dir, policy)
        rows.append(crash_request.table_row(record["crash_request"]))
    if "sigterm" in args.scenario:
        record["sigterm"] = sigterm.sigterm_shipped_models(repository, out_dir, args.sigterm_in_flight)
        rows.append(sigterm.table_row(record["sigterm"]))
    if "security" in args.scenario:
        record["security"] = restricted_api.checks_with_a_new_key(out_dir)
        rows.append(restricted_api.table_row(record["security"]))
    if "wedge" in args.scenario:
        record["wedge"] = wedge.wedge(config_on_free_ports(model_repository=repository), out_dir / "wedge")
        rows += [wedge.table_row(result) for result in record["wedge"]]


def run_lifecycle(repository: Path, args, out_dir: Path, record: dict) -> list[str]:
    """The fault matrix (reliability.lifecycle), the repeated stops and the fleet's scenarios (on the model
    repository `repository`), those `args.scenario` names; their Markdown tables (the columns differ from
    the main table's)."""
    tables = []
    if "lifecycle" in args.scenario:
        matrix = []
        for case in lifecycle.CASES:
            result = lifecycle.run_case(case, out_dir / "lifecycle" / case)
            record.setdefault("lifecycle", []).append(result)
            matrix.append(lifecycle.table_row(result))
            log.info("lifecycle %s: %s", case, lifecycle.table_row(result)[1:])
        tables.append(markdown_table(matrix, lifecycle.MATRIX_COLUMNS))
    if "stops" in args.scenario:
        result = lifecycle.repeated_stops(out_dir / "stops", args.stops)
        record["stops"] = result
        tables.append(f"`make serve` stopped with `kill -TERM -- -<pgid>` (two SIGTERMs each), {result['rounds']} "
                      f"rounds: {result['hangs']} hung; serve's exit statuses {result['serve_statuses']}; "
                      f"exit after {result['exit_s']} s; left running: {result['left_running'] or 'none'}; "
                      f"/dev/shm regions {result['shm_before']} -> {result['shm_after']}")
    if "fleet" in args.scenario:
        from resnet18_kit.tools.reliability import fleet_scenarios

        results = fleet_scenarios.run_all(repository, out_dir / "fleet")
        record["fleet"] = results
        tables.append(markdown_table([fleet_scenarios.table_cells(r) for r in results], fleet_scenarios.FLEET_COLUMNS))
    if "swap" in args.scenario:
        from resnet18_kit.tools.reliability import swap_scenarios

        results = [swap_scenarios.one_server(repository, out_dir / "swap-one"),
                   swap_scenarios.fleet(repository, out_dir / "swap-fleet")]
        record["swap"] = [{k: v for k, v in r.items() if k != "tallies"} | {"tallies": [t.row() for t in r["tallies"]]}
                          for r in results]
        tables.append(markdown_table([row for r in results for row in swap_scenarios.table_rows(r)],
                                     swap_scenarios.SWAP_COLUMNS))
    if "deadlines" in args.scenario:
        from resnet18_kit.client.samples import sample_photos

        photos = [path.read_bytes() for path in sample_photos()]
        storms = []
        for guard in (True, False):
            config = config_on_free_ports(model_repository=repository)
            storms += deadlines.storm_runs(config, out_dir / "deadlines", photos, args.storm_rounds, guard)
        folder = deadlines.jpeg_folder(out_dir / "deadlines" / "photos")
        runs = deadlines.classify_runs(config_on_free_ports(model_repository=repository), out_dir / "deadlines",
                                       folder, args.classify_runs)
        record["deadlines"] = {"storms": storms, "classify": runs}
        tables.append(markdown_table([deadlines.storm_cells(r) for r in storms], deadlines.STORM_COLUMNS))
        tables.append(markdown_table([deadlines.classify_cells(r) for r in runs], deadlines.CLASSIFY_COLUMNS))
    return tables


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The reliability command's sub-commands: run (the scenarios) and soak."""
    commands = parser.add_subparsers(dest="reliability_command", required=True, metavar="<run|soak>")
    run_parser = commands.add_parser(
        "run", help="the scenarios (default: all but stops), their table and JSON record",
        description="The scenarios against the real server; prints the table of docs/records/reliability.md and writes\n"
                    "reliability.json and reliability.md under --out/<time>/.",
        allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    run_parser.add_argument("--scenario", nargs="+", choices=SCENARIOS, metavar="NAME",
                            default=[s for s in SCENARIOS if s not in ON_REQUEST],
                            help=f"scenarios to run: {', '.join(SCENARIOS)} (default: all but {', '.join(ON_REQUEST)})")
    run_parser.add_argument("--stops", type=int, default=30, metavar="N",
                            help="rounds of the stops scenario (default 30: the hang it guards against was 1 in 7)")
    run_parser.add_argument("--burst-requests", type=int, default=400, metavar="N",
                            help="requests per burst (default 400: five times what the 64-request queue and a "
                                 "batch of 16 hold)")
    run_parser.add_argument("--sigterm-in-flight", type=int, default=48, metavar="N",
                            help="requests in flight when serve gets SIGTERM (default 48)")
    run_parser.add_argument("--storm-rounds", type=int, default=20, metavar="N",
                            help="rounds of the deadline storm per deadline range and target (default 20)")
    run_parser.add_argument("--classify-runs", type=int, default=20, metavar="N",
                            help="runs of classify --concurrency 128 --deadline-s 1 per protocol (default 20)")
    run_parser.add_argument("--out", type=Path, metavar="DIR", help=f"folder for <time>/ (default <results>/{RESULTS_NAME})")
    soak_parser = commands.add_parser(
        "soak", help="the bounded soak: capacity, then a Poisson load at a fraction of it, failures and memory",
        description=soak.__doc__, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    soak_parser.add_argument("--minutes", type=float, default=10.0, help="length of the soak, minutes (default 10)")
    soak_parser.add_argument("--load", type=float, default=0.8, help="fraction of the measured capacity (default 0.8)")
    soak_parser.add_argument("--capacity-s", type=float, default=30.0,
                             help="seconds of the capacity measurement (default 30)")
    soak_parser.add_argument("--max-in-flight", type=int, default=256,
                             help="most requests outstanding at once; a send waits beyond it (default 256)")
    soak_parser.add_argument("--memory-bound-mib", type=float, default=64.0,
                             help="allowed growth of the total resident memory from start to end (default 64 MiB)")
    soak_parser.add_argument("--out", type=Path, metavar="DIR", help=f"folder for soak-<time>/ (soak.json, tritonserver.log; "
                                                      f"default <results>/{RESULTS_NAME})")
    for sub in (run_parser, soak_parser):  # accepted after the sub-command's name too
        add_global_options(sub, suppress=True)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """`run` or `soak` (module doc); the exit status."""
    out = args.out or settings.results_dir(RESULTS_NAME)
    if args.reliability_command == "soak":
        return soak.soak(settings.model_repository, out, minutes=args.minutes, load_fraction=args.load,
                         capacity_s=args.capacity_s, max_in_flight=args.max_in_flight,
                         memory_bound_mib=args.memory_bound_mib)
    return run_scenarios(settings.model_repository, out, args)


def run_scenarios(repository: Path, out: Path, args: argparse.Namespace) -> int:
    """Run the scenarios `args` names on the model repository `repository`; print the table, write
    reliability.json and reliability.md under `out`/<time>/; exit status 0."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = out / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    from resnet18_kit.observe.machine import machine_info

    record: dict = {"started": stamp, "machine": machine_info(TRITON_VERSION), "cpu_steal_share": None,
                    "model_repository": str(repository),
                    "args": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")}}
    ticks_before = cpu_ticks()
    rows: list[list] = []
    if set(args.scenario) & set(ON_ONE_SERVER):
        config = config_on_free_ports(model_repository=repository, extra_model_repositories=(RELIABILITY_REPOSITORY,))
        log.info("starting tritonserver (log: %s)", shown(out_dir / "tritonserver.log"))
        with EmbeddedTritonServer(config, log_path=out_dir / "tritonserver.log") as server:
            run_on_one_server(config, server, args, rows, record)
    run_faults(repository, args, out_dir, rows, record)
    extra_tables = run_lifecycle(repository, args, out_dir, record)
    record["cpu_steal_share"] = round(cpu_share(ticks_before, cpu_ticks())["steal"], 3)
    table = "\n\n".join(([markdown_table(rows)] if rows else []) + extra_tables)
    record["table"] = table
    (out_dir / "reliability.json").write_text(json.dumps(record, indent=1, default=str))
    (out_dir / "reliability.md").write_text(table + "\n")
    print(table)
    print(f"\nCPU steal during the run: {record['cpu_steal_share']:.1%}; full record: "
          f"{shown(out_dir / 'reliability.json')}", file=sys.stderr)
    return 0
