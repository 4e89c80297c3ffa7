"""The documentation's figures as drawings: each function takes what a results folder holds (a bench
summary, validation.json's rows, a soak record) and returns a matplotlib Figure; nothing is read or written
here. `resnet18-kit figures` (resnet18_kit/tools/bench/figures.py) finds the inputs, calls these and saves the
PNGs; its help says what each figure shows."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

from resnet18_kit.tools.bench.pipeline import TRANSPORT_LINESTYLES  # noqa: E402

#: The planner's p99 target (resnet18_kit/tools/planner/validate_analysis.py within_target): predicted within +-25 % of measured.
P99_BAND = 0.25
MiB = 1024 * 1024


def plain_log_axis(axis) -> None:
    """Ticks at 1-2-5 steps written as plain numbers (20, 50, 100 ms rather than 10^2) on a log axis."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda value, _: ""))


def pipeline_figure(summary: dict, date: str) -> plt.Figure:
    """img/s against p99 ms of the end-to-end sweeps (summary["pipeline"], described in
    resnet18_kit/tools/bench/figures.py), points labelled with their concurrency; one panel per photo set, colour
    per variant, solid gRPC / dotted HTTP / dash-dot gRPC with photos in shared memory."""
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
                            linestyle=TRANSPORT_LINESTYLES[run["protocol"]],
                            label=f"{variant['variant']} {run['protocol']}")
                    below = run["protocol"] == "http"  # HTTP's labels below its points, the others' above
                    for row, x in zip(rows, p99_ms):
                        ax.annotate(f"{row['level']:g}", (x, row["throughput"]), fontsize=6, color=colour,
                                    textcoords="offset points", xytext=(2, -8 if below else 3))
                ax.axhline(entry["inprocess"]["saturation_img_per_s"], color=colour, linestyle="--",
                           linewidth=0.8, label=f"{variant['variant']} in-process")
        ax.set_xscale("log")
        plain_log_axis(ax.xaxis)
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
    plain_log_axis(ax.xaxis)
    plain_log_axis(ax.yaxis)
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
