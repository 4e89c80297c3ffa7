"""Server and model health, metadata and configuration of every model, over HTTP and gRPC."""
import pytest

from resnet18_kit.contract import ALL_MODELS, ENSEMBLE_MODEL


def test_server_live_and_ready(client):
    assert client.raw.is_server_live()
    assert client.is_server_ready()


@pytest.mark.parametrize("model", ALL_MODELS)
def test_model_ready_with_metadata_and_config(client, model):
    assert client.is_model_ready(model)
    metadata = client.model_metadata(model)
    assert metadata["name"] == model and metadata["versions"] == ["1"]
    config = client.model_config(model)
    max_batch = config.get("max_batch_size", config.get("maxBatchSize"))
    assert int(max_batch) == 16
    inputs = {t["name"]: t for t in metadata["inputs"]}
    outputs = {t["name"]: t for t in metadata["outputs"]}
    if model == "preprocess" or model == ENSEMBLE_MODEL:
        assert inputs["image"]["datatype"] == "BYTES" and inputs["image"]["shape"] == [-1, 1]
    else:
        assert inputs["input"]["datatype"] == "UINT8" and inputs["input"]["shape"] == [-1, 3, 224, 224]
    if model == "preprocess":
        assert outputs["pixels"]["datatype"] == "UINT8" and outputs["pixels"]["shape"] == [-1, 3, 224, 224]
    else:
        assert outputs["logits"]["datatype"] == "FP32" and outputs["logits"]["shape"] == [-1, 1000]
    if model != ENSEMBLE_MODEL:
        batcher = config.get("dynamic_batching", config.get("dynamicBatching"))
        preferred = batcher.get("preferred_batch_size", batcher.get("preferredBatchSize"))
        # preprocess hands each request to the next free instance, TorchScript runs batches of 8 faster per
        # image than 16 (their config.pbtxt files say why)
        wanted = {"preprocess": [1], "resnet18_torchscript": [8]}.get(model, [8, 16])
        assert [int(b) for b in preferred] == wanted


def test_unknown_model_is_an_error_not_a_crash(client):
    assert not client.is_model_ready("no_such_model")
    assert client.is_server_ready()


# -- tritonserver's log on a console (resnet18_kit/observe/server_log.py), no server needed ----------------------------

#: Lines tritonserver 2.51 logs at start on a machine without a GPU (from a real log), with other lines.
CPU_ONLY_START = [
    'W1123 07:11:05.123492 22707 pinned_memory_manager.cc:273] "Unable to allocate pinned system memory, '
    'pinned memory pool will not be available: CUDA driver version is insufficient for CUDA runtime version"',
    'I1123 07:11:05.123550 22707 cuda_memory_manager.cc:117] "CUDA memory pool disabled"',
    'E1123 07:11:05.123605 22707 server.cc:241] "CudaDriverHelper has not been initialized."',
    'I1123 07:11:05.128391 22707 model_lifecycle.cc:472] "loading: resnet18_onnx:1"',
    'W1123 07:11:06.978618 22707 pinned_memory_manager.cc:170] "failed to allocate pinned system memory: no '
    'pinned memory pool, falling back to non-pinned system memory"',
    'E1123 07:11:08.733513 22707 ensemble_scheduler.cc:1468] "unable to create stream for resnet18: CUDA driver '
    'version is insufficient for CUDA runtime version"',
    'W1123 07:11:08.800000 22707 metrics.cc:100] "unable to get number of CUDA devices: no CUDA-capable device '
    'is detected"',
    'I1123 07:11:08.733535 22707 model_lifecycle.cc:839] "successfully loaded \'resnet18\'"',
    "| server_extensions | classification sequence model_repository cuda_shared_memory binary_tensor_data |",
    'I1123 07:11:22.216998 23129 grpc_server.cc:2558] "Started GRPCInferenceService at 127.0.0.1:8001"',
]


def test_cuda_notices_of_a_cpu_only_machine_are_explained_once_and_other_lines_pass():
    from resnet18_kit.observe.server_log import CudaNoticeFilter, cpu_only_explanation

    line_filter = CudaNoticeFilter("results/serve-tritonserver.log", prefix="serve: ")
    shown = line_filter.lines(CPU_ONLY_START * 2)  # a restart logs them again: still one explanation
    explanation = "serve: " + cpu_only_explanation("results/serve-tritonserver.log")
    assert shown.count(explanation) == 1 and shown[0] == explanation
    assert "tritonserver runs on the CPU" in explanation and "results/serve-tritonserver.log" in explanation
    assert not [line for line in shown[1:] if "CUDA driver" in line or "pinned" in line or "CudaDriverHelper" in line
                or "CUDA devices" in line or "CUDA memory pool" in line]
    others = [line for line in CPU_ONLY_START if line.startswith(("I1123 07:11:05.128", "I1123 07:11:08", "|",
                                                                  "I1123 07:11:22"))]
    assert shown[1:] == others * 2  # every other line, in order
    assert line_filter.hidden == 12


def test_a_model_that_failed_to_load_is_shown_even_when_it_names_cuda():
    from resnet18_kit.observe.server_log import CudaNoticeFilter

    failed = ('E1123 07:12:00.000000 1 model_lifecycle.cc:641] "failed to load \'resnet18_onnx\' version 1: '
              'Internal: CUDA driver version is insufficient for CUDA runtime version"')
    assert CudaNoticeFilter()(failed) == [failed]


def test_log_follower_shows_the_lines_added_after_it_started(tmp_path):
    from resnet18_kit.observe.server_log import CudaNoticeFilter, LogFollower

    log = tmp_path / "tritonserver.log"
    log.write_text("an earlier run's line\n")
    shown: list[str] = []
    with LogFollower(log, shown.append, CudaNoticeFilter(log), poll_s=0.01):
        with open(log, "a") as out:
            out.write("\n".join(CPU_ONLY_START[:4]) + "\n")
            out.write("a last line without a newline")
    assert shown == [CudaNoticeFilter(log).lines(CPU_ONLY_START[:1])[0], CPU_ONLY_START[3],
                     "a last line without a newline"]


def test_start_failure_log_tail_explains_the_cuda_notices_instead_of_quoting_them(tmp_path):
    from resnet18_kit.observe.server_log import log_tail

    log = tmp_path / "tritonserver.log"
    log.write_text("\n".join(CPU_ONLY_START) + "\n")
    tail = log_tail(log)
    assert "tritonserver runs on the CPU" in tail and "CudaDriverHelper" not in tail
    assert "Started GRPCInferenceService" in tail
