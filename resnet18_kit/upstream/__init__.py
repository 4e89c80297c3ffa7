"""The upstream wing: what the kit does about Triton's own defects, in one place, apart from the product.

Every module here exists because a Triton release the kit runs (the PyPI server: 2.51) has a defect; each
module's docstring names the upstream issue, the symptom, the first release with the fix and the test that
reproduces it. The registry (`defects`) says which release fixed what:

    from resnet18_kit.upstream import needs, workarounds
    needs("grpc-cancellation", "2.51.0")  # True: serve puts its gRPC guard in front
    workarounds("2.72.0")                  # only the defects no release has fixed

  seam             the only names the product imports: `switches` (which workarounds a release gets),
                   `ServerHelpers` (what runs beside one tritonserver), `banner`, the supervisor's watches
  defects          the registry: `Defect` per defect, `needs`, `workarounds`, the ready banner's line
  grpc_guard       the gRPC front end that never passes a cancellation on (grpc-cancellation), the
                   `resnet18-kit grpc-guard` process; guard_process starts and stops it; guard_requests
                   rewrites a request on its way (its timeout; every output of a cached model)
  cancel_marks     where the guard marks a request whose client went, for the Python models to skip it
  admission        a stop that unloads the models before SIGTERM (keep-alive-stop)
  dead_stub        which Python-backend stub died, for the supervisor's restart (dead-stub)
  overload         the refusal warning read from the queue metrics

The product calls it only through `seam` (server.embedded, server.supervisor, server.__main__); the wing
imports only the product's foundations (server.config, server.resources, observe), never what runs it.
"""
from resnet18_kit.upstream.defects import DEFECTS, Defect, banner_line, needs, parse_version, workarounds

__all__ = ["DEFECTS", "Defect", "banner_line", "needs", "parse_version", "workarounds"]
