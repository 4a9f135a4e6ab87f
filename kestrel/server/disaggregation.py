"""Prefill/decode disaggregation, the instances' side: `--kv-role prefill|decode`.

A request reaches a prefill instance with `kv_transfer_params: {"do_remote_decode": true}`
(vLLM's field): the instance computes every prompt token but the last, samples nothing, and
answers with the completion's usual shape plus `kv_transfer_params` naming the state it now
holds (`transfer_id`, `num_tokens`). It keeps that state, as bytes (`core/transfer.py`'s wire
format), until a decode instance fetches it from `GET /v1/kv_transfer/{transfer_id}` or
`--kv-transfer-timeout` seconds pass.

The same request then reaches a decode instance with `{"do_remote_prefill": true,
"remote_host", "remote_port", "transfer_id", "num_tokens"}`: it fetches the state over TCP,
the engine checks it against its own pools and imports it, computes the last prompt token
and generates as usual. `kestrel router` (server/router.py) sends each request to both.

Ownership: the engine's pages are freed as soon as a prefill request finishes (its state is
copied to host memory first); `TransferStore` owns the bytes from then until fetched or
expired; the decode instance's engine owns what it imports, like any request's state.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from kestrel.server.metrics import ServerMetrics
from kestrel.server.protocol import ApiError, bad_request

KV_ROLES = ("prefill", "decode")
logger = logging.getLogger("kestrel.server")
FETCH_TIMEOUT_SECONDS = 60.0


@dataclass(frozen=True)
class RemoteDecode:
    """This (prefill) instance computes the prompt and keeps its state for a decode instance."""


@dataclass(frozen=True)
class RemotePrefill:
    """This (decode) instance starts from state a prefill instance holds."""

    url: str  # the prefill instance's base URL
    transfer_id: str | None  # None where the prompt's one token left nothing to compute there
    num_tokens: int

    def fetch_url(self) -> str:
        return f"{self.url}/v1/kv_transfer/{self.transfer_id}"


Handoff = RemoteDecode | RemotePrefill


def parse_handoff(params: dict[str, Any] | None, role: str | None, n: int, stream: bool) -> Handoff | None:
    """What a request's `kv_transfer_params` ask of this instance; a 400 naming what is wrong."""
    if params is None:
        return None
    field = "kv_transfer_params"
    if not isinstance(params, dict):
        raise bad_request("kv_transfer_params must be an object", field)
    if n != 1:
        raise bad_request("kv_transfer_params hand over one sequence; n must be 1", "n")
    if params.get("do_remote_decode"):
        if role != "prefill":
            raise bad_request("do_remote_decode needs an instance started with --kv-role prefill", field)
        if stream:
            raise bad_request("do_remote_decode answers in one response; set stream to false", "stream")
        return RemoteDecode()
    if params.get("do_remote_prefill"):
        if role != "decode":
            raise bad_request("do_remote_prefill needs an instance started with --kv-role decode", field)
        return _remote_prefill(params)
    raise bad_request("kv_transfer_params must set do_remote_decode or do_remote_prefill", field)


def _remote_prefill(params: dict[str, Any]) -> RemotePrefill:
    field = "kv_transfer_params"
    host, port, num_tokens = params.get("remote_host"), params.get("remote_port"), params.get("num_tokens")
    if not isinstance(host, str) or not isinstance(port, int) or not isinstance(num_tokens, int):
        raise bad_request("do_remote_prefill needs remote_host (text), remote_port and num_tokens (integers)", field)
    transfer_id = params.get("transfer_id")
    if num_tokens > 0 and not isinstance(transfer_id, str):
        raise bad_request("do_remote_prefill needs the transfer_id the prefill instance answered with", field)
    scheme = params.get("remote_scheme", "http")
    return RemotePrefill(f"{scheme}://{host}:{port}", transfer_id if num_tokens > 0 else None, num_tokens)


@dataclass
class _Held:
    data: bytes  # the state, or (CUDA IPC) its description
    deadline: float
    export_id: str | None  # where the state itself stays on this instance's GPU until released


class TransferStore:
    """Prefilled state waiting for its decode instance: bytes by transfer id, each kept until
    fetched once or until it expires. State lent on the GPU (`--kv-buffer-device cuda`) is
    held until the decode instance says it has copied it (`release`) or until it expires;
    `release_export` then tells the engine core to free it."""

    def __init__(
        self, timeout_seconds: float, metrics: ServerMetrics, release_export: Callable[[str], None] = lambda _: None
    ) -> None:
        self.timeout_seconds = timeout_seconds
        self.metrics = metrics
        self.release_export = release_export
        self._held: OrderedDict[str, _Held] = OrderedDict()  # oldest first
        self._lent: dict[str, _Held] = {}  # fetched, still on the GPU until released

    def put(self, data: bytes, export_id: str | None = None) -> str:
        self.expire()
        transfer_id = secrets.token_hex(16)  # also the right to fetch it: not guessable
        self._held[transfer_id] = _Held(data, time.monotonic() + self.timeout_seconds, export_id)
        self._report()
        return transfer_id

    def take(self, transfer_id: str) -> bytes:
        self.expire()
        held = self._held.pop(transfer_id, None)
        if held is None:
            raise ApiError(404, f"no prefilled state {transfer_id!r}: unknown, fetched already, or expired", "NotFound")
        if held.export_id is not None:
            self._lent[transfer_id] = _Held(b"", time.monotonic() + self.timeout_seconds, held.export_id)
        self.metrics.kv_transfer_sent_bytes.labels(self.metrics.model_name).inc(len(held.data))
        self._report()
        return held.data

    def release(self, transfer_id: str) -> None:
        """The decode instance is done with the state (copied it, or gave up on it)."""
        held = self._lent.pop(transfer_id, None) or self._held.pop(transfer_id, None)
        if held is None:
            raise ApiError(
                404, f"no prefilled state {transfer_id!r}: unknown, released already, or expired", "NotFound"
            )
        self._free(held)
        self._report()

    def expire(self) -> None:
        now = time.monotonic()
        while self._held and next(iter(self._held.values())).deadline <= now:
            _, held = self._held.popitem(last=False)
            self._free(held)
            self.metrics.kv_transfer_expired.labels(self.metrics.model_name).inc()
        for transfer_id in [key for key, held in self._lent.items() if held.deadline <= now]:
            self._free(self._lent.pop(transfer_id))
            self.metrics.kv_transfer_expired.labels(self.metrics.model_name).inc()
        self._report()

    def _free(self, held: _Held) -> None:
        if held.export_id is not None:
            self.release_export(held.export_id)

    def _report(self) -> None:
        label = self.metrics.model_name
        self.metrics.kv_transfer_pending.labels(label).set(len(self._held))
        self.metrics.kv_transfer_pending_bytes.labels(label).set(sum(len(held.data) for held in self._held.values()))
        self.metrics.kv_transfer_lent.labels(label).set(len(self._lent))


async def fetch_state(remote: RemotePrefill, headers: dict[str, str], metrics: ServerMetrics) -> bytes:
    """The prefilled state from its instance; a 502 saying what failed."""
    start = time.monotonic()
    try:
        status, body = await asyncio.to_thread(_get, remote.fetch_url(), headers, FETCH_TIMEOUT_SECONDS)
    except (OSError, http.client.HTTPException) as error:
        raise ApiError(
            502, f"could not fetch the prefilled state from {remote.url}: {type(error).__name__}: {error}", "BadGateway"
        ) from None
    if status != 200:
        text = body[:300].decode(errors="replace")
        raise ApiError(502, f"the prefill instance {remote.url} answered {status} for its state: {text}", "BadGateway")
    label = metrics.model_name
    metrics.kv_transfer_received_bytes.labels(label).inc(len(body))
    metrics.kv_transfer_seconds.labels(label).observe(time.monotonic() - start)
    return body


def _get(url: str, headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
    """One GET with the standard library's client, in a thread: it reads a body of known length
    in one buffered call, where httpx reads 64 KiB chunks (46.5 MB from uvicorn: 74 ms against
    150-180; docs/benchmarks.md)."""
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout)
    try:
        connection.request("GET", parts.path, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


async def release_state(remote: RemotePrefill, headers: dict[str, str]) -> None:
    """Tell the prefill instance that state it lent on its GPU is copied (or no longer wanted);
    a failure is only logged: the state expires there anyway."""
    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_SECONDS) as client:
            response = await client.delete(remote.fetch_url(), headers=headers)
        if response.status_code != 200:
            logger.warning(
                "releasing %s answered %d: %s", remote.fetch_url(), response.status_code, response.text[:300]
            )
    except httpx.HTTPError as error:
        logger.warning("could not release %s: %s: %s", remote.fetch_url(), type(error).__name__, error)
