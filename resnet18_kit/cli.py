"""The console scripts: every command a user runs, installed by `pip install` (pyproject.toml
[project.scripts]), each the same as `python -m <module>`.

Every script also takes two folder options, anywhere on its command line, before the command itself reads
them (resnet18_kit/contract.py resolves both once, on first import):
  --model-repository DIR   the Triton model repository (default: the checkout's model_repository/, or
                           ./model_repository when the package is installed outside a checkout)
  --results DIR            where results go (default: the checkout's results/, or ./results)
Both set the environment variables contract.MODEL_REPOSITORY_ENV and contract.RESULTS_ENV, which work too.
A command that has its own --model-repository option (serve, demo) still receives it.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

#: console script -> (module whose main(argv) runs it, whether that main has its own --model-repository,
#: the extra of pyproject.toml that installs what it imports)
COMMANDS = {
    "resnet18-serve": ("resnet18_kit.server.__main__", True, "serve"),
    "resnet18-demo": ("resnet18_kit.demo", True, "serve"),
    "resnet18-export": ("resnet18_kit.export.__main__", False, "export"),
    "resnet18-classify": ("resnet18_kit.client.classify", False, "client"),
    "resnet18-async-pipeline": ("resnet18_kit.client.async_pipeline", False, "client"),
    "resnet18-bench": ("resnet18_kit.bench.__main__", False, "bench"),
    "resnet18-evaluate": ("resnet18_kit.bench.evaluate", False, "bench"),
    "resnet18-figures": ("resnet18_kit.bench.figures", False, "bench"),
    "resnet18-lone-client": ("resnet18_kit.bench.lone_client", False, "bench"),
    "resnet18-runtimes": ("resnet18_kit.bench.runtimes", False, "bench"),
    "resnet18-shared-memory": ("resnet18_kit.bench.shared_memory", False, "bench"),
    "resnet18-stub-profile": ("resnet18_kit.bench.stub_profile", False, "bench"),
    "resnet18-reliability": ("resnet18_kit.reliability.__main__", False, "bench"),
    "resnet18-soak": ("resnet18_kit.reliability.soak", False, "bench"),
    "resnet18-plan": ("resnet18_kit.planner.__main__", False, "bench"),
}
#: The distribution whose extras install the commands' dependencies.
DISTRIBUTION = "triton-resnet18-kit"
#: The environment variables of resnet18_kit/contract.py (written out here so that setting them does not
#: import the contract before they are set).
FOLDER_ENV = {"model_repository": "RESNET18_KIT_MODEL_REPOSITORY", "results": "RESNET18_KIT_RESULTS"}


def run(script: str, argv: list[str] | None = None) -> int:
    """Run console script `script` (a key of COMMANDS) with `argv` (default sys.argv[1:]): take the folder
    options out, export them, then call the command's main. A folder that does not exist for
    --model-repository, or a library the command needs that is not installed (its extra was not), is one
    line on stderr and exit status 2."""
    module_name, own_repository_option, extra = COMMANDS[script]
    argv = list(sys.argv[1:] if argv is None else argv)
    folders = argparse.ArgumentParser(add_help=False)
    folders.add_argument("--model-repository", type=Path)
    folders.add_argument("--results", type=Path)
    known, rest = folders.parse_known_args(argv)
    if known.model_repository is not None:
        if not known.model_repository.is_dir():
            print(f"{script}: --model-repository: not a folder: {known.model_repository}", file=sys.stderr)
            return 2
        os.environ[FOLDER_ENV["model_repository"]] = str(known.model_repository.resolve())
        if own_repository_option:
            rest = ["--model-repository", str(known.model_repository), *rest]
    if known.results is not None:
        os.environ[FOLDER_ENV["results"]] = str(known.results.resolve())
    sys.argv[0] = script
    try:
        command = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "resnet18_kit":
            raise
        print(f"{script}: needs the '{extra}' extra (no module {exc.name!r}): "
              f"pip install '{DISTRIBUTION}[{extra}]' -c constraints.txt", file=sys.stderr)
        return 2
    status = command.main(rest)
    return 0 if status is None else int(status)


def _script(name: str):
    def main() -> int:
        return run(name)
    main.__name__ = name.replace("-", "_")
    main.__doc__ = f"`{name}`: `python -m {COMMANDS[name][0].removesuffix('.__main__')}` (see resnet18_kit.cli)."
    return main


serve, demo, export, classify, async_pipeline = (_script(n) for n in (
    "resnet18-serve", "resnet18-demo", "resnet18-export", "resnet18-classify", "resnet18-async-pipeline"))
bench, evaluate, figures, lone_client, runtimes, shared_memory, stub_profile = (_script(n) for n in (
    "resnet18-bench", "resnet18-evaluate", "resnet18-figures", "resnet18-lone-client", "resnet18-runtimes",
    "resnet18-shared-memory", "resnet18-stub-profile"))
reliability, soak, plan = (_script(n) for n in ("resnet18-reliability", "resnet18-soak", "resnet18-plan"))
