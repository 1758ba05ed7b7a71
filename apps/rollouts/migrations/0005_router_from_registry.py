"""``RolloutPlan.router_url`` (free text) becomes ``router``, a reference to the admin's router registry.

Existing plans: a ``router_url`` that is a valid router base URL (http(s)://host[:port]) is registered as a
router named ``migrated-<n>`` in the cluster of the plan's first pool (one per distinct URL) and referenced;
anything else (``file://``, junk, a path) is dropped and the plan waits on replica readiness only. An admin
reviews ``/api/v1/routers/`` after upgrading (README, "Security").
"""

import django.db.models.deletion
from django.core.exceptions import ValidationError
from django.db import migrations, models


def move_router_urls(apps, schema_editor):
    from apps.fleet.validators import validate_router_url

    plan_model = apps.get_model("rollouts", "RolloutPlan")
    router_model = apps.get_model("fleet", "Router")
    by_url = {}
    for plan in plan_model.objects.exclude(router_url="").order_by("pk"):
        url = plan.router_url.strip().rstrip("/")
        pool = plan.pools.order_by("pk").first()
        try:
            validate_router_url(url)
        except ValidationError:
            continue
        if pool is None:
            continue
        if url not in by_url:
            by_url[url] = router_model.objects.create(name=f"migrated-{len(by_url) + 1}", cluster_id=pool.cluster_id,
                                                      url=url)
        plan.router = by_url[url]
        plan.save(update_fields=["router"])


class Migration(migrations.Migration):

    dependencies = [
        ('fleet', '0006_router_registry'),
        ('rollouts', '0004_typed_phase_and_progress'),
    ]

    operations = [
        migrations.AddField(
            model_name='rolloutplan',
            name='router',
            field=models.ForeignKey(blank=True, help_text='The registered router fronting these pools (admin registry, /api/v1/routers/; in a cluster of one of the pools); a step counts as applied once its /ready reports the new routing table version. Empty: replica readiness only (replica ratio). Replaces router_url (free text).', null=True, on_delete=django.db.models.deletion.PROTECT, related_name='rollout_plans', to='fleet.router'),
        ),
        migrations.RunPython(move_router_urls, migrations.RunPython.noop),
        migrations.RemoveField(
            model_name='rolloutplan',
            name='router_url',
        ),
    ]
