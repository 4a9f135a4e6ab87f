"""What the routes share: the server's settings, the engine client, tokenizer, metrics and
parsers, and the capacity check every generating route makes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kestrel.engine.reasoning import reasoning_format
from kestrel.server.disaggregation import TransferStore
from kestrel.server.engine_client import EngineClient
from kestrel.server.metrics import ServerMetrics
from kestrel.server.protocol import ApiError, bad_request
from kestrel.server.tool_parsers import TOOL_CALL_PARSERS

RETRY_AFTER_SECONDS = 1  # what a refused request's Retry-After says: the queue moves every step


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    model_path: str
    api_key: str | None
    max_queue_len: int
    max_num_seqs: int
    log_requests: bool = True
    max_request_body_bytes: int = 32 << 20
    model_aliases: tuple[str, ...] = ()  # further names requests may use (--served-model-name a b)
    max_logprobs: int = 20
    tool_call_parser: str | None = None  # set with --enable-auto-tool-choice: tool_choice "auto" works
    reasoning_parser: str | None = None
    kv_role: str | None = None  # "prefill" | "decode": this instance's part in disaggregated serving
    kv_transfer_timeout: float = 60.0  # seconds a prefilled state waits for its decode instance


class ServerState:
    """What the routes share: the engine client, tokenizer, metrics and drain flag."""

    def __init__(self, settings: ServerSettings, client: EngineClient, tokenizer: Any) -> None:
        self.settings = settings
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = ServerMetrics(settings.served_model_name)
        self.draining = False
        parser = settings.tool_call_parser
        self.tool_parser = TOOL_CALL_PARSERS[parser]() if parser is not None else None
        self.reasoning = reasoning_format(settings.reasoning_parser) if settings.reasoning_parser else None
        self.transfers = TransferStore(settings.kv_transfer_timeout, self.metrics, client.release_export)

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    def piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def check_model(self, model: str | None) -> None:
        names = (self.settings.served_model_name, *self.settings.model_aliases)
        if model is not None and model not in names:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def check_capacity(self, new_requests: int) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", "ServiceUnavailableError")
        if not self.client.alive:
            raise ApiError(503, f"the engine is not running: {self.client.dead_reason}", "ServiceUnavailableError")
        limit = self.settings.max_num_seqs + self.settings.max_queue_len
        if new_requests > limit:  # could never be admitted: retrying cannot help
            raise bad_request(
                f"the request asks for {new_requests} sequences (prompts x n); this server holds at most {limit}",
                "n",
            )
        if self.client.num_in_flight + new_requests > limit:
            raise ApiError(
                429,
                f"the server is overloaded: more than {limit} requests in flight; retry later",
                "RateLimitError",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        self.client.reserve(new_requests)
