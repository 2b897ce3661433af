"""The harness of the tests and the benchmarks, kept out of the product package: spokes with
the test policy, CheckRequests as Envoy sends them, an OTLP receiver, mixed traffic and the
invariants it must leave true. What `gateway dev` needs too (starting a spoke, publishing
a policy, waiting for it, reading the usage topic) is in devspoke, and used from here."""
