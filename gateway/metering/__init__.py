"""What happens after admission: the request's life until its one settlement (and usage event)."""
