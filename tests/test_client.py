"""The client API (client.sync_client) over HTTP and gRPC, blocking and asyncio, against the real server:
health, metadata, classification, tensors, shared memory, back-pressure retries, deadlines, what the served
config says about the weights, and `resnet18-kit classify`: its output and every error as one line."""
from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from resnet18_kit.cli import main
from resnet18_kit.client.backoff import RetryPolicy
from resnet18_kit.client import AsyncTritonClassifierClient, Prediction, TritonClassifierClient
from resnet18_kit.client.command import format_predictions, json_line
from resnet18_kit.client.errors import DeadlineExceededError, QueueFullError
from resnet18_kit.client.samples import sample_photos
from resnet18_kit.contract import host_port
from resnet18_kit.contract import ENSEMBLE_MODEL, ONNX_MODEL, PROTOCOLS, REPO_ROOT
from resnet18_kit.export.resnet18 import PARITY_ATOL, PARITY_RTOL, eager_logits, parity_batch, torchvision_eval_transform
from resnet18_kit.server.config import free_ports


STUB_MODEL = "resnet18_slow_stub"  # tests/model_repository: sleeps 100 ms per execution, queue of 1
APIS = ("sync", "asyncio")


class BlockingView:
    """Runs an AsyncTritonClassifierClient's coroutines to completion on its own event loop, so one test
    body exercises both clients."""

    def __init__(self, url: str, protocol: str, **options):
        self.loop = asyncio.new_event_loop()
        self.client = self.loop.run_until_complete(self._make(url, protocol, options))

    @staticmethod
    async def _make(url, protocol, options):
        return AsyncTritonClassifierClient(url, protocol, **options)

    def __getattr__(self, name):
        attribute = getattr(self.client, name)
        if not asyncio.iscoroutinefunction(attribute):
            return attribute
        return lambda *args, **kwargs: self.loop.run_until_complete(attribute(*args, **kwargs))

    def close(self):
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def make_client(server, protocol: str, api: str, **options):
    url = server.config.url(protocol)
    if api == "sync":
        return TritonClassifierClient(url, protocol, **options)
    return BlockingView(url, protocol, **options)


@pytest.fixture(params=[(p, a) for p in PROTOCOLS for a in APIS], ids=lambda pa: f"{pa[0]}-{pa[1]}")
def any_client(request, triton_server):
    protocol, api = request.param
    client = make_client(triton_server, protocol, api)
    yield client
    client.close()


@pytest.fixture(scope="session")
def photos_and_eager_top5(eager_model):
    photos = sample_photos()
    batch = torch.stack([torchvision_eval_transform()(Image.open(p).convert("RGB")) for p in photos]).numpy()
    top5 = np.argsort(-eager_logits(eager_model, batch), axis=1)[:, :5]
    return [p.read_bytes() for p in photos], top5.tolist()


def test_health(any_client):
    assert any_client.is_server_live()
    assert any_client.is_server_ready()
    assert any_client.is_model_ready(ENSEMBLE_MODEL)
    assert not any_client.is_model_ready("no_such_model")


def test_metadata(any_client):
    metadata = any_client.model_metadata(ENSEMBLE_MODEL)
    assert metadata["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1, 1]}]
    assert metadata["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 1000]},
                                   {"name": "probabilities", "datatype": "FP32", "shape": [-1, 1000]}]
    assert any_client.model_metadata(ONNX_MODEL)["inputs"][0]["shape"] == [-1, 3, 224, 224]


def test_classify_real_photos(any_client, photos_and_eager_top5):
    images, expected_top5 = photos_and_eager_top5
    predictions = any_client.classify(images, top_k=5)
    assert [[p.class_index for p in row] for row in predictions] == expected_top5
    assert all(p.label and np.isfinite(p.logit) and 0 < p.probability < 1 for row in predictions for p in row)
    for row in predictions:  # most probable first; the softmax keeps the logits' order
        assert [p.probability for p in row] == sorted((p.probability for p in row), reverse=True)
        assert [p.logit for p in row] == sorted((p.logit for p in row), reverse=True)


def test_infer_tensor_matches_eager_torch(any_client, eager_model):
    batch = parity_batch(3, seed=11)
    logits = any_client.infer_tensor(batch)
    assert logits.shape == (3, 1000) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, eager_logits(eager_model, batch), rtol=PARITY_RTOL, atol=PARITY_ATOL)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("api", APIS)
def test_shared_memory_equals_plain_and_is_released_on_close(triton_server, protocol, api):
    batch = parity_batch(5, seed=21)
    plain = make_client(triton_server, protocol, api)
    shared = make_client(triton_server, protocol, api, shared_memory=True)
    try:
        expected = plain.infer_tensor(batch)
        np.testing.assert_array_equal(shared.infer_tensor(batch), expected)
        np.testing.assert_array_equal(shared.infer_tensor(batch[:2]), expected[:2])  # same regions reused
        regions = shared._regions[ONNX_MODEL]
        registered = _registered_region_names(triton_server)
        assert {regions.input_name, regions.output_name} <= registered
        keys = [Path("/dev/shm") / key.lstrip("/") for _, key, _ in regions.registrations()]
        assert all(k.exists() for k in keys)
    finally:
        shared.close()
        plain.close()
    assert not {regions.input_name, regions.output_name} & _registered_region_names(triton_server)
    assert not any(k.exists() for k in keys)


def _registered_region_names(server) -> set[str]:
    with TritonClassifierClient(server.config.http_url, "http") as c:
        return {region["name"] for region in c.raw.get_system_shared_memory_status()}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("api", APIS)
def test_queue_full_refusals_are_retried_until_all_succeed(triton_server, protocol, api):
    """A burst of 12 at a model whose queue holds 1 request: the server refuses most of them with
    503 / UNAVAILABLE at first; with retries every request succeeds within its deadline."""
    burst = 12
    batches = [np.full((1, 3, 224, 224), i, np.uint8) for i in range(burst)]
    retry = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.2, deadline_s=20.0)
    started = time.monotonic()
    if api == "sync":
        def send(batch):
            with TritonClassifierClient(triton_server.config.url(protocol), protocol, retry=retry) as c:
                return c.infer_tensor(batch, model=STUB_MODEL), c.retries

        with ThreadPoolExecutor(max_workers=burst) as pool:
            outcomes = list(pool.map(send, batches))
        results, retries = [o[0] for o in outcomes], sum(o[1] for o in outcomes)
    else:
        async def burst_of_requests():
            async with AsyncTritonClassifierClient(triton_server.config.url(protocol), protocol,
                                                   retry=retry) as c:
                answers = await asyncio.gather(*(c.infer_tensor(b, model=STUB_MODEL) for b in batches))
                return answers, c.retries

        results, retries = asyncio.run(burst_of_requests())
    elapsed = time.monotonic() - started
    print(f"\n{protocol}/{api}: {burst} requests, {retries} queue-full retries, all answered in {elapsed:.2f} s")
    for i, logits in enumerate(results):
        np.testing.assert_array_equal(logits, np.full((1, 1000), i, np.float32))
    assert retries >= 1, "the burst never met a full queue: the test proves nothing"


def test_queue_full_without_retry_budget_raises_the_typed_error(triton_server):
    """With no time left for a retry, the refusal itself reaches the caller as QueueFullError."""
    url = triton_server.config.url("http")
    retry = RetryPolicy(initial_backoff_s=5.0, max_backoff_s=5.0, deadline_s=2.0)
    retry.rng.seed(0)  # backoff draws of uniform(0, 5) s: the first three exceed the 2 s budget

    def send(i):
        with TritonClassifierClient(url, "http", retry=retry) as c:
            try:
                c.infer_tensor(np.zeros((1, 3, 224, 224), np.uint8), model=STUB_MODEL)
                return None
            except QueueFullError as exc:
                return exc

    with ThreadPoolExecutor(max_workers=6) as pool:
        refusals = [r for r in pool.map(send, range(6)) if r is not None]
    assert refusals, "six concurrent requests at a queue of one: some must be refused"
    assert all(r.status == "503" and "Exceeds maximum queue size" in r.message for r in refusals)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("api", APIS)
def test_expired_deadline_raises_the_typed_error(triton_server, protocol, api):
    client = make_client(triton_server, protocol, api)
    try:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            client.infer_tensor(np.zeros((1, 3, 224, 224), np.uint8), model=STUB_MODEL, deadline_s=0.03)
        assert time.monotonic() - started < 1.0, "the deadline was not enforced"
    finally:
        client.close()
    time.sleep(0.2)  # let the stub finish the abandoned request before the next test uses it


# -- served config: random weights, read from the server --------------------------------------------------

def served_answers(configs: dict[str, dict]):
    """A TritonClassifierClient whose Calls are answered from `configs` (model -> HTTP JSON config), no server."""
    client = TritonClassifierClient("127.0.0.1:1", "http")
    client._perform = lambda call: configs[call.args[0]] if call.name == "get_model_config" else None
    return client


ENSEMBLE_JSON = {"name": "resnet18", "platform": "ensemble", "max_batch_size": 16,
                 "ensemble_scheduling": {"step": [{"model_name": "preprocess"}, {"model_name": "resnet18_onnx"}]}}


def with_weights(config: dict, value: str) -> dict:
    return {**config, "parameters": {"weights_meaningful": {"string_value": value}}}


@pytest.mark.parametrize("where, value, expected", [
    ("ensemble", "false", False), ("ensemble", "true", True), ("step", "false", False), ("step", "true", True),
    ("nowhere", "", None)])
def test_weights_meaningful_comes_from_the_served_configs(where, value, expected):
    configs = {"resnet18": ENSEMBLE_JSON, "preprocess": {"name": "preprocess", "backend": "python"},
               "resnet18_onnx": {"name": "resnet18_onnx", "backend": "python"}}
    if where == "ensemble":
        configs["resnet18"] = with_weights(ENSEMBLE_JSON, value)
    elif where == "step":
        configs["resnet18_onnx"] = with_weights(configs["resnet18_onnx"], value)
    with served_answers(configs) as client:
        assert client.weights_meaningful("resnet18") is expected


def test_weights_meaningful_of_the_real_server_is_what_the_export_recorded_or_unknown(client, repository):
    assert client.weights_meaningful() in (None, repository.weights_meaningful())


def test_served_config_view_drives_timeout_and_region_sizes(client):
    view = client.model_config_view(ONNX_MODEL)
    assert view.max_batch_size == 16 and view.timeout_override_allowed


# -- the classify command ---------------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resnet18_kit", "--log-level", "WARNING", "classify", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def assert_one_line(result: subprocess.CompletedProcess, status: int, message: str) -> None:
    """Exit `status`, nothing on stdout, one line on stderr containing `message`, no traceback."""
    assert result.returncode == status, (result.returncode, result.stderr)
    assert result.stdout == "", result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("resnet18-kit classify: "), lines[0]


def test_cli_classifies_files_and_folders_as_json_lines(triton_server, tmp_path, photos_and_eager_top5):
    photos = sample_photos()
    folder = tmp_path / "photos"
    folder.mkdir()
    for photo in photos[1:]:
        (folder / photo.name).write_bytes(photo.read_bytes())
    (folder / "notes.txt").write_text("not an image")
    result = run_cli("--protocol", "grpc", "--url", triton_server.config.grpc_url, "--json",
                     "--concurrency", "4", str(photos[0]), str(folder))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]  # stdout: JSON lines and nothing else
    assert len(lines) == len(photos)
    by_name = {Path(line["file"]).name: line for line in lines}
    for photo, expected in zip(photos, photos_and_eager_top5[1]):
        predictions = by_name[photo.name]["predictions"]
        assert [p["class_index"] for p in predictions] == expected
        assert all(0 < p["probability"] < 1 and isinstance(p["logit"], float) for p in predictions)
    assert all(line["weights_meaningful"] in (None, True, False) for line in lines)
    assert result.stderr.count("notes.txt") == 1 and "skipped 1 file" in result.stderr


def test_cli_model_option_is_the_model_not_the_repository(triton_server):
    """`--model resnet18` was once taken for `--model-repository` (argparse prefix matching)."""
    result = run_cli("--url", triton_server.config.http_url, "--model", "resnet18", "--top-k", "2",
                     str(sample_photos()[0]))
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 3 and "1. " in result.stdout and "2. " in result.stdout


def test_cli_sends_avif_files_of_a_folder_and_names_what_it_skips(triton_server, tmp_path):
    Image.open(sample_photos()[0]).convert("RGB").save(tmp_path / "cat.avif")
    (tmp_path / "readme.md").write_text("# not an image")
    result = run_cli("--url", triton_server.config.http_url, "--json", str(tmp_path))
    assert result.returncode == 0, result.stderr
    (line,) = [json.loads(text) for text in result.stdout.splitlines()]
    assert line["file"].endswith("cat.avif") and len(line["predictions"]) == 5
    assert result.stderr.count("readme.md") == 1


def test_cli_exits_1_when_an_image_fails(triton_server, tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff not really a jpeg")
    result = run_cli("--url", triton_server.config.http_url, "--json", str(sample_photos()[0]), str(bad))
    assert result.returncode == 1
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert "predictions" in lines[0] and lines[1]["status"] == "400" and "broken.jpg" in lines[1]["file"]
    assert [line for line in result.stderr.splitlines() if "broken.jpg" in line], result.stderr


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cli_exits_2_when_the_server_is_unreachable(protocol):
    (port,) = free_ports(1)
    result = run_cli("--protocol", protocol, "--url", f"127.0.0.1:{port}", str(sample_photos()[0]))
    assert_one_line(result, 2, f"cannot reach a Triton server at 127.0.0.1:{port} ({protocol})")


def test_cli_exits_2_for_a_host_that_does_not_resolve():
    result = run_cli("--url", "no-such-host.invalid:8000", str(sample_photos()[0]))
    assert_one_line(result, 2, "cannot reach a Triton server at no-such-host.invalid:8000 (http)")


@pytest.mark.parametrize("protocol, port", [("http", "grpc"), ("http", "metrics"), ("grpc", "http"), ("grpc", "metrics")])
def test_cli_pointed_at_another_port_of_the_server_is_one_line(triton_server, protocol, port):
    """HTTP spoken to the gRPC port was a 41-line traceback, to the metrics port rapidjson's."""
    config = triton_server.config
    address = {"http": config.http_url, "grpc": config.grpc_url,
               "metrics": config.metrics_url.split("//", 1)[1].split("/", 1)[0]}[port]
    result = run_cli("--protocol", protocol, "--url", address, str(sample_photos()[0]))
    assert_one_line(result, 2, f"{address} does not answer as a Triton {'HTTP' if protocol == 'http' else 'gRPC'}")


def test_cli_pointed_at_another_http_server_is_one_line():
    (port,) = free_ports(1)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = run_cli("--url", f"127.0.0.1:{port}", str(sample_photos()[0]))
    finally:
        server.shutdown()
        server.server_close()
    assert_one_line(result, 2, f"127.0.0.1:{port} does not answer as a Triton HTTP endpoint")


def test_cli_exits_2_when_the_model_is_not_ready(triton_server):
    result = run_cli("--url", triton_server.config.http_url, "--model", "no_such_model", str(sample_photos()[0]))
    assert_one_line(result, 2, "model 'no_such_model' is not ready")


@pytest.mark.parametrize("top_k", ["0", "-1", "1001"])
def test_cli_refuses_top_k_outside_1_to_1000_before_sending(top_k):
    (port,) = free_ports(1)  # nothing listens: the refusal comes before any connection
    result = run_cli("--url", f"127.0.0.1:{port}", "--top-k", top_k, str(sample_photos()[0]))
    assert_one_line(result, 2, f"--top-k {top_k}: give 1..1000")


def test_cli_given_no_image_files_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("not an image")
    result = run_cli(str(tmp_path))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == f"resnet18-kit classify: no image files in {tmp_path}"


@pytest.mark.parametrize("url,message", [
    ("https://127.0.0.1:8000", "give host:port"),
    ("127.0.0.1", "give host:port"),
    ("127.0.0.1:8000/v2", "give host:port"),
])
def test_classify_refuses_a_bad_url_in_one_line(url, message, capsys):
    assert main(["classify", "--url", url, str(sample_photos()[0])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_a_url_with_the_protocols_scheme_is_accepted(triton_server):
    assert host_port("http://127.0.0.1:8000/", "http") == "127.0.0.1:8000"
    assert host_port("grpc://[::1]:8001", "grpc") == "[::1]:8001"
    with TritonClassifierClient("http://" + triton_server.config.http_url, "http") as client:
        assert client.is_server_ready()


def test_printed_predictions_carry_the_random_weights_mark():
    predictions = [Prediction(label="tabby", class_index=281, probability=0.8734, logit=2.5)]
    marked = format_predictions("cat.png", predictions, "[random weights]").splitlines()
    assert marked == ["cat.png",
                      "  1. tabby                           87.34 %  (logit   2.500, class 281) [random weights]"]
    assert "random" not in format_predictions("cat.png", predictions)


def test_json_lines_carry_weights_meaningful():
    line = json.loads(json_line(Path("a.png"), [Prediction("tabby", 281, 0.5, 2.0)], False))
    assert line["weights_meaningful"] is False and line["predictions"][0]["class_index"] == 281
    assert json.loads(json_line(Path("b.png"), FileNotFoundError(2, "No such file")))["weights_meaningful"] is None
