"""Model configs of a server-wide config variant, as written in the model repository and as served.

A variant is a tritonserver `--model-config-name`: every model with configs/<variant>.pbtxt loads it, the
others their config.pbtxt; "default" = config.pbtxt everywhere. The benchmarks read the files (in-process
twins of a variant: batch size, instance counts, runtime parameters) and what the server reports it loaded.
"""
from __future__ import annotations

from pathlib import Path

from resnet18_kit.contract import DEFAULT_VARIANT, config_path, variant_exists  # noqa: F401 (one place: the contract)


def variant_config(model: str, variant: str):
    """`model`'s config under `variant` parsed as tritonclient.grpc.model_config_pb2.ModelConfig (the
    protobuf Triton itself parses, via google.protobuf.text_format)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(config_path(model, variant).read_text(), model_config_pb2.ModelConfig())


def config_parameters(config) -> dict[str, str]:
    """A ModelConfig's `parameters` as key -> string value (what the Python-backend models read)."""
    return {key: value.string_value for key, value in config.parameters.items()}


def instance_count(config) -> int:
    """Model instances of a ModelConfig: the sum of its instance groups' counts."""
    return sum(group.count for group in config.instance_group)


def concurrent_executions(config) -> int:
    """How many of a model's instances Triton runs at once. Without rate-limiter resources: every
    instance. With them (tritonserver --rate-limit=execution_count) an instance runs only while the
    resources it asks for are free, and Triton makes available of each resource, by default, the largest
    amount any single instance asks for. So per resource at most the number of instances whose asks,
    smallest first, fit in that amount run together; instances that each ask for all of it (the CPU
    network configs' "cores") run one at a time. Returns the minimum over resources, at least 1."""
    asked: dict[str, list[int]] = {}
    for group in config.instance_group:
        for resource in group.rate_limiter.resources:
            asked.setdefault(resource.name, []).extend([resource.count] * group.count)
    fits = [instance_count(config)]
    for counts in asked.values():
        available, running, used = max(counts), 0, 0
        for count in sorted(counts):
            if used + count > available:
                break
            used, running = used + count, running + 1
        fits.append(running + (instance_count(config) - len(counts)))  # instances that ask for none
    return max(1, min(fits))


def served_config(client, model: str) -> dict:
    """The batching settings the server actually loaded for `model`, read back over HTTP or gRPC with a
    client.classifier.TritonClassifierClient: max_batch_size, dynamic_batching (bool),
    preferred_batch_size, max_queue_delay_us, max_queue_size (0 = unbounded), instances."""
    config = client.model_config(model)
    batcher = config.get("dynamic_batching")
    policy = (batcher or {}).get("default_queue_policy", {})
    return {"max_batch_size": int(config["max_batch_size"]), "dynamic_batching": batcher is not None,
            "preferred_batch_size": [int(b) for b in (batcher or {}).get("preferred_batch_size", [])],
            "max_queue_delay_us": int((batcher or {}).get("max_queue_delay_microseconds", 0)),
            "max_queue_size": int(policy.get("max_queue_size", 0)),
            "instances": sum(int(g["count"]) for g in config["instance_group"])}
