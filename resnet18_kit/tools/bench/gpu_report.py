"""summary.md of `bench gpu`: the run's record (gpu.json, resnet18_kit/tools/bench/gpu_run.py) as a short page:
the machine, each step's status and seconds, served tensors per concurrency, the in-process bar and the ratio,
the main job per concurrency and the stage that bounds it."""
from __future__ import annotations


def cell(value, digits: int = 1) -> str:
    """A table cell: "-" for None, a number rounded to `digits`, anything else as text."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def percent(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def machine_line(record: dict) -> str:
    """GPU, driver, CPU, cores, Python and torch, from the environment step."""
    environment = record.get("environment") or {}
    host, torch = environment.get("machine") or {}, environment.get("torch") or {}
    gpus = environment.get("nvidia_smi") or []
    gpu = ", ".join(f"{g.get('name', '?')} (driver {g.get('driver_version', '?')}, {g.get('memory.total', '?')} MiB)"
                    for g in gpus) or "no GPU seen by nvidia-smi"
    return (f"{gpu}; {host.get('cpu', '?')}, {host.get('cores', '?')} cores; Python {host.get('python', '?')}, "
            f"torch {torch.get('version', '?')} (CUDA {torch.get('cuda') or '-'}); device {environment.get('device', '?')}")


def steps_table(record: dict) -> list[str]:
    lines = ["| step | status | seconds | why |", "|---|---|---|---|"]
    for step in record["steps"]:
        lines.append(f"| {step['name']} | {step['status']} | {cell(step['seconds'])} | {step.get('reason', '')} |")
    return lines


def tensors_table(tensors: dict) -> list[str]:
    lines = ["| concurrency | infer/s | p50 ms | p99 ms | average batch | compute ms per batch | GPU busy |",
             "|---|---|---|---|---|---|---|"]
    for level in tensors.get("levels", []):
        if "error" in level:
            lines.append(f"| {cell(level['concurrency'])} | {level['error']} | | | | | |")
            continue
        stage = next(iter(level["stages"].values()), {})
        lines.append(f"| {cell(level['concurrency'])} | {cell(level['infer_per_s'])} | {cell(level['p50_ms'], 2)} | "
                     f"{cell(level['p99_ms'], 2)} | {cell(stage.get('average_batch'), 2)} | "
                     f"{cell(stage.get('compute_infer_ms'), 2)} | {percent(level['gpu_busy'])} |")
    return lines


def photos_table(main: dict) -> list[str]:
    lines = ["| concurrency | img/s | p99 ms | busy per step (queue ms) | GPU busy |", "|---|---|---|---|---|"]
    for level in main.get("levels", []):
        if "error" in level:
            lines.append(f"| {cell(level['concurrency'])} | {level['error']} | | | |")
            continue
        stages = "; ".join(f"{name} {percent(stage['busy'])} ({cell(stage['queue_ms'], 2)})"
                           for name, stage in level["stages"].items())
        lines.append(f"| {cell(level['concurrency'])} | {cell(level['infer_per_s'])} | {cell(level['p99_ms'], 2)} | "
                     f"{stages} | {percent(level['gpu_busy'])} |")
    return lines


def bar_lines(bar: dict) -> list[str]:
    best, any_batch = bar["bar"], bar["best_any_batch"]
    lines = [f"In-process bar (TorchScript on {bar['device']}, pinned host memory, CUDA streams; batch up to "
             f"{bar['max_batch_size']}): **{cell(best['img_per_s'])} img/s** (batch {best['batch']}, "
             f"{best['streams']} stream(s)); at any batch: {cell(any_batch['img_per_s'])} img/s (batch "
             f"{any_batch['batch']}, {any_batch['streams']} stream(s)).", "",
             "| batch | streams | img/s | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    for row in bar["batch_sizes"] + bar["streams"]:
        lines.append(f"| {row['batch']} | {row['streams']} | {cell(row['img_per_s'])} | {cell(row['p50_ms'], 2)} | "
                     f"{cell(row['p99_ms'], 2)} |")
    runner = bar.get("served_runner")
    if runner:
        lines += ["", "The served model's runner alone (runtimes.py as model.py calls it, one thread, no server):", "",
                  "| batch | img/s | p50 ms | p99 ms |", "|---|---|---|---|"]
        lines += [f"| {row['batch']} | {cell(row['img_per_s'])} | {cell(row['p50_ms'], 2)} | {cell(row['p99_ms'], 2)} |"
                  for row in runner]
    return lines


def instances(groups: list[dict]) -> str:
    """A served config's instance_group (as /v2/models/<m>/config gives it) as "3 x KIND_CPU"."""
    return " + ".join(f"{group.get('count')} x {group.get('kind')}" for group in groups)


def summary_markdown(record: dict) -> str:
    """The page (module doc) for a record as gpu_run writes it."""
    head = record.get("headline") or {}
    lines = [f"# bench gpu{' --dry-run' if record['dry_run'] else ''}, {record['started_utc']}", "",
             machine_line(record), "",
             f"Bundle {record['bundle']}; wall time {cell(record.get('wall_s'))} s of a {record['budget_s']:g} s budget.",
             ""]
    problems = [f"Problem: {problem}" for problem in record.get("problems", [])]
    lines += (problems + [""] if problems else []) + steps_table(record) + [""]
    serve = record.get("serve") or {}
    served = [f"{name} {instances(groups)}" for name, groups in
              (("preprocess", serve.get("preprocess_instance_group")), ("network", serve.get("instance_group")))
              if groups]
    if served:
        lines += [f"Instances: {'; '.join(served)}.", ""]
    tensors = record.get("tensors")
    if tensors:
        lines += [f"## Served tensors: {tensors['model']}, {tensors['protocol']} with {tensors['shared_memory']} "
                  "shared memory, one image per request", ""] + tensors_table(tensors) + [""]
    if record.get("inprocess"):
        lines += ["## In-process bar", ""] + bar_lines(record["inprocess"]) + [""]
    if head.get("served_over_inprocess") is not None:
        lines += [f"Best served / in-process: **{head['served_over_inprocess']:g}** ({cell(head['served_infer_per_s'])} "
                  f"infer/s at concurrency {cell(head['served_concurrency'])}, p99 {cell(head['served_p99_ms'], 2)} ms; "
                  f"bar {cell(head['inprocess_img_per_s'])} img/s).", ""]
    main = record.get("main_job")
    if main:
        lines += [f"## Main job: {len(main['photos'])} sample photos through the {main['model']} ensemble, "
                  f"{main['protocol']}", ""] + photos_table(main) + ["", f"Bound by: {main.get('bound_by') or '-'}", ""]
    return "\n".join(lines)
