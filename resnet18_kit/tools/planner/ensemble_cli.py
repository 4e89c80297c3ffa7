"""`resnet18-kit plan profile-ensemble` and `plan ensemble`: the main job (the `resnet18` ensemble) as two
stages (resnet18_kit/tools/planner/ensemble.py for the model, measure_ensemble.py for the runs).

  profile-ensemble  measure preprocess alone, the network alone and both together (starts tritonserver;
                    about 6 minutes for 3 x 2 instance counts); writes <out>/profile-ensemble[-<variant>].json
  ensemble          plan both stages for a target images/s and a latency SLO; writes configs/<name>.pbtxt
                    for preprocess and for the network (served together with --model-config-name=<name>)
  validate-ensemble the prediction against the real ensemble on photos, Poisson levels (starts tritonserver)
"""
from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from resnet18_kit.contract import DEFAULT_VARIANT, ONNX_MODEL, PREPROCESS_MODEL
from resnet18_kit.observe.model_config import ModelConfigView
from resnet18_kit.tools.planner.batcher import batcher_from_config
from resnet18_kit.tools.planner.ensemble import EnsemblePlan, EnsembleProfile, format_ensemble_plan, plan_ensemble
from resnet18_kit.tools.planner.search import SearchSpace, Slo
from resnet18_kit.tools.planner.simulator import LostWakeup
from resnet18_kit.settings import Settings


def cmd_profile_ensemble(settings: Settings, args) -> int:
    """`profile-ensemble`: measure and write the ensemble profile (minutes; starts tritonserver)."""
    from resnet18_kit.tools.planner.measure_ensemble import measure_ensemble_profile
    from resnet18_kit.tools.planner.profile import Profile

    settings.repository.own_config_path(ONNX_MODEL, args.model_config_name)  # FileNotFoundError: unknown variant
    network = Profile.load(args.network_profile) if args.network_profile else None
    suffix = "" if args.model_config_name == DEFAULT_VARIANT else f"-{args.model_config_name}"
    out = Path(args.out or settings.results_dir("planner", "profile-ensemble"))
    profile = measure_ensemble_profile(settings.repository, out / f"profile-ensemble{suffix}",
                                       tuple(args.preprocess_instances), tuple(args.network_instances),
                                       args.model_config_name, network, settings.results)
    path = profile.save(out / f"profile-ensemble{suffix}.json")
    print(f"ensemble profile written: {path}")
    return 0


def write_ensemble_configs(p: EnsemblePlan, profile: EnsembleProfile, repository, folder: Path, name: str,
                           command: str) -> list[Path]:
    """Both stages' planned configs, <folder>/<model>/configs/<name>.pbtxt, each from the config it was
    measured with (preprocess's config.pbtxt; the network's variant), with a header saying how."""
    from resnet18_kit.tools.planner.measure import instance_parameters
    from resnet18_kit.tools.planner.pbtxt import planned_config, write_config

    variant = profile.network.extra.get("variant", DEFAULT_VARIANT)
    best, r = p.best, p.best.result
    header = (f"variant \"{name}\" (--model-config-name={name}) of the resnet18 ensemble's %s stage, written by "
              f"the capacity planner:\n  {command}\nTarget {p.target_rps:g} images/s, SLO {p.slo.describe()}; "
              f"predicted {best.devices} device(s), p50 {r.percentile_ms(50):.0f} ms, p99 {r.percentile_ms(99):.0f} ms "
              f"end to end.\nProfile: {profile.measured_utc} (preprocess alone, the network alone, both together).")
    written = []
    for model, stage, base_variant in ((PREPROCESS_MODEL, best.preprocess, DEFAULT_VARIANT),
                                       (ONNX_MODEL, best.network, variant)):
        base = ModelConfigView.for_variant(repository, model, base_variant)
        config = planned_config(base.proto, stage.batcher, stage.instances,
                                instance_parameters(base.parameters, stage.instances))
        written.append(write_config(config, folder / model / "configs" / f"{name}.pbtxt", header % model))
    return written


def cmd_ensemble(settings: Settings, args) -> int:
    """`ensemble`: print the plan, write both configs; exit 1 when nothing meets the SLO."""
    profile = EnsembleProfile.load(args.profile)
    slo = Slo(args.percentile, args.budget_ms)
    space = SearchSpace(max_batch_sizes=tuple(args.max_batch_sizes) if args.max_batch_sizes else None,
                        requests=args.requests, lost_wakeup=LostWakeup(args.lost_wakeup) if args.lost_wakeup else None,
                        speed_under_load=False)
    if args.unbounded_queue:
        space = replace(space, base_queue=None)
    preprocess = batcher_from_config(ModelConfigView.for_variant(settings.repository, PREPROCESS_MODEL))
    result = plan_ensemble(args.qps, slo, profile, space, preprocess)
    print(format_ensemble_plan(result, profile))
    if result.best is None:
        return 1
    folder = settings.model_repository if args.into_model_repository else Path(
        args.out or settings.results_dir("planner"))
    for path in write_ensemble_configs(result, profile, settings.repository, folder, args.name,
                                       "resnet18-kit " + shlex.join(sys.argv[1:])):
        print(f"config written: {path}")
    return 0


def cmd_validate_ensemble(settings: Settings, args) -> int:
    """`validate-ensemble`: every config x level; writes validation-ensemble.json / .md into --out."""
    import json

    from resnet18_kit.tools.planner.validate_ensemble import format_table, validate_ensemble

    profile = EnsembleProfile.load(args.profile)
    out = Path(args.out or settings.results_dir("planner", "validate-ensemble"))
    if args.predict_only:  # the measured levels of an earlier run, predicted again with this code
        from resnet18_kit.tools.planner.validate_ensemble import predict_again

        if not (out / "validation-ensemble.json").is_file():
            raise FileNotFoundError(f"--predict-only: no earlier run in {out} (validation-ensemble.json); "
                                    f"run without --predict-only first")
        rows = predict_again(json.loads((out / "validation-ensemble.json").read_text()), profile, out)
        (out / "validation-ensemble.json").write_text(json.dumps(rows, indent=2, default=float) + "\n")
        (out / "validation-ensemble.md").write_text(format_table(rows) + "\n")
        print(format_table(rows))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if args.configs_from and not args.configs_from.is_dir():
        raise FileNotFoundError(f"--configs-from {args.configs_from}: no such folder")
    rows = validate_ensemble(settings.repository, profile, args.configs, tuple(args.fractions), out,
                             args.requests_per_level, args.min_level_s, args.configs_from, settings.results,
                             rates=tuple(args.rates or ()))
    (out / "validation-ensemble.json").write_text(json.dumps(rows, indent=2, default=float) + "\n")
    table = format_table(rows)
    (out / "validation-ensemble.md").write_text(table + "\n")
    print(table)
    return 0


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want a number > 0")
    return value


def add_ensemble_commands(sub, subcommand) -> None:
    """Register profile-ensemble and ensemble on `plan`'s subparsers (`subcommand` makes one parser)."""
    p = subcommand(sub, "profile-ensemble", "measure the ensemble's two stages and their interference "
                   "(starts tritonserver)")
    p.add_argument("--preprocess-instances", type=int, nargs="+", default=[1, 2, 3],
                   help="preprocess instance counts (default 1 2 3)")
    p.add_argument("--network-instances", type=int, nargs="+", default=[1, 2],
                   help="network instance counts (default 1 2); n instances get cores / n threads each")
    p.add_argument("--model-config-name", default=DEFAULT_VARIANT,
                   help=f"the network's config variant (default {DEFAULT_VARIANT}; e.g. int8)")
    p.add_argument("--network-profile", type=Path,
                   help="the network's profile (resnet18-kit plan profile) instead of measuring it")
    p.add_argument("--out", type=Path, help="results folder (default <results>/planner/profile-ensemble)")
    p.set_defaults(plan_run=cmd_profile_ensemble)

    p = subcommand(sub, "ensemble", "plan the ensemble's two stages for images/s under a latency SLO")
    p.add_argument("--profile", type=Path, required=True, help="ensemble profile (plan profile-ensemble)")
    p.add_argument("--qps", type=positive, required=True, help="target images/s (one photo per request)")
    p.add_argument("--budget-ms", type=positive, required=True, help="latency budget at --percentile, ms")
    p.add_argument("--percentile", type=float, default=99.0)
    p.add_argument("--max-batch-sizes", type=int, nargs="*", help="network max batch sizes to try "
                   "(default: the profile's, up to the ensemble's max_batch_size)")
    p.add_argument("--requests", type=int, default=10000, help="simulated requests per candidate")
    p.add_argument("--lost-wakeup", type=float, default=0.0, help="Triton 2.51's lost wake-up probability")
    p.add_argument("--unbounded-queue", action="store_true", help="write the network without a queue policy")
    p.add_argument("--name", default="planned", help="variant name of both written configs")
    p.add_argument("--out", type=Path, help="folder for <model>/configs/<name>.pbtxt (default <results>/planner)")
    p.add_argument("--into-model-repository", action="store_true",
                   help="write into the model repository instead")
    p.set_defaults(plan_run=cmd_ensemble)

    p = subcommand(sub, "validate-ensemble", "the two-stage prediction against the real ensemble on photos "
                   "(starts tritonserver)")
    p.add_argument("--profile", type=Path, required=True, help="ensemble profile (plan profile-ensemble)")
    p.add_argument("--configs", nargs="+", default=[DEFAULT_VARIANT],
                   help="config names served with --model-config-name (default: default)")
    p.add_argument("--configs-from", type=Path, help="a `plan ensemble --out` folder: its planned configs too")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.3, 0.7, 0.95],
                   help="levels as fractions of the predicted capacity (default 0.3 0.7 0.95)")
    p.add_argument("--rates", type=positive, nargs="+", help="levels as images/s instead of --fractions")
    p.add_argument("--requests-per-level", type=int, default=400, help="requests per level, at least")
    p.add_argument("--min-level-s", type=float, default=10.0, help="seconds per level, at least")
    p.add_argument("--out", type=Path, help="results folder (default <results>/planner/validate-ensemble)")
    p.add_argument("--predict-only", action="store_true",
                   help="predict the levels measured in --out again (no server), e.g. after a model change")
    p.set_defaults(plan_run=cmd_validate_ensemble)
