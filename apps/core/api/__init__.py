"""The versioned REST API router (``/api/v1/``)."""
