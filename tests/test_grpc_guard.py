"""The gRPC guard (resnet18_kit/upstream/grpc_guard.py) in front of an upstream that is not listening yet, as
when `serve` starts, a container is re-created or the supervisor restarts tritonserver: the guard listens
first, so clients reach it while nothing answers behind it. A stand-in upstream (KServe v2's ServerLive only)
keeps tritonserver out of it: the fast tier runs it.
"""
from __future__ import annotations

import time
from concurrent import futures

import grpc
from tritonclient.grpc import service_pb2

from resnet18_kit.server.config import free_ports
from resnet18_kit.upstream.guard_process import GrpcGuard

SERVICE = "inference.GRPCInferenceService"


def stand_in_upstream(port: int) -> grpc.Server:
    """A gRPC server on 127.0.0.1:`port` answering ServerLive with live=true (the method the test calls)."""
    handler = grpc.unary_unary_rpc_method_handler(
        lambda request, context: service_pb2.ServerLiveResponse(live=True),
        request_deserializer=service_pb2.ServerLiveRequest.FromString,
        response_serializer=service_pb2.ServerLiveResponse.SerializeToString)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {"ServerLive": handler})])
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def live_through(channel: grpc.Channel) -> bool:
    """ServerLive through the guard: True when answered, False on UNAVAILABLE (nothing behind it)."""
    call = channel.unary_unary(f"/{SERVICE}/ServerLive",
                               request_serializer=service_pb2.ServerLiveRequest.SerializeToString,
                               response_deserializer=service_pb2.ServerLiveResponse.FromString)
    try:
        return call(service_pb2.ServerLiveRequest(), timeout=2.0).live
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        return False


def test_the_guard_forwards_within_a_second_of_its_upstream_listening_after_clients_called_into_the_gap(tmp_path):
    """Clients call for 6 s while nothing listens behind the guard (each call refused with UNAVAILABLE); then
    the upstream starts. gRPC's default reconnect backoff (1 s, x1.6 per try) would put the guard's next try
    up to 4 s later; its own backoff (at most 0.5 s) answers within a second."""
    guard_port, upstream_port = free_ports(2)
    guard = GrpcGuard("127.0.0.1", guard_port, f"127.0.0.1:{upstream_port}", log_path=tmp_path / "guard.log")
    guard.start()
    upstream = None
    try:
        with grpc.insecure_channel(f"127.0.0.1:{guard_port}") as channel:
            refused_until = time.monotonic() + 6.0
            while time.monotonic() < refused_until:
                assert not live_through(channel)
                time.sleep(0.05)
            upstream = stand_in_upstream(upstream_port)
            listening = time.monotonic()
            while not live_through(channel):
                assert time.monotonic() - listening < 10.0, "the guard never reached its upstream"
                time.sleep(0.02)
            waited_s = time.monotonic() - listening
        assert waited_s < 1.0, f"first answer {waited_s:.1f} s after the upstream listened"
    finally:
        if upstream is not None:
            upstream.stop(grace=None)
        assert guard.stop(grace_s=1.0) == 0
