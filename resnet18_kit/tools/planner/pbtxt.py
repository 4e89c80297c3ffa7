"""Planned model configs out: write the chosen config as a config.pbtxt ready to serve.

Configs are read through observe.model_config (parsing and Triton's defaults, one place; the planner's
BatcherConfig of a config's ModelConfigView is planner.batcher.batcher_from_config). Written through tritonclient's
`model_config_pb2` (Triton's own ModelConfig protobuf) and protobuf's `text_format`, so what is written
is exactly what Triton parses. A planned config is the model's existing config.pbtxt, parsed, with only
the planned fields changed (max_batch_size, dynamic_batching, the instance count, per-instance
parameters the profile was measured with, warmup batch sizes that would exceed the new max_batch_size),
and re-serialized.
"""
from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from resnet18_kit.observe.model_config import ModelConfigView, read_config
from resnet18_kit.tools.planner.batcher import BatcherConfig
from resnet18_kit.tools.planner.profile import Profile
from resnet18_kit.tools.planner.search import Plan, p99_trust


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
    if read_config(path) != config:
        raise ValueError(f"{path} does not parse back to the planned config")
    return path


def write_planned_config(p: Plan, profile: Profile, base_path: Path, path: Path, name: str, command: str) -> Path:
    """Write the plan's best config (base config + its batcher and instances) to `path`, with a header
    saying how it was planned and what it is predicted to do; returns the path."""
    best = p.best
    params = (profile.extra.get("instance_parameters", {}) or {}).get(str(best.instances), {})
    config = planned_config(ModelConfigView.from_file(base_path).proto, best.batcher, best.instances, params)
    d = best.predicted(p.slo)
    header = (f"{config.name}, variant \"{name}\" (--model-config-name={name}), written by the capacity planner:\n"
              f"  {command}\n"
              f"Target {p.target_rps:,.0f} infer/s, SLO {p.slo.describe()}, arrivals {p.arrival}.\n"
              f"Profile: {profile.model} on {profile.device} ({profile.measured_utc or 'no date'}).\n"
              f"Predicted: {d['devices']:,} devices x {best.instances} instance(s); per device "
              f"{d['throughput_rps_per_device']:,.1f} infer/s, p50 {d['p50_ms']:.1f} ms, p99 {d['p99_ms']:.1f} ms, "
              f"busy {d['busy_fraction']:.0%}, average batch {d['average_batch']:.1f}.\n"
              f"p99 at {d['capacity_used']:.0%} of capacity: {p99_trust(d['capacity_used'])[1]}.\n"
              + ("max_queue_size = requests one device serves within the budget (resnet18_kit/tools/planner/search.py)."
                 if best.batcher.queue.max_queue_size else
                 "No queue policy: Triton prefetches payloads (no lost wake-up, no queue bound)."))
    return write_config(config, path, header)
