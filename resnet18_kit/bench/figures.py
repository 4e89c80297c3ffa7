"""(Re)generate the documentation's figures (docs/figures/) from results folders (resnet18-kit figures).

Each figure is written only when its input exists; one log line per figure says where it was written
(and its size) or why it was skipped. Every figure is a PNG at 100 dpi, checked to be under 200 KB.

  pipeline_throughput_vs_p99.png   --pipeline DIR: a `resnet18-kit bench run` results folder whose summary.json
      has the end-to-end part ("pipeline"). img/s (perf_analyzer's throughput; one image per request)
      against p99 latency (ms, perf_analyzer's p99_us / 1000), one panel per photo set, one line per
      variant and protocol, each point labelled with its concurrency; dashed: the variant's in-process
      saturation img/s.
  tensor_throughput_vs_p99.png     --tensor DIR: a `resnet18-kit bench run` results folder whose summary.json has
      the tensor sweeps ("configs"): infer/s against p99 ms of resnet18_onnx, one line per config.
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
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

from resnet18_kit.bench.report import throughput_vs_p99_figure  # noqa: E402
from resnet18_kit.settings import Settings, bench_summaries, checkout  # noqa: E402

log = logging.getLogger(__name__)

DPI = 100
#: Every written figure must be smaller than this (they are committed as documentation).
MAX_FIGURE_BYTES = 200_000
#: The planner's p99 target (resnet18_kit/planner/validate_analysis.py within_target): predicted within +-25 % of measured.
P99_BAND = 0.25
MiB = 1024 * 1024
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
    before --quick ones (settings.bench_summaries). Skip when there is none."""
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


def _plain_log_axis(axis) -> None:
    """Ticks at 1-2-5 steps written as plain numbers (20, 50, 100 ms rather than 10^2) on a log axis."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda value, _: ""))


# --- the figures --------------------------------------------------------------------------------------

def pipeline_figure(summary: dict, date: str) -> plt.Figure:
    """img/s against p99 ms of the end-to-end sweeps (summary["pipeline"], module doc), points labelled
    with their concurrency; one panel per photo set, colour per variant, solid gRPC / dotted HTTP."""
    pipeline = summary["pipeline"]
    sets = list(pipeline["photo_sets"])
    colours = {v["variant"]: f"C{i}" for i, v in enumerate(pipeline["variants"])}
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 4.2), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], sets):
        for variant in pipeline["variants"]:
            colour = colours[variant["variant"]]
            for entry in (e for e in variant["photo_sets"] if e["photos"] == name):
                for run in entry["protocols"]:
                    rows = sorted(run["concurrency"], key=lambda r: r["level"])
                    p99_ms = [r["p99_us"] / 1000 for r in rows]
                    ax.plot(p99_ms, [r["throughput"] for r in rows], marker="o", markersize=4, color=colour,
                            linestyle="-" if run["protocol"] == "grpc" else ":",
                            label=f"{variant['variant']} {run['protocol']}")
                    below = run["protocol"] != "grpc"  # gRPC's labels above its points, HTTP's below
                    for row, x in zip(rows, p99_ms):
                        ax.annotate(f"{row['level']:g}", (x, row["throughput"]), fontsize=6, color=colour,
                                    textcoords="offset points", xytext=(2, -8 if below else 3))
                ax.axhline(entry["inprocess"]["saturation_img_per_s"], color=colour, linestyle="--",
                           linewidth=0.8, label=f"{variant['variant']} in-process")
        ax.set_xscale("log")
        _plain_log_axis(ax.xaxis)
        ax.set_xlabel("p99 latency (ms, log scale)")
        ax.set_title(f"{name} photos", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("img/s")
    fig.suptitle(f"`resnet18` ensemble end to end: img/s vs p99 latency, point labels = concurrency "
                 f"(measured {date})", fontsize=10)
    fig.tight_layout()
    return fig


def validation_rows(rows) -> tuple[list[dict], int, int]:
    """(rows with a prediction, levels that failed, levels not yet predicted) of validation.json's rows."""
    if not isinstance(rows, list):
        raise TypeError("validation.json is not a list of rows")
    failed = sum("error" in r for r in rows)
    done = [r for r in rows if "error" not in r and (r.get("predicted") or {}).get("p99_ms") is not None]
    return done, failed, len(rows) - failed - len(done)


def in_band_of_range(measured: float, a: float, b: float, band: float = P99_BAND) -> bool:
    """Whether some p99 between the two predictions a and b is within `band` of the measured one
    (|p / measured - 1| <= band): min(a, b) <= (1 + band) x measured and max(a, b) >= (1 - band) x measured."""
    return min(a, b) <= (1 + band) * measured and max(a, b) >= (1 - band) * measured


def validation_figure(rows: list[dict], date: str) -> plt.Figure:
    """Predicted p99 (ms, y) against measured p99 (ms, x), log-log, one filled marker per validation row
    for the model (row "predicted": speed under load, lost wake-up; colour and shape per config, labelled
    with its load as a fraction of capacity), and where the row has one, a hollow marker for the documented
    rules alone ("predicted_static") joined to it by a line: the range `resnet18-kit plan plan` prints. The
    y = x line and the band y = (1 +- P99_BAND) x. Rows: validation.json's with "predicted" (`validation_rows`)."""
    fig, ax = plt.subplots(figsize=(6.8, 5.6))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    levels = [(r["measured"]["p99_us"] / 1000, r["predicted"]["p99_ms"], (r.get("predicted_static") or {}).get("p99_ms"))
              for r in rows]  # (measured, the model, the rules alone or None), ms
    values = [v for level in levels for v in level if v is not None]
    low, high = min(values) / 1.4, max(values) * 1.4
    edge_x = [low, high]
    ax.fill_between(edge_x, [x * (1 - P99_BAND) for x in edge_x], [x * (1 + P99_BAND) for x in edge_x],
                    color="0.85", label=f"±{P99_BAND:.0%} of measured", gid="band")
    ax.plot(edge_x, [x * (1 + P99_BAND) for x in edge_x], color="0.6", linewidth=0.8, gid="band_upper")
    ax.plot(edge_x, [x * (1 - P99_BAND) for x in edge_x], color="0.6", linewidth=0.8, gid="band_lower")
    ax.plot(edge_x, edge_x, color="0.3", linewidth=1, label="predicted = measured", gid="identity")
    for i, config in enumerate(configs):
        mine = [(r, level) for r, level in zip(rows, levels) if r["config"] == config]
        marker, colour = "osD^v<>"[i % 7], f"C{i}"
        ax.scatter([x for _, (x, _, _) in mine], [y for _, (_, y, _) in mine], marker=marker, color=colour,
                   zorder=3, label=config, gid=f"config:{config}")
        static = [(x, z) for _, (x, _, z) in mine if z is not None]
        if static:
            ax.scatter(*zip(*static), marker=marker, facecolors="none", edgecolors=colour, zorder=3, gid=f"rules:{config}")
        for row, (x, y, z) in mine:
            if z is not None:
                ax.plot([x, x], [y, z], color=colour, linewidth=0.8, alpha=0.6, gid=f"range:{config}")
            ax.annotate(f"{row['fraction']:.0%}", (x, y), fontsize=7, textcoords="offset points", xytext=(4, -3))
    within = sum(abs(y / x - 1) <= P99_BAND for x, y, _ in levels)
    paired = [level for level in levels if level[2] is not None]
    rules_line = "" if not paired else (
        f"\nhollow: the documented rules alone, {sum(abs(z / x - 1) <= P99_BAND for x, _, z in paired)} of "
        f"{len(paired)}; the range between the two, on {sum(in_band_of_range(*level) for level in paired)} of {len(paired)}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_axis(ax.xaxis)
    _plain_log_axis(ax.yaxis)
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("measured p99 (ms, perf_analyzer, Poisson arrivals)")
    ax.set_ylabel("predicted p99 (ms, planner simulation)")
    ax.set_title(f"capacity planner: predicted vs measured p99, {within} of {len(levels)} levels within "
                 f"±{P99_BAND:.0%} (filled: the model){rules_line}\nlabels: load as a fraction of capacity "
                 f"(measured {date})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")  # clear of the markers
    fig.tight_layout()
    return fig


def soak_figure(record: dict, date: str) -> plt.Figure:
    """Two panels over one time axis (minutes): p50/p99 of the answered requests per minute (ms, soak.json
    "per_minute", drawn at each minute's middle; minutes with failed requests marked), and the resident
    memory's growth since the first sample per process and in total (MiB, "memory_samples": [seconds,
    {process: bytes}] every 5 s; the legend gives each start value)."""
    minutes = record["per_minute"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 5.6), sharex=True,
                                      gridspec_kw={"height_ratios": [1, 1.2]})
    mid = [m["minute"] - 0.5 for m in minutes]
    top.plot(mid, [m["p99_ms"] for m in minutes], marker="o", markersize=4, label="p99")
    top.plot(mid, [m["p50_ms"] for m in minutes], marker=".", markersize=4, linestyle=":", label="p50")
    bad = [(x, m["p99_ms"]) for x, m in zip(mid, minutes) if m.get("failed")]
    if bad:
        top.scatter(*zip(*bad), color="red", marker="x", zorder=3, label="minute with failed requests")
    top.set_ylabel("latency (ms), per minute")
    top.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    samples = record["memory_samples"]
    names = sorted({name for _, sample in samples for name in sample}, key=lambda n: (n != "tritonserver", n))
    times_min = [t / 60 for t, _ in samples]
    totals = [sum(sample.values()) / MiB for _, sample in samples]
    bottom.plot(times_min, [v - totals[0] for v in totals], color="black", linewidth=1.5,
                label=f"total (start {totals[0]:,.0f} MiB)")
    for name in names:
        values = [sample.get(name, 0) / MiB for _, sample in samples]
        bottom.plot(times_min, [v - values[0] for v in values], linewidth=0.9,
                    label=f"{name} (start {values[0]:,.0f} MiB)")
    low, high = bottom.get_ylim()
    low, high = min(low, -2.0), max(high, 2.0)  # a flat line stays flat, not noise blown up
    bottom.set_ylim(low, high + 0.6 * (high - low))  # room for the legend above the lines
    bottom.set_ylabel("resident memory growth\nsince start (MiB)")
    bottom.set_xlabel("minutes since the load began")
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize=7, loc="upper left", ncol=2)
    growth = record.get("memory", {}).get("total", {}).get("growth_mib")
    fig.suptitle(f"soak: {record['rate_per_s']:g} req/s ({record['load']:.0%} of the measured capacity) for "
                 f"{record['minutes']:g} min, {record.get('failed', 0)} failed requests\n"
                 f"resident memory of tritonserver and its stubs{'' if growth is None else f' {growth:+g} MiB'} "
                 f"from start to end (measured {date})", fontsize=10)
    fig.tight_layout()
    return fig


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
