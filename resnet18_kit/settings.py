"""Settings: one frozen object built once at the entry point (resnet18_kit.cli) and handed down.

Each field comes from its flag, else its environment variable, else its default (`Settings.build`):

| field              | flag                 | environment variable             | default |
|---|---|---|---|
| model_repository   | --model-repository   | RESNET18_KIT_MODEL_REPOSITORY    | the checkout's model_repository/, else ./model_repository |
| results            | --results            | RESNET18_KIT_RESULTS             | the checkout's results/, else ./results |
| log_level          | --log-level          | RESNET18_KIT_LOG_LEVEL           | INFO |
| protocol           | --protocol           | RESNET18_KIT_PROTOCOL            | http |
| url                | --url                | RESNET18_KIT_URL                 | 127.0.0.1:8000 for http, 127.0.0.1:8001 for grpc |
| metrics_url        | --metrics-url        | RESNET18_KIT_METRICS_URL         | http://<host of url>:8002/metrics |
| triton_version     | (none)               | TRITON_SERVER_VERSION            | None: the release the server reports |

triton_version is the Triton release `serve` runs, which switches the upstream workarounds
(resnet18_kit.upstream.seam): NVIDIA's Triton images set TRITON_SERVER_VERSION to theirs; when nobody
sets it, `serve` asks the server given by --tritonserver, and takes the wheel's own (contract.TRITON_VERSION)
for the wheel's.

"The checkout" is the source tree this package sits in (an editable install); an installed package has
none, and then the folders are relative to the working directory. Nothing here is read at import time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from resnet18_kit.contract import (DEFAULT_PORTS, DEFAULT_URLS, DEFAULT_VARIANT, PROTOCOLS, REPO_ROOT,
                                   host_port, parse_version)
from resnet18_kit.repository import ModelRepository

#: The variable NVIDIA's Triton images set to their release (server build.py's Dockerfiles:
#: `ENV TRITON_SERVER_VERSION ${TRITON_VERSION}`).
TRITON_VERSION_ENV = "TRITON_SERVER_VERSION"
ENV = {"model_repository": "RESNET18_KIT_MODEL_REPOSITORY", "results": "RESNET18_KIT_RESULTS",
       "log_level": "RESNET18_KIT_LOG_LEVEL", "protocol": "RESNET18_KIT_PROTOCOL", "url": "RESNET18_KIT_URL",
       "metrics_url": "RESNET18_KIT_METRICS_URL", "triton_version": TRITON_VERSION_ENV}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class SettingsError(ValueError):
    """A setting that cannot be used (a folder that is not one, an unknown protocol or log level, a URL
    that is not host:port); the message is one line naming the flag or variable and the value."""


def checkout() -> Path | None:
    """The source checkout this package lives in, None for an installed package."""
    in_checkout = (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "model_repository").is_dir()
    return REPO_ROOT if in_checkout else None


def default_folder(name: str) -> Path:
    """`name` ("model_repository", "results") in the checkout, else in the working directory."""
    root = checkout()
    return (root if root is not None else Path.cwd()).resolve() / name


def metrics_url_for(url: str) -> str:
    """The metrics endpoint of the server at `url` (host:port): the same host, port 8002, /metrics."""
    host = url.rsplit(":", 1)[0] if ":" in url else url
    return f"http://{host}:{DEFAULT_PORTS['metrics']}/metrics"


def check_url(url: str, protocol: str, source: str) -> str:
    """The host:port tritonclient takes, from `url` as a user gives it (contract.host_port: "host:port",
    or a URL whose scheme is `protocol`'s); SettingsError naming `source` (the flag or variable) otherwise."""
    try:
        return host_port(url, protocol)
    except ValueError as exc:
        raise SettingsError(f"{source}: {exc}") from None


@dataclass(frozen=True)
class Settings:
    """What every command shares. Paths are absolute; url is host:port for `protocol`."""

    model_repository: Path
    results: Path
    log_level: str = "INFO"
    protocol: str = "http"
    url: str = DEFAULT_URLS["http"]
    metrics_url: str = metrics_url_for(DEFAULT_URLS["http"])
    triton_version: str | None = None

    @property
    def repository(self) -> ModelRepository:
        """The model repository as files (repository.ModelRepository)."""
        return ModelRepository(self.model_repository)

    def results_dir(self, *parts: str) -> Path:
        """results / parts (not created), e.g. results_dir("reliability")."""
        return self.results.joinpath(*parts)

    @classmethod
    def build(cls, flags: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
              ) -> "Settings":
        """Settings from `flags` (field name -> value; None = not given), then `environ` (default
        os.environ; the variables of ENV), then the defaults (module doc). Raises SettingsError."""
        flags = {k: v for k, v in (flags or {}).items() if v is not None}
        environ = os.environ if environ is None else environ

        def pick(field: str):
            if field in flags:
                return flags[field], "--" + field.replace("_", "-")
            value = environ.get(ENV[field])
            return (value, f"${ENV[field]}") if value else (None, None)

        repository, source = pick("model_repository")
        repository = Path(repository).expanduser().resolve() if repository else default_folder("model_repository")
        if source and not repository.is_dir():
            raise SettingsError(f"{source}: not a folder: {repository}")
        results, _ = pick("results")
        results = Path(results).expanduser().resolve() if results else default_folder("results")
        log_level, source = pick("log_level")
        log_level = str(log_level or "INFO").upper()
        if log_level not in LOG_LEVELS:
            raise SettingsError(f"{source} {log_level!r}: one of {', '.join(LOG_LEVELS)}")
        protocol, source = pick("protocol")
        protocol = str(protocol or "http").lower()
        if protocol not in PROTOCOLS:
            raise SettingsError(f"{source} {protocol!r}: one of {', '.join(PROTOCOLS)}")
        url, source = pick("url")
        url = check_url(str(url), protocol, source) if url else DEFAULT_URLS[protocol]
        metrics_url, _ = pick("metrics_url")
        triton_version, source = pick("triton_version")
        triton_version = str(triton_version).strip() if triton_version else None
        try:
            triton_version and parse_version(triton_version)
        except ValueError as exc:
            raise SettingsError(f"{source}: {exc}") from None
        return cls(model_repository=repository, results=results, log_level=log_level, protocol=protocol,
                   url=url, metrics_url=str(metrics_url) if metrics_url else metrics_url_for(url),
                   triton_version=triton_version)


def shipped_variants() -> list[str]:
    """The config variant names of the default model repository (the checkout's, else ./model_repository),
    for the commands' --help; ["default"] when it cannot be read."""
    try:
        return ModelRepository(default_folder("model_repository")).variant_names()
    except OSError:
        return [DEFAULT_VARIANT]


def shown(path: Path) -> Path:
    """`path` as a command prints it: relative to the working directory when it lies under it, else as it is."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path

