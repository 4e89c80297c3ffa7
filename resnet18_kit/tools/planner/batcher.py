"""Triton's dynamic batcher as configured (typed) and as it decides (`form_batch`).

`form_batch` is a transcription of `DynamicBatchScheduler::GetDynamicBatch` and the queue policy of
`PriorityQueue::PolicyQueue` in triton-inference-server/core at tag r24.10 (the core of Triton 2.51,
src/dynamic_batch_scheduler.cc and src/scheduler_utils.cc), for the case every config of this repository
is in: traffic at one priority level (the default one, whose queue follows `default_queue_policy`; the
shipped configs' level 1, for interactive requests, is not modelled), and a `default_queue_policy` that sets a queue size, a timeout or
`allow_timeout_override`, which turns the rate limiter's payload prefetching off, so the batcher forms a
batch only when a model instance is idle (`WaitForPayloadSlotAvailable`) and a formed batch never grows.

The rules, as that code applies them when an instance is idle (all sizes in inferences, a request of
batch size b counting b):
  1. Requests are scanned from the head of the queue. A request whose timeout has passed (now > enqueue
     + timeout) is removed and answered "Request timeout expired" when the scan reaches it.
  2. The first request always starts the batch. A following request that would take the pending batch
     past the largest preferred size marks the pending batch as the best one (if none is yet); one that
     would take it past max_batch_size stops the scan ("send now").
  3. Each time the pending batch's size equals a preferred size, that size becomes the best one.
  4. If a best (preferred) size was found and the oldest pending request has not waited
     max_queue_delay yet (or the delay is 0), the batch of that size goes out at once.
  5. Otherwise the whole pending batch goes out at once if the scan was stopped by max_batch_size, or
     the pending batch is at least the largest preferred size, or the oldest pending request has waited
     max_queue_delay, or the delay is 0.
  6. Otherwise the batcher waits until the oldest pending request has waited max_queue_delay, or until
     the closest request timeout of the pending batch, whichever comes first, or until a new request
     arrives; then it decides again from rule 1.
  No preferred_batch_size in the config means [max_batch_size] (Triton's model_config_utils.cc does so
  when it normalises the config). Without a dynamic_batching block (the default scheduler) every request
  is executed alone, first come first served, and there is no queue policy.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from math import inf

from resnet18_kit.observe import model_config
from resnet18_kit.observe.model_config import ModelConfigView


@dataclass(frozen=True)
class QueuePolicy:
    """`default_queue_policy` of the batcher (timeout_action REJECT; DELAY is not modelled).

    max_queue_size: requests waiting in the queue beyond which a new one is refused at once
        (HTTP 503 / gRPC UNAVAILABLE); 0 = unbounded.
    default_timeout_us: a request still queued this long after it arrived is answered "Request timeout
        expired"; 0 = no timeout.
    allow_timeout_override: a request may ask for a shorter timeout than the default.
    """

    max_queue_size: int = 0
    default_timeout_us: int = 0
    allow_timeout_override: bool = False

    @property
    def disables_prefetching(self) -> bool:
        """Triton prefetches payloads only when the policy is all defaults (scheduler_utils.cc)."""
        return bool(self.max_queue_size or self.default_timeout_us or self.allow_timeout_override)

    def timeout_s(self, requested_us: int = 0) -> float:
        """Queue timeout of a request asking for `requested_us` (0 = none), seconds; inf = none."""
        timeout_us = self.default_timeout_us
        if self.allow_timeout_override and requested_us and (not timeout_us or requested_us < timeout_us):
            timeout_us = requested_us
        return timeout_us / 1e6 if timeout_us else inf


@dataclass(frozen=True)
class BatcherConfig:
    """The batching part of a model config.

    max_batch_size: the largest batch an execution may take (inferences).
    dynamic_batching: False = no dynamic_batching block: Triton's default scheduler, one request per
        execution, no queue policy.
    preferred_batch_sizes: () = Triton's default, (max_batch_size,).
    max_queue_delay_us: how long the batcher may hold the oldest request for a preferred size.
    """

    max_batch_size: int
    dynamic_batching: bool = True
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    queue: QueuePolicy = field(default_factory=QueuePolicy)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1 (0 = no batching dimension is not modelled)")
        if any(not 1 <= p <= self.max_batch_size for p in self.preferred_batch_sizes):
            raise ValueError(f"preferred sizes {self.preferred_batch_sizes} must lie in 1..{self.max_batch_size}")

    @property
    def preferred(self) -> tuple[int, ...]:
        """The preferred sizes Triton uses: as configured, or (max_batch_size,) when none is given."""
        return tuple(sorted(set(self.preferred_batch_sizes))) or (self.max_batch_size,)

    def describe(self) -> str:
        if not self.dynamic_batching:
            return f"no dynamic batching (max_batch_size {self.max_batch_size}, one request per execution)"
        preferred = (f"preferred {list(self.preferred_batch_sizes)}" if self.preferred_batch_sizes
                     else "preferred = max")
        queue = (f", max_queue_size {self.queue.max_queue_size}" if self.queue.max_queue_size else "")
        timeout = (f", timeout {self.queue.default_timeout_us / 1000:g} ms" if self.queue.default_timeout_us else "")
        return (f"max_batch_size {self.max_batch_size}, {preferred}, "
                f"max_queue_delay {self.max_queue_delay_us / 1000:g} ms{queue}{timeout}")


def batcher_from_config(view: ModelConfigView) -> BatcherConfig:
    """The BatcherConfig a model config describes (what the simulator runs), from its
    observe.model_config.ModelConfigView (Triton's defaults filled in: preferred sizes none =
    (max_batch_size,)). Without a dynamic_batching block max_batch_size is at least 1. Raises TypeError for
    anything but a ModelConfigView, ValueError for what is not modelled: a queue policy with
    timeout_action DELAY, a default priority level with a queue policy of its own (with several levels,
    what is modelled is every request at the default level)."""
    if not isinstance(view, ModelConfigView):
        raise TypeError(f"batcher_from_config takes a ModelConfigView, not {type(view).__name__}")
    if not view.dynamic_batching:
        return BatcherConfig(max_batch_size=max(1, view.max_batch_size), dynamic_batching=False)
    if model_config.delays_timed_out_requests(view.proto):
        raise ValueError(f"{view.name}: timeout_action DELAY is not modelled (only REJECT)")
    batching = view.proto.dynamic_batching
    if model_config.priority_levels(view.proto) > 1 and batching.default_priority_level in batching.priority_queue_policy:
        raise ValueError(f"{view.name}: a queue policy of the default priority level is not modelled")
    return BatcherConfig(
        max_batch_size=view.max_batch_size, preferred_batch_sizes=view.preferred_batch_sizes,
        max_queue_delay_us=view.max_queue_delay_us,
        queue=QueuePolicy(max_queue_size=view.max_queue_size, default_timeout_us=view.queue_timeout_us,
                          allow_timeout_override=view.timeout_override_allowed))


class Request:
    """A request in the simulated queue: arrival time at the batcher (s), batch size, deadline (s)."""

    __slots__ = ("index", "arrival_s", "size", "deadline_s", "start_s")

    def __init__(self, index: int, arrival_s: float, size: int = 1, deadline_s: float = inf):
        self.index, self.arrival_s, self.size, self.deadline_s = index, arrival_s, size, deadline_s
        self.start_s = inf

    def __repr__(self) -> str:
        return f"Request({self.index}, t={self.arrival_s:g}, size={self.size})"


@dataclass
class Decision:
    """What the batcher does now: take the first `count` requests of the queue as one batch (count > 0),
    or wait until `wake_s` (count 0; None = nothing to wait for: the queue is empty). `rejected`:
    requests the scan found timed out and removed from the queue."""

    count: int = 0
    wake_s: float | None = None
    rejected: list[Request] = field(default_factory=list)


def form_batch(queue: deque[Request], now_s: float, config: BatcherConfig) -> Decision:
    """Triton's GetDynamicBatch for an idle instance (rules 1-6 of the module docstring).

    Removes the timed-out requests it passes from `queue` (returned in Decision.rejected); the caller
    pops the first Decision.count requests as the batch.
    """
    rejected: list[Request] = []
    preferred = config.preferred
    max_preferred = preferred[-1]
    delay_s = config.max_queue_delay_us / 1e6

    def drop_expired(i: int) -> None:  # PolicyQueue::ApplyPolicy at the cursor
        while i < len(queue) and queue[i].deadline_s < now_s:
            rejected.append(queue[i])
            del queue[i]

    drop_expired(0)
    pending = count = best = best_count = 0
    send_now = False
    closest_deadline_s = inf
    while count < len(queue):
        size = queue[count].size
        if count:
            if pending + size > max_preferred and best == 0:
                best, best_count = pending, count
            if pending + size > config.max_batch_size:
                send_now = True
                break
        pending += size
        closest_deadline_s = min(closest_deadline_s, queue[count].deadline_s)
        count += 1
        drop_expired(count)
        if pending in preferred:
            best, best_count = pending, count
    if count == 0:
        return Decision(rejected=rejected)
    oldest_s = queue[0].arrival_s
    # now >= oldest + delay (not now - oldest >= delay): the same float sum as the wake-up time below,
    # so a timer set for oldest + delay always finds the delay exceeded.
    delay_exceeded = delay_s > 0 and now_s >= oldest_s + delay_s
    if best and not delay_exceeded:
        return Decision(best_count, rejected=rejected)
    if send_now or pending >= max_preferred or delay_exceeded or delay_s == 0:
        return Decision(count, rejected=rejected)
    wake_s = oldest_s + delay_s
    if closest_deadline_s < inf:
        wake_s = min(wake_s, closest_deadline_s) if now_s <= closest_deadline_s else now_s + 1e-6
    return Decision(0, wake_s, rejected)


def drop_all_expired(queue: deque[Request], now_s: float) -> list[Request]:
    """PriorityQueue::RejectTimeoutRequests: what the batcher does every 500 ms while it waits for an
    idle instance (WaitForPayloadSlotAvailable): every timed-out request anywhere in the queue goes."""
    expired = [r for r in queue if r.deadline_s < now_s]
    if expired:
        kept = [r for r in queue if r.deadline_s >= now_s]
        queue.clear()
        queue.extend(kept)
    return expired
