"""resnet18-kit: the one command of this kit (`python -m resnet18_kit` is the same).

    resnet18-kit [--model-repository DIR] [--results DIR] [--log-level LEVEL] <command> [options]

Each command is a module with `add_arguments(parser)` and `run(settings, args) -> exit status`; this
module builds the parser, imports only the module of the command given (so `--help` and a client-only
install stay light), builds the Settings once (flags, then environment, then defaults: settings.py) and
hands them down. The global options are accepted before or after the command name. No option may be
abbreviated (`--model` is never taken for `--model-repository`).

Exit status: the command's; 2 for a usage error, a bad setting, or a command whose extra is not
installed (one line naming the extra to install).
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from resnet18_kit.options import GLOBAL_OPTIONS, Parser, add_global_options, command_parser
from resnet18_kit.settings import Settings, SettingsError

PROG = "resnet18-kit"
#: The distribution whose extras install the commands' dependencies.
DISTRIBUTION = "triton-resnet18-kit"
#: command -> (module with add_arguments and run, the extra that installs what it imports, one-line help)
COMMANDS = {
    "serve": ("resnet18_kit.server.__main__", "serve",
              "serve the model repository with Triton 2.51 (supervised) until Ctrl-C or SIGTERM"),
    "fleet": ("resnet18_kit.fleet.__main__", "serve",
              "N replicas of the server behind HAProxy (per-request balancing, health checks, rolling restarts)"),
    "swap": ("resnet18_kit.swap", "client",
             "load another config into a running server or fleet while it serves (model control, admin key)"),
    "grpc-guard": ("resnet18_kit.upstream.grpc_guard", "serve",
                   "a gRPC front end that never passes clients' deadlines or cancellations on to Triton 2.51"),
    "docker": ("resnet18_kit.containers.__main__", "client",
               "the CPU images of docker-compose.yaml (from PyPI's wheels), and a private Docker engine"),
    "demo": ("resnet18_kit.demo", "serve", "the main job: serve, classify the sample photos over HTTP and gRPC, stop"),
    "export": ("resnet18_kit.export.__main__", "export",
               "ResNet-18 -> ONNX, TorchScript and INT8 ONNX in the model repository, with parity checks"),
    "classify": ("resnet18_kit.client.command", "client", "top-k ImageNet labels for image files, from a server"),
    "evaluate": ("resnet18_kit.tools.bench.evaluate", "bench",
                 "top-1 accuracy and agreement with FP32 of served variants on a labelled folder"),
    "bench": ("resnet18_kit.tools.bench.commands", "bench", "benchmarks: perf_analyzer sweeps and the client pipeline"),
    "reliability": ("resnet18_kit.tools.reliability.__main__", "bench",
                    "overload, faults and shutdown against the real server, every request accounted for"),
    "plan": ("resnet18_kit.tools.planner.__main__", "bench", "capacity planner: profile, plan, validate"),
    "model-analyzer": ("resnet18_kit.tools.bench.model_analyzer", "bench",
                       "Triton Model Analyzer 1.58 (its own venv) on this repository and the embedded server"),
    "figures": ("resnet18_kit.tools.bench.figures", "bench", "the figures of docs/ from the newest results"),
    "perf-analyzer": ("resnet18_kit.tools.load.perf_analyzer", "bench",
                      "the bundled perf_analyzer 2.51 with its library path set; arguments passed through"),
}


DESCRIPTION = """\
Serve ResNet-18 on NVIDIA Triton Inference Server 2.51 (Python backend, dynamic batching) and classify,
benchmark, stress and size it. `resnet18-kit <command> --help` tells each command's options.

Global options go before or after the command; each also reads an environment variable (--help lists
them). Exit status: the command's; 2 for a usage error, a bad setting or a missing extra."""
EPILOG = """\
examples:
  resnet18-kit serve                                   # HTTP :8000, gRPC :8001, metrics :8002; Ctrl-C stops
  resnet18-kit classify --url 127.0.0.1:8000 photo.jpg some/folder/
  resnet18-kit --results /tmp/r bench run --quick      # about 7 minutes on 2 cores"""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of the whole command; the options of `command` (a key of COMMANDS) added by importing its
    module (ModuleNotFoundError when its extra is missing). Every other command is listed by name only."""
    parser = Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG)
    add_global_options(parser, suppress=False)
    subparsers = parser.add_subparsers(dest="command", metavar="<command>", required=True, title="commands")
    for name, (module_name, _, help_text) in COMMANDS.items():
        if name != command:
            command_parser(subparsers, name, help_text)
            continue
        module = importlib.import_module(module_name)
        sub = command_parser(subparsers, name, help_text, description=module.__doc__)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run, _parser=sub)
    return parser


def command_name(argv: list[str]) -> str | None:
    """The command named in `argv`: the first word that is not a global option or its value."""
    takes_value = {flag for flag, _, _ in GLOBAL_OPTIONS}
    words = iter(argv)
    for word in words:
        if word in takes_value:
            next(words, None)
        elif not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    """Run `resnet18-kit` with `argv` (default sys.argv[1:]); returns the exit status (module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = command_name(argv)
    try:
        parser = build_parser(command)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "resnet18_kit":
            raise
        return missing_extra(command, exc)
    if command == "perf-analyzer":  # everything after the command goes to perf_analyzer untouched
        index = argv.index(command)
        args, rest = parser.parse_args(argv[:index + 1]), argv[index + 1:]
        args.arguments = rest
    else:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # named by the command's own parser, so the hint is `resnet18-kit <command> --help`
            getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        settings = Settings.build({dest: getattr(args, dest, None) for _, dest, _ in GLOBAL_OPTIONS} |
                                  {dest: getattr(args, dest, None) for dest in ("url", "protocol", "metrics_url")})
    except SettingsError as exc:
        print(f"{PROG} {command}: {exc}", file=sys.stderr)
        return 2
    from resnet18_kit.progress import setup_logging

    setup_logging(command, settings.log_level)
    terminated: list[int] = []
    previous = _sigterm_unwinds(terminated)
    try:
        status = args._run(settings, args)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "resnet18_kit":
            raise
        return missing_extra(command, exc)
    except BrokenPipeError:  # stdout's reader went away (`... | head -1`): no traceback, as the shell's tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's docs: nothing more to flush
        return 141  # 128 + SIGPIPE, what a shell tool's exit would say
    except KeyboardInterrupt:
        print(f"{PROG} {command}: {'stopped by SIGTERM' if terminated else 'interrupted'}; what it had "
              f"started is stopped", file=sys.stderr)
        return 143 if terminated else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0 if status is None else int(status)


def _sigterm_unwinds(terminated: list[int]):
    """SIGTERM (kill, a container or job stop) unwinds a command as Ctrl-C does: KeyboardInterrupt from
    where the main thread is, so the `with` blocks that hold a tritonserver or a perf_analyzer stop them
    and their shared memory goes with them (without this the default action ends the process at once and
    leaves its server running). The first SIGTERM is recorded in `terminated` and raises; later ones are
    ignored, so they cannot cut that clean-up short. serve and fleet install their own handlers over this
    one for as long as they run (resnet18_kit/server/stop.py). Returns the previous handler (None when not
    on the main thread, where no handler can be set)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def unwind(signum, frame):
        if terminated:
            return
        terminated.append(signum)
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, unwind)


def missing_extra(command: str, exc: ModuleNotFoundError) -> int:
    """One line naming the extra that installs what `command` lacks; exit status 2."""
    extra = COMMANDS[command][1]
    print(f"{PROG} {command}: needs the '{extra}' extra (no module {exc.name!r}): "
          f"pip install '{DISTRIBUTION}[{extra}]' -c constraints.txt", file=sys.stderr)
    return 2
