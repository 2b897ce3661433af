"""The policy operators and the hub write: schema (what is valid), runtime model (fast)."""
