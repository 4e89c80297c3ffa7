"""Has a request's client gone? Asked by the kit's Python-backend models before their expensive step.

Two signals, either one is enough:
  * Triton's own: `request.is_cancelled()` (one round trip to the server). Set by a gRPC cancellation
    straight to tritonserver, which crashes Triton 2.51 under load (upstream defect grpc-cancellation; docs/reliability.md).
  * the kit's gRPC guard's mark (`serve`, resnet18_kit/upstream/cancel_marks.py): the guard never passes a
    cancellation on. It gives every ModelInfer it forwards a request parameter `cancel_mark` (32 hex
    digits, replacing any the client sent) and, when the client cancels or its deadline passes while Triton
    holds the request, creates an empty file of that name in a folder, removed once Triton answers. The
    folder reaches this process through tritonserver's environment (RESNET18_KIT_CANCEL_MARKS); without
    it (tritonserver started by anything but the kit) only the first signal counts. An ensemble copies its
    request's parameters onto every step (core src/ensemble_scheduler/ensemble_scheduler.cc,
    SetParameters), so each step sees the mark. Cost: one stat() of a file in a folder of a few entries.
"""
import json
import os
import re

#: The request parameter holding the guard's mark; the environment variable naming the marks' folder.
PARAMETER = "cancel_mark"
ENVIRONMENT = "RESNET18_KIT_CANCEL_MARKS"
#: What a mark looks like (anything else is ignored: a parameter never names another file).
MARK = re.compile(r"[0-9a-f]{32}")


class Cancellation:
    """`gone(request)`: True when the request's client cancelled (either signal). `folder`: where the
    guard's marks are (None: Triton's signal only)."""

    def __init__(self, folder=None):
        self.folder = folder

    @classmethod
    def from_environment(cls, environ=os.environ):
        return cls(environ.get(ENVIRONMENT) or None)

    def gone(self, request) -> bool:
        return self.marked(request.parameters()) or request.is_cancelled()

    def marked(self, parameters: str) -> bool:
        """Whether the request whose parameters (Triton's JSON text) are `parameters` carries a mark that
        the guard has set."""
        if self.folder is None:
            return False
        try:
            mark = json.loads(parameters or "{}").get(PARAMETER)
        except (ValueError, AttributeError):
            return False
        return isinstance(mark, str) and MARK.fullmatch(mark) is not None \
            and os.path.exists(os.path.join(self.folder, mark))
