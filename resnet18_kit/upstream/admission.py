"""Close a running tritonserver to new inference requests before it is stopped, so it never holds one
when it exits.

Upstream defect `keep-alive-stop` (upstream.defects): server PR #6986 with core PR #335 (since 2.45), no
fix release known; reproduced by tests/test_lifecycle.py (the stop under keep-alive HTTP load); on by
default in `serve`, off with --no-refuse-first.

Why (Triton 2.51; docs/deployment.md "Stopping under load"): on SIGTERM tritonserver stops
accepting HTTP connections but keeps serving every request that arrives on a connection already open
(keep-alive) until those connections close or its exit timeout passes; only then does it wait for the
inferences it holds, with no time left ("Timeout 0"), so it logs "Exit timeout expired. Exiting
immediately.", exits 1 and abandons them. A client with a connection pool keeps its connections open, so
under steady keep-alive load every stop ended that way.

What the kit does first: unload the models through the model-control API (tritonserver always runs with
`--model-control-mode=explicit`; with `serve --model-control none` that API is locked by a key only
`EmbeddedTritonServer` knows). An unloaded model refuses new requests at once (HTTP 404 / gRPC NOT_FOUND
"... has no available versions") while the requests it holds run to the end; Triton unloads it only then.
Ensembles go first, and their steps only once no ensemble holds a request, so a photo accepted by the
ensemble still finds its steps. When every model is unloaded nothing can be in flight, and SIGTERM follows.
"""
from __future__ import annotations

import time
from typing import Callable

from resnet18_kit.server.config import ADMIN_HEADER

#: Model states in the repository index that still hold or accept requests.
LIVE_STATES = ("READY", "UNLOADING", "LOADING")
#: Seconds between two reads of the repository index while models unload.
POLL_INTERVAL_S = 0.1


def stop_admitting(http_url: str, key: str | None, timeout_s: float,
                   hurry: Callable[[], bool] | None = None) -> bool:
    """Unload every model of the tritonserver at `http_url` (host:port), ensembles first (module doc),
    and wait until Triton reports each unloaded (its last request answered), for at most `timeout_s`
    seconds in all. key: the admin key of its model-control API (the header `admin-key`), None when that
    API is open. hurry: polled while waiting; True gives up at once.
    Returns True when every model is unloaded; False when time ran out, `hurry` said so, or the server
    did not answer or refused (it is then stopped as before: SIGTERM, its exit timeout). Raises nothing."""
    import tritonclient.http as httpclient

    deadline = time.monotonic() + timeout_s
    headers = {ADMIN_HEADER: key} if key else None
    client = httpclient.InferenceServerClient(http_url, connection_timeout=2.0, network_timeout=max(timeout_s, 1.0))
    try:
        live = _live_models(client, headers)
        ensembles = [name for name in live if client.get_model_config(name).get("platform") == "ensemble"]
        for group in (ensembles, [name for name in live if name not in ensembles]):
            for name in group:
                client.unload_model(name, headers=headers, unload_dependents=False)
            while set(group) & set(_live_models(client, headers)):
                if time.monotonic() >= deadline or (hurry is not None and hurry()):
                    return False
                time.sleep(POLL_INTERVAL_S)
        return True
    except Exception:  # a refusal (InferenceServerException), or a server that no longer answers
        return False
    finally:
        client.close()


def _live_models(client, headers: dict | None) -> list[str]:
    """Names of the models the repository index lists in a state that holds or accepts requests."""
    return sorted({entry["name"] for entry in client.get_model_repository_index(headers=headers)
                   if entry.get("state") in LIVE_STATES})
