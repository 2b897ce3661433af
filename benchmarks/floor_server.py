"""The floor for bench_authz: a grpc.aio Authorization server that answers every Check with
a constant OK, on uvloop like `gateway serve`. What a Check costs before any of our code.

    python benchmarks/floor_server.py PORT
"""

from __future__ import annotations

import sys

import grpc
import uvloop
from envoy.service.auth.v3 import external_auth_pb2 as pb
from envoy.service.auth.v3 import external_auth_pb2_grpc as pb_grpc
from google.rpc import status_pb2

OK = pb.CheckResponse(status=status_pb2.Status(code=0), ok_response=pb.OkHttpResponse())


class Constant(pb_grpc.AuthorizationServicer):
    async def Check(self, request: pb.CheckRequest,
                    context: grpc.aio.ServicerContext) -> pb.CheckResponse:
        return OK


async def main(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_AuthorizationServicer_to_server(Constant(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1])))
