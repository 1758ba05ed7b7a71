"""App config for :mod:`apps.fleet`: feeds telemetry's direct scrape from the observed ``Replica`` rows."""

from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "apps.fleet"
    label = "fleet"
    verbose_name = "Fleet"

    def ready(self) -> None:
        from apps.fleet.selectors import replica_endpoints
        from apps.telemetry.endpoints import set_endpoint_provider

        set_endpoint_provider(replica_endpoints)
