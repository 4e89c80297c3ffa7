"""Model configs: the one reader of config.pbtxt files and of the configs the server reports it loaded.

A config is read as tritonclient.grpc.model_config_pb2.ModelConfig, the protobuf Triton itself parses
(files via google.protobuf.text_format, the server's JSON via google.protobuf.json_format), and every
figure the benchmarks and the planner take from it comes from the functions here, with the defaults
Triton 2.51 (core r24.10) fills in when it normalizes a config: instance counts, max_batch_size,
preferred batch sizes, the queue delay and the queue policy.

A variant is a tritonserver `--model-config-name`: every model with configs/<variant>.pbtxt loads it, the
others their config.pbtxt; "default" = config.pbtxt everywhere (repository.ModelRepository.config_path).

`ModelConfigView` is the typed view every user of a config holds (the server's overload watch, the client's
timeout override and shared-memory sizes, bench, evaluate, the planner's BatcherConfig): built from a file
(`from_file`, `for_variant`) or from what the server reports it loaded (`from_served`), its fields read
through the functions below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from resnet18_kit.contract import DEFAULT_VARIANT
from resnet18_kit.repository import ModelRepository

#: Triton's default instance count per group on the CPU for the backends that opt into it
#: (SetDefaultInstanceCount in core src/model_config_utils.cc, r24.10); every other case gets 1.
DEFAULT_CPU_INSTANCE_COUNT = 2
CPU_MULTI_INSTANCE_BACKENDS = ("tensorflow", "onnxruntime")


def read_config(path: Path):
    """Parse a config.pbtxt as ModelConfig. Raises FileNotFoundError when there is no such file and
    google.protobuf.text_format.ParseError when it is not a valid ModelConfig."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(Path(path).read_text(), model_config_pb2.ModelConfig())


def variant_config(repository: ModelRepository, model: str, variant: str = DEFAULT_VARIANT):
    """`model`'s config under `variant` (the file tritonserver loads: ModelRepository.config_path), parsed."""
    return read_config(repository.config_path(model, variant))


def config_parameters(config) -> dict[str, str]:
    """A ModelConfig's `parameters` as key -> string value (what the Python-backend models read)."""
    return {key: value.string_value for key, value in config.parameters.items()}


def _backend(config) -> str:
    """The backend Triton runs a config with: `backend`, else what the platform or default_model_filename
    names (AutoCompleteBackendFields, core src/model_config_utils.cc r24.10). Not modelled: a config
    naming neither, which Triton completes from the files in the version folder."""
    if config.backend:
        return config.backend
    if config.platform.startswith("tensorflow_") or config.default_model_filename in ("model.savedmodel",
                                                                                       "model.graphdef"):
        return "tensorflow"
    if config.platform == "onnxruntime_onnx" or config.default_model_filename == "model.onnx":
        return "onnxruntime"
    return config.platform


def group_instance_counts(config, gpus: int = 0) -> list[int]:
    """Instances Triton creates for each instance group of a ModelConfig, on a machine with `gpus`
    GPUs (default 0: CPU only), after its normalization (NormalizeInstanceGroup and
    SetDefaultInstanceCount in triton-inference-server/core src/model_config_utils.cc, branch r24.10 =
    Triton 2.51):
      * no instance_group at all: Triton adds one group, kind KIND_AUTO, count 0 (then as below); the
        backend's preferred group may set its kind, and a count only when it gives one > 0, which none
        of this repository's backends (python, onnxruntime, pytorch) does;
      * KIND_AUTO is KIND_CPU without GPUs (or when a listed GPU is absent), else KIND_GPU;
      * count < 1 (0, or negative) becomes the default: 2 for a KIND_CPU group of the onnxruntime or
        tensorflow backend, 1 otherwise;
      * KIND_GPU: count instances on each listed GPU, or on every GPU when none is listed.
    An ensemble has no instances (instance groups do not apply to it): []. Raises ValueError for a
    KIND_GPU group on a machine without GPUs (Triton refuses to load the model)."""
    from tritonclient.grpc import model_config_pb2

    group_kind = model_config_pb2.ModelInstanceGroup
    if config.platform == "ensemble" or config.HasField("ensemble_scheduling"):
        return []
    groups = list(config.instance_group) or [group_kind(kind=group_kind.KIND_AUTO, count=0)]
    counts = []
    for group in groups:
        kind = group.kind
        if kind == group_kind.KIND_AUTO:
            present = gpus > 0 and all(0 <= gpu < gpus for gpu in group.gpus)
            kind = group_kind.KIND_GPU if present else group_kind.KIND_CPU
        count = group.count
        if count < 1:
            cpu_default = kind == group_kind.KIND_CPU and _backend(config) in CPU_MULTI_INSTANCE_BACKENDS
            count = DEFAULT_CPU_INSTANCE_COUNT if cpu_default else 1
        if kind == group_kind.KIND_GPU:
            devices = len(group.gpus) or gpus
            if not devices:
                raise ValueError(f"{config.name}: instance group {group.name or '?'} is KIND_GPU and there is no "
                                 "GPU: Triton refuses to load the model")
            count *= devices
        counts.append(count)
    return counts


def instance_count(config, gpus: int = 0) -> int:
    """Model instances Triton runs for a ModelConfig on a machine with `gpus` GPUs (default 0): the sum
    of `group_instance_counts` (its docstring: Triton's defaults, from core src/model_config_utils.cc
    r24.10). 0 for an ensemble. Raises ValueError for a KIND_GPU group without GPUs."""
    return sum(group_instance_counts(config, gpus))


def concurrent_executions(config) -> int:
    """How many of a model's instances Triton runs at once. Without rate-limiter resources: every
    instance. With them (tritonserver --rate-limit=execution_count) an instance runs only while the
    resources it asks for are free, and Triton makes available of each resource, by default, the largest
    amount any single instance asks for. So per resource at most the number of instances whose asks,
    smallest first, fit in that amount run together; instances that each ask for all of it (the CPU
    network configs' "cores") run one at a time. Returns the minimum over resources, at least 1."""
    asked: dict[str, list[int]] = {}
    for group, count in zip(config.instance_group, group_instance_counts(config)):
        for resource in group.rate_limiter.resources:
            asked.setdefault(resource.name, []).extend([resource.count] * count)
    total = instance_count(config)
    fits = [total]
    for counts in asked.values():
        available, running, used = max(counts), 0, 0
        for count in sorted(counts):
            if used + count > available:
                break
            used, running = used + count, running + 1
        fits.append(running + (total - len(counts)))  # instances that ask for none
    return max(1, min(fits))


def max_batch_size(config) -> int:
    """The largest batch (inferences) one execution may take; 0 = the model has no batch dimension."""
    return int(config.max_batch_size)


def dynamic_batching(config) -> bool:
    """True when the config has a dynamic_batching block (else Triton's default scheduler: one request
    per execution, no queue policy)."""
    return config.HasField("dynamic_batching")


def preferred_batch_sizes(config) -> tuple[int, ...]:
    """The dynamic batcher's preferred batch sizes (inferences) as Triton uses them: as written, or
    (max_batch_size,) when none is written (NormalizeModelConfig, core src/model_config_utils.cc r24.10);
    () without dynamic batching or a batch dimension."""
    if not dynamic_batching(config):
        return ()
    written = tuple(int(size) for size in config.dynamic_batching.preferred_batch_size)
    return written or ((max_batch_size(config),) if max_batch_size(config) > 0 else ())


def max_queue_delay_us(config) -> int:
    """How long (microseconds) the dynamic batcher may hold the oldest request for a preferred size;
    0 without dynamic batching."""
    return int(config.dynamic_batching.max_queue_delay_microseconds) if dynamic_batching(config) else 0


def max_queue_size(config) -> int:
    """The default queue policy's bound on queued requests; 0 = unbounded (also without dynamic
    batching or a queue policy)."""
    return int(config.dynamic_batching.default_queue_policy.max_queue_size) if dynamic_batching(config) else 0


def queue_timeout_us(config) -> int:
    """The default queue policy's timeout of a queued request, microseconds; 0 = none."""
    return (int(config.dynamic_batching.default_queue_policy.default_timeout_microseconds)
            if dynamic_batching(config) else 0)


def timeout_override_allowed(config) -> bool:
    """Whether a request may ask for a shorter queue timeout than the default (allow_timeout_override)."""
    return dynamic_batching(config) and config.dynamic_batching.default_queue_policy.allow_timeout_override


def delays_timed_out_requests(config) -> bool:
    """True when the default queue policy's timeout_action is DELAY (a timed-out request is kept, behind
    the others) rather than REJECT."""
    from tritonclient.grpc import model_config_pb2

    return dynamic_batching(config) and (config.dynamic_batching.default_queue_policy.timeout_action
                                         == model_config_pb2.ModelQueuePolicy.DELAY)


def priority_levels(config) -> int:
    """The dynamic batcher's priority levels (0 or 1 = a single queue)."""
    return int(config.dynamic_batching.priority_levels) if dynamic_batching(config) else 0


def output_row_bytes(config) -> int:
    """Bytes of the largest output tensor per batch row (perf_analyzer's --output-shared-memory-size is
    per output tensor: this times the batch size); an element of unknown size (BYTES) counts 4 bytes."""
    import numpy as np
    from tritonclient.grpc import model_config_pb2
    from tritonclient.utils import triton_to_np_dtype

    sizes = []
    for output in config.output:
        dtype = triton_to_np_dtype(model_config_pb2.DataType.Name(output.data_type).removeprefix("TYPE_"))
        element = np.dtype(dtype).itemsize if dtype is not None and dtype != np.object_ else 4
        sizes.append(int(np.prod(list(output.dims))) * element)
    return max(sizes) if sizes else 0


def parse_served_config(served: dict):
    """The server's JSON model configuration (HTTP: field names as in the .proto; gRPC as_json:
    camelCase) as ModelConfig; fields this tritonclient does not know are passed over."""
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    return json_format.ParseDict(served, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)


def served_config(client, model: str) -> dict:
    """The batching settings the server actually loaded for `model`, read back over HTTP or gRPC with a
    client.sync_client.TritonClassifierClient and read with this module's functions: max_batch_size,
    dynamic_batching (bool), preferred_batch_size, max_queue_delay_us, max_queue_size (0 = unbounded),
    instances (the server's normalized instance groups: every count already filled in)."""
    config = parse_served_config(client.model_config(model))
    return {"max_batch_size": max_batch_size(config), "dynamic_batching": dynamic_batching(config),
            "preferred_batch_size": list(preferred_batch_sizes(config)),
            "max_queue_delay_us": max_queue_delay_us(config), "max_queue_size": max_queue_size(config),
            "instances": instance_count(config)}


@dataclass(frozen=True)
class ModelConfigView:
    """One model's config as this kit reads it, with Triton 2.51's defaults filled in (the functions above).

    name; backend ("python", "onnxruntime", "" for an ensemble); max_batch_size (0 = no batch dimension);
    dynamic_batching; preferred_batch_sizes (Triton's: (max_batch_size,) when none is written);
    max_queue_delay_us (microseconds); max_queue_size (0 = unbounded); queue_timeout_us (0 = none);
    timeout_override_allowed; parameters (key -> string value); proto: the parsed ModelConfig for anything
    else. instance_count(gpus) and concurrent_executions() are methods: they can raise ValueError (a
    KIND_GPU group without GPUs)."""

    name: str
    backend: str
    max_batch_size: int
    dynamic_batching: bool
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_us: int
    max_queue_size: int
    queue_timeout_us: int
    timeout_override_allowed: bool
    parameters: dict = field(compare=False)
    proto: object = field(repr=False, compare=False)

    @classmethod
    def of(cls, config) -> "ModelConfigView":
        """The view of a parsed ModelConfig."""
        return cls(name=config.name, backend=_backend(config) if config.platform != "ensemble" else "",
                   max_batch_size=max_batch_size(config), dynamic_batching=dynamic_batching(config),
                   preferred_batch_sizes=preferred_batch_sizes(config), max_queue_delay_us=max_queue_delay_us(config),
                   max_queue_size=max_queue_size(config), queue_timeout_us=queue_timeout_us(config),
                   timeout_override_allowed=bool(timeout_override_allowed(config)),
                   parameters=config_parameters(config), proto=config)

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfigView":
        """The view of a config.pbtxt (read_config: FileNotFoundError, text_format.ParseError)."""
        view = cls.of(read_config(path))
        return view if view.name else cls.of(_named(view.proto, Path(path)))

    @classmethod
    def for_variant(cls, repository: ModelRepository, model: str, variant: str = DEFAULT_VARIANT
                    ) -> "ModelConfigView":
        """The view of the file tritonserver loads for `model` under `variant`."""
        return cls.from_file(repository.config_path(model, variant))

    @classmethod
    def from_served(cls, served: dict) -> "ModelConfigView":
        """The view of the config the server reports it loaded (HTTP JSON or gRPC as_json)."""
        return cls.of(parse_served_config(served))

    def instance_count(self, gpus: int = 0) -> int:
        """Model instances Triton runs (instance_count above)."""
        return instance_count(self.proto, gpus)

    def concurrent_executions(self) -> int:
        """Instances that run at once under the rate limiter (concurrent_executions above)."""
        return concurrent_executions(self.proto)

    @property
    def overload_threshold(self) -> int:
        """Pending requests at which a bounded queue is about to refuse: at most one more batch fits
        (max_queue_size - max_batch_size, at least 1; upstream.overload); 0 for an unbounded queue."""
        return max(1, self.max_queue_size - self.max_batch_size) if self.max_queue_size > 0 else 0


def _named(config, path: Path):
    """`config` with its name set from its model folder (Triton names a config without one after it)."""
    model_dir = path.parent.parent if path.parent.name == "configs" else path.parent
    config.name = model_dir.name
    return config
