"""Benchmarks of the served model: perf_analyzer sweeps and the client pipeline.

    resnet18-kit bench run [--quick]     perf_analyzer sweeps per config variant, the batching-layer ceiling
                                         and the end-to-end pipeline; report.md in <results>/bench-<time>/
                                         (--quick: about 7 minutes on 2 cores)
    resnet18-kit bench lone-client       one gRPC client back to back: the lost wake-up check (p99, stalls)
    resnet18-kit bench runtimes          every CPU runtime of the network in-process, speed and agreement
    resnet18-kit bench shared-memory     what system shared memory saves over plain transfer, batch of 32
    resnet18-kit bench stub-profile      where the Python-backend stubs spend their time under load (py-spy)
    resnet18-kit bench traffic           priority under a bulk flood, the response cache, cancellation
    resnet18-kit bench async-pipeline    an asyncio client pipeline against a running server
    resnet18-kit bench gpu-pack          the bundle a bare GPU machine needs for `bench gpu` (build/gpu/)
    resnet18-kit bench gpu               the GPU table from that bundle: served tensors and photos, in-process

`resnet18-kit bench <name> --help` tells each one's options. Every one but async-pipeline and gpu-pack starts
its own tritonserver on free ports and writes under --results (gpu: under --out).
"""
from __future__ import annotations

import argparse
import importlib

from resnet18_kit.options import add_global_options
from resnet18_kit.settings import Settings

#: sub-command -> (module with add_arguments and run, one-line help). Imported when the sub-command is built.
SUBCOMMANDS = {
    "run": ("resnet18_kit.tools.bench.sweeps",
            "perf_analyzer sweeps per config, the batching-layer ceiling and the end-to-end pipeline"),
    "lone-client": ("resnet18_kit.tools.bench.lone_client", "one client back to back: p50/p99/max and stalls vs in-process"),
    "runtimes": ("resnet18_kit.tools.bench.runtimes", "every CPU runtime of the network in-process: speed and agreement"),
    "shared-memory": ("resnet18_kit.tools.bench.shared_memory", "system shared memory against plain transfer, batch 32"),
    "stub-profile": ("resnet18_kit.tools.bench.stub_profile", "py-spy samples of the Python-backend stubs under load"),
    "traffic": ("resnet18_kit.tools.bench.traffic", "priority under a bulk flood, the response cache, cancellation"),
    "async-pipeline": ("resnet18_kit.tools.bench.async_pipeline", "an asyncio client pipeline against a running server"),
    "gpu-pack": ("resnet18_kit.tools.bench.gpu_pack", "the bundle a bare GPU machine needs for `bench gpu`, size-checked"),
    "gpu": ("resnet18_kit.tools.bench.gpu_run", "on a GPU machine, from the bundle: served and in-process, one JSON"),
}


def add_subcommand(subparsers, name: str) -> argparse.ArgumentParser:
    """The parser of `bench <name>`: its module imported here, its docstring the description, its options,
    the global options accepted after the name too. A module whose libraries are not installed (a GPU
    machine with none of the bench extra but what `bench gpu` needs) is listed by name, and running it
    raises the ModuleNotFoundError again (cli: one line naming the extra)."""
    module_name, help_text = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "resnet18_kit":
            raise
        # No option character: every argument is taken as it is, so the command reaches run() and its error.
        parser = subparsers.add_parser(name, help=help_text, add_help=False, prefix_chars="\0")
        parser.add_argument("arguments", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        parser.set_defaults(_bench_run=_missing(exc))
        return parser
    parser = subparsers.add_parser(name, help=help_text, description=module.__doc__, allow_abbrev=False,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    add_global_options(parser, suppress=True)
    parser.set_defaults(_bench_run=module.run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench sub-commands (SUBCOMMANDS)."""
    subparsers = parser.add_subparsers(dest="bench_command", required=True, metavar="<" + "|".join(SUBCOMMANDS) + ">",
                                       title="sub-commands")
    for name in SUBCOMMANDS:
        add_subcommand(subparsers, name)


def _missing(exc: ModuleNotFoundError):
    def run(settings: Settings, args: argparse.Namespace) -> int:
        raise exc
    return run


def run(settings: Settings, args: argparse.Namespace) -> int:
    """The sub-command's run(settings, args): its exit status."""
    return args._bench_run(settings, args)
