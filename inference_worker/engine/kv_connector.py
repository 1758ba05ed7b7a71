"""The KV connector seam: the one interface for KV that comes from or goes to outside the running batch.

Vocabulary and split from vLLM v1's ``KVConnectorBase_V1``: a **scheduler side** that says how
many of a request's tokens are available externally (``get_num_new_matched_tokens``), learns
which blocks were allocated for them (``update_state_after_alloc``) and sees a request finish
with its blocks still allocated (``request_finished``), and a **runner side** that loads KV into
the given blocks before the step's forward pass (``start_load_kv`` / ``wait_for_load``) and
saves a request's KV (``save_kv``). The PD hand-off (:mod:`~inference_worker.engine.kv_handoff`)
plugs in here; the KV tiers of part 2 plug into the same seam.

Threading: every method runs on the engine's thread, the only thread that writes engine tensors;
KV arriving on another thread is handed over as CPU tensors with the request (see
``PagedLLMEngine.add_prefilled_request``) and copied into blocks by ``start_load_kv``.

The scheduler holds the connector and never imports torch: this base class and
:class:`ExternalKV` are torch-free; implementations with tensors live next to the runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference_worker.engine.request import Request


@dataclass(frozen=True)
class ExternalKV:
    """KV a connector can provide for a request being admitted.

    Attributes:
        num_tokens: tokens after the request's computed ones whose KV the connector loads; the
            scheduler counts them as computed.
        first_positions: per KV-cache group, the first position the loaded KV covers (sliding
            groups receive only the window); blocks holding an earlier position are never
            registered in the prefix cache (a partly written block).
        load_async: the KV is not here yet (DualPath cold path: a tier read runs off the step loop); the
            scheduler parks the request, without blocks, until ``get_finished_loads`` names it, then asks
            again (``num_tokens`` and ``first_positions`` are unused).
        num_cached_tokens: tokens reported to the client as cached (a tier load: all of ``num_tokens``;
            a PD import: 0 here, the engine adds the prefill worker's hit).
    """

    num_tokens: int
    first_positions: tuple[int, ...]
    load_async: bool = False
    num_cached_tokens: int = 0


class KVConnector:
    """Base connector: no external KV (every method is a no-op). Subclasses override what they use."""

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalKV | None:
        """KV available outside the engine for ``request`` beyond ``num_computed_tokens``, or None."""
        return None

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 external: ExternalKV) -> None:
        """Blocks were allocated for ``external``: ``block_ids`` is the request's table per group."""

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> None:
        """``request`` finished or was aborted; its blocks are still allocated and freed right after."""

    def get_finished_loads(self) -> set[str]:
        """Ids of parked requests (``load_async``) whose KV is now ready or whose load failed (called each step)."""
        return set()

    def wait_for_any_load(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` seconds for an async load to finish (an idle engine with parked requests)."""

    # ---- runner side ---------------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Start copying the KV of requests admitted this step into their blocks (before the forward)."""

    def wait_for_load(self) -> None:
        """Return once every load started by ``start_load_kv`` is in the cache."""

    def save_kv(self, request: Request, block_ids: tuple[list[int], ...]) -> None:
        """Copy the KV ``request`` holds in ``block_ids`` out of the cache (called from ``request_finished``)."""
