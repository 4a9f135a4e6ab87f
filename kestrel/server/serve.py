"""`python -m kestrel serve MODEL`: start the engine core, then the HTTP front end.

SIGTERM (or Ctrl-C) drains: new requests get 503, in-flight ones may finish for up to
`--shutdown-timeout` seconds, the rest are aborted (finish_reason "abort"), then both
processes exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi.middleware.cors import CORSMiddleware

from kestrel.config import EngineArgs
from kestrel.server.app import build_app
from kestrel.server.engine_client import EngineClient
from kestrel.server.state import ServerSettings, ServerState
from kestrel.server.stats_log import log_engine_stats
from kestrel.weights.checkpoint import load_tokenizer_from, open_checkpoint

logger = logging.getLogger("kestrel.server")
ABORT_GRACE_SECONDS = 2.0
CORE_WATCH_SECONDS = 0.5


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains in-flight requests before stopping."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._draining_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn re-raises the signal it caught once serving stops; after a completed
            # drain the shutdown is a clean one, so the process exits 0 instead.
            self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: object) -> None:
        if self._draining_task is not None:
            return super().handle_exit(sig, frame)  # a second signal: stop now
        self.state.draining = True
        loop = asyncio.get_event_loop()
        self._draining_task = loop.create_task(self._drain(sig, frame))

    async def _drain(self, sig: int, frame: object) -> None:
        client = self.state.client
        deadline = time.monotonic() + self.shutdown_timeout
        while client.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if client.num_in_flight:
            logger.warning("aborting %d requests still running at shutdown", client.num_in_flight)
            client.abort_all()
            grace = time.monotonic() + ABORT_GRACE_SECONDS
            while client.num_in_flight and time.monotonic() < grace:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # let the last responses flush
        super().handle_exit(sig, frame)


def load_front_end_tokenizer(engine_args: EngineArgs) -> Any:
    """The tokenizer the routes need (chat templates, text prompts, detokenized logprobs)."""
    if engine_args.tokenizer is not None:
        return load_tokenizer_from(engine_args.tokenizer)
    checkpoint = open_checkpoint(engine_args.model, engine_args.revision)
    tokenizer = checkpoint.tokenizer()
    if tokenizer is None:
        raise FileNotFoundError(
            f"{checkpoint.path} has no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model); "
            "the server needs a tokenizer: add them or pass --tokenizer"
        )
    return tokenizer


def read_chat_template(template: str) -> str:
    """`--chat-template`: a file's contents, or the template itself."""
    path = Path(template).expanduser()
    return path.read_text() if path.is_file() else template


async def serve(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    client = EngineClient(engine_args)
    # The core process loads the model while this one loads its tokenizer (seconds each, in
    # transformers' imports alone).
    client.launch()
    try:
        tokenizer = load_front_end_tokenizer(engine_args)
        if args.chat_template is not None:
            tokenizer.chat_template = read_chat_template(args.chat_template)
    except BaseException:
        client.kill()
        raise
    ready = await client.wait_ready()
    names = tuple(args.served_model_name or [args.model])
    settings = ServerSettings(
        served_model_name=names[0],
        model_aliases=names[1:],
        max_logprobs=args.max_logprobs,
        model_path=args.model,
        api_key=args.api_key,
        max_queue_len=args.max_queue_len,
        max_num_seqs=engine_args.max_num_seqs,
        log_requests=not args.disable_log_requests,
        max_request_body_bytes=int(args.max_request_body_mb * (1 << 20)),
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=engine_args.reasoning_parser,
        kv_role=args.kv_role,
        kv_transfer_timeout=args.kv_transfer_timeout,
    )
    state = ServerState(settings, client, tokenizer)
    app = build_app(state)
    app.add_middleware(CORSMiddleware, allow_origins=json.loads(args.allowed_origins), allow_methods=["*"])
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )
    server = DrainingServer(config, state, args.shutdown_timeout)
    print(
        f"Kestrel serving {settings.served_model_name} (max_model_len {ready.max_model_len}) "
        f"on http://{args.host}:{args.port}",
        flush=True,
    )
    stats_task = None if args.disable_log_stats else asyncio.create_task(log_engine_stats(client, state.metrics))
    watchdog = asyncio.create_task(stop_when_core_dies(server, client))
    try:
        await server.serve()
        died = None if client.alive else client.dead_reason  # before our own shutdown stops it
    finally:
        watchdog.cancel()
        if stats_task is not None:
            stats_task.cancel()
        await client.shutdown()
    if died is not None:
        raise EngineCoreDied(died)


class EngineCoreDied(RuntimeError):
    """The server stopped because its engine core died; the process exits non-zero so that a
    supervisor restarts it, as vLLM's does."""


async def stop_when_core_dies(server: uvicorn.Server, client: EngineClient) -> None:
    while client.alive:
        await asyncio.sleep(CORE_WATCH_SECONDS)
    logger.error("%s; failing the requests in flight and stopping the server", client.dead_reason)
    await asyncio.sleep(CORE_WATCH_SECONDS)  # the in-flight requests' error responses go out
    server.should_exit = True
