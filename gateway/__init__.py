"""Auth-and-metering sidecar for LLM serving: Envoy ext_authz + ext_proc."""

__version__ = "0.1.0"
