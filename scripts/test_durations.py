#!/usr/bin/env python3
"""Where a test run's time goes: reads results/test-durations.json (written by tests/conftest.py on every
pytest run) and prints Markdown tables.

Per file: tests, seconds in fixture setup and teardown (where module and session fixtures start and stop
servers, fleets and compose projects), seconds in the tests' own bodies, the total and the share of the run.
Then the slowest tests (all three phases summed).

Usage: scripts/test_durations.py [PATH] [--top N]   (PATH defaults to results/test-durations.json)
Exit 2 with one line when the file is missing or not a durations file.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent.parent / "results" / "test-durations.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT, help="durations JSON (default: %(default)s)")
    parser.add_argument("--top", type=int, default=15, help="how many of the slowest tests to list (default 15)")
    args = parser.parse_args()
    try:
        phases = json.loads(args.path.read_text())["phases"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"test_durations: {args.path}: not a durations file ({exc.__class__.__name__}: {exc})", file=sys.stderr)
        return 2
    files: dict[str, dict[str, float]] = defaultdict(lambda: {"tests": 0, "startstop_s": 0.0, "body_s": 0.0})
    per_test: dict[str, float] = defaultdict(float)
    for phase in phases:
        name = phase["nodeid"].split("::", 1)[0]
        row = files[name]
        if phase["phase"] == "call":
            row["tests"] += 1
            row["body_s"] += phase["duration_s"]
        else:
            row["startstop_s"] += phase["duration_s"]
        per_test[phase["nodeid"]] += phase["duration_s"]
    total_s = sum(r["startstop_s"] + r["body_s"] for r in files.values())
    print(f"| file | tests | setup + teardown s | test bodies s | total s | share |\n|---|---|---|---|---|---|")
    for name, row in sorted(files.items(), key=lambda kv: -(kv[1]["startstop_s"] + kv[1]["body_s"])):
        file_s = row["startstop_s"] + row["body_s"]
        print(f"| {name} | {row['tests']} | {row['startstop_s']:.1f} | {row['body_s']:.1f} | {file_s:.1f} | "
              f"{100 * file_s / total_s:.1f} % |")
    startstop_s = sum(r["startstop_s"] for r in files.values())
    print(f"| **all** | {sum(r['tests'] for r in files.values())} | {startstop_s:.1f} | {total_s - startstop_s:.1f} | "
          f"{total_s:.1f} | 100 % |\n")
    print("| slowest tests | s |\n|---|---|")
    for nodeid, seconds in sorted(per_test.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| {nodeid} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
