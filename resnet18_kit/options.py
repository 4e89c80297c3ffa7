"""Command-line options shared by the commands, defined once: the global options (folders, log level), the
server address (--url, --protocol, --metrics-url), and the argparse parser every command uses (one-line
usage errors, no abbreviations). Settings.build reads what these parse; this module holds no settings logic.
"""
from __future__ import annotations

import argparse

from resnet18_kit.contract import DEFAULT_PORTS, DEFAULT_URLS, PROTOCOLS
from resnet18_kit.settings import ENV, LOG_LEVELS

#: Global options: (flag, Settings field, help).
GLOBAL_OPTIONS = (
    ("--model-repository", "model_repository",
     "the Triton model repository (default: the checkout's model_repository/, else ./model_repository; "
     "$RESNET18_KIT_MODEL_REPOSITORY)"),
    ("--results", "results", "where results go (default: the checkout's results/, else ./results; $RESNET18_KIT_RESULTS)"),
    ("--log-level", "log_level", f"status lines on stderr at this level and up: {', '.join(LOG_LEVELS)} "
                                 "(default INFO; $RESNET18_KIT_LOG_LEVEL)"),
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks (module docstrings are the help)."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line ("resnet18-kit classify: error: ...", exit 2) and
    that never abbreviates options; subcommand parsers made from it are Parsers too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_global_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """GLOBAL_OPTIONS on `parser`; with `suppress` they leave no default (so a value given before the
    command is not overwritten by the subcommand's parser)."""
    group = parser.add_argument_group("global options")
    for flag, dest, help_text in GLOBAL_OPTIONS:
        group.add_argument(flag, dest=dest, help=help_text, metavar="LEVEL" if dest == "log_level" else "DIR",
                           type=str.upper if dest == "log_level" else None,
                           default=argparse.SUPPRESS if suppress else None)


def command_parser(subparsers, name: str, help_text: str, description: str | None = None,
                   parents: tuple = ()) -> argparse.ArgumentParser:
    """A subcommand's parser: no abbreviations, the description as written, the global options too."""
    parser = subparsers.add_parser(name, help=help_text, description=description or help_text,
                                   formatter_class=HelpFormatter, allow_abbrev=False, parents=list(parents))
    add_global_options(parser, suppress=True)
    return parser


def add_server_address_options(parser) -> None:
    """--url, --protocol and --metrics-url: the address of the server a command talks to, defined once for
    every command that talks to one (Settings.build reads them; argparse parser)."""
    group = parser.add_argument_group("server address")
    group.add_argument("--url", help=f"host:port of the server, no scheme (default {DEFAULT_URLS['http']} for "
                                     f"http, {DEFAULT_URLS['grpc']} for grpc; ${ENV['url']})")
    group.add_argument("--protocol", type=str.lower, choices=PROTOCOLS,
                       help=f"http or grpc (KServe v2 / Open Inference Protocol; default http; ${ENV['protocol']})")
    group.add_argument("--metrics-url", help=f"Prometheus metrics endpoint (default http://<host of --url>:"
                                             f"{DEFAULT_PORTS['metrics']}/metrics; ${ENV['metrics_url']})")
