"""Ferry's Django apps, one concern each, in layers that import only downwards.

Layers, bottom to top (``LAYERS``; ``apps/core/tests/test_layers.py`` fails naming file:line when a
module imports from a layer above its own, function-local imports included)::

    controlplane   the Django project: settings, urls, asgi (+ websocket_urls), the Celery app
    setup          demo fleet, ferry_setup / ferry_demo, the ``make run`` launcher
    dashboard      pages and Channels consumers
    rollouts       decides; changes pool tracks only through operations' services
    planning       profiles and capacity plans; applies a plan through operations' services
    operations     every verb that changes the world: Actions, pool scale/delete, replica logs,
                   reconcile, autoscaler
    orchestrators  backends (Kubernetes, local agent); no models
    telemetry      metric sources, signals, alerts, history; reads fleet
    catalog fleet  pure state: model versions; clusters, links, pools, tracks, observed replicas,
                   field validation, the routing table's content
    core accounts  errors, pagination, idempotency keys; users and roles

Apps on one layer may import each other. A lower app that needs an answer only a higher app has
(is this pool in an active rollout?) asks a check the higher app registers at startup
(``apps.fleet.holds``) rather than importing it.
"""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("core", "accounts"),
    ("catalog", "fleet"),
    ("telemetry",),
    ("orchestrators",),
    ("operations",),
    ("rollouts", "planning"),
    ("dashboard",),
    ("setup",),
)
"""The apps under ``apps/``, bottom layer first; the project package ``controlplane`` sits above them all."""

PROJECT = "controlplane"
