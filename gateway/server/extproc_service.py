"""ext_proc Process: follows each request to its end and settles it exactly once.

Envoy sends the ext_authz context as forwarded metadata on every message (trusted; the
request headers are not). The end of a request is certain only from end_of_stream; a
client disconnect or upstream reset just ends the gRPC stream, so settlement is in
`finally` and never awaits (envoy-protocol §0.5).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from gateway.metering.lifecycle import Lifecycle
from gateway.server import metrics

AUTHZ_NS = "envoy.filters.http.ext_authz"
ATTR_NS = "envoy.filters.http.ext_proc"

_CONTINUE = {
    "request_headers": ep.ProcessingResponse(request_headers=ep.HeadersResponse()),
    "request_body": ep.ProcessingResponse(request_body=ep.BodyResponse()),
    "request_trailers": ep.ProcessingResponse(request_trailers=ep.TrailersResponse()),
    "response_headers": ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
    "response_body": ep.ProcessingResponse(response_body=ep.BodyResponse()),
    "response_trailers": ep.ProcessingResponse(response_trailers=ep.TrailersResponse()),
}


class ExternalProcessorService(ep_grpc.ExternalProcessorServicer):
    def __init__(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle

    async def Process(
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ep.ProcessingResponse]:
        request_id = ""
        leased = False
        metrics.STREAMS_ACTIVE.inc()
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("request")
                if not request_id:
                    authz = msg.metadata_context.filter_metadata.get(AUTHZ_NS)
                    if authz is not None and authz.fields["leased"].bool_value:
                        request_id = authz.fields["request_id"].string_value
                        leased = bool(request_id)
                        if leased:
                            self.lifecycle.begin(request_id)
                yield _CONTINUE[kind]
        finally:
            metrics.STREAMS_ACTIVE.dec()
            if leased:
                self.lifecycle.end(request_id, None)
