"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kestrel.config import EngineArgs
from kestrel.engine.admission import fan_out
from kestrel.engine.compat import resolve_vllm_arguments
from kestrel.engine.engine import LLMEngine
from kestrel.engine.outputs import RequestOutput
from kestrel.sampling_params import RequestOutputKind, SamplingParams

PromptInput = str | dict[str, Any]


class LLM:
    """An engine for offline batches. Tensor-parallel workers stop at `shutdown()`, at the end
    of a `with LLM(...) as llm:` block, or when the object is collected."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        """`engine_args`: `EngineArgs`' fields, or vLLM's names for them (`engine/compat.py`)."""
        self.engine = LLMEngine(EngineArgs(model=model, **resolve_vllm_arguments(engine_args)))
        self._ids = itertools.count()
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine's worker processes and free its process group; idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}: {PROMPT_FORMS}"
            )
        params = self._params_per_prompt(len(prompts), sampling_params)
        resolved = [self._resolve_prompt(p) for p in prompts]
        for (_, token_ids), sp in zip(resolved, params):
            self.engine.validate_prompt(token_ids, sp)  # all or nothing: fail before adding any
        groups = [self._add(text, ids, sp) for (text, ids), sp in zip(resolved, params)]
        try:
            finished = self._run_to_completion(sum(len(g) for g in groups), use_tqdm)
        except BaseException:
            for child_id in itertools.chain.from_iterable(groups):
                self.engine.abort_request(child_id)
            raise
        return [self._merge([finished[child] for child in group]) for group in groups]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (the tokenizer's, or `chat_template`) and generate; `tools` are
        rendered into the prompt by the template, as vLLM's `LLM.chat` does."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        for conversation in conversations:
            _check_conversation(conversation)
        tokenizer = self._require_tokenizer()
        if chat_template is None and tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template; pass chat_template= or use generate()")
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # continuing the last message opens no new one (vLLM's rule)
        prompts = [
            tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _require_tokenizer(self) -> Any:
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass {'prompt_token_ids': [...]} prompts")
        return self.engine.tokenizer

    def _params_per_prompt(
        self, count: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if not isinstance(sampling_params, Sequence) or not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {sampling_params!r:.80}")
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling params for {count} prompts")
        return list(sampling_params)

    def _resolve_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        unknown = sorted(set(prompt) - PROMPT_KEYS) if isinstance(prompt, dict) else []
        if unknown:  # multi_modal_data, say: asked for, and would not be used
            raise ValueError(f"prompt keys {unknown} are not supported: {PROMPT_FORMS}")
        if isinstance(prompt, str):
            return prompt, self._require_tokenizer().encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._resolve_prompt(prompt["prompt"])
        raise ValueError(f"got a prompt of type {type(prompt).__name__}: {PROMPT_FORMS}")

    def _add(self, text: str | None, token_ids: list[int], params: SamplingParams) -> list[str]:
        """Add one request per requested sequence (n); return their ids."""
        base = str(next(self._ids))
        children = []
        for index, child_params in enumerate(fan_out(params)):
            child_id = f"{base}-{index}"
            child_params = child_params.replace(output_kind=RequestOutputKind.FINAL_ONLY)
            self.engine.add_request(child_id, token_ids, child_params, prompt=text)
            children.append(child_id)
        return children

    def _run_to_completion(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        speed = _TokenSpeed()
        with tqdm(total=total, desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        speed.add(output)
                        bar.set_postfix_str(speed.describe(bar.format_dict["elapsed"]), refresh=False)
                        bar.update(1)
        return finished

    @staticmethod
    def _merge(children: list[RequestOutput]) -> RequestOutput:
        first = children[0]
        completions = []
        for index, child in enumerate(children):
            completion = child.outputs[0]
            completion.index = index
            completions.append(completion)
        return RequestOutput(
            request_id=first.request_id.rsplit("-", 1)[0],
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=completions,
            finished=True,
            metrics=first.metrics if len(children) == 1 else None,  # n > 1: one request per sample
        )


class _TokenSpeed:
    """Input and output tokens of the finished requests, per second, as vLLM's progress bar shows them."""

    def __init__(self) -> None:
        self.input_tokens = self.output_tokens = 0

    def add(self, output: RequestOutput) -> None:
        self.input_tokens += len(output.prompt_token_ids)
        self.output_tokens += sum(len(completion.token_ids) for completion in output.outputs)

    def describe(self, elapsed: float) -> str:
        seconds = max(elapsed, 1e-6)
        return (
            f"est. speed input: {self.input_tokens / seconds:.2f} toks/s, "
            f"output: {self.output_tokens / seconds:.2f} toks/s"
        )


PROMPT_FORMS = "a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}"
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})


def _check_conversation(conversation: Any) -> None:
    """A conversation is a list of {"role": ..., "content": ...} messages (an assistant turn
    may carry tool_calls instead of content): said before the template fails on it."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {conversation!r:.80}")
    for index, message in enumerate(conversation):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{index}] must be a dict with a 'role', got {message!r:.80}")
        if "content" not in message and "tool_calls" not in message:
            raise ValueError(f"messages[{index}] ({message['role']}) has no 'content'")
