"""`bench traffic`'s summary lines, from hand-made records (no server)."""
from resnet18_kit.tools.bench.traffic import summary_lines


def test_the_priority_summary_adds_the_trickles_that_ran_beside_the_flood():
    """`bench traffic` runs a flood per trickle (the priority trickle's answers added); the tests run both
    trickles beside one flood (both added). The line says which, with the ratio priority_run computed."""

    def record(together: bool) -> dict:
        trickle = {"p50_ms": 40.0, "p99_ms": 60.0, "requests": 20, "bulk_infer_per_s": 30.0}
        return {"idle": {"p99_ms": 35.0}, "full_batch_ms": 120.0, "bulk_alone": {"bulk_infer_per_s": 32.0},
                "with_priority": trickle | {"trickle_per_s": 1.5},
                "without_priority": trickle | {"p99_ms": 900.0, "trickle_per_s": 0.5},
                "together": together, "bulk_ratio": 30.0 / 32.0, "served_ratio": (30.0 + 1.5 + 0.5 * together) / 32.0}

    apart, together = ([line for line in summary_lines({"priority": record(t)}) if line.startswith("priority: flood")]
                       for t in (False, True))
    assert apart == ["priority: flood 32.0 infer/s alone, 30.0 beside the priority trickle (0.938); served in all, "
                     "the trickle's 1.5 answers/s added: 0.984 of the flood alone (target >= 0.95: met)"]
    assert together == ["priority: flood 32.0 infer/s alone, 30.0 beside the priority trickles (0.938); served in "
                        "all, the trickles' 1.5 + 0.5 answers/s added: 1.000 of the flood alone (target >= 0.95: met)"]
