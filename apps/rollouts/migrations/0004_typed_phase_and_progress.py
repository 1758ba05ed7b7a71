"""``RolloutPlan.phase`` becomes an enum and replaces ``progress["mode"]`` (``RolloutProgress``).

Data: a row whose ``progress`` has ``mode`` gets the phase that mode implies when its phase is blank or not a
known value, and loses the ``mode`` key (``RolloutProgress.from_json`` also ignores it, so an unmigrated row
still loads). Reverse: the key is put back from the phase.
"""

from django.db import migrations, models

PHASES = ("", "steps", "finalizing", "preview", "smoke", "switched", "reverting")
PHASE_OF_MODE = {"canary": "steps", "finalize": "finalizing", "revert": "reverting", "preview": "preview",
                 "switched": "switched", "done": "switched"}
MODE_OF_PHASE = {"canary": {"steps": "canary", "finalizing": "finalize", "reverting": "revert"},
                 "blue_green": {"preview": "preview", "smoke": "preview", "steps": "preview",
                                "switched": "switched", "reverting": "revert"}}


def mode_to_phase(apps, schema_editor):
    RolloutPlan = apps.get_model("rollouts", "RolloutPlan")
    for plan in RolloutPlan.objects.filter(progress__has_key="mode"):
        mode = plan.progress.pop("mode")
        if plan.phase not in PHASES or (not plan.phase and plan.state in ("progressing", "paused")):
            plan.phase = PHASE_OF_MODE.get(mode, "")
        if plan.phase not in PHASES:
            plan.phase = ""
        plan.save(update_fields=["phase", "progress"])


def phase_to_mode(apps, schema_editor):
    RolloutPlan = apps.get_model("rollouts", "RolloutPlan")
    for plan in RolloutPlan.objects.exclude(progress={}):
        mode = MODE_OF_PHASE.get(plan.strategy, {}).get(plan.phase)
        if mode is not None:
            plan.progress["mode"] = mode
            plan.save(update_fields=["progress"])


class Migration(migrations.Migration):

    dependencies = [
        ("rollouts", "0003_rolloutplan_worker_args"),
    ]

    operations = [
        migrations.AlterField(
            model_name="rolloutplan",
            name="phase",
            field=models.CharField(blank=True, choices=[("", "none"), ("steps", "Steps"), ("finalizing", "Finalizing"), ("preview", "Preview"), ("smoke", "Smoke"), ("switched", "Switched"), ("reverting", "Reverting")], default="", editable=False, help_text="Where the controller is inside the state (e.g. preview, finalizing).", max_length=24),
        ),
        migrations.RunPython(mode_to_phase, phase_to_mode),
    ]
