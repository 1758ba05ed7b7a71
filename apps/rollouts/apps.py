"""App config for :mod:`apps.rollouts`: registers the pool hold (a pool in an active rollout keeps its
model version and cluster and cannot be deleted; :mod:`apps.fleet.holds`)."""

from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "apps.rollouts"
    label = "rollouts"
    verbose_name = "Rollouts"

    def ready(self) -> None:
        from apps.fleet.holds import pool_hold_register
        from apps.rollouts.selectors import rollout_active_for_pool

        pool_hold_register("rollouts", lambda pool: None if rollout_active_for_pool(pool=pool) is None
                           else "an active rollout")
