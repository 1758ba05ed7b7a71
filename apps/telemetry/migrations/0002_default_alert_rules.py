"""Data migration: the fleet-default alert rules (seeds' GPU-fleet thresholds, KV-transfer errors)."""

from django.db import migrations

from apps.telemetry.alerts import DEFAULT_RULES, create_default_rules


def create_defaults(apps, schema_editor):
    create_default_rules(apps.get_model("telemetry", "AlertRule"))


def remove_defaults(apps, schema_editor):
    AlertRule = apps.get_model("telemetry", "AlertRule")
    AlertRule.objects.filter(pool=None, name__in=[r["name"] for r in DEFAULT_RULES]).delete()


class Migration(migrations.Migration):
    dependencies = [("telemetry", "0001_initial")]

    operations = [migrations.RunPython(create_defaults, remove_defaults)]
