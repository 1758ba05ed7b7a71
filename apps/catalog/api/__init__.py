"""REST API of the catalog: ``/api/v1/model-versions/``."""
