"""The billing side of the usage topic: the reference consumer, reports and reconciliation."""
