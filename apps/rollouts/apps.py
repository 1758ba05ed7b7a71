"""App config for :mod:`apps.rollouts`: registers the pool hold (a pool in an active rollout keeps its
model version and cluster and cannot be deleted; :mod:`apps.fleet.holds`) and the ``rollout.state`` broadcast of
every saved plan (:mod:`apps.rollouts.broadcast`)."""

from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "apps.rollouts"
    label = "rollouts"
    verbose_name = "Rollouts"

    def ready(self) -> None:
        from django.db.models.signals import post_save

        from apps.fleet.holds import pool_hold_register
        from apps.rollouts.broadcast import rollout_saved
        from apps.rollouts.models import RolloutPlan
        from apps.rollouts.selectors import rollout_active_for_pool

        post_save.connect(rollout_saved, sender=RolloutPlan, dispatch_uid="rollouts.rollout_state")

        pool_hold_register("rollouts", lambda pool: None if rollout_active_for_pool(pool=pool) is None
                           else "an active rollout")
