"""Admission: RPS (GCRA), concurrency leases and token windows over three tiers, at once."""
