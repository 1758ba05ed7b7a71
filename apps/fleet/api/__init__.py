"""REST API of the fleet: clusters, cluster links and pools (with the scale action)."""
