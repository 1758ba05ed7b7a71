"""Pool worker credentials (issue 19): every pool gets its own token, existing pools included."""

import secrets

from django.db import migrations, models

import apps.fleet.models


def give_every_pool_a_token(apps, schema_editor):
    """One fresh token per existing pool (a column default would give them all the same one)."""
    pool = apps.get_model("fleet", "Pool")
    for row in pool.objects.filter(worker_token="").only("pk"):
        row.worker_token = secrets.token_urlsafe(32)
        row.save(update_fields=["worker_token"])


class Migration(migrations.Migration):

    dependencies = [
        ('fleet', '0007_cluster_production'),
    ]

    operations = [
        migrations.AddField(
            model_name='pool',
            name='worker_token',
            field=models.CharField(default='', editable=False, max_length=64),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name='pool',
            name='worker_token_previous',
            field=models.CharField(blank=True, default='', editable=False,
                                   help_text='The token before the last rotation, still accepted.', max_length=64),
        ),
        migrations.RunPython(give_every_pool_a_token, migrations.RunPython.noop),
        migrations.AlterField(
            model_name='pool',
            name='worker_token',
            field=models.CharField(default=apps.fleet.models.new_worker_token, editable=False,
                                   help_text="Bearer secret the pool's workers require (never shown).", max_length=64),
        ),
    ]
