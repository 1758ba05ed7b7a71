"""Prefill/decode disaggregation in the worker: the prefill hand-off endpoint and the decode side.

Flow of one request the router sends to a decode worker with ``X-Ferry-Prefill-Endpoint: <URL>``:

1. decode: ``receiver.expect(rid)``, then ``POST <URL>/internal/prefill`` with the prompt token ids,
   the sampling options and its KV receiver's address; the body is signed with the per-link secret
   (``X-Ferry-KV-Signature``: hex HMAC-SHA256 of the body), so only a decode worker holding the link
   secret can make a prefill worker compute and send;
2. prefill: runs the prefill on its engine, samples the first token, copies the KV the next decode
   step reads out of its paged cache (N tokens for full layers, the last min(N, W-1) for sliding
   ones), frees the request's blocks, sends the KV with :class:`~inference_worker.kv_transfer.transport.KVSender`
   (keyed-BLAKE3 MAC, optional bandwidth cap) and answers with the first token, timings, byte counts and
   ``num_cached_tokens`` (the prompt tokens its prefix cache spared it);
3. decode: waits for the payload (``--kv-timeout`` seconds at most), checks it carries this worker's
   model version id, weights sha256 and the prompt's token count, writes it into its own paged cache
   and continues decoding in the normal batch. The request reports the prefill worker's
   ``num_cached_tokens`` as its ``cached_tokens`` (and ``X-Ferry-Cached-Tokens``): the prompt tokens not
   computed for it; an answer without the field (an older prefill worker) counts as 0.

Any failure (bad checksum, truncated, wrong key, another version's KV, timeout, late, prefill worker
unreachable or dead) is counted under its reason on ``ferry_kv_transfer_total`` by the side that saw
it; the decode worker then prefills the prompt itself (``--kv-recompute-on-failure``, the default,
counted on ``ferry_kv_recompute_total{reason}``) or fails the request with a 502 OpenAI error
``kv_transfer_failed``. The decode never runs on KV that did not verify, and never waits longer than
the timeout.

A prefill worker that *refuses* the prompt with a 400 or 413 (it is over that worker's ``max_model_len``,
KV cache or body cap) has not failed: it is :class:`PrefillRefused`, counted on no KV transfer series.
With recompute on, the decode worker (whose own limits the prompt passed) prefills it itself, counted on
``ferry_kv_recompute_total{reason="capacity"}``; with recompute off the client gets a 400 with the prefill
worker's reason (code ``context_length_exceeded`` or ``invalid_prompt``), counted ``client_error``, never a
502 the router would retry or its circuit breaker would count. The KV receiver's port is printed at start-up and reported by ``GET /health``
(``kv_port``).

Sampling: the first token is sampled on the prefill worker with the request's temperature, top_p,
top_k and seed, the rest on the decode worker with its own generator; greedy output is the same as
colocated, a seeded non-greedy request is reproducible per path but not token-identical to the
colocated path. Each of ``n`` choices is handed off separately.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from inference_worker import http_headers
from inference_worker.kv_transfer.errors import ConnectionFailed, KVTransferError, ProtocolVersionMismatch
from inference_worker.kv_transfer.receiver import KVReceiver
from inference_worker.kv_transfer.recorder import RECEIVE, SEND, TransferRecorder
from inference_worker.kv_transfer.transport import KVSender
from inference_worker.kv_transfer.wire import encode_kv
from inference_worker.server.engine_loop import SeqUpdate
from inference_worker.server.errors import OpenAIError
from inference_worker.server.pd_faults import RAW_MODES, TEST_HEADER_ENV, parse_fault, send_faulty_frame
from inference_worker.server.signing import sign, verify_signature
from inference_worker.server.streaming import CLIENT_ERROR_CODES
from inference_worker.tracing import RequestSpan, Timeline

logger = logging.getLogger(__name__)

PREFILL_PATH = "/internal/prefill"


@dataclass
class PDSettings:
    """Disaggregation options of one worker (``serve --kv-*``)."""

    role: str
    link_secret: bytes
    model_version_id: str
    kv_host: str = "127.0.0.1"
    """Decode: address the KV receiver binds and tells the prefill worker to connect to."""
    kv_port: int = 0
    """Decode: KV receiver port (0: any free port, reported by /health)."""
    bandwidth_gbps: float | None = None
    """Prefill: cap on each outgoing KV link, Gbit/s (None: uncapped)."""
    timeout_s: float = 30.0
    """Decode: longest wait for the KV of one request; prefill: connect/IO timeout of a send."""
    recompute_on_failure: bool = True
    compression: str = "none"
    fault_kv: str | None = None
    """Prefill: a KV fault to rehearse (``--fault-kv``, see :mod:`.pd_faults`); None: no fault."""
    fault_header: bool = False
    """TEST ONLY: honour the per-request ``FAULT_KV`` header (decode: forward it; prefill: ``--fault-kv
    header``). Set from ``FERRY_TEST_KV_FAULT_HEADER=1``; off by default (see :mod:`.pd_faults`)."""


def max_prefill_body_bytes(max_model_len: int) -> int:
    """Largest ``/internal/prefill`` body accepted: a ``max_model_len`` prompt of token ids plus the fields.

    The decode side sends ``json.dumps`` of the token ids: at most 10 digits (ids below 2**32) plus ``", "``
    per token, 12 bytes; 64 KiB covers the request id, KV host/port, model version id and sampling options.
    """
    return 12 * max_model_len + 65_536


class KVHandoffFailed(Exception):
    """The KV of one request could not be obtained; ``reason`` is a ``ferry_kv_transfer_total`` reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class PrefillRefused(KVHandoffFailed):
    """The prefill worker answered 400 or 413: the prompt is over its limits (the client's error, not a failure).

    ``code`` is the OpenAI error code the client gets: the prefill worker's ``context_length_exceeded`` or
    ``invalid_prompt``, and ``context_length_exceeded`` for a 413 (a token-id body over its cap is a prompt over
    its ``max_model_len``).
    """

    def __init__(self, status: int, code: str, message: str):
        super().__init__("capacity", f"the prefill worker refused the prompt ({status}): {message}")
        self.status, self.code = status, code


def prefill_answer_failure(response: httpx.Response) -> KVHandoffFailed | None:
    """What a prefill worker's ``/internal/prefill`` answer means for the hand-off: None for a 200;
    :class:`PrefillRefused` for a 400 or 413 (the prompt is over that worker's limits: the client's error);
    else a :class:`KVHandoffFailed` with the transfer reason of a 502 ``kv_transfer_failed``, ``protocol`` for
    any other status (401 signature, 409 another model version, 5xx)."""
    if response.status_code == 200:
        return None
    try:
        error = response.json()["error"]
        reason = error.get("param") if error.get("code") == "kv_transfer_failed" else None
        code, message = error.get("code"), error.get("message", "")
    except (ValueError, KeyError, TypeError, AttributeError):
        reason, code, message = None, None, response.text[:500]
    if response.status_code in (400, 413):
        return PrefillRefused(response.status_code, code if code in CLIENT_ERROR_CODES else "context_length_exceeded",
                              message)
    return KVHandoffFailed(reason or "protocol", f"prefill worker answered {response.status_code}: {message}")


class PrefillAbandoned(Exception):
    """The decode worker hung up while its prefill was computing; the prefill was aborted in the engine."""


def prefill_cached_tokens(answer: dict, num_prompt_tokens: int) -> int:
    """The prefill worker's prefix-cache hit in its ``/internal/prefill`` answer: ``num_cached_tokens``, 0 when
    absent (a prefill worker older than the field).

    Raises:
        KVHandoffFailed: reason ``protocol``: the value is not an integer in ``[0, num_prompt_tokens)`` (the
            last prompt token is always computed).
    """
    value = answer.get("num_cached_tokens", 0)
    if type(value) is not int or not 0 <= value < num_prompt_tokens:
        raise KVHandoffFailed("protocol", f"num_cached_tokens {value!r} is not an integer in [0, {num_prompt_tokens}) "
                              f"for a prompt of {num_prompt_tokens} tokens")
    return value


class PDService:
    """The disaggregation state of one worker: KV receiver (decode) or senders (prefill).

    Args:
        settings: the options.
        metrics: the worker's :class:`~inference_worker.metrics.WorkerMetrics`.

    Raises:
        ValueError: ``settings.fault_kv`` is not a fault mode, or is ``header`` without ``settings.fault_header``.
    """

    def __init__(self, settings: PDSettings, metrics):
        self.settings = settings
        self.metrics = metrics
        self.recorder = TransferRecorder(metrics.kv_transfer, metrics.identity)
        self.fault = parse_fault(settings.fault_kv)
        if self.fault is not None and self.fault[0] == "header" and not settings.fault_header:
            raise ValueError(f"--fault-kv header is a test hook: it needs {TEST_HEADER_ENV}=1 in the environment")
        self.receiver: KVReceiver | None = None
        self._senders: dict[tuple[str, int], KVSender] = {}
        self._client: httpx.AsyncClient | None = None
        self.layout = None
        self.weights_sha256 = "0" * 64

    # ---- start-up -------------------------------------------------------------------------
    async def start(self) -> None:
        """Decode role: start the KV receiver (on the server's event loop)."""
        if self.settings.role != "decode":
            return
        self.receiver = await KVReceiver(
            link_secret=self.settings.link_secret, model_version_id=self.settings.model_version_id,
            weights_sha256=self.weights_sha256, layout=self.layout, host=self.settings.kv_host,
            port=self.settings.kv_port, read_timeout_s=self.settings.timeout_s, recorder=self.recorder).start()
        print(f"KV receiver listening on {self.settings.kv_host}:{self.receiver.port}", flush=True)
        logger.info("KV receiver listening on %s:%d", self.settings.kv_host, self.receiver.port)

    def bind_model(self, kv_layout, weights_sha256: str, max_num_tokens: int | None = None) -> None:
        """Adopt the loaded model's KV layout, weights hash (KV is only valid for these weights) and the context a
        request can use (tokens): the KV receiver refuses frames beyond that geometry before reading them."""
        self.layout, self.weights_sha256 = kv_layout, weights_sha256
        if self.receiver is not None:
            self.receiver.layout, self.receiver.weights_sha256 = kv_layout, weights_sha256
            self.receiver.max_num_tokens = max_num_tokens

    @property
    def kv_port(self) -> int | None:
        """The KV receiver's port (decode role, once started)."""
        return None if self.receiver is None else self.receiver.port

    # ---- prefill role -----------------------------------------------------------------------
    async def handle_prefill(self, model, raw: bytes, headers, abandoned: asyncio.Future | None = None,
                             timeline: Timeline | None = None) -> dict:
        """Serve ``POST /internal/prefill``: prefill, send the KV, return the first token.

        ``timeline`` (optional) gets the request id and the phases ``prefill.queue`` (until the engine admitted
        the prompt), ``prefill.compute``, ``prefill.encode`` (the KV frame) and ``kv.send`` (``raw_bytes``,
        ``wire_bytes``, ``link_cap_wait_ms``); the answer carries ``queue_seconds`` and ``cap_wait_seconds`` too.

        ``abandoned`` completes when the decode worker hangs up (its client left): a prefill still computing
        is then aborted in the engine and :class:`PrefillAbandoned` raised. Once the KV is computed it is sent
        whatever happens, so a send failure or a late KV is still counted as such.

        Raises:
            PrefillAbandoned: ``abandoned`` completed while the prefill was computing (aborted in the engine).
            OpenAIError: 401 bad signature, 400 bad body (or, test hook only, an unknown fault named in the
                ``FAULT_KV`` header), 409 another model version, 502 the KV
                could not be delivered (``error.reason`` is the transfer failure reason).
        """
        verify_signature(self.settings.link_secret, raw, headers.get(http_headers.KV_SIGNATURE))
        try:
            body = json.loads(raw)
            rid, prompt = str(body["request_id"]), [int(t) for t in body["prompt_token_ids"]]
            host, port, sampling = str(body["kv_host"]), int(body["kv_port"]), dict(body.get("sampling") or {})
        except (ValueError, KeyError, TypeError) as exc:
            raise OpenAIError(400, f"invalid prefill request: {exc!r}") from None
        if timeline is not None:
            timeline.request_id = rid
        if body.get("model_version_id") != self.settings.model_version_id:
            raise OpenAIError(409, f"this prefill worker serves model version {self.settings.model_version_id!r}, "
                              f"not {body.get('model_version_id')!r}", code="version_mismatch")
        fault = self.fault
        if fault is not None and fault[0] == "header":
            try:
                fault = parse_fault(headers.get(http_headers.FAULT_KV))
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param=http_headers.FAULT_KV) from None
        # a prompt over this worker's context or cache is the caller's error (400), decided before the engine sees it
        model.check_kv_capacity(len(prompt), 1, param="prompt_token_ids")
        if len(prompt) + 1 > model.max_model_len:
            raise OpenAIError(400, f"the prompt has {len(prompt)} tokens; with its first output token it exceeds "
                              f"this prefill worker's context of {model.max_model_len} tokens",
                              param="prompt_token_ids", code="context_length_exceeded")
        params = model.make_sampling_params(max_tokens=1, ignore_eos=True, **{
            k: sampling[k] for k in ("temperature", "top_p", "top_k", "seed") if sampling.get(k) is not None})
        started, started_ns = time.perf_counter(), time.time_ns()
        export = model.engine_loop.prefill_export(f"prefill-{rid}", prompt, params)
        if abandoned is not None:
            await asyncio.wait({export, abandoned}, return_when=asyncio.FIRST_COMPLETED)
        if not export.done():  # the decode worker went away (its client did): stop the prefill
            model.engine_loop.abort(f"prefill-{rid}")
            export.cancel()
            raise PrefillAbandoned(f"the decode worker hung up during the prefill of {rid!r}")
        try:
            first, num_tokens, kv, num_cached = await export
        except ValueError as exc:
            raise OpenAIError(400, str(exc), code="invalid_prompt") from None
        prefill_s, computed_ns = time.perf_counter() - started, time.time_ns()
        admitted_ns = model.engine_loop.pop_export_admitted_ns(f"prefill-{rid}") or started_ns
        self.metrics.tokens(num_prompt_tokens=num_tokens)
        version = self.settings.model_version_id + ("-other" if fault and fault[0] == "wrong-version" else "")
        frame = encode_kv(request_id=rid, model_version_id=version, weights_sha256=self.weights_sha256,
                          layout=self.layout, num_tokens=num_tokens, kv=kv, compression=self.settings.compression)
        encoded_ns = time.time_ns()
        try:
            if fault and fault[0] == "delay":
                await asyncio.sleep(fault[1])
            if fault and fault[0] in RAW_MODES:
                try:
                    await send_faulty_frame(fault[0], frame, host=host, port=port,
                                            link_secret=self.settings.link_secret, timeout_s=self.settings.timeout_s)
                except KVTransferError as exc:
                    self.recorder.failure(SEND, exc.reason)
                    raise
                transfer_s = cap_wait_s = 0.0
            else:
                transfer_s, cap_wait_s = await self._sender(host, port).send_measured(frame)
        except KVTransferError as exc:
            raise OpenAIError(502, f"KV transfer to {host}:{port} failed ({exc.reason}): {exc}", type="server_error",
                              code="kv_transfer_failed", param=exc.reason) from None
        # the prefill worker sampled the request's first token: its TTFT is the prefill time; end to end adds the
        # KV transfer (the decode worker records the client-side TTFT of the whole request)
        self.metrics.observe_latency(ttft_s=prefill_s, e2e_s=prefill_s + transfer_s, num_output_tokens=1)
        queue_s = (admitted_ns - started_ns) / 1e9
        if timeline is not None:
            sent_ns = time.time_ns()
            timeline.add("prefill.queue", started_ns, admitted_ns)
            timeline.add("prefill.compute", admitted_ns, computed_ns, num_prompt_tokens=num_tokens,
                         num_cached_tokens=num_cached)
            timeline.add("prefill.encode", computed_ns, encoded_ns, compression=self.settings.compression)
            timeline.add("kv.send", encoded_ns, sent_ns, raw_bytes=frame.raw_bytes, wire_bytes=frame.wire_bytes,
                         link_cap_wait_ms=round(cap_wait_s * 1e3, 3))
            timeline.attributes.update(num_prompt_tokens=num_tokens, num_cached_tokens=num_cached)
        return {"request_id": rid, "first_token_id": first, "num_tokens": num_tokens, "prefill_seconds": prefill_s,
                "queue_seconds": queue_s, "transfer_seconds": transfer_s, "cap_wait_seconds": cap_wait_s,
                "raw_bytes": frame.raw_bytes, "wire_bytes": frame.wire_bytes,
                "layer_groups": frame.header["layer_groups"], "num_cached_tokens": num_cached}

    def _sender(self, host: str, port: int) -> KVSender:
        key = (host, port)
        if key not in self._senders:
            self._senders[key] = KVSender(host, port, link_secret=self.settings.link_secret,
                                          bandwidth_gbps=self.settings.bandwidth_gbps,
                                          connect_timeout_s=min(5.0, self.settings.timeout_s),
                                          io_timeout_s=self.settings.timeout_s, recorder=self.recorder)
        return self._senders[key]

    # ---- decode role ------------------------------------------------------------------------
    def remote_prefill_for(self, prefill_url: str, headers, timeline: Timeline | None = None,
                           span: RequestSpan | None = None) -> Any:
        """The ``Generation.remote_prefill`` callable for a request routed with a prefill endpoint.

        ``timeline``: the first choice's hand-off goes there (:meth:`_record_handoff`); ``span``: the request's
        span, whose ``traceparent`` the prefill request carries.
        """
        fault = headers.get(http_headers.FAULT_KV) if self.settings.fault_header else None
        pending = [timeline]

        async def run(engine_loop, request_id: str, prompt: list[int], params, sampling: dict,
                      updates: asyncio.Queue) -> None:
            record, pending[0] = pending[0], None  # only the first choice's hand-off is recorded
            await self._continue_remote(engine_loop, prefill_url, fault, request_id, prompt, params, sampling, updates,
                                        timeline=record, span=span)

        return run

    @staticmethod
    def _record_handoff(timeline: Timeline, started_ns: int, received_ns: int, answer: dict) -> None:
        """Phases of a remote prefill seen from the decode worker: ``kv.handoff`` (request sent to KV received; a
        span) and, for the slow-request timeline only (the prefill worker traces its own spans), the prefill
        worker's ``prefill.queue``, ``prefill.compute`` and ``kv.transfer`` from the durations it answered,
        placed back to back ending when the KV arrived (on this worker's clock: no clock skew between hosts)."""
        timeline.add("kv.handoff", started_ns, received_ns, raw_bytes=answer.get("raw_bytes", 0),
                     wire_bytes=answer.get("wire_bytes", 0))
        transfer_ns = int(float(answer.get("transfer_seconds", 0.0)) * 1e9)
        prefill_ns = int(float(answer.get("prefill_seconds", 0.0)) * 1e9)
        queue_ns = min(int(float(answer.get("queue_seconds", 0.0)) * 1e9), prefill_ns)
        end = received_ns
        for name, duration, attributes in (
                ("kv.transfer", transfer_ns, {"raw_bytes": answer.get("raw_bytes", 0),
                                              "wire_bytes": answer.get("wire_bytes", 0),
                                              "link_cap_wait_ms": round(float(answer.get("cap_wait_seconds", 0.0))
                                                                        * 1e3, 3)}),
                ("prefill.compute", prefill_ns - queue_ns, {"num_cached_tokens": answer.get("num_cached_tokens", 0)}),
                ("prefill.queue", queue_ns, {})):
            start = max(started_ns, end - duration)
            timeline.add(name, start, end, remote=True, **attributes)
            timeline.phases[-1].span = False
            end = start

    async def _continue_remote(self, engine_loop, prefill_url: str, fault: str | None, request_id: str,
                               prompt: list[int], params, sampling: dict, updates: asyncio.Queue, *,
                               timeline: Timeline | None = None, span: RequestSpan | None = None) -> None:
        started_ns = time.time_ns()
        try:
            first, payload, num_cached, answer = await self._fetch(prefill_url, fault, request_id, prompt, sampling,
                                                                   span=span)
            if timeline is not None:
                self._record_handoff(timeline, started_ns, time.time_ns(), answer)
        except KVHandoffFailed as exc:
            logger.warning("KV hand-off for %s failed (%s): %s", request_id, exc.reason, exc)
            if not self.settings.recompute_on_failure:
                if isinstance(exc, PrefillRefused):
                    updates.put_nowait(SeqUpdate(request_id, (), "", len(prompt), True, "error", str(exc), exc.code))
                    return
                updates.put_nowait(SeqUpdate(request_id, (), "", len(prompt), True, "error",
                                             f"KV transfer failed ({exc.reason}): {exc}", "kv_transfer_failed"))
                return
            self.metrics.kv_recompute(exc.reason)
            self.metrics.tokens(num_prompt_tokens=len(prompt))  # prefilled here after all
            engine_loop.submit(request_id, prompt, params, updates)
            return
        except asyncio.CancelledError:
            updates.put_nowait(SeqUpdate(request_id, (), "", len(prompt), True, "abort"))
            raise
        engine_loop.submit_prefilled(request_id, prompt, params, first, payload.layers, payload.first_positions,
                                     updates, num_cached_tokens=num_cached)

    async def _fetch(self, prefill_url: str, fault: str | None, request_id: str, prompt: list[int],
                     sampling: dict, span: RequestSpan | None = None):
        """Ask the prefill worker for ``request_id``'s KV; return ``(first_token_id, KVPayload, num_cached_tokens,
        answer)`` (``answer``: the prefill worker's JSON answer, with its timings and byte counts).

        ``num_cached_tokens``: the prefill worker's prefix-cache hit for the prompt (0 when its answer has
        no such field, as from a worker older than the field).

        Raises:
            KVHandoffFailed: with the failure reason (``protocol`` for a ``num_cached_tokens`` that is not an
                integer in ``[0, len(prompt))``); the receiver has given the request id up.
        """
        receiver, timeout_s = self.receiver, self.settings.timeout_s
        if receiver is None:
            raise KVHandoffFailed("connection", "this worker has no KV receiver (role is not decode)")
        if self._client is None:
            self._client = httpx.AsyncClient()
        body = json.dumps({"request_id": request_id, "prompt_token_ids": prompt, "sampling": sampling,
                           "kv_host": self.settings.kv_host, "kv_port": receiver.port,
                           "model_version_id": self.settings.model_version_id}).encode()
        headers = {http_headers.KV_SIGNATURE: sign(self.settings.link_secret, body), "Content-Type": "application/json"}
        if fault:
            headers[http_headers.FAULT_KV] = fault
        if span is not None:
            span.inject(headers)
        receiver.expect(request_id)
        http = asyncio.ensure_future(self._client.post(prefill_url.rstrip("/") + PREFILL_PATH, content=body,
                                                       headers=headers, timeout=timeout_s + 5.0))
        wait = asyncio.ensure_future(receiver.wait(request_id, timeout_s))
        ok = False
        try:
            pending = {http, wait}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if wait in done and wait.exception() is not None:
                    exc = wait.exception()
                    raise KVHandoffFailed(getattr(exc, "reason", "timeout"), str(exc))
                if http in done:
                    self._check_prefill_answer(http, prefill_url)
            answer = http.result().json()
            payload, first = wait.result(), int(answer["first_token_id"])
            ok = True
        finally:
            for task in (http, wait):
                if not task.done():
                    task.cancel()
            if not ok:
                receiver.give_up(request_id)
        if payload.num_tokens != len(prompt):
            self.recorder.failure(RECEIVE, ProtocolVersionMismatch.reason)
            raise KVHandoffFailed("protocol", f"KV for {payload.num_tokens} tokens, the prompt has {len(prompt)}")
        try:
            num_cached = prefill_cached_tokens(answer, len(prompt))
        except KVHandoffFailed:
            self.recorder.failure(RECEIVE, ProtocolVersionMismatch.reason)
            raise
        return first, payload, num_cached, answer

    def _check_prefill_answer(self, http: asyncio.Future, prefill_url: str) -> None:
        """Raise KVHandoffFailed unless the prefill worker's answer is a 200 (:class:`PrefillRefused` for a 400 or
        413: the prompt is over the prefill worker's limits)."""
        exc = http.exception()
        if exc is not None:
            if isinstance(exc, httpx.ConnectError):  # nothing was ever sent: the receiver saw nothing
                self.recorder.failure(RECEIVE, ConnectionFailed.reason)
            raise KVHandoffFailed("connection", f"prefill worker {prefill_url}: {exc!r}")
        failure = prefill_answer_failure(http.result())
        if failure is not None:
            raise failure

    async def close(self) -> None:
        """Stop the receiver and close the senders and the HTTP client."""
        if self.receiver is not None:
            await self.receiver.close()
        for sender in self._senders.values():
            await sender.close()
        if self._client is not None:
            await self._client.aclose()
