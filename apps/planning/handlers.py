"""The ``pool.profile`` Action handler: a bounded sweep on one ready replica of the pool, fitted and stored.

Failures are recorded on the Action with the reason and ``retryable=True`` (retry it from the audit log or the
page): no ready replica, or a worker error during the sweep (:class:`apps.planning.profiling.SweepError`).
"""

from __future__ import annotations

from django.core.exceptions import ValidationError

from apps.fleet.models import Pool
from apps.operations.handlers import ActionError, register
from apps.operations.models import Action
from apps.operations.services import action_log_append
from apps.planning import profiling, services
from apps.planning.models import Profile


@register(services.POOL_PROFILE)
def pool_profile_handler(action: Action) -> None:
    """Profile the Action's pool on its first ready replica (by name) and store a ``measured`` profile (a decode or
    co-located pool's with its prefill measured while decoding: :mod:`apps.planning.profiling`).

    Raises:
        ActionError: (not retryable) the pool is gone; (retryable) no ready replica, the sweep failed, or the
            points could not be fitted (the message says why).
    """
    pool = action.pool
    if pool is None:
        raise ActionError("the pool no longer exists", retryable=False)
    replica = pool.observed_replicas.filter(ready=True, alive=True).exclude(endpoint="").order_by("name").first()
    if replica is None:
        raise ActionError(f"pool {pool} has no ready replica to profile; scale it up or wait for one",
                          retryable=True)
    params = action.params
    vocab = int(pool.model_version.architecture.get("vocab_size", 32000))
    sweep = profiling.WorkerSweep(replica.endpoint, pool.worker_token, vocab_size=vocab)
    action_log_append(action_id=action.pk, message=f"profiling replica {replica.name} at {replica.endpoint}")
    try:
        found = sweep.run(lengths=params["lengths"], batch_sizes=params["batch_sizes"],
                          max_new_tokens=params["max_new_tokens"],
                          colocated=pool.role in (Pool.Role.DECODE, Pool.Role.COLOCATED))
    except profiling.SweepError as exc:
        raise ActionError(f"replica {replica.name}: {exc}", retryable=True) from exc
    message = ("prefill " + ", ".join(f"{n} tok {s * 1000:.1f} ms" for n, s in found.prefill_points)
               + "; decode step " + ", ".join(f"B={b} {s * 1000:.1f} ms" for b, s in found.decode_points))
    if found.colocated_prefill_points:
        message += "; prefill while decoding " + ", ".join(f"{n} tok {s * 1000:.1f} ms"
                                                           for n, s in found.colocated_prefill_points)
    action_log_append(action_id=action.pk, message=message)
    try:
        profile = services.profile_create(
            model_version=pool.model_version, pool_kind=pool.role, hardware_label=params["hardware_label"],
            source=Profile.Source.MEASURED, prefill_points=[list(p) for p in found.prefill_points],
            decode_points=[list(p) for p in found.decode_points], pool=pool,
            colocated_prefill_points=[list(p) for p in found.colocated_prefill_points])
    except ValidationError as exc:
        # Measurement noise (a loaded machine) can flatten the decode curve: measuring again may succeed.
        named = exc.message_dict.items() if hasattr(exc, "error_dict") else [("points", exc.messages)]
        reasons = "; ".join(f"{name}: {' '.join(messages)}" for name, messages in named)
        raise ActionError(f"the measured points could not be fitted: {reasons}", retryable=True) from exc
    action_log_append(action_id=action.pk, message=f"stored profile #{profile.pk}")
