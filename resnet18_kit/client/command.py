"""Top-k ImageNet labels for image files, from a Triton server that serves this model repository.

    resnet18-kit classify [--url HOST:PORT] [--protocol http|grpc] [--model NAME] [--top-k K] [--json]
                          [--priority N] [--shared-memory] IMAGE_OR_FOLDER ...

Sends one request per image (up to --concurrency in flight) to the ensemble --model (default `resnet18`),
so the server's dynamic batcher forms the batches; a request refused because the queue is full is retried
until --deadline-s. --priority 1 puts the requests ahead of default-priority traffic in the steps' queues
(0, the default: the models' default level, 2). A folder stands for the image files under it: every suffix the server's decoder
(Pillow) opens, .avif included; other files found there are named once on stderr. --shared-memory passes
each photo through a system shared-memory region instead of the socket (a server on this host only: one
that cannot open this host's regions, or that locks shared memory behind an admin key, is one line and
exit 2 before anything is sent); the server then spends less per image (docs/benchmarks.md).

Output (stdout): per image, its top-k labels with probabilities in percent (the ensemble's softmax) and
logits; or with --json one JSON object per image and line, and nothing else on stdout:
  {"file": str, "predictions": [{"label": str, "class_index": int (0..999), "probability": float (0..1),
   "logit": float}, ...], "weights_meaningful": bool | null}
  {"file": str, "error": str, "status": str | null, "weights_meaningful": bool | null}  (an image that failed)
weights_meaningful is what the server's model config says (parameter `weights_meaningful` of the model or
of its ensemble steps): false = a seeded random init, the labels mean nothing; null = the server does not
say. When it is false a note says so once on stderr (text and --json). Progress bar, notes and errors go to stderr.

Exit status: 0 every image classified; 1 some image failed (each failure is one line); 2 nothing was sent:
bad options (--top-k outside 1..1000, a --priority the model does not serve, ...), a path that does not exist, no
image files, or the server unreachable, not a Triton
server speaking --protocol, or not ready (one line naming the problem).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import queue
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Iterator

from resnet18_kit.client.backoff import RetryPolicy
from resnet18_kit.client.sync_client import Prediction, TritonClassifierClient
from resnet18_kit.client.errors import InferenceError, NotTritonError
from resnet18_kit.client.samples import expand_paths
from resnet18_kit.client.shared_memory import TensorRegions
from resnet18_kit.contract import ENSEMBLE_MODEL, NUM_CLASSES
from resnet18_kit.options import add_server_address_options

log = logging.getLogger(__name__)
PREFIX = "resnet18-kit classify"
#: Skipped files named on the one stderr line before "and N more".
SKIPPED_SHOWN = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """classify's options; the server address options come from settings.add_server_address_options."""
    parser.add_argument("paths", nargs="+", type=Path, metavar="IMAGE_OR_FOLDER",
                        help="image files, or folders of them (searched recursively)")
    parser.add_argument("--model", default=ENSEMBLE_MODEL,
                        help=f"the ensemble to call: encoded image in, classes out (default {ENSEMBLE_MODEL})")
    parser.add_argument("--top-k", type=int, default=5, help=f"labels per image, 1..{NUM_CLASSES} (default 5)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight, >= 1 (default 4)")
    parser.add_argument("--deadline-s", type=float, default=60.0,
                        help="time budget per image in seconds, retries of a full queue included (default 60)")
    parser.add_argument("--priority", type=int, default=0,
                        help="priority level, 1 = served first (default 0: the model's default level)")
    parser.add_argument("--json", action="store_true", help="one JSON object per image and line on stdout")
    parser.add_argument("--shared-memory", action="store_true",
                        help="photos through system shared memory (a server on this host only)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_server_address_options(parser)


def classify_files(files: list[Path], url: str, protocol: str, top_k: int = 5, concurrency: int = 4,
                   model: str = ENSEMBLE_MODEL, deadline_s: float = 60.0, progress: bool = False,
                   priority: int = 0,
                   shared_memory: bool = False) -> Iterator[tuple[Path, list[Prediction] | Exception]]:
    """Classify each file in its own request, `concurrency` at a time: that many threads, each with its
    own client, which it also closes (so a request past its deadline is waited for, never cancelled:
    client.sync_client). Yields (path, top_k predictions) in input order; a failed file gets its exception
    (an InferenceError, or OSError when it cannot be read) instead. progress: a tqdm bar on stderr;
    priority: each request's priority level (0 = the model's default); shared_memory: each client passes
    its photos through a region of its own (client.shared_memory)."""
    from tqdm import tqdm

    retry = RetryPolicy(deadline_s=deadline_s)
    work: queue.SimpleQueue = queue.SimpleQueue()
    results: list[Future] = [Future() for _ in files]
    for item in enumerate(files):
        work.put(item)

    def worker() -> None:
        with TritonClassifierClient(url, protocol, retry=retry, shared_memory=shared_memory) as client:
            while True:
                try:
                    index, path = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    results[index].set_result(client.classify([path.read_bytes()], top_k, model,
                                                                   priority=priority)[0])
                except (InferenceError, OSError) as exc:  # reported per file, the others go on
                    results[index].set_result(exc)
                except BaseException as exc:  # a bug: raised where the results are read
                    results[index].set_exception(exc)

    threads = [threading.Thread(target=worker, name=f"classify-{i}", daemon=True)
               for i in range(max(1, min(concurrency, len(files))))]
    for thread in threads:
        thread.start()
    try:
        for path, result in tqdm(zip(files, results), total=len(files), unit="image", disable=not progress,
                                 file=sys.stderr):
            yield path, result.result()
    finally:
        while not work.empty():  # the caller stopped reading: send nothing more
            try:
                work.get_nowait()
            except queue.Empty:
                break
        for thread in threads:
            thread.join()


def json_line(path: Path, result: list[Prediction] | Exception, weights_meaningful: bool | None = None) -> str:
    """One --json output line (see the module doc)."""
    if isinstance(result, Exception):
        record = {"file": str(path), "error": error_text(result), "status": getattr(result, "status", None)}
    else:
        record = {"file": str(path), "predictions": [
            {"label": p.label, "class_index": p.class_index, "probability": p.probability, "logit": p.logit}
            for p in result]}
    return json.dumps({**record, "weights_meaningful": weights_meaningful})


def error_text(error: Exception) -> str:
    """An image's failure on one line (OSError: its strerror and file; others: their message)."""
    if isinstance(error, OSError) and not isinstance(error, InferenceError):
        return f"cannot read: {error.strerror or error}"
    return " ".join(str(error).split())


def format_predictions(path: Path, predictions: list[Prediction], mark: str = "") -> str:
    """The file name, then one line per prediction: rank, label, probability in percent, logit, class
    index, and `mark` (e.g. "[random weights]") after each."""
    lines = [f"{path}"]
    lines += [f"  {rank}. {p.label:<30} {100 * p.probability:6.2f} %  (logit {p.logit:7.3f}, class "
              f"{p.class_index}){' ' + mark if mark else ''}" for rank, p in enumerate(predictions, 1)]
    return "\n".join(lines)


def check_server(url: str, protocol: str, model: str, priority: int = 0,
                 shared_memory: bool = False) -> tuple[str | None, bool | None]:
    """(None, weights_meaningful) when `url` is a ready Triton server speaking `protocol` with `model`
    ready and serving `priority` (and, with `shared_memory`, able to register a region of this host);
    else (a one-line message saying what is wrong, None). weights_meaningful: True, False or None
    (unknown), from the served config (TritonClassifierClient.weights_meaningful)."""
    where = f"{url} ({protocol})"
    try:
        with TritonClassifierClient(url, protocol, connection_timeout_s=5.0) as client:
            client.server_metadata()
            if not client.is_server_ready():
                return f"the Triton server at {where} is not ready", None
            if not client.is_model_ready(model):
                return f"model '{model}' is not ready on the Triton server at {where}", None
            try:
                client.check_priority(model, priority)
            except ValueError as exc:
                return f"--{exc}", None
            problem = shared_memory_problem(client.raw, where) if shared_memory else None
            if problem:
                return problem, None
            try:
                return None, client.weights_meaningful(model)
            except InferenceError:
                return None, None
    except NotTritonError as exc:
        return exc.message, None
    except InferenceError as exc:
        detail = " ".join(exc.message.split()).removeprefix(f"cannot connect to {url}: ")
        return f"cannot reach a Triton server at {where}: {detail}", None
    except ValueError as exc:  # contract.host_port: not a host:port
        return f"--url: {exc}", None


def shared_memory_problem(raw_client, where: str) -> str | None:
    """One line when the server behind `raw_client` (a tritonclient client) cannot register a system
    shared-memory region of this host (another host or container, or the API locked by an admin key),
    else None. Registers and unregisters one 4 KiB region, then destroys it."""
    from tritonclient.utils import InferenceServerException

    regions = TensorRegions("classify_check", 4096)
    try:
        for name, key, size in regions.registrations():
            raw_client.register_system_shared_memory(name, key, size)
            raw_client.unregister_system_shared_memory(name)
    except InferenceServerException as exc:
        detail = " ".join((exc.message() or str(exc)).split())[:200]
        return (f"--shared-memory: the Triton server at {where} cannot use this host's shared memory "
                f"({detail}); leave --shared-memory out")
    finally:
        regions.close()
    return None


def usage_problem(args: argparse.Namespace) -> str | None:
    """The first option out of range, as a one-line message, else None."""
    if not 1 <= args.top_k <= NUM_CLASSES:
        return f"--top-k {args.top_k}: give 1..{NUM_CLASSES}"
    if args.concurrency < 1:
        return f"--concurrency {args.concurrency}: give 1 or more"
    if not args.deadline_s > 0:
        return f"--deadline-s {args.deadline_s:g}: give more than 0"
    if args.priority < 0:
        return f"--priority {args.priority}: give 0 (the model's default level) or a level, 1 = served first"
    return None


def say(message: str) -> None:
    """One line on stderr, above any progress bar."""
    from tqdm import tqdm

    tqdm.write(f"{PREFIX}: {message}", file=sys.stderr)


def run(settings, args: argparse.Namespace) -> int:
    """Classify the images (module doc); the exit status."""
    problem = usage_problem(args)
    if problem:
        say(problem)
        return 2
    missing = [path for path in args.paths if not path.exists()]
    if missing:  # named before anything is sent: a mistyped path is a usage error, not a failed image
        say(f"no such file or folder: {', '.join(map(str, missing))}")
        return 2
    skipped: list[Path] = []
    files = expand_paths(args.paths, skipped)
    if skipped:
        names = ", ".join(str(path) for path in skipped[:SKIPPED_SHOWN])
        more = f" and {len(skipped) - SKIPPED_SHOWN} more" if len(skipped) > SKIPPED_SHOWN else ""
        say(f"skipped {len(skipped)} file(s) that are not images the server decodes: {names}{more}")
    if not files:
        say(f"no image files in {' '.join(map(str, args.paths))}")
        return 2
    problem, weights_meaningful = check_server(settings.url, settings.protocol, args.model, args.priority,
                                               shared_memory=args.shared_memory)
    if problem:
        say(problem)
        return 2
    if weights_meaningful is False:
        say(f"NOTE the server's '{args.model}' has RANDOM weights, not trained ones: its labels are meaningless")
    failed = 0
    results = classify_files(files, settings.url, settings.protocol, args.top_k, args.concurrency, args.model,
                             args.deadline_s, progress=not args.no_progress and sys.stderr.isatty(),
                             priority=args.priority, shared_memory=args.shared_memory)
    for path, result in results:
        failed += isinstance(result, Exception)
        log.debug("%s: %s", path, "failed" if isinstance(result, Exception) else "classified")
        if args.json:
            print(json_line(path, result, weights_meaningful), flush=True)
        if isinstance(result, Exception):
            say(f"{path}: {error_text(result)}")
        elif not args.json:
            print(format_predictions(path, result), flush=True)
    log.info("%d image(s) classified, %d failed", len(files) - failed, failed)
    return 1 if failed else 0
