"""The GPU run, prepared here on the CPU: `resnet18-kit bench gpu-pack` writes a bundle under its size limit
holding what the run needs (tritonserver, the 3.12 stub, perf_analyzer and libb64, the package, the model
repository without exports, the photos), and `bench gpu --dry-run` runs every step from that bundle with
only the Python packages a GPU machine has, so the run there does not fail on a missing module or a typo."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2

from resnet18_kit.client.samples import SAMPLE_PHOTO_NAMES
from resnet18_kit.contract import TORCHSCRIPT_MODEL
from resnet18_kit.observe.model_config import ModelConfigView
from resnet18_kit.tools.bench.gpu_pack import BUNDLE_NAME, GPU_PYTHON, GPU_VARIANT, GROUPS, MANIFEST, STUB_SITE, MiB
from resnet18_kit.server.config import ConfigurationError, config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.tools.bench.gpu_env import overlay_python
from resnet18_kit.tools.bench.gpu_run import STEPS
from resnet18_kit.tools.bench.gpu_steps import GPU_MAX_BATCH_SIZE, TENSOR_LEVELS

BIN = Path(sys.executable).parent
#: What the GPU machine's python3 has (besides the standard library), with what these require.
GPU_MACHINE_PACKAGES = ("torch", "torchvision", "onnx", "onnxruntime", "numpy", "pillow", "grpcio", "protobuf")
LIMIT_MIB = 64


def kit(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "resnet18-kit"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, str]:
    """The bundle (xz preset 0: the fastest to write) and what the packer printed."""
    out = tmp_path_factory.mktemp("gpu-pack")
    result = kit("bench", "gpu-pack", "--out", str(out), "--xz-preset", "0", "--limit-mib", str(LIMIT_MIB), cwd=out)
    assert result.returncode == 0, result.stderr
    return out / BUNDLE_NAME, result.stdout


def gpu_machine_site(folder: Path) -> Path:
    """A folder of links to the installed GPU_MACHINE_PACKAGES and what they require, nothing else."""
    folder.mkdir()
    todo, seen = list(GPU_MACHINE_PACKAGES), set()
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if name in seen:
            continue
        seen.add(name)
        todo += [re.split(r"[\s\[<>=!~;(]", r, maxsplit=1)[0] for r in distribution.requires or [] if "extra ==" not in r]
        for top in {Path(str(f)).parts[0] for f in distribution.files or [] if not str(f).startswith("..")}:
            if not (folder / top).exists():
                (folder / top).symlink_to(distribution.locate_file(top))
    return folder


def test_the_bundle_fits_its_limit_and_holds_what_the_run_needs(packed):
    bundle, printed = packed
    size_mib = bundle.stat().st_size / MiB
    assert size_mib <= LIMIT_MIB and f"{BUNDLE_NAME}: {size_mib:.1f} MiB (limit {LIMIT_MIB} MiB)" in printed
    assert all(group in printed for group in GROUPS), printed
    with zipfile.ZipFile(bundle) as archive:
        zipped, manifest = archive.namelist(), json.loads(archive.read(MANIFEST))
    files = manifest["files"]
    assert {f"site/pytriton/tritonserver/python_backend_stubs/{GPU_PYTHON}/triton_python_backend_stub",
            "site/pytriton/tritonserver/bin/tritonserver", "site/pytriton/tritonserver/backends/python/libtriton_python.so",
            "bin/perf_analyzer", "lib/libb64.so.0d", "lib/libcudart.so.12"} <= set(files)
    assert any(name.startswith("site/nvidia_pytriton.libs/libtritonserver") for name in files)
    assert not [name for name in files if "libpython" in name or "tritonclient" in name]
    assert {"__main__.py", "resnet18_kit/cli.py", "resnet18_kit/tools/bench/gpu_run.py", "tqdm/__init__.py"} <= set(zipped)
    repository = [name for name in files if name.startswith("model_repository/")]
    assert f"model_repository/{TORCHSCRIPT_MODEL}/configs/{GPU_VARIANT}.pbtxt" in repository
    assert f"model_repository/resnet18/configs/{GPU_VARIANT}.pbtxt" in repository
    assert not [name for name in repository if name.endswith((".onnx", ".pt")) or "provenance" in name
                or "warmup" in name or "resnet18_onnx" in name]
    assert sorted(Path(photo).name for photo in manifest["photos"]) == sorted(SAMPLE_PHOTO_NAMES)
    # numpy<2 for the GPU machine's stub (STUB_NUMPY_WHY), its compiled core included, its tests left out
    stub_numpy = [name for name in files if name.startswith(f"{STUB_SITE}/{GPU_PYTHON}/")]
    version = next(re.fullmatch(rf"{STUB_SITE}/{GPU_PYTHON}/numpy-([\d.]+)\.dist-info/METADATA", name)
                   for name in stub_numpy if name.endswith(".dist-info/METADATA"))
    assert int(version.group(1).split(".")[0]) < 2, version.group(1)
    assert any(re.search(rf"_multiarray_umath\.cpython-{GPU_PYTHON.replace('.', '')}-x86_64", n) for n in stub_numpy)
    assert not [name for name in stub_numpy if "/tests/" in name]


def test_a_bundle_over_its_limit_is_refused_in_one_line_and_leaves_nothing(tmp_path):
    result = kit("bench", "gpu-pack", "--out", str(tmp_path), "--xz-preset", "0", "--limit-mib", "1", cwd=tmp_path)
    assert result.returncode == 2 and "over the limit of 1 MiB" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("content, message", [(None, "no such file"), (b"not a zip", "not a zip application")])
def test_a_bad_bundle_is_one_line(tmp_path, content, message):
    bundle = tmp_path / "bundle.pyz"
    if content is not None:
        bundle.write_bytes(content)
    result = kit("bench", "gpu", "--bundle", str(bundle), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1, \
        result.stderr


def test_the_tensor_levels_fit_the_gpu_variant(repository):
    """Up to 2 x max_batch_size x instances (Triton's rule of thumb for saturation), within the queue."""
    view = ModelConfigView.for_variant(repository, TORCHSCRIPT_MODEL, GPU_VARIANT)
    instances = sum(group.count for group in view.proto.instance_group)
    assert view.max_batch_size == GPU_MAX_BATCH_SIZE
    assert [group.kind for group in view.proto.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
    assert max(TENSOR_LEVELS) == min(2 * view.max_batch_size * instances, view.max_queue_size)


def test_the_gpu_runner_matches_the_cpu_runner_and_keeps_no_aliases(repository):
    """The served GPU path's code (runtimes.GpuRunner: staging buffer, copies, outputs), here on the CPU."""
    import torch

    runtimes = repository.runtimes()
    cpu = runtimes.load(runtimes.RuntimeSpec(repository.torchscript_path, "torchscript", threads=1))
    runner = runtimes.GpuRunner(torch.jit.load(str(repository.torchscript_path)).eval(), "cpu")
    rng = np.random.default_rng(0)
    requests = [rng.integers(0, 256, (1, 3, 224, 224), dtype=np.uint8) for _ in range(3)]
    staged = np.concatenate(requests, out=runner.staging(3, requests[0]))
    first = runner(staged)  # written into the staging buffer: run from there
    assert np.shares_memory(staged, runner.staging(3, requests[0]))
    expected = cpu(np.concatenate(requests))
    assert [a.shape for a in first] == [(3, 1000), (3, 1000)]
    assert all(np.allclose(a, b, atol=1e-4) for a, b in zip(first, expected))
    kept = [a.copy() for a in first]
    second = runner(np.concatenate(requests[:1]))  # a smaller batch, copied in: the earlier outputs stay
    assert all(np.array_equal(a, b) for a, b in zip(first, kept)) and second[0].shape == (1, 1000)
    assert np.allclose(second[0], expected[0][:1], atol=1e-4)
    bigger = runner(np.concatenate(requests * 3))  # the buffers grow
    assert bigger[1].shape == (9, 1000) and np.allclose(bigger[1][6:], expected[1], atol=1e-5)


@pytest.mark.live
def test_the_dry_run_runs_every_step_from_the_bundle_with_a_gpu_machines_packages(packed, tmp_path):
    bundle, _ = packed
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(gpu_machine_site(tmp_path / "site")))
    result = subprocess.run([sys.executable, "-S", str(bundle), "--out", str(out), "--dry-run",
                             "--preprocess-instances", "2", "--network-instances", "1"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert (out / "gpu.json").is_file(), result.stderr[-3000:]
    record = json.loads((out / "gpu.json").read_text())
    steps = [(step["name"], step["status"]) for step in record["steps"]]
    assert steps == [(name, "skipped" if name == "inprocess" else "ok") for name, _ in STEPS], \
        (record["steps"], result.stderr[-3000:])
    assert result.returncode == 0 and record["dry_run"] and not record["problems"]
    assert [(g["count"], g["kind"]) for g in record["serve"]["instance_group"]] == [(1, "KIND_CPU")]
    assert [g["count"] for g in record["serve"]["preprocess_instance_group"]] == [2]
    assert record["environment"]["stub_python"]["numpy"].startswith("1.")
    assert all(level["infer_per_s"] > 0 for level in record["tensors"]["levels"] + record["main_job"]["levels"])
    assert record["headline"]["main_job_bound_by"] and record["headline"]["served_infer_per_s"] > 0
    assert record["environment"]["ldd"]["perf_analyzer"]["libb64.so.0d"].startswith(record["unpack"]["work"])
    assert record["stop"] == {"exit_status": 0, "shm_regions_left": 0}
    assert not Path(record["unpack"]["work"]).exists()  # the temporary work folder is removed
    assert {path.name for path in out.iterdir()} == {"gpu.json", "summary.md", "run.log", "tritonserver.log"}
    summary = (out / "summary.md").read_text()
    assert "| main_job | ok |" in summary and "Bound by: " in summary
    assert "Instances: preprocess 2 x KIND_CPU; network 1 x KIND_CPU." in summary
    log = (out / "run.log").read_text()
    assert all(re.search(rf"^\d{{4}}-\d\d-\d\dT[\d:]+Z INFO \[{name}\] (started|skipped)", log, re.M) for name, _ in STEPS)


@pytest.mark.live
def test_triton_251_stubs_misread_numpy_2_arrays_which_the_gpu_run_avoids(ensemble_repository, tmp_path):
    """Upstream: Triton 2.51's stub (pybind11 2.10) builds every array with item size 0 under numpy 2, so the
    preprocess warmup's BYTES length reads its first byte four times and the stub dies (fixed in 2.52). The
    GPU machine's python3 has numpy 2: `bench gpu` gives the stubs an environment with numpy<2
    (gpu_env.overlay_python, ServerConfig.stub_python). Here the same environment with numpy 2 reproduces it."""
    wheels = tmp_path / "wheels"
    download = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                               "--dest", str(wheels), "numpy==2.2.6"], capture_output=True, text=True, timeout=300)
    assert download.returncode == 0, download.stderr[-2000:]
    with zipfile.ZipFile(next(wheels.glob("numpy-2.2.6-*.whl"))) as wheel:
        wheel.extractall(tmp_path / "numpy2")
    stub_python = overlay_python(tmp_path / "overlay", tmp_path / "numpy2")
    probe = subprocess.run([str(stub_python), "-c", "import numpy; print(numpy.__version__)"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "2.2.6", probe.stderr
    config = config_on_free_ports(model_repository=ensemble_repository.root, stub_python=stub_python,
                                  refuse_first=False, exit_timeout_s=5)
    server = EmbeddedTritonServer(config, log_path=tmp_path / "tritonserver.log")
    try:
        with pytest.raises(ConfigurationError):
            server.start(ready_timeout_s=120)
    finally:
        server.stop()
    log = (tmp_path / "tritonserver.log").read_text(errors="replace")
    warmup = ensemble_repository.warmup_image_path.read_bytes()
    misread = int.from_bytes(warmup[:1] * 4, "little")  # the length's first byte, four times
    assert f"unpacking {misread} bytes at offset 4 (actual buffer size is {len(warmup)})" in log, log[-3000:]
