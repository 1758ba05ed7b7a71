"""Cross-cutting API plumbing: versioned router, health probe, error mapping, idempotency, pagination."""
