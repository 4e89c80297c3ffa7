"""resnet18-kit plan: plan, simulate, measure a profile, validate against the server, scale on paper.

  plan            cheapest config meeting a latency SLO at a target load; writes it as a .pbtxt
  worked-example  the textbook case: 20,000 QPS, 100 per batch in 100 ms, 500 ms budget
  simulate        one config at one load: predicted throughput, p50/p99, batches
  profile         measure a model's profile through the embedded tritonserver (needs the server)
  validate        profile + perf_analyzer Poisson runs vs the simulation (needs the server)
  scale           replicas for 1k..1M infer/s from profiles, and the limit that binds first
  profile-ensemble, ensemble   the main job as two stages (resnet18_kit/tools/planner/ensemble_cli.py)

`resnet18-kit plan <subcommand> --help` tells each one's options; the model repository and the results
folder are the global --model-repository and --results (results go to <results>/planner/ by default).
docs/capacity.md is the guide; docs/records/capacity.md has what these commands printed on the reference machine.
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from resnet18_kit.contract import DEFAULT_VARIANT, ONNX_MODEL
from resnet18_kit.observe.model_config import ModelConfigView
from resnet18_kit.options import add_global_options
from resnet18_kit.tools.planner.arrivals import BALANCERS, Bursty, Poisson, Trace
from resnet18_kit.tools.planner.ensemble_cli import add_ensemble_commands
from resnet18_kit.tools.planner.profile import Profile, constant_profile
from resnet18_kit.tools.planner.pbtxt import write_planned_config
from resnet18_kit.tools.planner.search import SearchSpace, Slo, format_plan, max_rate, plan, plan_to_json, speed_for
from resnet18_kit.tools.planner.simulator import LostWakeup, simulate
from resnet18_kit.progress import Progress
from resnet18_kit.repository import ModelRepository
from resnet18_kit.settings import Settings

log = logging.getLogger(__name__)


def _arrival(args, rate_rps: float):
    if args.arrivals == "poisson":
        return Poisson(rate_rps)
    if args.arrivals == "bursty":
        return Bursty(rate_rps, args.burst_factor, args.burst_fraction, args.burst_s)
    if not args.trace:
        raise ValueError("--arrivals trace needs --trace FILE")
    return Trace.load(args.trace).scaled_to(rate_rps)


def _add_arrival_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arrivals", choices=("poisson", "bursty", "trace"), default="poisson")
    p.add_argument("--burst-factor", type=float, default=3.0, help="bursty: peak rate / mean rate")
    p.add_argument("--burst-fraction", type=float, default=0.2, help="bursty: fraction of time in bursts")
    p.add_argument("--burst-s", type=float, default=1.0, help="bursty: mean burst length, seconds")
    p.add_argument("--trace", type=Path, help="trace: arrival times file (seconds per line, or a "
                                               "perf_analyzer --profile-export-file JSON), rescaled to the rate")
    p.add_argument("--balancer", choices=BALANCERS, default="round_robin")


STATIC_SPEED_HELP = ("ignore the profile's speed under load (resnet18_kit/tools/planner/speed.py): execution times exactly as "
                     "in the closed-loop table")


def _lost_wakeup(probability: float) -> LostWakeup | None:
    return LostWakeup(probability) if probability > 0 else None


def cmd_plan(settings: Settings, args) -> int:
    """`plan`: print the plan, write its config; exit 1 when no config meets the SLO."""
    if args.worked_example:
        profile = constant_profile(100.0, 100, model="worked_example")
        args.qps = args.qps or 20000.0
        args.budget_ms = args.budget_ms or 500.0
    elif args.profile:
        profile = Profile.load(args.profile)
    else:
        raise ValueError("give --profile FILE or --worked-example")
    if not (args.qps or args.max_qps) or not args.budget_ms:
        raise ValueError("give --qps (or --max-qps) and --budget-ms")
    slo = Slo(args.percentile, args.budget_ms)
    space = SearchSpace(instances=tuple(args.instances) if args.instances else None,
                        max_batch_sizes=tuple(args.max_batch_sizes) if args.max_batch_sizes else None,
                        balancer=args.balancer, requests=args.requests, max_utilization=args.max_utilization,
                        lost_wakeup=_lost_wakeup(args.lost_wakeup), speed_under_load=not args.static_speed)
    if args.unbounded_queue:
        space = replace(space, base_queue=None)
    elif args.model_config:
        from resnet18_kit.tools.planner.batcher import batcher_from_config

        base_queue = batcher_from_config(ModelConfigView.from_file(args.model_config)).queue
        space = replace(space, base_queue=replace(base_queue, max_queue_size=0))
    if args.max_qps:
        args.qps = 0.99 * max_rate(profile, slo, space)
        print(f"highest load one device serves within {slo.describe()}: {args.qps / 0.99:,.1f} infer/s; "
              f"planned at 99% of it")
        if not args.qps:
            raise ValueError(f"no config meets {slo.describe()} on one device at any load")
    arrival = _arrival(args, args.qps)
    if space.base_queue is not None and not space.lost_wakeup:
        print("note: the written config bounds the queue; Triton 2.51 then loses batcher wake-ups (up to "
              "500 ms, docs/capacity.md): plan with --lost-wakeup P or write --unbounded-queue", file=sys.stderr)
    result = plan(args.qps, slo, profile, space, arrival)
    print(format_plan(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(plan_to_json(result), indent=2) + "\n")
    base = args.model_config or settings.repository.config_path(profile.model)
    if result.best is None:
        print("no config meets the SLO within the search space", file=sys.stderr)
        return 1
    if not Path(base).is_file():
        print(f"(no model config at {base}: no .pbtxt written; pass --model-config)", file=sys.stderr)
        return 0
    if args.into_model_repository:
        path = settings.model_repository / profile.model / "configs" / f"{args.name}.pbtxt"
    else:
        path = Path(args.out or settings.results_dir("planner")) / profile.model / "configs" / f"{args.name}.pbtxt"
    command = "resnet18-kit " + shlex.join(sys.argv[1:])
    written = write_planned_config(result, profile, Path(base), path, args.name, command)
    print(f"config written: {written}")
    return 0


def cmd_worked_example(settings: Settings, args) -> int:
    """`worked-example`: the textbook case under each load balancer."""
    for balancer in BALANCERS:
        print(f"--- {balancer} load balancer ---")
        print(format_plan(plan(20000.0, Slo(99, 500.0), constant_profile(100.0, 100, model="worked_example"),
                               SearchSpace(balancer=balancer))))
    return 0


def cmd_simulate(settings: Settings, args) -> int:
    """`simulate`: one config at one rate (req/s); prints the simulated figures (ms, infer/s)."""
    from resnet18_kit.tools.planner.batcher import batcher_from_config

    profile = Profile.load(args.profile)
    path = args.config or settings.repository.own_config_path(profile.model, args.config_name)
    config = ModelConfigView.from_file(path)
    batcher, instances, concurrent = batcher_from_config(config), config.instance_count(), config.concurrent_executions()
    if args.max_queue_delay_us is not None:
        batcher = replace(batcher, max_queue_delay_us=args.max_queue_delay_us)
    import numpy as np

    arrivals = _arrival(args, args.rate).arrivals(args.requests, args.replicas, args.balancer,
                                                  np.random.default_rng(args.seed))
    speed = None if args.static_speed else speed_for(profile, batcher, concurrent, args.rate / args.replicas)
    result = simulate(arrivals, batcher, profile, instances, seed=args.seed, lost_wakeup=_lost_wakeup(args.lost_wakeup),
                      speed=speed, concurrent=concurrent)
    print(f"{path}: {batcher.describe()}, {instances} instance(s), {concurrent} executing at once; {args.rate:g} req/s over {args.replicas} "
          f"replica(s), {args.arrivals}, {args.balancer}; speed under load: "
          f"{f'trace at {speed.utilization:.0%} (mean factor {speed.mean:.2f})' if speed else 'none (static profile)'}")
    for key, value in result.summary().items():
        print(f"  {key:16s} {value:,.3f}" if isinstance(value, float) else f"  {key:16s} {value}")
    print(f"  batches          {result.batches}")
    return 0


def profile_runs(batch_sizes: list[int], instances: list[int], speed_under_load: bool) -> int:
    """How many finished measurements `measure_profile` reports, one status line each: every batch size
    per instance count, the lone batch-1 request once, and per instance count the speed-under-load
    result at each SPEED_UTILIZATIONS level plus the closed loop (with batch 1 among the sizes)."""
    from resnet18_kit.tools.planner.measure import SPEED_UTILIZATIONS

    speed = len(SPEED_UTILIZATIONS) + 1 if speed_under_load and 1 in batch_sizes else 0
    return len(instances) * (len(batch_sizes) + speed) + 1


def measure_with_progress(args, out_dir: Path, source_repository: ModelRepository, **options) -> Profile:
    """measure_profile of `source_repository`'s args.model for the profile/validate arguments, with a bar
    over its measurements (runs)."""
    from resnet18_kit.tools.planner.measure import measure_profile

    total = profile_runs(args.batch_sizes, args.instances, not args.no_speed)
    log.info("profile of %s: batch sizes %s, instances %s: %d measurements", args.model,
             " ".join(map(str, args.batch_sizes)), " ".join(map(str, args.instances)), total)
    with Progress(total, "run", "profile", log) as progress:
        return measure_profile(args.model, tuple(args.batch_sizes), tuple(args.instances), out_dir,
                               source_repository, executions=args.executions, speed_under_load=not args.no_speed,
                               progress=progress, **options)


def cmd_profile(settings: Settings, args) -> int:
    """`profile`: measure and write <out>/profile-<model>.json (starts tritonserver; minutes)."""
    from resnet18_kit.tools.planner.measure import server_ceiling_from_bench

    source = ModelRepository(args.source_repository) if args.source_repository else settings.repository
    if not (source.root / args.model / "config.pbtxt").is_file():
        raise FileNotFoundError(f"--model {args.model}: no {source.root / args.model / 'config.pbtxt'} "
                                f"(models there: {', '.join(source.model_names()) or 'none'})")
    args.instances = args.instances or [1]
    ceiling, ceiling_source = server_ceiling_from_bench(settings.results)
    out = Path(args.out or settings.results_dir("planner", "profile"))
    source.own_config_path(args.model, args.model_config_name)  # FileNotFoundError for an unknown variant
    name = args.model if args.model_config_name == DEFAULT_VARIANT else f"{args.model}-{args.model_config_name}"
    profile = measure_with_progress(args, out / f"profile-{name}", source, server_ceiling_rps=ceiling,
                                    variant=args.model_config_name)
    if ceiling_source:
        profile.extra["server_ceiling_source"] = ceiling_source
    path = profile.save(out / f"profile-{name}.json")
    print(f"profile written: {path}")
    return 0


def configs_instance_counts(repository: ModelRepository, model: str, names: list[str]) -> list[int]:
    """The profile tables validate needs to predict `model`'s configs `names` ("default" or
    configs/<name>.pbtxt) in `repository`: the distinct counts of instances that execute at once
    (ModelConfigView.concurrent_executions: Triton's instance count, fewer under the rate limiter; each
    such execution has the cores of one of that many instances), ascending. Raises FileNotFoundError for
    a name the model has no config of."""
    return sorted({ModelConfigView.from_file(repository.own_config_path(model, name)).concurrent_executions()
                   for name in names})


def cmd_validate(settings: Settings, args) -> int:
    """`validate`: profile, then every config x level against the simulation; writes validation.json and
    validation.md into --out and prints the tables (starts tritonserver; about 20 minutes by default)."""
    from resnet18_kit.tools.planner.validate_analysis import add_predictions, format_table

    out = Path(args.out or settings.results_dir("planner", "validate"))
    repository = settings.repository
    if args.configs_from:  # e.g. a planned config and one Model Analyzer chose, served side by side
        from resnet18_kit.tools.planner.validate_ensemble import scratch_repository

        if not args.configs_from.is_dir():
            raise FileNotFoundError(f"--configs-from {args.configs_from}: no such folder")
        repository = scratch_repository(repository, args.configs_from, out / "repository")
    for name in args.configs:  # before minutes of profiling, not after
        try:
            repository.own_config_path(args.model, name)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"--configs {name}: {exc}") from None
    out.mkdir(parents=True, exist_ok=True)
    if args.predict_only:
        profile = Profile.load(args.profile or out / f"profile-{args.model}.json")
        rows = add_predictions(json.loads((out / "validation.json").read_text()), profile)
        (out / "validation.json").write_text(json.dumps(rows, indent=2, default=float) + "\n")
        (out / "validation.md").write_text(format_table(rows) + "\n")
        print(format_table(rows))
        return 0
    from resnet18_kit.tools.planner.measure import server_ceiling_from_bench
    from resnet18_kit.tools.planner.validate import validate_config

    if args.profile:
        profile = Profile.load(args.profile)
    else:
        args.instances = args.instances or configs_instance_counts(repository, args.model, args.configs)
        ceiling, source = server_ceiling_from_bench(settings.results)
        profile = measure_with_progress(args, out / "profile", repository, server_ceiling_rps=ceiling)
        profile.extra["server_ceiling_source"] = source
        log.info("profile written: %s", profile.save(out / f"profile-{args.model}.json"))
    rows = []
    levels = len(args.rates or args.fractions)
    log.info("validating %d config(s) x %d level(s): %s", len(args.configs), levels, " ".join(args.configs))
    with Progress(len(args.configs) * levels, "level", "validate", log) as progress:
        for name in args.configs:
            progress.set_description(f"validate {name}")
            rows += validate_config(repository, args.model, name, profile, tuple(args.fractions), out,
                                    args.requests_per_level, args.min_level_s, progress=progress,
                                    rates=tuple(args.rates or ()))
            (out / "validation.json").write_text(json.dumps(rows, indent=2, default=float) + "\n")
    log.info("predicting every level (simulation)")
    rows = add_predictions(rows, profile)
    (out / "validation.json").write_text(json.dumps(rows, indent=2, default=float) + "\n")
    table = format_table(rows)
    (out / "validation.md").write_text(table + "\n")
    print(table)
    return 0


def cmd_scale(settings: Settings, args) -> int:
    """`scale`: replicas per target rate (infer/s) for each PROFILE:PERCENTILE:BUDGET_MS."""
    from resnet18_kit.tools.planner.scale import format_rows, scale_rows

    rows = []
    for spec in args.profile:
        path, percentile, budget = spec.rsplit(":", 2)
        rows += scale_rows(Profile.load(path), Slo(float(percentile), float(budget)), tuple(args.targets))
    print(format_rows(rows))
    return 0


def _subcommand(sub, name: str, help_text: str, description: str | None = None) -> argparse.ArgumentParser:
    """One subcommand's parser: no abbreviations, its description as written, the global options too."""
    parser = sub.add_parser(name, help=help_text, description=description or help_text, allow_abbrev=False,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_global_options(parser, suppress=True)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommands of `resnet18-kit plan` and their options (module doc)."""
    sub = parser.add_subparsers(dest="plan_command", required=True, metavar="<subcommand>")

    p = _subcommand(sub, "plan", "cheapest config meeting the SLO; writes it as <model>/configs/<name>.pbtxt")
    p.add_argument("--profile", type=Path, help="profile JSON (resnet18-kit plan profile)")
    p.add_argument("--worked-example", action="store_true", help="the 100-in-100-ms device, 20,000 QPS, 500 ms")
    p.add_argument("--qps", type=float, help="target inferences/s (requests of batch 1)")
    p.add_argument("--max-qps", action="store_true", help="instead of --qps: the highest load one device "
                   "serves within the SLO (search.max_rate), and the config for it")
    p.add_argument("--percentile", type=float, default=99.0)
    p.add_argument("--budget-ms", type=float, help="latency budget at that percentile, ms")
    p.add_argument("--instances", type=int, nargs="*", help="instance counts to try (default: the profile's)")
    p.add_argument("--max-batch-sizes", type=int, nargs="*", help="default: the profile's measured sizes")
    p.add_argument("--max-utilization", type=float, default=1.0, help="headroom: load < this x capacity")
    p.add_argument("--requests", type=int, default=20000, help="simulated requests per candidate")
    p.add_argument("--lost-wakeup", type=float, default=0.0,
                   help="model Triton 2.51's lost wake-up with this probability (default 0: off)")
    p.add_argument("--model-config", type=Path, help="config.pbtxt the planned one derives from "
                                                     "(default <model repository>/<profile model>/config.pbtxt)")
    p.add_argument("--unbounded-queue", action="store_true",
                   help="write no default_queue_policy (Triton prefetches payloads; no lost wake-up)")
    p.add_argument("--name", default="planned", help="variant name: writes configs/<name>.pbtxt")
    p.add_argument("--out", type=Path, help="folder for <model>/configs/<name>.pbtxt (default <results>/planner)")
    p.add_argument("--into-model-repository", action="store_true",
                   help="write <model repository>/<model>/configs/<name>.pbtxt instead of --out")
    p.add_argument("--json", type=Path, help="also write the plan as JSON to this file")
    p.add_argument("--static-speed", action="store_true", help=STATIC_SPEED_HELP)
    _add_arrival_options(p)
    p.set_defaults(plan_run=cmd_plan)

    p = _subcommand(sub, "worked-example", "the textbook case, both load balancers")
    p.set_defaults(plan_run=cmd_worked_example)

    p = _subcommand(sub, "simulate", "one config at one load")
    p.add_argument("--profile", type=Path, required=True)
    p.add_argument("--config", type=Path, help="a .pbtxt (default: the profile model's --config-name)")
    p.add_argument("--config-name", default=DEFAULT_VARIANT)
    p.add_argument("--rate", type=float, required=True, help="total requests/s")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--max-queue-delay-us", type=int)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lost-wakeup", type=float, default=0.0)
    p.add_argument("--static-speed", action="store_true", help=STATIC_SPEED_HELP)
    _add_arrival_options(p)
    p.set_defaults(plan_run=cmd_simulate)

    for command, helptext in (("profile", "measure a profile (starts tritonserver)"),
                              ("validate", "profile + perf_analyzer vs simulation (starts tritonserver)")):
        p = _subcommand(sub, command, helptext)
        p.add_argument("--model", default=ONNX_MODEL, help=f"model of the repository (default {ONNX_MODEL})")
        p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                       help="batch sizes to profile, images per execution (default 1 2 4 8 16 32)")
        p.add_argument("--instances", type=int, nargs="+",
                       help="instance counts to profile, one server start each (default: profile 1; "
                            "validate the counts of the --configs' instance groups)")
        p.add_argument("--executions", type=int, default=12, help="back-to-back executions per size (default 12)")
        p.add_argument("--out", type=Path, help=f"results folder (default <results>/planner/{command})")
        p.add_argument("--no-speed", action="store_true", help="skip the speed-under-load runs "
                       "(resnet18_kit/tools/planner/speed.py; about 2 minutes per instance count)")
        if command == "profile":
            p.add_argument("--model-config-name", default=DEFAULT_VARIANT,
                           help="the model's config variant to profile (default: config.pbtxt; e.g. int8)")
            p.add_argument("--source-repository", type=Path,
                           help="model repository holding --model (default: the global --model-repository; "
                                "e.g. resnet18_kit/tools/bench/model_repository for identity)")
            p.set_defaults(plan_run=cmd_profile)
        else:
            p.add_argument("--profile", type=Path, help="use this profile instead of measuring one")
            p.add_argument("--configs-from", type=Path, metavar="DIR",
                           help="<DIR>/<model>/configs/<name>.pbtxt served too (e.g. `plan plan --out DIR`), "
                                "from a copy of the model repository under --out")
            p.add_argument("--configs", nargs="+", default=[DEFAULT_VARIANT, "throughput"],
                           help="config names: default (config.pbtxt) or <name> (configs/<name>.pbtxt); "
                                "default: default throughput")
            p.add_argument("--fractions", type=float, nargs="+", default=[0.3, 0.7, 0.95],
                           help="levels as fractions of each config's capacity (from the profile)")
            p.add_argument("--rates", type=float, nargs="+", help="levels as request rates, req/s (instead of --fractions)")
            p.add_argument("--requests-per-level", type=int, default=400,
                           help="requests per level, at least (default 400)")
            p.add_argument("--min-level-s", type=float, default=10.0,
                           help="seconds per level, at least: the count grows to rate x this (default 10)")
            p.add_argument("--predict-only", action="store_true",
                           help="no server: predict again from <out>/validation.json and the profile")
            p.set_defaults(plan_run=cmd_validate)

    p = _subcommand(sub, "scale", "replicas for 1k..1M infer/s")
    p.add_argument("--profile", nargs="+", required=True, help="PROFILE.json:PERCENTILE:BUDGET_MS, one per model")
    p.add_argument("--targets", type=float, nargs="+", default=[1e3, 2e4, 1e5, 1e6])
    p.set_defaults(plan_run=cmd_scale)
    add_ensemble_commands(sub, _subcommand)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Run the subcommand; its exit status. A missing or unreadable input named on the command line (profile,
    config, trace, validation.json) or a bad value is one line on stderr and exit 2."""
    from google.protobuf.text_format import ParseError

    try:
        return args.plan_run(settings, args)
    except (FileNotFoundError, IsADirectoryError, json.JSONDecodeError, ParseError, ValueError) as exc:
        print(f"resnet18-kit plan {args.plan_command}: {exc}", file=sys.stderr)
        return 2
