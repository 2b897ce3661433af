"""A Check server that stops after a given stage of the real handler, for bench_stages.py.

    python benchmarks/stage_server.py PORT STAGE POLICY_FILE REDIS_URL

Stages, each adding one piece of `AuthorizationService.Check` to the one before:
  floor     answer a constant OK (what grpc.aio costs, through our registration)
  parse     + read the CheckRequest (to_request)
  authorize + the authorization pipeline (key, body, ACL) with an admission that always allows
  answer    + the real answer and metrics: the whole Check, minus the store
  redis     the whole Check with Redis admission, as `gateway serve` runs it
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import uvloop
from envoy.service.auth.v3 import external_auth_pb2 as pb

from gateway.authz.check import Check
from gateway.authz.engine import Authorizer
from gateway.clock import SystemClock
from gateway.limits.ledger import Ledger
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.resp import RespClient
from gateway.limits.types import AdmitRequest, Admitted, Verdict
from gateway.policy.holder import FilePolicySync, PolicyHolder
from gateway.server.authz_service import AuthorizationService, to_request

STAGES = ("floor", "parse", "authorize", "answer", "redis")
OK = b"\x0a\x00\x1a\x00"  # CheckResponse{status: {}, ok_response: {}}


class AlwaysAllow:
    async def admit(self, req: AdmitRequest) -> Verdict:
        return Admitted()

    async def close(self) -> None:
        pass


async def main(port: int, stage: str, policy_file: str, redis_url: str) -> None:
    holder = PolicyHolder()
    FilePolicySync(holder, Path(policy_file)).refresh()
    limiter = RedisLimiter(RespClient(redis_url), 30, 5) if stage == "redis" else AlwaysAllow()
    clock = SystemClock()
    ledger = Ledger(limiter, clock, 30, 5)  # type: ignore[arg-type]
    svc = AuthorizationService(Check(Authorizer(holder.get, limiter,  # type: ignore[arg-type]
                                                clock, ledger=ledger)))

    async def floor(request: pb.CheckRequest, context: grpc.aio.ServicerContext) -> bytes:
        return OK

    async def parse(request: pb.CheckRequest, context: grpc.aio.ServicerContext) -> bytes:
        to_request(request)
        return OK

    async def authorize(request: pb.CheckRequest, context: grpc.aio.ServicerContext) -> bytes:
        await svc.check.authorizer.check(to_request(request))
        return OK

    handler = {"floor": floor, "parse": parse, "authorize": authorize}.get(stage)
    if handler is not None:
        svc.Check = handler  # type: ignore[assignment,method-assign]
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1),
                                      ("grpc.http2.max_pings_without_data", 0)])
    svc.register(server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    port, stage, policy_file, redis_url = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    if stage not in STAGES:
        raise SystemExit(f"stage {stage!r}: one of {', '.join(STAGES)}")
    uvloop.run(main(port, stage, policy_file, redis_url))
