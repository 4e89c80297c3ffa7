"""Fixtures: a real tritonserver on free ports for the whole session, clients for both protocols.
Test files share code through these fixtures and the product's public modules, never by importing
this file or each other."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from resnet18_kit.client import TritonClassifierClient
from resnet18_kit.client.errors import InvalidInputError
from resnet18_kit.contract import PROTOCOLS, TORCHSCRIPT_MODEL
from resnet18_kit.export.resnet18 import model_from_spec
from resnet18_kit.observe.processes import child_processes
from resnet18_kit.tools.reliability import RELIABILITY_REPOSITORY
from resnet18_kit.server.config import config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer
from resnet18_kit.server.resources import python_backend_regions
from resnet18_kit.repository import ModelRepository
from resnet18_kit.settings import Settings

#: Test-only models (e.g. resnet18_slow_stub), served beside the product's model repository.
TEST_MODEL_REPOSITORY = Path(__file__).parent / "model_repository"
#: Where every run writes each test's phase durations (scripts/test_durations.py makes the tables from it).
DURATIONS_JSON = Path(__file__).parent.parent / "results" / "test-durations.json"
#: Fixtures that start (or need) a real tritonserver, and those that need a Docker engine: a test using one
#: is marked `live` or `docker` here, whatever its module says (so the fast tier can never start a server).
LIVE_FIXTURES = {"triton_server", "client"}
DOCKER_FIXTURES = {"engine", "images"}


def pytest_collection_modifyitems(items):
    """Marks tests by the fixtures they use: `live` (a tritonserver) and `docker` (a Docker engine). Then
    orders the files, each kept whole (its module fixtures start once): files with neither live nor docker
    tests first, then those with live tests, then those with docker tests, so that the image build
    (EarlyImages) runs beside the first group and never beside a server's latency bound."""
    rank: dict[Path, int] = {}
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & LIVE_FIXTURES:
            item.add_marker(pytest.mark.live)
        if names & DOCKER_FIXTURES:
            item.add_marker(pytest.mark.docker)
        tier = 2 if item.get_closest_marker("docker") else 1 if item.get_closest_marker("live") else 0
        rank[item.path] = max(rank.get(item.path, 0), tier)
    items.sort(key=lambda item: rank[item.path])  # stable: the order within a group stays


class ServerWatch(threading.Thread):
    """Notes, every POLL_S, each new process named in PROGRAMS (read from /proc/*/comm) under this pytest
    process and the test that was running when it appeared: a test that starts one must be marked live,
    docker or deploy."""

    PROGRAMS = ("tritonserver", "dockerd", "haproxy", "prometheus")
    POLL_S = 0.25

    def __init__(self) -> None:
        super().__init__(name="server-watch", daemon=True)
        self.current: tuple[str, bool] | None = None  # (nodeid, marked live/docker/deploy)
        self.unmarked: dict[str, set[str]] = {}        # nodeid -> programs it started while unmarked
        self.stopping = threading.Event()
        self.seen = set(self.servers())
        self.excuse_engine = False  # EarlyImages runs: the engine's processes belong to no test

    @classmethod
    def servers(cls) -> dict[int, str]:
        """pid -> program of the PROGRAMS running under this pytest process (servers of other programs on
        the machine, e.g. a `make serve` in another terminal, are not the suite's)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    comm = (entry / "comm").read_text().strip()
                except OSError:
                    continue
                if comm in cls.PROGRAMS and cls.runs_the_program(entry, comm) and cls.descends_from_us(int(entry.name)):
                    found[int(entry.name)] = comm
        return found

    @staticmethod
    def runs_the_program(entry: Path, comm: str) -> bool:
        """True when the process's executable is named `comm` too: a shell script named tritonserver (the
        fake servers of test_upstream) runs /bin/sh and is no server. A zombie (exited, not yet reaped: its
        exe link cannot be read, its comm and parent still can) runs nothing: False; such a fake server's
        zombie was once counted as a server."""
        try:
            return Path(os.readlink(entry / "exe")).name == comm
        except OSError:  # exited, a zombie, or not ours to read
            fields = ServerWatch.stat_fields(int(entry.name))
            return fields is not None and fields[0] != "Z"  # gone: False; not ours to read: judge by the name

    @staticmethod
    def stat_fields(pid: int) -> list[str] | None:
        """The fields of /proc/<pid>/stat after the command name (state, ppid, ...: proc(5)), or None when
        the process has gone. The name is skipped up to its last ")" since it may hold spaces and brackets."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        return stat[stat.rindex(")") + 2:].split()

    @staticmethod
    def ancestors(pid: int):
        """The pids above `pid`, its parent first (the ppid chain in /proc/<pid>/stat), up to init; the
        chain ends early where a process exited while we looked."""
        while pid > 1:
            fields = ServerWatch.stat_fields(pid)
            if fields is None:
                return
            pid = int(fields[1])
            yield pid

    @staticmethod
    def descends_from_us(pid: int) -> bool:
        """True when this pytest process is an ancestor of `pid`."""
        return os.getpid() in ServerWatch.ancestors(pid)

    @staticmethod
    def under_dockerd(pid: int) -> bool:
        """True when a dockerd is an ancestor of `pid` (a build's step)."""
        def comm(ancestor: int) -> str:
            try:
                return Path(f"/proc/{ancestor}/comm").read_text().strip()
            except OSError:
                return ""
        return any(comm(ancestor) == "dockerd" for ancestor in ServerWatch.ancestors(pid))

    def run(self) -> None:
        while not self.stopping.wait(self.POLL_S):
            current = self.current
            for pid, comm in self.servers().items():
                if pid not in self.seen:
                    self.seen.add(pid)
                    if self.excuse_engine and (comm == "dockerd" or self.under_dockerd(pid)):
                        continue
                    if current is not None and not current[1]:
                        self.unmarked.setdefault(current[0], set()).add(comm)


SERVER_WATCH = ServerWatch()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Tells the server watch which test runs, and whether it may start servers."""
    SERVER_WATCH.current = (item.nodeid, any(item.get_closest_marker(m) for m in ("live", "docker", "deploy")))
    yield
    SERVER_WATCH.current = None


_phases: list[dict] = []


def pytest_runtest_logreport(report):
    """Records each test's setup, call and teardown seconds (setup and teardown hold the fixtures' server,
    fleet and compose starts and stops)."""
    _phases.append({"nodeid": report.nodeid, "phase": report.when, "duration_s": round(report.duration, 3),
                    "outcome": report.outcome})


def pytest_sessionfinish(session, exitstatus):
    """Writes results/test-durations.json: the marker expression, the exit status and every phase (under
    pytest-xdist the controller, which receives every worker's reports, writes it; the workers do not)."""
    if not _phases or hasattr(session.config, "workerinput"):
        return
    DURATIONS_JSON.parent.mkdir(parents=True, exist_ok=True)
    DURATIONS_JSON.write_text(json.dumps({"markexpr": session.config.getoption("markexpr"),
                                          "exitstatus": int(exitstatus), "phases": _phases}, indent=0))


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """Fails the run when the suite leaves Python-backend shared-memory regions in /dev/shm that were not
    there before it, or a tritonserver / stub / haproxy / dockerd process of its own (set up first, so checked
    last), or when a test not marked live, docker or deploy started a server (ServerWatch)."""
    before = set(python_backend_regions())
    SERVER_WATCH.start()
    yield
    SERVER_WATCH.stopping.set()
    SERVER_WATCH.join()
    assert not SERVER_WATCH.unmarked, ("tests marked neither live, docker nor deploy started servers (mark them):"
                                       f" {SERVER_WATCH.unmarked}")
    deadline = time.monotonic() + 10  # a server SIGTERMed by its parent's death may still be draining
    while True:
        regions = sorted(set(python_backend_regions()) - before)
        processes = [argv[0] for _, argv in child_processes(os.getpid())
                     if argv and any(name in argv[0] for name in ("tritonserver", "triton_python_backend_stub", "haproxy",
                                                                    "dockerd", "containerd"))]
        if not (regions or processes) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not regions, f"the suite left {len(regions)} shared-memory regions: {[r.name for r in regions]}"
    assert not processes, f"the suite left processes running: {processes}"


@pytest.fixture(scope="session")
def settings() -> Settings:
    """The settings a command would get with no flags and this environment (the checkout's folders)."""
    return Settings.build()


@pytest.fixture(scope="session")
def repository(settings) -> ModelRepository:
    """The shipped model repository (with the exported files: `make test` runs the export first)."""
    return settings.repository


@pytest.fixture(scope="session")
def ensemble_repository(repository, tmp_path_factory) -> ModelRepository:
    """A copy of the shipped repository without the TorchScript network: the ensemble's models only
    (preprocess, resnet18_onnx, resnet18), real files, so that a container can mount it too. A server of it
    starts in about half the time and stops a second sooner (no torch in a stub); for scenarios that never
    call the TorchScript model."""
    root = tmp_path_factory.mktemp("ensemble-repository") / "models"
    shutil.copytree(repository.root, root, ignore=lambda folder, names: [TORCHSCRIPT_MODEL] if folder == str(
        repository.root) else [])
    return ModelRepository(root)


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory, repository):
    missing = repository.missing_artifacts()
    if missing:
        pytest.fail(f"model files missing ({', '.join(map(str, missing))}): run `make export` first")
    config = config_on_free_ports(model_repository=repository.root,
                                  extra_model_repositories=(TEST_MODEL_REPOSITORY, RELIABILITY_REPOSITORY))
    server = EmbeddedTritonServer(config, log_path=tmp_path_factory.mktemp("triton") / "tritonserver.log")
    server.start()
    yield server
    server.stop(drain_s=0)  # its graceful stop is not what is tested here (test_lifecycle's servers are)


@pytest.fixture(scope="session")
def test_model_repository() -> Path:
    """The folder of the test-only models (served beside the product's repository)."""
    return TEST_MODEL_REPOSITORY


@pytest.fixture(scope="session")
def reliability_repository() -> Path:
    """The reliability scenarios' models (reliability_echo, reliability_timeout), served beside the rest."""
    return RELIABILITY_REPOSITORY


class EarlyImages(threading.Thread):
    """A Docker engine (the user's, else the checkout's private dockerd: resnet18_kit/containers/engine.py)
    and the images of docker-compose.yaml (cached by the engine: seconds when nothing changed), made in a
    thread. A run with tests that use them starts it at once (early_images): the build, mostly downloads and
    unpacking (150-200 s from nothing on the 2-core reference machine), runs beside the files that start no
    server, which come first (pytest_collection_modifyitems), and the first live test waits for its end, so
    that no latency bound is measured beside it. Under pytest-xdist, whose workers would each build, it
    starts when a worker first uses the `engine` fixture."""

    def __init__(self) -> None:
        super().__init__(name="early-images", daemon=True)
        self.engine = self.report = self.error = None
        self.private = None  # the PrivateEngine this run started, stopped at the session's end
        self.took_s = 0.0

    def run(self) -> None:
        from resnet18_kit.containers.__main__ import private_engine
        from resnet18_kit.containers.engine import users_engine
        from resnet18_kit.containers.image import IMAGES, ImageBuild
        from resnet18_kit.contract import REPO_ROOT

        began = time.monotonic()
        try:
            self.engine = users_engine()
            if self.engine is None:
                private = private_engine()
                started_here = private.pid() is None
                self.engine = private.start()
                self.private = private if started_here else None
            self.report = ImageBuild(self.engine, REPO_ROOT, names=tuple(IMAGES)).run()
        except BaseException as exc:  # raised in the test that uses the engine or the images
            self.error = exc
        self.took_s = time.monotonic() - began

    def result(self):
        """(engine, BuildReport) once the thread ends; its exception is raised here."""
        if self.ident is None:
            self.start()
        self.join()
        if self.error is not None:
            raise self.error
        return self.engine, self.report


EARLY = EarlyImages()


@pytest.fixture(scope="session", autouse=True)
def early_images(request, nothing_left_behind):
    """Starts EARLY when this run (not an xdist worker) has a test that uses the images; at the end stops
    the private engine it started (before nothing_left_behind checks that nothing is left)."""
    if any("images" in getattr(item, "fixturenames", ()) for item in request.session.items) and \
            not hasattr(request.config, "workerinput"):
        SERVER_WATCH.excuse_engine = True  # dockerd and its builds start while unmarked tests run
        EARLY.start()
    yield
    if EARLY.ident is not None:
        EARLY.join()
        if EARLY.private is not None:
            assert EARLY.private.stop()
            assert EARLY.private.pid() is None and not EARLY.private.run_dir.exists()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A live test waits for the early image build (EarlyImages) to end."""
    if EARLY.is_alive() and item.get_closest_marker("live"):
        EARLY.join()


@pytest.fixture(scope="session")
def engine():
    """A Docker engine (EarlyImages), nothing left of it at the session's end."""
    return EARLY.result()[0]


@pytest.fixture(scope="session")
def images(engine):
    """The CPU images of docker-compose.yaml (EarlyImages)."""
    report = EARLY.result()[1]
    print(f"\nimage build: {EARLY.took_s:.1f} s with the engine's start, beside the first tests\n" +
          "\n".join(f"image build: {line}" for line in report.lines()), flush=True)
    return report


@pytest.fixture(params=PROTOCOLS)
def protocol(request) -> str:
    return request.param


@pytest.fixture
def client(triton_server, protocol):
    with TritonClassifierClient(triton_server.config.url(protocol), protocol) as c:
        yield c


@pytest.fixture(scope="session")
def eager_model(repository) -> torch.nn.Module:
    """The eager torch model the exports were made from (same weights, per provenance.json)."""
    return model_from_spec(repository.provenance()["weights"])


#: Run in a process of its own by `int8_twin_run`: bench's in-process int8 pipeline twin (every arrangement
#: compiled, measured, dropped), two photos measured, its facts printed as JSON; then the twin is dropped and
#: the process sends itself SIGTERM, which its handler must see (OpenVINO's signal-stack defect, test_int8).
INT8_TWIN_SCRIPT = """
import gc, json, os, signal, sys, time
from pathlib import Path
from resnet18_kit.client.samples import sample_photos
from resnet18_kit.repository import ModelRepository
from resnet18_kit.tools.bench.pipeline_inprocess import PipelineTwin
twin = PipelineTwin(ModelRepository(Path(sys.argv[1])), "int8", choose_s=0.3)
photos = [p.read_bytes() for p in sample_photos(("rocket.jpg", "chelsea.png"))]
facts = {"spec": repr(twin.spec), "runtime": twin.spec.runtime, "batch_size": twin.batch_size,
         "tried": twin.network_bar.tried, "best": twin.network_bar.best, "network_workers": twin.network_workers,
         "runners": len(twin.runners), "decode_threads": twin.decode_threads,
         "measured": twin.measure(photos, saturation_s=1.0, batch1_s=0.5)}
print(json.dumps(facts, default=str))
del twin
gc.collect()
seen = []
signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("handled", seen)
"""


@pytest.fixture(scope="session")
def int8_twin_run(repository) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of INT8_TWIN_SCRIPT on the shipped repository: one run of the int8
    pipeline twin (about 10 s) for the twin's own test and the signal test after it."""
    result = subprocess.run([sys.executable, "-c", INT8_TWIN_SCRIPT, str(repository.root)], capture_output=True,
                            text=True, timeout=300)
    return result.returncode, result.stdout, result.stderr


@pytest.fixture(scope="session")
def assert_invalid_argument():
    """assert_invalid_argument(exc, protocol): exc is a client.errors.InvalidInputError carrying HTTP 400
    or gRPC INVALID_ARGUMENT, as Triton reports bad input."""
    def check(exc, protocol: str) -> None:
        expected = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
        assert isinstance(exc, InvalidInputError), f"{type(exc).__name__}: {exc}"
        assert exc.status == expected, f"status {exc.status} (expected {expected}): {exc.message}"
    return check
