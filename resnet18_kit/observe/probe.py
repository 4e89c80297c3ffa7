"""Is the server still doing inference? The check behind the supervisor's wedge detection, the compose
health check and the Kubernetes liveness probe (the same file: it needs nothing but Python's standard
library, so it runs inside the Triton image as `python3 probe.py ...`).

Why health endpoints are not enough: a tritonserver can be left with a corrupt heap or stuck threads (as
upstream defect grpc-cancellation does, docs/reliability.md) while /v2/health/live and
/v2/health/ready still answer 200 and no request is ever answered again.

One probe round (`ProgressWatch.round`), over HTTP (KServe v2):
  1. read the server's execution count: the sum of `execution_count` over every model of the statistics
     extension (GET /v2/models/stats);
  2. unless that count grew since the last round (busy: other requests are being served), send one
     inference to each step of the ensemble, not to the ensemble itself, whose answers may come from the
     response cache without running anything: the preprocess model gets its warmup image (a serialized
     BYTES tensor, the file the export writes), the network zero UINT8 pixels [1, 3, 224, 224], both as
     the binary tensor data extension, with the request's `timeout` parameter so that a full queue
     refuses it rather than holding it (a cache hit counts no execution either, so step 1 sees only work
     the models did);
  3. the round shows progress when the count grew or both inferences were answered (200). A refusal of
     a probe by a full queue is not progress by itself: a stuck server's queue is full too.
The server is wedged when no round has shown progress for a while (server.supervisor: wedged_after_s). As a
script (compose, Kubernetes), one invocation is two reads of the count around the probe:

    python3 probe.py --url 127.0.0.1:8000 --image /models/preprocess/warmup/image_bytes [--kill-wedged]
    exit 0: progress; exit 1: no progress (one line on stderr says what was seen)

--kill-wedged (docker compose, where an unhealthy container is not restarted by Docker): a server that is
live (/v2/health/live 200) but shows no progress is wedged, and every `tritonserver` process of this PID
namespace gets SIGKILL, so that the container exits and its restart policy starts it again. A server
that is not live yet (loading its models) is left alone. tritonserver must not be PID 1 (compose's
`init: true`), since PID 1 ignores a SIGKILL from inside its own namespace.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

#: The ensemble's steps a probe sends to, each (model, input, its datatype and shape, output): the names of
#: contract.PREPROCESS_MODEL and contract.ONNX_MODEL, written out so that the file stays free of the
#: package's imports.
PROBE_STEPS = (("preprocess", "image", "BYTES", [1, 1], "pixels"),
               ("resnet18_onnx", "input", "UINT8", [1, 3, 224, 224], "logits"))
#: The network's probe input: zeros, UINT8 [1, 3, 224, 224] (1 byte each).
ZERO_PIXELS = bytes(3 * 224 * 224)


def executions(http_url: str, timeout_s: float) -> int | None:
    """The sum of `execution_count` over every model and version in GET /v2/models/stats at `http_url`
    ("host:port"); None when it does not answer within `timeout_s` seconds."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/models/stats", timeout=timeout_s) as response:
            stats = json.load(response)
    except (OSError, ValueError):
        return None
    return sum(int(model.get("execution_count", 0)) for model in stats.get("model_stats", []))


def probe_inference(http_url: str, serialized_image: bytes, timeout_s: float) -> tuple[bool, str]:
    """One inference per step of PROBE_STEPS: `serialized_image` (a BYTES tensor: 4-byte little-endian
    length, then an encoded image) to the preprocess model, zeros to the network. (True, "200") when both
    are answered, else (False, what came back from the first that was not)."""
    for (model, name, datatype, shape, output), data in zip(PROBE_STEPS, (serialized_image, ZERO_PIXELS)):
        answered, detail = _infer(http_url, model, name, datatype, shape, output, data, timeout_s)
        if not answered:
            return False, f"{model}: {detail}"
    return True, "200"


def _infer(http_url: str, model: str, name: str, datatype: str, shape: list[int], output: str, data: bytes,
           timeout_s: float) -> tuple[bool, str]:
    """One inference of `data` as input `name` of `model`, asking the server to refuse it after `timeout_s`
    in a queue and waiting at most 2 x `timeout_s` + 1 s for the answer."""
    header = json.dumps({
        "inputs": [{"name": name, "shape": shape, "datatype": datatype, "parameters": {"binary_data_size": len(data)}}],
        "outputs": [{"name": output, "parameters": {"binary_data": True}}],
        "parameters": {"timeout": max(1, int(timeout_s * 1e6))}}).encode()
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/{model}/infer", data=header + data, method="POST",
        headers={"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"})
    try:
        with urllib.request.urlopen(request, timeout=2 * timeout_s + 1.0) as response:
            response.read()
            return True, str(response.status)
    except urllib.error.HTTPError as error:
        return False, f"{error.code} {error.read()[:120].decode(errors='replace')}"
    except OSError as error:
        return False, f"no answer: {error}"


class ProgressWatch:
    """Tells a wedged server from a busy or idle one, round after round (module doc): `round()` probes,
    `stalled_s()` is how long no round has shown progress; the clock starts at creation. A round whose
    execution count grew needs no probe inference (a busy server is not loaded with probes)."""

    def __init__(self, http_url: str, serialized_image: bytes, timeout_s: float = 2.0):
        self.http_url = http_url
        self.image = serialized_image
        self.timeout_s = timeout_s
        self._last_progress = time.monotonic()
        self._last_executions: int | None = None
        #: What the last round saw, one line.
        self.last_detail = "no round yet"

    def round(self) -> bool:
        """One probe round; True when it showed progress."""
        count = executions(self.http_url, self.timeout_s)
        grew = count is not None and self._last_executions is not None and count > self._last_executions
        if count is not None:
            self._last_executions = count
        if grew:
            self.last_detail = f"executions {count}"
        else:
            answered, detail = probe_inference(self.http_url, self.image, self.timeout_s)
            self.last_detail = f"probe {detail}; executions {count}"
            if not answered:
                return False
        self._last_progress = time.monotonic()
        return True

    def stalled_s(self) -> float:
        return time.monotonic() - self._last_progress


def live(http_url: str, timeout_s: float) -> bool:
    """True when GET /v2/health/live at `http_url` answers 200 within `timeout_s` seconds."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/live", timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def kill_tritonservers() -> list[int]:
    """SIGKILL every process named `tritonserver` in this PID namespace (/proc); their pids."""
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as comm:
                if comm.read().strip() != "tritonserver":
                    continue
            os.kill(int(entry), signal.SIGKILL)
            killed.append(int(entry))
        except OSError:
            continue
    return killed


def main(argv: list[str] | None = None) -> int:
    """The script (module doc): exit 0 when the server shows progress, 1 when not."""
    parser = argparse.ArgumentParser(prog="probe.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="127.0.0.1:8000", help="the server's HTTP host:port (default 127.0.0.1:8000)")
    parser.add_argument("--image", required=True,
                        help="a serialized BYTES tensor of one image: model_repository/preprocess/warmup/image_bytes")
    parser.add_argument("--timeout-s", type=float, default=2.0,
                        help="the probe's queue timeout, seconds; the whole check takes at most 5 x this + 1 s (default 2)")
    parser.add_argument("--kill-wedged", action="store_true",
                        help="SIGKILL tritonserver when it is live but shows no progress (see the module doc)")
    args = parser.parse_args(argv)
    try:
        with open(args.image, "rb") as file:
            image = file.read()
    except OSError as error:
        print(f"probe: cannot read --image: {error}", file=sys.stderr)
        return 1
    before = executions(args.url, args.timeout_s)
    answered, detail = probe_inference(args.url, image, args.timeout_s)
    if answered:
        return 0
    after = executions(args.url, args.timeout_s)
    if before is not None and after is not None and after > before:
        return 0
    print(f"probe: no inference answered or executed at {args.url}: probe got {detail}; executions "
          f"{before} -> {after}", file=sys.stderr)
    if args.kill_wedged and live(args.url, args.timeout_s):
        print(f"probe: live but wedged: SIGKILL to tritonserver pid {kill_tritonservers()}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
