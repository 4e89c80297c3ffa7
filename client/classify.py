"""python -m client.classify: top-5 ImageNet labels for image files, from a Triton server.

Sends one request per image (up to --concurrency in flight) to the `resnet18` ensemble, so the server's
dynamic batcher forms the batches. Works with any Triton server that hosts this model repository.

Exit status: 0 all images classified; 1 some image failed (its error is printed); 2 server unreachable
or not ready.
"""
from __future__ import annotations

import argparse
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

from client.classifier import DEFAULT_URLS, PROTOCOLS, Prediction, TritonClassifierClient
from export.artifacts import ENSEMBLE_MODEL

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


def expand_paths(paths: Iterable[Path]) -> list[Path]:
    """Files as given; folders replaced by the image files under them (recursively, sorted)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES))
        else:
            files.append(path)
    return files


def classify_files(files: list[Path], url: str, protocol: str, top_k: int = 5, concurrency: int = 4,
                   model: str = ENSEMBLE_MODEL) -> list[tuple[Path, list[Prediction] | Exception]]:
    """Classify each file in its own request, `concurrency` at a time. Results keep the input order;
    a failed file gets its exception instead of predictions."""
    local = threading.local()
    clients: list[TritonClassifierClient] = []

    def classify_one(path: Path):
        if not hasattr(local, "client"):
            local.client = TritonClassifierClient(url, protocol)
            clients.append(local.client)
        try:
            return path, local.client.classify([path.read_bytes()], top_k, model)[0]
        except Exception as exc:  # reported per file, the others go on
            return path, exc

    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(classify_one, files))
    finally:
        for client in clients:
            client.close()


def format_predictions(path: Path, predictions: list[Prediction]) -> str:
    lines = [f"{path}"]
    lines += [f"  {rank}. {p.label:<30} logit {p.score:8.3f}  (class {p.class_index})"
              for rank, p in enumerate(predictions, 1)]
    return "\n".join(lines)


def check_server(url: str, protocol: str, model: str) -> str | None:
    """Return None when server and model are ready, else a message saying what is wrong."""
    try:
        with TritonClassifierClient(url, protocol, timeout_s=5.0) as client:
            if not client.is_server_ready():
                return f"Triton server at {url} ({protocol}) is not ready"
            if not client.is_model_ready(model):
                return f"model '{model}' is not ready on the Triton server at {url} ({protocol})"
    except Exception as exc:
        return f"cannot reach a Triton server at {url} ({protocol}): {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.classify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="image files or folders of images")
    parser.add_argument("--protocol", choices=PROTOCOLS, default="http")
    parser.add_argument("--url", help="host:port of the server (default 127.0.0.1:8000 for http, "
                                      "127.0.0.1:8001 for grpc)")
    parser.add_argument("--model", default=ENSEMBLE_MODEL, help="ensemble to call (default resnet18)")
    parser.add_argument("--top-k", type=int, default=5, help="labels per image (default 5)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
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
    for path, result in classify_files(files, url, args.protocol, args.top_k, args.concurrency, args.model):
        if isinstance(result, Exception):
            failed += 1
            print(f"{path}: ERROR {result}", file=sys.stderr)
        else:
            print(format_predictions(path, result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
