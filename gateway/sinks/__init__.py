"""Where usage events go: a durable local spool first, then Kafka (or a JSONL file)."""
