"""Where the clients find the server: the protocols, their default addresses, and what a --url may be."""
from __future__ import annotations

import urllib.parse

from resnet18_kit.contract import DEFAULT_URLS


def host_port(url: str, protocol: str) -> str:
    """The "host:port" tritonclient takes, from what a user gives: "host:port", or a URL whose scheme is
    the protocol's ("http://127.0.0.1:8000", "grpc://127.0.0.1:8001"). Raises ValueError naming the problem:
    another scheme (https needs TLS options this client does not set), a path, no port."""
    parsed = urllib.parse.urlsplit(url if "://" in url else f"//{url}")
    if parsed.scheme and parsed.scheme != protocol:
        raise ValueError(f"URL {url!r}: scheme {parsed.scheme}:// does not match the protocol {protocol} "
                         f"(give host:port)")
    try:
        port = parsed.port
    except ValueError:  # a port that is not a number
        port = None
    if parsed.path.strip("/") or parsed.query or not parsed.hostname or port is None:
        raise ValueError(f"URL {url!r}: give host:port, e.g. {DEFAULT_URLS[protocol]}")
    return parsed.netloc
