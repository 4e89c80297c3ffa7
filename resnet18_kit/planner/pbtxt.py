"""Model configs in and out: read a config.pbtxt's batching, write a planned config ready to serve.

Both directions go through tritonclient's `model_config_pb2` (Triton's own ModelConfig protobuf) and
protobuf's `text_format`, so what is written is exactly what Triton parses. A planned config is the
model's existing config.pbtxt, parsed, with only the planned fields changed (max_batch_size,
dynamic_batching, the instance count, per-instance parameters the profile was measured with, warmup
batch sizes that would exceed the new max_batch_size), and re-serialized.
"""
from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from resnet18_kit.planner.batcher import BatcherConfig, QueuePolicy


def load_config(path: Path) -> model_config_pb2.ModelConfig:
    """Parse a config.pbtxt. Raises google.protobuf.text_format.ParseError on a bad file."""
    return text_format.Parse(Path(path).read_text(), model_config_pb2.ModelConfig())


def batcher_from_config(config: model_config_pb2.ModelConfig) -> BatcherConfig:
    """The BatcherConfig a model config describes (what the simulator runs)."""
    if not config.HasField("dynamic_batching"):
        return BatcherConfig(max_batch_size=max(1, config.max_batch_size), dynamic_batching=False)
    batching = config.dynamic_batching
    policy = batching.default_queue_policy
    if policy.timeout_action == model_config_pb2.ModelQueuePolicy.DELAY:
        raise ValueError("timeout_action DELAY is not modelled (only REJECT)")
    if batching.priority_levels > 1:
        raise ValueError("priority levels are not modelled")
    return BatcherConfig(
        max_batch_size=config.max_batch_size, preferred_batch_sizes=tuple(batching.preferred_batch_size),
        max_queue_delay_us=batching.max_queue_delay_microseconds,
        queue=QueuePolicy(max_queue_size=policy.max_queue_size,
                          default_timeout_us=policy.default_timeout_microseconds,
                          allow_timeout_override=policy.allow_timeout_override))


def instance_count(config: model_config_pb2.ModelConfig) -> int:
    """Instances per device: the sum of the instance groups' counts (1 when none is given)."""
    return sum(g.count or 1 for g in config.instance_group) or 1


def planned_config(base: model_config_pb2.ModelConfig, batcher: BatcherConfig, instances: int,
                   parameters: dict[str, str] | None = None) -> model_config_pb2.ModelConfig:
    """A copy of `base` serving with `batcher` and `instances` instances (in its first instance group),
    with `parameters` (e.g. the intra_op_threads the profile used for that instance count) set."""
    config = model_config_pb2.ModelConfig()
    config.CopyFrom(base)
    config.max_batch_size = batcher.max_batch_size
    if batcher.dynamic_batching:
        config.dynamic_batching.Clear()
        config.dynamic_batching.preferred_batch_size.extend(batcher.preferred_batch_sizes)
        config.dynamic_batching.max_queue_delay_microseconds = batcher.max_queue_delay_us
        if batcher.queue.disables_prefetching:  # an all-defaults policy is written as none at all
            policy = config.dynamic_batching.default_queue_policy
            policy.max_queue_size = batcher.queue.max_queue_size
            policy.default_timeout_microseconds = batcher.queue.default_timeout_us
            policy.allow_timeout_override = batcher.queue.allow_timeout_override
    else:
        config.ClearField("dynamic_batching")
    if not config.instance_group:
        config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_AUTO)
    del config.instance_group[1:]
    config.instance_group[0].count = instances
    # The planner's model runs its instances side by side, each with the threads its profile measured;
    # a base config's rate-limiter resources (the default's "cores": one instance at a time) would
    # serialize them, so a planned or profiled config drops them.
    config.instance_group[0].ClearField("rate_limiter")
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = value
    for warmup in config.model_warmup:
        if warmup.batch_size > batcher.max_batch_size:
            warmup.batch_size = batcher.max_batch_size
            warmup.name = f"{warmup.name}_as_{batcher.max_batch_size}"
    return config


def write_config(config: model_config_pb2.ModelConfig, path: Path, header: str = "") -> Path:
    """Serialize `config` to `path` with `header` as leading '#' comment lines. Parses the result back
    and raises ValueError if it does not round-trip."""
    body = text_format.MessageToString(config)
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(comment + body)
    if load_config(path) != config:
        raise ValueError(f"{path} does not parse back to the planned config")
    return path
