"""Triton's upstream defects the kit meets, in one place: which release fixed each, and what the kit does
while the running release lacks the fix (docs/reliability.md "Triton 2.51 defects and what the kit does").

    from resnet18_kit.upstream import needs, workarounds
    needs("grpc-cancellation", "2.51.0")  # True: serve puts its gRPC guard in front
    workarounds("2.72.0")                  # only the defects no release has fixed

The product asks `needs` where it decides whether to start a workaround; `serve` names the ones on in its
ready banner (`banner_line`).
"""
from resnet18_kit.upstream.defects import DEFECTS, Defect, banner_line, needs, parse_version, workarounds

__all__ = ["DEFECTS", "Defect", "banner_line", "needs", "parse_version", "workarounds"]
