"""`python -m kestrel router --prefill URL... --decode URL...`: one OpenAI-compatible endpoint
in front of prefill and decode instances (`kestrel serve ... --kv-role prefill|decode`).

Each completion or chat completion goes first to a prefill instance, asking it to compute the
prompt and keep its state (`kv_transfer_params.do_remote_decode`), then to a decode instance
with the prefill instance's answer (`do_remote_prefill`, where to fetch the state); the decode
instance's answer, streamed or whole, is the client's. Each step picks the instance of its
role with the fewest requests in flight. An instance that cannot be reached is set aside for
`RETRY_DOWN_SECONDS` and the request is failed with a 502 naming it, or, where the prefill
instance could not even be connected to, tried once on another; nothing waits forever.
Client authorization headers pass through unchanged.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kestrel.server.protocol import ApiError

RETRY_DOWN_SECONDS = 5.0
CONNECT_TIMEOUT_SECONDS = 5.0
PASSED_HEADERS = ("authorization",)


@dataclass
class Instance:
    url: str
    role: str  # "prefill" | "decode"
    in_flight: int = 0
    down_until: float = 0.0
    last_error: str | None = None

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def mark_down(self, error: str) -> None:
        self.down_until, self.last_error = time.monotonic() + RETRY_DOWN_SECONDS, error


class InstancePool:
    def __init__(self, urls: list[str], role: str) -> None:
        if not urls:
            raise ValueError(f"the router needs at least one {role} instance")
        self.role = role
        self.instances = [Instance(url.rstrip("/"), role) for url in urls]

    def pick(self, excluding: Instance | None = None) -> Instance:
        """The reachable instance with the fewest requests in flight; a 502 when none is."""
        candidates = [i for i in self.instances if i.up and i is not excluding]
        if not candidates:
            reasons = "; ".join(f"{i.url}: {i.last_error}" for i in self.instances)
            raise ApiError(502, f"no {self.role} instance is reachable ({reasons})", "BadGateway")
        return min(candidates, key=lambda i: i.in_flight)


class RouterMetrics:
    def __init__(self, pools: list[InstancePool]) -> None:
        self.registry = CollectorRegistry()
        self.pools = pools
        labels = ["role", "instance"]

        def metric(kind: type, name: str, doc: str):
            return kind(f"kestrel:{name}", doc, labels, registry=self.registry)

        self.in_flight = metric(Gauge, "router_requests_in_flight", "Requests at each instance.")
        self.requests = metric(Counter, "router_requests", "Requests sent to each instance.")
        self.failures = metric(Counter, "router_failures", "Requests an instance could not serve.")

    def render(self) -> bytes:
        for pool in self.pools:
            for instance in pool.instances:
                self.in_flight.labels(pool.role, instance.url).set(instance.in_flight)
        return generate_latest(self.registry)


class Router:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout: float) -> None:
        self.prefill = InstancePool(prefill_urls, "prefill")
        self.decode = InstancePool(decode_urls, "decode")
        self.metrics = RouterMetrics([self.prefill, self.decode])
        timeouts = httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_SECONDS)
        self.client = httpx.AsyncClient(timeout=timeouts, limits=httpx.Limits(max_connections=None))

    async def generate(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        handoff = await self._prefill(path, body, headers)
        if isinstance(handoff, Response):
            return handoff  # the prefill instance refused it: its answer is the client's
        decode_body = {**body, "kv_transfer_params": handoff}
        instance = self.decode.pick()
        if body.get("stream"):
            return await self._stream(instance, path, decode_body, headers)
        response = await self._post(instance, path, decode_body, headers)
        return Response(response.content, response.status_code, media_type="application/json")

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | Response:
        """The decode instance's `kv_transfer_params`, or the prefill instance's refusal."""
        prefill_body = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        prefill_body.pop("stream_options", None)
        instance = self.prefill.pick()
        try:
            response = await self._post(instance, path, prefill_body, headers, raise_connect=True)
        except httpx.ConnectError:  # nothing was computed: another instance may serve it
            instance = self.prefill.pick(excluding=instance)
            response = await self._post(instance, path, prefill_body, headers)
        if response.status_code != 200:
            return Response(response.content, response.status_code, media_type="application/json")
        params = response.json().get("kv_transfer_params") or {}
        address = urlsplit(instance.url)
        return {
            "do_remote_prefill": True,
            "remote_scheme": address.scheme,
            "remote_host": address.hostname,
            "remote_port": address.port or (443 if address.scheme == "https" else 80),
            "transfer_id": params.get("transfer_id"),
            "num_tokens": params.get("num_tokens", 0),
        }

    async def _post(
        self, instance: Instance, path: str, body: dict, headers: dict[str, str], raise_connect: bool = False
    ) -> httpx.Response:
        self._sent(instance)
        try:
            return await self.client.post(f"{instance.url}{path}", json=body, headers=headers)
        except httpx.HTTPError as error:
            self.failed(instance, error)
            if raise_connect and isinstance(error, httpx.ConnectError):
                raise
            raise _gateway_error(instance, error) from None
        finally:
            instance.in_flight -= 1

    async def _stream(self, instance: Instance, path: str, body: dict, headers: dict[str, str]) -> Response:
        self._sent(instance)
        request = self.client.build_request("POST", f"{instance.url}{path}", json=body, headers=headers)
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError as error:
            instance.in_flight -= 1
            self.failed(instance, error)
            raise _gateway_error(instance, error) from None
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            instance.in_flight -= 1
            return Response(content, upstream.status_code, media_type="application/json")
        return StreamingResponse(self._relay(instance, upstream), media_type="text/event-stream")

    async def _relay(self, instance: Instance, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """The decode instance's events as they come; if it fails midway, an error event and
        the end of the stream. A client that leaves closes the upstream stream, and with it
        the decode instance's request."""
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as error:
            self.failed(instance, error)
            body = _gateway_error(instance, error).body()
            yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await upstream.aclose()
            instance.in_flight -= 1

    def _sent(self, instance: Instance) -> None:
        instance.in_flight += 1
        self.metrics.requests.labels(instance.role, instance.url).inc()

    def failed(self, instance: Instance, error: httpx.HTTPError) -> None:
        """Set the instance aside for a while, and count the failure."""
        instance.mark_down(f"{type(error).__name__}: {error}")
        self.metrics.failures.labels(instance.role, instance.url).inc()


def _gateway_error(instance: Instance, error: httpx.HTTPError) -> ApiError:
    return ApiError(
        502, f"the {instance.role} instance {instance.url} failed: {type(error).__name__}: {error}", "BadGateway"
    )


def build_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="Kestrel router")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    async def forward(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError as error:
            raise ApiError(400, f"the request body is not JSON: {error}", "BadRequestError") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", "BadRequestError")
        headers = {name: value for name, value in request.headers.items() if name in PASSED_HEADERS}
        return await router.generate(path, body, headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        instance = router.decode.pick()
        headers = {name: value for name, value in request.headers.items() if name in PASSED_HEADERS}
        try:
            response = await router.client.get(f"{instance.url}/v1/models", headers=headers)
        except httpx.HTTPError as error:
            router.failed(instance, error)
            raise _gateway_error(instance, error) from None
        return Response(response.content, response.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> dict:
        return {
            pool.role: [{"url": i.url, "up": i.up, "in_flight": i.in_flight} for i in pool.instances]
            for pool in (router.prefill, router.decode)
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    router = Router(args.prefill, args.decode, args.timeout)
    print(f"Kestrel router on http://{args.host}:{args.port}: prefill {args.prefill}, decode {args.decode}", flush=True)
    uvicorn.run(build_router_app(router), host=args.host, port=args.port, log_level="warning")
    return 0
