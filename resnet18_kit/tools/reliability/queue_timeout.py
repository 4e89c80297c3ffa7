"""Queue timeouts: requests still queued when their timeout expires are refused, the others proceed;
a request may shorten its timeout, not lengthen it (reliability_timeout: 200 ms per request, batch 1,
default_timeout_microseconds 2 s, allow_timeout_override)."""
from __future__ import annotations

import asyncio
from dataclasses import asdict

from resnet18_kit.tools.load.outcomes import ANSWERED, TIMED_OUT, summarize
from resnet18_kit.tools.reliability import TIMEOUT_MODEL
from resnet18_kit.tools.reliability.loads import echo_load
from resnet18_kit.tools.reliability.senders import send_all
from resnet18_kit.tools.reliability.server_counts import delta, settled_counts
from resnet18_kit.tools.reliability.table import unaccounted
from resnet18_kit.server.config import ServerConfig

#: reliability_timeout's default_timeout_microseconds, in seconds.
DEFAULT_TIMEOUT_S = 2.0


def queue_timeouts(config: ServerConfig, protocol: str, requests: int = 16) -> dict:
    """reliability_timeout: 200 ms per request (batch 1), queue timeout 2 s (default_timeout_microseconds).

    Phase "default": `requests` requests at once; the k-th starts after about 0.2 k s, so those still
    queued after 2 s are refused with "Request timeout expired". Each refusal's latency minus 2 s is how
    late Triton noticed the expiry.
    Phase "override": one request occupies the instance, then 2 requests with the default timeout (they
    wait about 0.2 and 0.4 s) and one asking for 50 ms (`timeout` parameter, allow_timeout_override):
    the 50 ms one is refused, the others are answered.
    Phase "longer": 13 requests at once, each asking for 5 s (2.6 s of work in all): those still queued
    after 2 s are refused all the same (a request can only shorten its queue timeout).

    Returns summaries (load.outcomes.summarize) per phase ("default", "override_others",
    "override_50ms", "override_5s") and in all ("total"), the lateness of the default phase's refusals
    ("default_refusal_after_expiry_ms": min and max, ms), "override_50ms_refused_after_ms",
    "override_5s_refused_after_ms", "server" (server_counts delta) and "outcomes" (every Outcome as a dict).
    """
    load = echo_load(16)
    load.model = TIMEOUT_MODEL
    before = settled_counts(config, TIMEOUT_MODEL)

    default = asyncio.run(send_all(config, protocol, load, range(requests)))

    async def override_phase():
        first = asyncio.ensure_future(send_all(config, protocol, load, range(100, 101)))
        await asyncio.sleep(0.05)
        normal = asyncio.ensure_future(send_all(config, protocol, load, range(101, 103)))
        short = asyncio.ensure_future(send_all(config, protocol, load, range(103, 104), timeout_us=50_000))
        return (await first) + (await normal), await short

    others, short = asyncio.run(override_phase())

    # 13 requests of 200 ms: answered in 2.6 s if their 5 s would hold; refused after 2 s where it does not.
    longer = asyncio.run(send_all(config, protocol, load, range(200, 213), timeout_us=5_000_000))
    after = settled_counts(config, TIMEOUT_MODEL)
    everything = default + others + short + longer
    lateness_ms = sorted((o.latency_s - DEFAULT_TIMEOUT_S) * 1000 for o in default if o.kind == TIMED_OUT)
    return {
        "protocol": protocol, "model": TIMEOUT_MODEL, "default_timeout_s": DEFAULT_TIMEOUT_S,
        "default": summarize(default, requests),
        "default_refusal_after_expiry_ms": {"min": round(lateness_ms[0], 1), "max": round(lateness_ms[-1], 1)}
        if lateness_ms else None,
        "override_others": summarize(others, 3), "override_50ms": summarize(short, 1),
        "override_50ms_refused_after_ms": round(short[0].latency_s * 1000, 1),
        "override_5s": summarize(longer, len(longer)),
        "override_5s_refused_after_ms": sorted(round(o.latency_s * 1000, 1) for o in longer if o.kind == TIMED_OUT),
        "total": summarize(everything, len(everything)),
        "server": delta(before, after), "outcomes": [asdict(o) for o in everything],
    }


def table_row(result: dict) -> list:
    """The table's row of one queue_timeouts run."""
    total = result["total"]
    late = result["default_refusal_after_expiry_ms"] or {"min": float("nan"), "max": float("nan")}
    return [f"queue timeout 2 s (+50 ms and 5 s overrides), {result['protocol']}", "--scenario timeout",
            total["sent"], total[ANSWERED], f"{total[TIMED_OUT]} timed out", unaccounted(total),
            f"refused {late['min']:.0f} to {late['max']:.0f} ms after expiry; 50 ms override refused "
            f"after {result['override_50ms_refused_after_ms']:.0f} ms",
            f"5 s override capped at 2 s: {result['override_5s'][TIMED_OUT]} of 13 refused; server "
            f"failures (REJECTED) {result['server']['metrics_failure']}"]
