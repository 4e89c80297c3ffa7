"""The admin key (scenario "security"): against a server started with one, each restricted API without
and with the key, and the open APIs without it."""
from __future__ import annotations

import secrets
import tempfile
from pathlib import Path

from tritonclient.utils import InferenceServerException

from resnet18_kit.tools.reliability import ECHO_MODEL, repository_with
from resnet18_kit.tools.reliability.loads import echo_load, infer_input
from resnet18_kit.server.config import ADMIN_GRPC_HEADER, ADMIN_HEADER, ServerConfig, config_on_free_ports
from resnet18_kit.server.embedded import EmbeddedTritonServer


def restricted_api_checks(config: ServerConfig) -> list[dict]:
    """Against a server started with an admin key (config.admin_key): each restricted API
    (model-repository index, shared-memory status, trace settings; HTTP and gRPC) without and with the
    key, and inference, health and statistics without it (open). Returns one row per call:
    {"protocol", "api", "key" (sent or not), "outcome" ("OK" or "<status>: <message>")}."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    rows = []

    def attempt(protocol, api, with_key, call):
        try:
            call()
            outcome = "OK"
        except InferenceServerException as exc:
            outcome = f"{exc.status()}: {(exc.message() or '')[:80]}"
        rows.append({"protocol": protocol, "api": api, "key": with_key, "outcome": outcome})

    http = httpclient.InferenceServerClient(config.http_url)
    grpc = grpcclient.InferenceServerClient(config.grpc_url)
    load = echo_load(1)
    try:
        for with_key in (False, True):
            for protocol, client, header in (("http", http, ADMIN_HEADER), ("grpc", grpc, ADMIN_GRPC_HEADER)):
                headers = {header: config.admin_key} if with_key else {}
                attempt(protocol, "model-repository (index)", with_key,
                        lambda: client.get_model_repository_index(headers=headers))
                attempt(protocol, "shared-memory (status)", with_key,
                        lambda: client.get_system_shared_memory_status(headers=headers))
                attempt(protocol, "trace (settings)", with_key, lambda: client.get_trace_settings(headers=headers))
        attempt("http", "inference (open)", False, lambda: http.infer(ECHO_MODEL, [infer_input(httpclient, load, 0)]))
        attempt("grpc", "inference (open)", False, lambda: grpc.infer(ECHO_MODEL, [infer_input(grpcclient, load, 0)]))
        attempt("http", "health (open)", False, lambda: http.is_server_ready())
        attempt("http", "statistics (open)", False, lambda: http.get_inference_statistics(ECHO_MODEL))
    finally:
        http.close()
        grpc.close()
    return rows


def checks_with_a_new_key(out_dir: Path) -> list[dict]:
    """The command's run: a server of reliability_echo alone with a fresh random admin key and model
    control on, so the key opens every restricted API (log and repository in `out_dir`);
    restricted_api_checks' rows."""
    repository = repository_with([ECHO_MODEL], Path(tempfile.mkdtemp(dir=out_dir)) / "repository")
    config = config_on_free_ports(model_repository=repository, admin_key=secrets.token_hex(16), model_control="explicit")
    with EmbeddedTritonServer(config, log_path=out_dir / "tritonserver-security.log"):
        return restricted_api_checks(config)


def table_row(checks: list[dict]) -> list:
    """The table's row of restricted_api_checks' rows."""
    refused = [c for c in checks if not c["key"] and "open" not in c["api"]]
    return ["restricted APIs (model-repository, shared-memory, trace), admin key", "--scenario security",
            len(checks), sum(c["outcome"] == "OK" for c in checks), f"{sum(c['outcome'] != 'OK' for c in checks)} "
            "without key", 0, "-", "without key: " + ", ".join(sorted({c["outcome"].split(':')[0] for c in refused}))]
