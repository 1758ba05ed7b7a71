"""REST API of rollouts: ``/api/v1/rollouts/``."""
