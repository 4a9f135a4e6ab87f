"""OpenAI-compatible request bodies (pydantic), and their mapping onto `SamplingParams`.

Unknown fields are accepted and ignored, as vLLM does; fields with a meaning that Kestrel
does not implement yet are refused by name (`NOT_YET_SUPPORTED`), never silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kestrel.sampling_params import SamplingParams


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.error_type, self.param = status, message, error_type, param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def validation_problems(errors: list[dict[str, Any]]) -> str:
    """Pydantic's errors as one line: each field's dotted location and what is wrong with it."""
    return "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in errors)


def refuse_what_asks(
    data: dict[str, Any], table: dict[str, Callable[[Any], bool]], why: str = "is not supported by this server yet"
) -> None:
    """A 400 naming the first field of `table` in `data` whose value asks for something."""
    for name, asks_nothing in table.items():
        if name in data and not asks_nothing(data[name]):
            raise bad_request(f"{name} {why}", name)


def _unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


# Field -> whether a value asks for nothing (then it is accepted). Anything else is a 400:
# OpenAI's and vLLM's request fields that Kestrel does not implement yet.
NOT_YET_SUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v is None or v == 1,
    "guided_whitespace_pattern": _unset,
    "priority": lambda v: v is None or v == 0,
    "use_beam_search": _unset,
    "length_penalty": lambda v: v is None or v == 1,
    "spaces_between_special_tokens": lambda v: v is None or v is True,
    "logits_processors": _unset,
    "cache_salt": lambda v: v is None,  # a prefix cache kept apart per salt
    "mm_processor_kwargs": _unset,
    "background": _unset,  # Responses: needs stored responses
    "truncation": lambda v: v is None or v == "disabled",  # Responses' "auto" drops input
}
# Per endpoint, where the two differ in what a field's default is or whether it is served.
CHAT_NOT_YET_SUPPORTED: dict[str, Callable[[Any], bool]] = {
    "prompt_logprobs": lambda v: v is None,  # served on /v1/completions
    "chat_template": lambda v: v is None,  # a template sent with the request
    "documents": _unset,
    "continue_final_message": _unset,
    "echo": _unset,  # chat: the last message's content before the answer (vLLM's)
    "add_special_tokens": _unset,  # chat prompts take the template's special tokens alone
    "modalities": lambda v: v is None or v == ["text"],  # audio output
    "audio": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "functions": _unset,  # the legacy form of `tools`
    "function_call": lambda v: v is None or v == "none",
}
# The Responses and Messages APIs' own fields that ask for what is not served (their other
# fields are translated, or ride along into the chat request and are checked there).
RESPONSES_NOT_YET_SUPPORTED: dict[str, Callable[[Any], bool]] = {
    "prompt": lambda v: v is None,  # a stored prompt template
    "conversation": lambda v: v is None,  # a stored conversation
    "include": _unset,  # logprobs, encrypted reasoning, tool results
    "top_logprobs": lambda v: v is None or v == 0,
}
MESSAGES_NOT_YET_SUPPORTED: dict[str, Callable[[Any], bool]] = {
    "mcp_servers": _unset,
    "container": lambda v: v is None,
}
COMPLETION_NOT_YET_SUPPORTED: dict[str, Callable[[Any], bool]] = {
    "add_special_tokens": lambda v: v is None or v is True,
    "functions": _unset,  # tools of the legacy form, which chat does not take either
    "suffix": lambda v: v is None,  # text after the completion (insertion)
}
# The other endpoint's fields, refused where they ask for something this endpoint would
# ignore: `tools` sent to /v1/completions asks for tool calls it would never make.
CHAT_ONLY_FIELDS: dict[str, Callable[[Any], bool]] = {
    "messages": lambda v: v is None,
    "tools": _unset,
    "tool_choice": lambda v: v is None or v == "none",
    "max_completion_tokens": lambda v: v is None,
    "top_logprobs": lambda v: v is None or v == 0,
    "reasoning_effort": lambda v: v is None,
    "chat_template_kwargs": _unset,
}
COMPLETION_ONLY_FIELDS: dict[str, Callable[[Any], bool]] = {
    "prompt": lambda v: v is None,
    "suffix": lambda v: v is None,
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")
    endpoint_not_yet_supported: ClassVar[dict[str, Callable[[Any], bool]]] = {}
    other_endpoint: ClassVar[str] = ""
    other_endpoint_fields: ClassVar[dict[str, Callable[[Any], bool]]] = {}
    # Disaggregated serving (vLLM's field): what a prefill or decode instance does with this
    # request's state (server/disaggregation.py).
    kv_transfer_params: dict[str, Any] | None = None

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # vLLM's: keep only the prompt's last N tokens (-1: as many as the context window holds).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # What the output must match (server/structured.py): OpenAI's field, then vLLM's.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_what_asks(data, NOT_YET_SUPPORTED | cls.endpoint_not_yet_supported)
            elsewhere = f"is a field of {cls.other_endpoint}, which this endpoint does not take"
            refuse_what_asks(data, cls.other_endpoint_fields, elsewhere)
        return data

    def _token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise ValueError('logit_bias keys must be token ids, e.g. {"50256": -100}') from None

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the bad field."""
        fields = dict(
            n=1,  # the front end fans n out into one engine request per choice
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop or (),
            stop_token_ids=self.stop_token_ids or (),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self._token_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or (),
        )
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        return SamplingParams(**fields)


class CompletionRequest(SamplingFields):
    endpoint_not_yet_supported: ClassVar[dict[str, Callable[[Any], bool]]] = COMPLETION_NOT_YET_SUPPORTED
    other_endpoint: ClassVar[str] = "/v1/chat/completions"
    other_endpoint_fields: ClassVar[dict[str, Callable[[Any], bool]]] = CHAT_ONLY_FIELDS
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the most likely


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # A conversation's tool-call history goes to the chat template as it came.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's convention, arguments parsed from JSON)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _json(c.function)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json(function: ToolCallFunction) -> Any:
    try:
        return json.loads(function.arguments)
    except ValueError:
        raise bad_request(f"tool call {function.name!r}: arguments are not valid JSON", "messages") from None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    endpoint_not_yet_supported: ClassVar[dict[str, Callable[[Any], bool]]] = CHAT_NOT_YET_SUPPORTED
    other_endpoint: ClassVar[str] = "/v1/completions"
    other_endpoint_fields: ClassVar[dict[str, Callable[[Any], bool]]] = COMPLETION_ONLY_FIELDS
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    # OpenAI's; handed to the chat template, as vLLM does (GPT-OSS's template reads it).
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]
