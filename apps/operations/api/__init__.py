"""REST API of operations: ``/api/v1/actions/`` (read-only plus retry and cancel)."""
