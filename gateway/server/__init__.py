"""gRPC and HTTP adapters: the only place that knows protos, Envoy and grpc.aio."""
