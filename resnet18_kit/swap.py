"""resnet18-kit swap: load another config into a running server (or every replica of a fleet) while it
serves, and say what runs now.

    resnet18-kit swap --model-config-name int8                 # the server whose gRPC is 127.0.0.1:8001
    resnet18-kit swap --model-config-name default --url 10.0.0.5:8001
    resnet18-kit swap --config my.pbtxt --model resnet18_onnx
    resnet18-kit swap --model-config-name int8 --fleet         # the fleet of this results folder, rolling

The server must run with model control: `serve --model-control explicit` (or `fleet --model-control
explicit`; compose: TRITON_MODEL_CONTROL=explicit), which needs an admin key; this command sends the key
from $TRITON_ADMIN_KEY. Configs are read from the model repository here (--model-repository), which must
hold the same files as the server's.

--model-config-name NAME gives every model (or those of --model) what tritonserver would load at start
with --model-config-name NAME: <model>/configs/NAME.pbtxt, else config.pbtxt ("default": config.pbtxt
everywhere); a model already serving that config is left as it is. --config FILE loads that file for the
model it names (or --model).

Model control goes over gRPC (--url: the server's gRPC address; through serve's gRPC guard too): a load
over HTTP holds that thread's HTTP requests until it is done (upstream defect http-load-holds).

What the server does (model_control): the new config's instances load and warm up beside the old
ones, the ensemble is reloaded, and the old instances leave once their requests are answered; nothing
fails. Before anything is sent, each config is checked against the ensembles that use the model (tensor
names, dtypes and shapes, max_batch_size): Triton would accept such a config and unload the ensemble.
--fleet drains each replica in HAProxy, swaps it and puts it back before the next (fleet.swap).

Exit status: 0 when every model serves the new config; 2 for a bad request, nothing changed (unknown
variant or model, unreadable file, a config an ensemble cannot use, no admin key); 1 when the server
refused the config, the key, or did not finish in --timeout-s (the previous configs serve, said on the
last line).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from resnet18_kit.contract import DEFAULT_URLS
from resnet18_kit.settings import Settings, shipped_variants, shown
from resnet18_kit.server.config import ADMIN_KEY_ENV
from resnet18_kit.model_control import (DEFAULT_SWAP_TIMEOUT_S, ModelControl, SwapError, file_target, swap,
                                               variant_targets)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The swap command's options."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model-config-name", metavar="NAME",
                      help="the variant to serve: <model>/configs/NAME.pbtxt where present, else config.pbtxt "
                           f"(\"default\": config.pbtxt everywhere); the shipped names: {', '.join(shipped_variants())}")
    what.add_argument("--config", type=Path, metavar="FILE", help="a config file (config.pbtxt syntax) to load")
    parser.add_argument("--model", action="append", metavar="MODEL",
                        help="swap this model only (repeat for more; default: every model of the repository, or "
                             "the one --config names)")
    parser.add_argument("--url", help=f"host:port of the server's gRPC endpoint, where model control goes (default "
                                     f"{DEFAULT_URLS['grpc']}; serve's --grpc-port)")
    parser.add_argument("--fleet", action="store_true",
                        help="swap every replica of the fleet running from this results folder (<results>/fleet), "
                             "one after another, each drained in HAProxy first")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_SWAP_TIMEOUT_S,
                        help=f"seconds each model's load and warm-up may take (default {DEFAULT_SWAP_TIMEOUT_S:.0f})")


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Swap (module doc); the exit status of the module doc."""
    admin_key = os.environ.get(ADMIN_KEY_ENV) or None
    url = settings.url if args.url else DEFAULT_URLS["grpc"]  # settings.url: --url checked as host:port
    try:
        if args.timeout_s <= 0:
            raise SwapError(f"--timeout-s {args.timeout_s:g}: give a positive number of seconds")
        if args.config is not None:
            if args.model and len(args.model) > 1:
                raise SwapError("--config loads one model's config: give at most one --model")
            targets = [file_target(args.config, args.model[0] if args.model else None)]
        else:
            targets = variant_targets(settings.repository, args.model_config_name, args.model)
        if admin_key is None:
            raise SwapError(f"${ADMIN_KEY_ENV} is not set: model control needs the admin key the server was started "
                            "with")
        if args.fleet:
            from resnet18_kit.fleet.__main__ import RESULTS_NAME
            from resnet18_kit.fleet.swap import swap_fleet

            workdir = settings.results_dir(RESULTS_NAME)
            say(f"rolling swap of the fleet in {shown(workdir)}")
            replicas = swap_fleet(workdir, targets, admin_key, args.timeout_s, on_line=say)
            say(f"done: {len(replicas)} replicas swapped")
            return 0
        with ModelControl(url, admin_key, args.timeout_s) as control:
            outcomes = swap(control, targets, args.timeout_s, on_line=say)
    except SwapError as exc:
        say(str(exc))
        return exc.exit_status
    changed = [o.model for o in outcomes if o.changed]
    say(f"done: {url} serves the new config of {', '.join(changed)}" if changed
        else f"done: {url} already served these configs; nothing changed")
    return 0


def say(line: str) -> None:
    print(f"swap: {line}", file=sys.stderr, flush=True)
