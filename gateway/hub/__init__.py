"""The hub's contract (DESIGN §10): revisions down on llm.policy.v1, status up on
llm.gateway.status.v1. Pure rules (feed, fleet) apart from the Kafka I/O (topics)."""
