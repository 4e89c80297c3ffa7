"""Results the benchmarks leave in the results folder, read back by the tools that build on them (the
figures, the planner's ceiling)."""
from __future__ import annotations

from pathlib import Path


def bench_summaries(results: Path):
    """Yield (path, summary) for each <results>/bench-*/summary.json that reads as a JSON object: full runs
    first, then --quick ones (folders ending in "-quick"; they read 10-20 % low), each newest first by folder
    name (bench-YYYYmmdd-HHMMSS). Unreadable files are passed over."""
    import json

    paths = sorted(Path(results).glob("bench-*/summary.json"),
                   key=lambda p: (not p.parent.name.endswith("-quick"), p.parent.name), reverse=True)
    for path in paths:
        try:
            summary = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
        if isinstance(summary, dict):
            yield path, summary
