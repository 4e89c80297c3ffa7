"""Overload: a burst of requests far above what a model's queue holds, sent at once; every request is
answered or refused, and the server's counters add up to what the clients saw."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from resnet18_kit.tools.load.outcomes import ANSWERED, Outcome, summarize
from resnet18_kit.tools.reliability.loads import TensorLoad
from resnet18_kit.tools.reliability.senders import send_all
from resnet18_kit.tools.reliability.server_counts import delta, failure_reasons, settled_counts
from resnet18_kit.tools.reliability.table import ms_cell, unaccounted
from resnet18_kit.server.config import ServerConfig


@dataclass
class BurstResult:
    protocol: str
    model: str
    outcomes: list[Outcome]
    server: dict[str, int]           # delta of server_counts over the burst
    failure_reasons: dict[str, int]  # delta of nv_inference_request_failure per reason
    wall_s: float

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    def summary(self) -> dict:
        """{"protocol", "model", "wall_s", "total" (summarize), "server", "failure_reasons"}."""
        return {"protocol": self.protocol, "model": self.model, "wall_s": round(self.wall_s, 2),
                "total": summarize(self.outcomes, self.sent), "server": self.server,
                "failure_reasons": self.failure_reasons}


def burst(config: ServerConfig, protocol: str, load: TensorLoad, requests: int) -> BurstResult:
    """Send `requests` requests at once to `load.model` (reference answers filled in), classify every
    outcome, and read the server's counts before and after. A burst request's refusal waits until the
    server has read the burst; the server's own time to refuse is refusal.refusal_latency's measure."""
    # settled: the counters of requests answered just before (reference answers) may still be moving
    before, reasons_before = settled_counts(config, load.model), failure_reasons(config, load.model)
    started = time.perf_counter()
    outcomes = asyncio.run(send_all(config, protocol, load, range(requests)))
    wall_s = time.perf_counter() - started
    after = settled_counts(config, load.model)
    reasons = {k: int(v - reasons_before.get(k, 0.0)) for k, v in failure_reasons(config, load.model).items()}
    return BurstResult(protocol, load.model, outcomes, delta(before, after), reasons, wall_s)


def table_row(summary: dict, requests: int) -> list:
    """The table's row of one burst (BurstResult.summary())."""
    total, counted = summary["total"], summary["server"]
    agree = counted["metrics_success"] == total[ANSWERED] == counted["stats_success"]
    return [f"burst of {requests} at once, {summary['model']}, {summary['protocol']}",
            f"--scenario burst --burst-requests {requests}", total["sent"], total[ANSWERED], total["refused"],
            unaccounted(total),
            f"burst refusals p50 {ms_cell(total.get('refused_ms'))} / max {ms_cell(total.get('refused_ms'), 'max')} "
            f"ms (wall {summary['wall_s']} s)",
            f"server successes = answered: {'yes' if agree else 'NO'} ({counted['metrics_success']}); "
            f"failures counted {counted['metrics_failure']}"]
