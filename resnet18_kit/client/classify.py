"""python -m resnet18_kit.client.classify: top-5 ImageNet labels for image files, from a Triton server.

Sends one request per image (up to --concurrency in flight) to the `resnet18` ensemble, so the server's
dynamic batcher forms the batches; a request refused because the queue is full is retried until
--deadline-s. Works with any Triton server that hosts this model repository.

Output: per image, its top-k labels with their probabilities in percent (the ensemble's softmax output)
and logits (stdout), or with --json one JSON object per line:
{"file": str, "predictions": [{"label": str, "class_index": int, "probability": float (0..1),
"logit": float}, ...]}, or
{"file": str, "error": str, "status": str | null} for an image that failed. A progress bar goes to
stderr.

Exit status: 0 all images classified; 1 some image failed (its error is printed); 2 server unreachable
or not ready (nothing was sent).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from resnet18_kit.client.backoff import RetryPolicy
from resnet18_kit.client.classifier import Prediction, TritonClassifierClient
from resnet18_kit.contract import DEFAULT_URLS, PROTOCOLS
from resnet18_kit.client.errors import InferenceError
from resnet18_kit.client.samples import expand_paths
from resnet18_kit.contract import ENSEMBLE_MODEL

def classify_files(files: list[Path], url: str, protocol: str, top_k: int = 5, concurrency: int = 4,
                   model: str = ENSEMBLE_MODEL, deadline_s: float = 60.0, progress: bool = False,
                   ) -> Iterator[tuple[Path, list[Prediction] | Exception]]:
    """Classify each file in its own request, `concurrency` at a time (one client per thread).
    Yields (path, predictions) in input order; a failed file gets its exception (an InferenceError, or
    OSError when it cannot be read) instead of predictions. progress: a tqdm bar on stderr."""
    local = threading.local()
    clients: list[TritonClassifierClient] = []
    retry = RetryPolicy(deadline_s=deadline_s)

    def classify_one(path: Path):
        if not hasattr(local, "client"):
            local.client = TritonClassifierClient(url, protocol, retry=retry)
            clients.append(local.client)
        try:
            return path, local.client.classify([path.read_bytes()], top_k, model)[0]
        except (InferenceError, OSError) as exc:  # reported per file, the others go on
            return path, exc

    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            yield from tqdm(pool.map(classify_one, files), total=len(files), unit="image",
                            disable=not progress, file=sys.stderr)
    finally:
        for client in clients:
            client.close()


def json_line(path: Path, result: list[Prediction] | Exception) -> str:
    """One --json output line (see the module doc)."""
    if isinstance(result, Exception):
        return json.dumps({"file": str(path), "error": str(result), "status": getattr(result, "status", None)})
    return json.dumps({"file": str(path), "predictions": [
        {"label": p.label, "class_index": p.class_index, "probability": p.probability, "logit": p.logit}
        for p in result]})


def format_predictions(path: Path, predictions: list[Prediction], mark: str = "") -> str:
    """The file name, then one line per prediction: rank, label, probability in percent, logit, class
    index, and `mark` (e.g. "[random weights]") after each."""
    lines = [f"{path}"]
    lines += [f"  {rank}. {p.label:<30} {100 * p.probability:6.2f} %  (logit {p.logit:7.3f}, class "
              f"{p.class_index}){' ' + mark if mark else ''}" for rank, p in enumerate(predictions, 1)]
    return "\n".join(lines)


def check_server(url: str, protocol: str, model: str) -> str | None:
    """Return None when server and model are ready, else a message saying what is wrong."""
    try:
        with TritonClassifierClient(url, protocol, connection_timeout_s=5.0) as client:
            if not client.is_server_ready():
                return f"Triton server at {url} ({protocol}) is not ready"
            if not client.is_model_ready(model):
                return f"model '{model}' is not ready on the Triton server at {url} ({protocol})"
    except InferenceError as exc:
        return f"cannot reach a Triton server at {url} ({protocol}): {exc.message}"
    except ValueError as exc:  # client.urls.host_port: not a host:port
        return f"--url: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resnet18_kit.client.classify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="image files or folders of images")
    parser.add_argument("--protocol", choices=PROTOCOLS, default="http")
    parser.add_argument("--url", help="host:port of the server (default 127.0.0.1:8000 for http, "
                                      "127.0.0.1:8001 for grpc)")
    parser.add_argument("--model", default=ENSEMBLE_MODEL, help="ensemble to call (default resnet18)")
    parser.add_argument("--top-k", type=int, default=5, help="labels per image (default 5)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--deadline-s", type=float, default=60.0,
                        help="time budget per image in seconds, retries of a full queue included (default 60)")
    parser.add_argument("--json", action="store_true", help="one JSON object per image and line")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    url = args.url or DEFAULT_URLS[args.protocol]

    problem = check_server(url, args.protocol, args.model)
    if problem:
        print(f"classify: {problem}", file=sys.stderr)
        return 2
    files = expand_paths(args.paths)
    if not files:
        print("classify: no image files found", file=sys.stderr)
        return 1
    failed = 0
    results = classify_files(files, url, args.protocol, args.top_k, args.concurrency, args.model,
                             args.deadline_s, progress=not args.no_progress and sys.stderr.isatty())
    for path, result in results:
        failed += isinstance(result, Exception)
        if args.json:
            print(json_line(path, result), flush=True)
        elif isinstance(result, Exception):
            tqdm.write(f"{path}: ERROR {result}", file=sys.stderr)
        else:
            tqdm.write(format_predictions(path, result), file=sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
