"""Retry schedule for back-pressure: capped exponential backoff with full jitter, bounded by a deadline.

A request the server refused with "Exceeds maximum queue size" was never queued, so it is safe to send
again. Waiting `uniform(0, min(max_backoff_s, initial_backoff_s * multiplier**attempt))` before try
`attempt + 1` ("full jitter", AWS Architecture Blog, "Exponential Backoff And Jitter", 2015) spreads
the retries of many clients so they do not hit the queue again in lockstep.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries a queue-full refusal (HTTP 503 / gRPC UNAVAILABLE "Exceeds maximum queue
    size"), and the default time budget of its calls. The wait after try n is drawn uniformly from
    [0, min(max_backoff_s, initial_backoff_s * multiplier**n)] ("full jitter", so clients refused together
    do not come back together).

    Attributes:
        initial_backoff_s: cap of the first wait, seconds (default 0.005).
        multiplier: growth of the cap per retry (default 2).
        max_backoff_s: the largest cap, seconds (default 0.5).
        deadline_s: default time budget of one call, all its tries and waits, seconds (default 30);
            None = no deadline.
        rng: the random source of the jitter (seed it for repeatable waits).
    """

    initial_backoff_s: float = 0.005
    multiplier: float = 2.0
    max_backoff_s: float = 0.5
    deadline_s: float | None = 30.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait after failed try number `attempt` (0-based), drawn with full jitter."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** attempt)
        return self.rng.uniform(0.0, cap)


class Deadline:
    """An absolute point on the monotonic clock; None seconds = never."""

    def __init__(self, seconds: float | None):
        self.at = None if seconds is None else time.monotonic() + seconds

    def remaining_s(self) -> float | None:
        """Seconds left (may be <= 0), or None when there is no deadline."""
        return None if self.at is None else self.at - time.monotonic()

    def expired(self) -> bool:
        remaining = self.remaining_s()
        return remaining is not None and remaining <= 0
