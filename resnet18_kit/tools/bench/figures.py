"""(Re)generate the documentation's figures (docs/figures/) from results folders (resnet18-kit figures).

Each figure is written only when its input exists; one log line per figure says where it was written
(and its size) or why it was skipped. Every figure is a PNG at 100 dpi, checked to be under 200 KB.

  pipeline_throughput_vs_p99.png   --pipeline DIR: a `resnet18-kit bench run` results folder whose summary.json
      has the end-to-end part ("pipeline"). img/s (perf_analyzer's throughput; one image per request)
      against p99 latency (ms, perf_analyzer's p99_us / 1000), one panel per photo set, one line per
      variant and protocol, each point labelled with its concurrency; dashed: the variant's in-process
      saturation img/s.
  tensor_throughput_vs_p99.png     --tensor DIR: a `resnet18-kit bench run` results folder whose summary.json has
      the tensor sweeps ("configs"): infer/s against p99 ms of resnet18_onnx, one line per config. From the
      same summary: configs.json beside the figures, and the measured tables of the docs rewritten in place
      ("Choosing a config" in docs/model-repository.md; resnet18_kit/tools/bench/doc_tables.py).
  planner_p99_predicted_vs_measured.png   --validation DIR [DIR ...]: `resnet18-kit plan validate` folders
      (validation.json, with predictions). The model's predicted p99 (ms, row "predicted" "p99_ms":
      Poisson arrivals at the level's rate, steady state) against perf_analyzer's measured p99 (ms,
      "measured" "p99_us" / 1000), one marker per config and load level, the y = x line and a +-25 % band;
      hollow markers: the documented rules alone ("predicted_static"), joined to the model's by a line.
  soak_p99_memory.png              --soak DIR: a `resnet18-kit reliability soak` output folder (its soak.json, or the
      newest soak-*/soak.json under it). Top: p50 and p99 latency of the answered requests per minute
      (ms); bottom: resident memory growth since the start (MiB) of tritonserver, each Python-backend stub
      and their total, per 5 s sample (start values in the legend); one time axis (minutes since the
      open-loop load began).

Defaults (<results> is --results): --pipeline and --tensor: the newest <results>/bench-* folder holding
that part (full runs before --quick ones); --validation: <results>/planner/validate; --soak:
<results>/reliability; --out: the checkout's docs/figures (else ./docs/figures). Bad input (a file that is
not JSON, or lacks a field a figure needs) is one error line and exit status 2; no figure written, 1.

    resnet18-kit figures --pipeline results/<run> --validation results/planner/validate --soak results/reliability
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import re
import sys
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from resnet18_kit.tools.bench.plots import pipeline_figure, soak_figure, validation_figure, validation_rows  # noqa: E402
from resnet18_kit.tools.bench.doc_tables import write_tables  # noqa: E402
from resnet18_kit.tools.bench.report import throughput_vs_p99_figure  # noqa: E402
from resnet18_kit.tools.load.results import bench_summaries  # noqa: E402
from resnet18_kit.settings import Settings, checkout  # noqa: E402

log = logging.getLogger(__name__)

DPI = 100
#: Every written figure must be smaller than this (they are committed as documentation).
MAX_FIGURE_BYTES = 200_000
FIGURES = {"pipeline": "pipeline_throughput_vs_p99.png", "tensor": "tensor_throughput_vs_p99.png",
           "validation": "planner_p99_predicted_vs_measured.png", "soak": "soak_p99_memory.png"}


class BadInput(Exception):
    """An input file that exists but cannot be drawn (not JSON, or a field missing): exit status 2."""


class Skip(Exception):
    """A figure whose input is absent: logged and left out."""


def read_json(path: Path):
    """The parsed JSON of `path`; BadInput (one line) when it is not JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path}: not valid JSON ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: cannot be read ({exc})") from None


# --- finding the inputs -------------------------------------------------------------------------------

def _summary_with(folder: Path, part: str) -> tuple[Path, dict]:
    """(summary.json path, summary) of a bench results folder (or a summary.json) that has `part`."""
    path = folder if folder.is_file() else folder / "summary.json"
    if not path.is_file():
        raise Skip(f"no {path}")
    summary = read_json(path)
    if not isinstance(summary, dict):
        raise BadInput(f"{path}: not a `resnet18-kit bench run` summary (a JSON object)")
    if not summary.get(part):
        why = {"pipeline": "run without --skip-pipeline", "configs": "run without --skip-tensor-sweeps"}[part]
        raise Skip(f"{path} has no {part!r} part ({why})")
    return path, summary


def newest_bench_folder(results: Path, part: str) -> Path:
    """The newest results/bench-*/ whose summary.json has `part` ("pipeline" or "configs"), full runs
    before --quick ones (load.results.bench_summaries). Skip when there is none."""
    for path, summary in bench_summaries(results):
        if summary.get(part):
            return path.parent
    raise Skip(f"no {results}/bench-*/summary.json with a {part!r} part (give the folder as an option)")


def soak_file(folder: Path) -> Path:
    """soak.json in `folder`, or the newest `folder`/soak-*/soak.json (reliability.soak writes soak-<time>/)."""
    if folder.is_file():
        return folder
    if (folder / "soak.json").is_file():
        return folder / "soak.json"
    found = sorted(folder.glob("soak-*/soak.json"))
    if not found:
        raise Skip(f"no soak.json in {folder} or its soak-*/ folders")
    return found[-1]


def _date_of(path: Path, text: str | None = None) -> str:
    """YYYY-MM-DD of the results: from `text` (an ISO time or a name with YYYYMMDD) or the file's mtime."""
    if text:
        match = re.search(r"(\d{4})-?(\d{2})-?(\d{2})", text)
        if match:
            return "-".join(match.groups())
    return datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc).strftime("%Y-%m-%d")


# --- the command --------------------------------------------------------------------------------------

def save(fig: plt.Figure, path: Path) -> int:
    """Write `fig` as a PNG at DPI, close it; returns its size in bytes; ValueError if over MAX_FIGURE_BYTES."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    size_bytes = path.stat().st_size
    if size_bytes >= MAX_FIGURE_BYTES:
        raise ValueError(f"{path} is {size_bytes:,} bytes, over the {MAX_FIGURE_BYTES:,}-byte limit")
    return size_bytes


def _pipeline(folder: Path | None, results: Path) -> tuple[Path, plt.Figure]:
    path, summary = _summary_with(folder or newest_bench_folder(results, "pipeline"), "pipeline")
    return path, pipeline_figure(summary, _date_of(path, summary.get("started_utc")))


def _tensor(folder: Path | None, results: Path) -> tuple[Path, plt.Figure]:
    path, summary = _summary_with(folder or newest_bench_folder(results, "configs"), "configs")
    title = (f"{summary['model']} tensor sweeps: infer/s vs p99 latency per config\n"
             f"(labels: concurrency; measured {_date_of(path, summary.get('started_utc'))})")
    return path, throughput_vs_p99_figure(summary, title)


def _validation(folders: Path | list[Path] | None, results: Path) -> tuple[Path, plt.Figure]:
    """The validation figure from one or more `plan validate` folders (or validation.json files), their
    rows drawn together; the date is the first one's."""
    folders = folders if isinstance(folders, list) else [folders or results / "planner" / "validate"]
    paths = [folder if folder.is_file() else folder / "validation.json" for folder in folders]
    for path in paths:
        if not path.is_file():
            raise Skip(f"no {path}")
    path = paths[0]
    rows, failed, pending = validation_rows([row for p in paths for row in read_json(p)])
    if not rows:
        raise Skip(f"{path} has no predicted level yet ({pending} measured; a run in progress, or run "
                   f"`resnet18-kit plan validate --predict-only --out {path.parent}`)")
    if failed or pending:
        log.info("validation: %d level(s) failed and %d without a prediction are not drawn", failed, pending)
    profiles = sorted(path.parent.glob("profile-*.json"))
    measured = read_json(profiles[0]).get("measured_utc") if profiles else None
    return path, validation_figure(rows, _date_of(path, measured))


def _soak(folder: Path | None, results: Path) -> tuple[Path, plt.Figure]:
    folder = folder or results / "reliability"
    if not folder.exists():
        raise Skip(f"no {folder}")
    path = soak_file(folder)
    record = read_json(path)
    return path, soak_figure(record, _date_of(path, path.parent.name))


#: figure -> builder(input folder or None for the default, results folder) -> (input file, figure).
BUILDERS: dict[str, Callable[[Path | None, Path], tuple[Path, plt.Figure]]] = {
    "pipeline": _pipeline, "tensor": _tensor, "validation": _validation, "soak": _soak}


def generate(inputs: dict[str, Path | None], out_dir: Path, results: Path,
             only: tuple[str, ...] = tuple(FIGURES)) -> dict[str, Path]:
    """Write every figure of `only` whose input exists into out_dir; returns {figure: path written}.
    inputs: {figure: results folder or file (validation: also a list of them), None for the default under
    `results` (module doc)}. Missing
    inputs are logged and skipped; BadInput for an input that is there but cannot be drawn."""
    written = {}
    for name in only:
        source = inputs.get(name)
        missing = [s for s in (source if isinstance(source, list) else [source]) if s is not None and not s.exists()]
        if missing:
            log.warning("%s: skipped: %s does not exist", FIGURES[name], missing[0])
            continue
        try:
            path, fig = BUILDERS[name](source, results)
        except Skip as why:
            log.warning("%s: skipped: %s", FIGURES[name], why)
            continue
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as exc:
            plt.close("all")
            where = source or "the default input"
            raise BadInput(f"{where}: cannot draw {FIGURES[name]}: unexpected content "
                           f"({type(exc).__name__}: {exc})") from None
        target = out_dir / FIGURES[name]
        size_bytes = save(fig, target)
        log.info("%s: %s bytes from %s", target, f"{size_bytes:,}", path)
        written[name] = target
        if name == "tensor":  # the docs' measured tables come from the same sweeps (bench/doc_tables.py)
            for line in write_tables(path, out_dir.parent.parent, out_dir):
                log.info("%s", line)
    return written


def default_out() -> Path:
    """docs/figures of the checkout this package sits in, else ./docs/figures."""
    return (checkout() or Path.cwd()) / "docs" / "figures"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """figures' options."""
    parser.add_argument("--pipeline", type=Path, metavar="DIR",
                        help="`resnet18-kit bench run` results folder with the end-to-end part "
                             "(default: the newest <results>/bench-* that has it)")
    parser.add_argument("--tensor", type=Path, metavar="DIR",
                        help="`resnet18-kit bench run` results folder with the tensor sweeps "
                             "(default: the newest <results>/bench-* that has them)")
    parser.add_argument("--validation", type=Path, nargs="+", metavar="DIR",
                        help="`resnet18-kit plan validate` folder(s), drawn together "
                             "(default: <results>/planner/validate)")
    parser.add_argument("--soak", type=Path, metavar="DIR",
                        help="`resnet18-kit reliability soak` folder, or one soak-<time>/ in it "
                             "(default: <results>/reliability)")
    parser.add_argument("--only", nargs="+", choices=tuple(FIGURES), default=tuple(FIGURES), metavar="FIGURE",
                        help=f"write only these figures ({', '.join(FIGURES)}; default all)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="folder for the PNGs (default: the checkout's docs/figures, else ./docs/figures)")


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Write the figures (module doc); exit status 0, 1 when none was written or one is too big, 2 for bad
    input."""
    inputs = {"pipeline": args.pipeline, "tensor": args.tensor, "validation": args.validation, "soak": args.soak}
    try:
        written = generate(inputs, args.out or default_out(), settings.results, tuple(args.only))
    except BadInput as exc:
        print(f"figures: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a figure over MAX_FIGURE_BYTES
        print(f"figures: error: {exc}", file=sys.stderr)
        return 1
    if not written:
        log.warning("no figure written")
        return 1
    return 0
