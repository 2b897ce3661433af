"""Envoy's side of the gateway, as code: the bootstrap (bootstrap.py), the ext_authz and
ext_proc filters (filters.py), Envoy-fed metering's filters and record (metering.py), the
Lua filter (lua/), and the typed-message → YAML glue (plain.py).

Not named `envoy`: that is the top-level package of Envoy's protobufs (xds-protos).
"""
