"""The gRPC health check, for container health checks and scripts (no torch, a fraction of a second).

    python -m quantserve.client.health [--target 127.0.0.1:50051] [--service quantserve.v1.Inference] [--timeout 3]
                             [--tls] [--ca-file ca.pem]

Exit 0 when the server answers SERVING; 1 when it answers anything else (NOT_SERVING while it drains) or
cannot be reached. One line on stdout says which.
"""

from __future__ import annotations

import argparse
import sys

SERVICE = "quantserve.v1.Inference"


def check(target: str, service: str = SERVICE, timeout: float = 3.0, tls: bool = False,
          ca_file: str | None = None) -> tuple[bool, str]:
    """(serving, what the server said or why it could not be asked)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from quantserve.client.transport_grpc import channel as open_channel
    from quantserve.client.types import Options

    with open_channel(Options(target, tls=tls or bool(ca_file), ca_file=ca_file)) as channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                           timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    return r.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m quantserve.client.health", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--service", default=SERVICE, help=f'default {SERVICE}; "" asks about the whole server')
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--tls", action="store_true")
    p.add_argument("--ca-file")
    a = p.parse_args(argv)
    ok, said = check(a.target, a.service, a.timeout, a.tls, a.ca_file)
    print(f"{a.target}: {said}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
