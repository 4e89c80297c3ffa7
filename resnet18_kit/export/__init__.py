"""ResNet-18 -> ONNX, TorchScript and INT8 ONNX in a model repository (`resnet18-kit export`).

`ensure_exported(repository)` is what other commands (serve, demo) call before serving: it runs the export
into that repository when one of its generated files is missing or predates the served outputs. A
repository that does not hold this kit's models (e.g. one of test or reliability models only) is served as
it is: there is nothing to export into it. This module imports nothing heavy: the export runs as
`resnet18-kit export` in a child process, so a missing `export` extra is that command's one-line message.
"""
from __future__ import annotations

import logging
import subprocess
import sys

from resnet18_kit.repository import ModelRepository

log = logging.getLogger(__name__)


def export_needed(repository: ModelRepository) -> str | None:
    """Why `repository` needs an export (files missing, or exports older than the served outputs), or None:
    also None for a repository without this kit's models (ModelRepository.holds_the_kit_models)."""
    if not repository.holds_the_kit_models():
        return None
    missing = repository.missing_artifacts()
    if missing:
        return f"{len(missing)} model files missing"
    return repository.outdated_reason()


def export_command(repository: ModelRepository) -> list[str]:
    """The command line that exports into `repository`."""
    return [sys.executable, "-m", "resnet18_kit", "--model-repository", str(repository.root), "export"]


def ensure_exported(repository: ModelRepository) -> None:
    """Run `resnet18-kit --model-repository <repository.root> export` (a child process, its output on this
    process's stdout/stderr) when export_needed(repository); nothing otherwise. Raises
    subprocess.CalledProcessError when the export fails (it has said why on stderr)."""
    reason = export_needed(repository)
    if reason:
        log.info("%s in %s, running the export first", reason, repository.root)
        subprocess.run(export_command(repository), check=True)
