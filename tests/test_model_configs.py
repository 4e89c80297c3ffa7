"""Every config.pbtxt and configs/<name>.pbtxt parses as Triton's ModelConfig and the variants agree."""
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from resnet18_kit import contract
from resnet18_kit.observe.model_config import ModelConfigView, read_config
from resnet18_kit.settings import Settings

#: The shipped model repository, as a command gets it with no flags (the `repository` fixture's; built
#: here too because the parametrizations below need its files at collection).
REPOSITORY = Settings.build().repository
CONFIG_FILES = sorted(REPOSITORY.root.glob("*/config.pbtxt")) + sorted(REPOSITORY.root.glob("*/configs/*.pbtxt"))


def parse(path: Path) -> mc.ModelConfig:
    return read_config(path)


def default_config(model: str) -> mc.ModelConfig:
    return parse(REPOSITORY.config_path(model))


def signature(config: mc.ModelConfig):
    def tensors(items):
        return [(t.name, t.data_type, list(t.dims), getattr(t, "label_filename", "")) for t in items]
    return config.name, tensors(config.input), tensors(config.output)


def variant_name(path: Path) -> str:
    """"default" for config.pbtxt, else the --model-config-name that selects configs/<name>.pbtxt."""
    return "default" if path.name == "config.pbtxt" else path.stem


def ensemble_steps() -> set[str]:
    return {step.model_name for step in default_config(contract.ENSEMBLE_MODEL).ensemble_scheduling.step}


def test_every_model_directory_has_a_default_config():
    models = {p.name for p in REPOSITORY.root.iterdir() if p.is_dir()}
    assert models == set(contract.ALL_MODELS) == set(REPOSITORY.model_names())
    variants = {variant_name(p) for p in CONFIG_FILES}
    assert {"default", "gpu", "latency", "throughput", "no_batching", "int8"} <= variants


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(REPOSITORY.root)))
def test_config_names_its_directory_and_variants_match_the_default(path):
    config = parse(path)
    model_dir = path.parent if path.name == "config.pbtxt" else path.parent.parent
    assert config.name == model_dir.name
    default = default_config(model_dir.name)
    assert signature(config) == signature(default)  # names, dtypes, dims, labels
    assert (config.max_batch_size > 0) == (default.max_batch_size > 0)
    if model_dir.name in ensemble_steps():  # the ensemble must still load with this variant
        assert config.max_batch_size >= default_config(contract.ENSEMBLE_MODEL).max_batch_size


#: Variants that leave the queue unbounded so that Triton 2.51's batcher prefetches payloads: with any
#: default_queue_policy it can sleep 500 ms with a batch waiting (configs/latency.pbtxt explains, and
#: docs/benchmarks.md measures it). Every other batched config bounds its queue.
PREFETCHING_VARIANTS = {"latency", "throughput"}


#: Variants that never hold a lone request back (the default CPU configs are tuned for the main job, where
#: a delay is paid in full by every request at low load, and for a lone client; see their comments).
ZERO_DELAY_VARIANTS = {"latency", "default", "int8"}


def test_default_network_keeps_an_idle_instance_and_runs_one_at_a_time():
    """The default network config avoids Triton 2.51's lost wake-up (a second instance) without two
    executions sharing the cores (a rate-limiter resource each instance needs all of)."""
    (group,) = default_config(contract.ONNX_MODEL).instance_group
    assert group.count == 2
    (resource,) = group.rate_limiter.resources
    assert resource.count == 2 and resource.name == "cores"
    params = {k: v.string_value for k, v in default_config(contract.ONNX_MODEL).parameters.items()}
    assert params["allow_spinning"] == "0"


@pytest.mark.parametrize("path", [p for p in CONFIG_FILES if parse(p).platform != "ensemble"],
                         ids=lambda p: str(p.relative_to(REPOSITORY.root)))
def test_batched_model_has_batcher_queue_policy_instances_and_warmup(path):
    config = parse(path)
    assert config.max_batch_size > 0
    assert config.instance_group and all(g.count >= 1 for g in config.instance_group)
    assert config.model_warmup
    for warmup in config.model_warmup:
        assert 1 <= warmup.batch_size <= config.max_batch_size
        assert set(warmup.inputs) == {t.name for t in config.input}
    variant = variant_name(path)
    if variant == "no_batching":  # the baseline: Triton's default scheduler, one request per execution
        assert not config.HasField("dynamic_batching")
        return
    batcher = config.dynamic_batching
    assert batcher.preferred_batch_size and max(batcher.preferred_batch_size) <= config.max_batch_size
    if variant in PREFETCHING_VARIANTS:  # Triton 2.51's lost wake-up: no queue policy at all (see the file)
        assert not batcher.HasField("default_queue_policy")
    else:
        assert batcher.default_queue_policy.max_queue_size > 0  # bounded queue: back-pressure
    if variant in ZERO_DELAY_VARIANTS:
        assert batcher.max_queue_delay_microseconds == 0
    else:
        assert batcher.max_queue_delay_microseconds > 0
    if batcher.HasField("default_queue_policy") and variant != "gpu":  # gpu: the NGC image's Triton, not measured here
        # Triton 2.51's lost wake-up: with a queue policy a lone instance can sleep 500 ms with a request
        # waiting; a second instance is idle for it (resnet18_onnx/config.pbtxt).
        assert sum(g.count for g in config.instance_group) >= 2
    if variant == "throughput":
        assert list(batcher.preferred_batch_size) == [config.max_batch_size]


def test_ensemble_steps_fit_their_models():
    ensemble = default_config(contract.ENSEMBLE_MODEL)
    assert ensemble.platform == "ensemble"
    produced = {t.name for t in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        model = default_config(step.model_name)
        assert ensemble.max_batch_size <= model.max_batch_size
        assert set(step.input_map) == {t.name for t in model.input}
        assert set(step.input_map.values()) <= produced
        assert set(step.output_map) <= {t.name for t in model.output}
        produced |= set(step.output_map.values())
    assert {t.name for t in ensemble.output} <= produced
    assert [t.name for t in ensemble.output] == ["logits", "probabilities"]
    for output in ensemble.output:  # both usable with class_count
        labels = REPOSITORY.root / contract.ENSEMBLE_MODEL / output.label_filename
        assert labels == REPOSITORY.labels_path and len(labels.read_text().splitlines()) == 1000


@pytest.mark.parametrize("model", [contract.ONNX_MODEL, contract.TORCHSCRIPT_MODEL])
def test_network_configs_serve_the_exports_outputs_in_their_order(model, repository):
    """The pytorch backend maps a TorchScript module's outputs to the config's by position, and the
    Python-backend model looks each configured name up in the runtime's outputs: both need the export's
    names in the export's order (variants have the default's signature: the test above)."""
    assert tuple(t.name for t in default_config(model).output) == repository.runtimes().OUTPUT_NAMES


# -- Triton's answer for what a config leaves out (observe.model_config; core src/model_config_utils.cc r24.10) --

def counts(text: str, gpus: int = 0) -> int:
    from resnet18_kit.observe.model_config import instance_count

    return instance_count(text_format.Parse(text, mc.ModelConfig()), gpus)


@pytest.mark.parametrize("text, expected", [
    ('backend: "python" instance_group [{ count: 0, kind: KIND_CPU }]', 1),
    ('backend: "python" instance_group [{ count: -1, kind: KIND_CPU }]', 1),
    ('backend: "onnxruntime" instance_group [{ count: 0, kind: KIND_CPU }]', 2),  # onnxruntime/tensorflow opt in
    ('platform: "onnxruntime_onnx" instance_group [{ count: 0 }]', 2),  # KIND_AUTO without GPUs = KIND_CPU
    ('backend: "pytorch" instance_group [{ count: 0 }, { count: 3, kind: KIND_CPU }]', 4),
    ('backend: "python"', 1),  # no instance_group: one group, KIND_AUTO, default count
    ('backend: "onnxruntime"', 2),
    ('backend: "tensorflow" platform: "tensorflow_savedmodel"', 2),
    ('name: "e" platform: "ensemble"', 0),  # instance groups do not apply to an ensemble
])
def test_instance_count_is_tritons_on_a_cpu_only_machine(text, expected):
    assert counts(text) == expected


def test_instance_count_with_gpus_counts_per_gpu_and_refuses_kind_gpu_without_one():
    assert counts('backend: "onnxruntime"', gpus=2) == 2  # KIND_AUTO = KIND_GPU: 1 (default) on each GPU
    assert counts('backend: "onnxruntime" instance_group [{ count: 3, kind: KIND_GPU, gpus: [1] }]', gpus=2) == 3
    with pytest.raises(ValueError, match="KIND_GPU"):
        counts('backend: "onnxruntime" instance_group [{ count: 1, kind: KIND_GPU }]')


def test_bench_and_planner_read_the_same_figures_through_one_reader(repository):
    from resnet18_kit.tools.bench.sweeps import local_batching
    from resnet18_kit.tools.planner.__main__ import configs_instance_counts
    from resnet18_kit.tools.planner.batcher import batcher_from_config

    cpu_variants = [name for name in repository.variant_names(contract.ONNX_MODEL) if name != "gpu"]
    assert {"default", "latency", "throughput", "no_batching"} <= set(cpu_variants)
    for variant in cpu_variants:
        view = ModelConfigView.for_variant(repository, contract.ONNX_MODEL, variant)
        assert view.proto == read_config(repository.config_path(contract.ONNX_MODEL, variant))
        batcher = batcher_from_config(view)
        bench = local_batching(repository, contract.ONNX_MODEL, variant)
        assert (bench.max_batch_size, bench.max_queue_size, bench.instance_count()) == (
            batcher.max_batch_size, batcher.queue.max_queue_size, view.instance_count())
        assert configs_instance_counts(repository, contract.ONNX_MODEL, [variant]) == [view.concurrent_executions()]
    with pytest.raises(FileNotFoundError, match="nosuch.pbtxt"):
        repository.own_config_path(contract.ONNX_MODEL, "nosuch")


def test_preferred_sizes_default_to_max_batch_size_and_queue_fields_to_none():
    from resnet18_kit.observe import model_config

    config = text_format.Parse("max_batch_size: 8 dynamic_batching { }", mc.ModelConfig())
    assert model_config.preferred_batch_sizes(config) == (8,)
    assert (model_config.max_queue_delay_us(config), model_config.max_queue_size(config)) == (0, 0)
    unbatched = text_format.Parse("max_batch_size: 8", mc.ModelConfig())
    assert not model_config.dynamic_batching(unbatched) and model_config.preferred_batch_sizes(unbatched) == ()


def test_served_config_reads_the_servers_json_with_the_same_functions():
    """HTTP gives the .proto's field names, gRPC (as_json) camelCase and int64 as strings: one answer."""
    from resnet18_kit.observe.model_config import served_config

    http = {"name": "m", "max_batch_size": 32, "instance_group": [{"name": "m_0", "kind": "KIND_CPU", "count": 2}],
            "dynamic_batching": {"preferred_batch_size": [32], "max_queue_delay_microseconds": 100000,
                                 "default_queue_policy": {"max_queue_size": 64}},
            "some_field_of_a_newer_server": {}}
    grpc = {"name": "m", "maxBatchSize": 32, "instanceGroup": [{"name": "m_0", "kind": "KIND_CPU", "count": 2}],
            "dynamicBatching": {"preferredBatchSize": [32], "maxQueueDelayMicroseconds": "100000",
                                "defaultQueuePolicy": {"maxQueueSize": "64"}}}

    class Client:
        def __init__(self, config):
            self.config = config

        def model_config(self, model):
            return self.config

    expected = {"max_batch_size": 32, "dynamic_batching": True, "preferred_batch_size": [32],
                "max_queue_delay_us": 100000, "max_queue_size": 64, "instances": 2}
    assert served_config(Client(http), "m") == expected == served_config(Client(grpc), "m")
