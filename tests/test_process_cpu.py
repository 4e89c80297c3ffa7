"""The server's CPU per inference (observe.process_cpu): a process tree's CPU time over a window, by role,
and its division by the inferences served, which `bench run` prints beside the in-process bar's."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from resnet18_kit.observe.process_cpu import ProcessCpu, cpu_phrase, per_inference_ms, process_cpu_s, role
from resnet18_kit.observe.processes import child_processes, process_alive
from resnet18_kit.tools.bench.inprocess import measure_workers

#: A child that burns CPU_S of CPU time, says so in a file, then sleeps until killed.
BURN = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < {cpu_s}: pass\n"
        "open(sys.argv[1], 'w').close()\ntime.sleep(60)")


def test_a_root_and_its_descendants_are_counted_over_the_window(tmp_path):
    done = tmp_path / "done"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])",
                               sys.executable, "-c", BURN.format(cpu_s=0.6), str(done)])
    try:
        time.sleep(0.3)  # the parent has started its child, which is burning
        with ProcessCpu({"server": parent.pid}) as cpu:
            deadline = time.monotonic() + 30
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        assert done.exists()
        # the child's 0.6 s, less what it burnt before the window opened, plus the parent's start-up
        assert list(cpu.seconds) == ["server"] and 0.15 <= cpu.total_s <= 1.2, cpu.seconds
    finally:
        parent.kill()
        subprocess.run(["pkill", "-f", str(done)], check=False)
        parent.wait()
    assert process_cpu_s(parent.pid) is None


def test_a_stub_is_named_by_its_model():
    stub = ["/x/backends/python/triton_python_backend_stub", "/repo/resnet18_onnx/1/model.py", "region", "1"]
    assert role(stub, "tritonserver") == "stub resnet18_onnx"
    assert role(["/usr/bin/tritonserver", "--model-repository", "/repo"], "tritonserver") == "tritonserver"


def test_per_inference_divides_by_the_inferences_and_sums_the_stubs():
    figures = per_inference_ms({"tritonserver": 0.5, "stub preprocess": 1.0, "stub resnet18_onnx": 2.5}, 1000)
    assert figures == {"total": 4.0, "by_process": {"tritonserver": 0.5, "stub preprocess": 1.0,
                                                     "stub resnet18_onnx": 2.5, "stubs": 3.5}}
    assert per_inference_ms({"tritonserver": 1.0}, 0)["total"] is None
    phrase = cpu_phrase(figures, 2.0)
    assert phrase == "; CPU per inference: server 4.00 ms (tritonserver 0.50, stubs 3.50) / in-process 2.00 ms = 2.00x"
    assert cpu_phrase(figures, float("nan")) == "" and cpu_phrase(None, 2.0) == ""


def test_the_in_process_bar_counts_every_threads_cpu_per_image():
    def burn(batch):  # ~4 ms of CPU per batch, in the calling thread
        t = time.thread_time()
        while time.thread_time() - t < 0.004:
            pass
    result = measure_workers([burn, burn], batch_size=2, duration_s=0.5, label="burn x2")
    assert result.cpu_ms_per_image == pytest.approx(2.0, rel=0.35), result


def test_child_processes_lists_live_children_with_their_argv_and_leaves_out_zombies():
    """observe.processes.child_processes: a sleeping child with its argv; an exited child not yet reaped
    (a zombie) is not listed; a process with no children gives []."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "marker-arg"])
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while process_alive(exited.pid) and time.monotonic() < deadline:  # exited, left a zombie (not waited)
            time.sleep(0.05)
        children = dict(child_processes(os.getpid()))
        assert children.get(sleeper.pid) == [sys.executable, "-c", "import time; time.sleep(60)", "marker-arg"]
        assert exited.pid not in children
        assert child_processes(sleeper.pid) == []
    finally:
        sleeper.kill()
        sleeper.wait()
        exited.wait()
