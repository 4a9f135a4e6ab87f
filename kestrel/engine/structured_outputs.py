"""Structured outputs: grammars compiled by xgrammar, one matcher per constrained request.

The engine owns the matchers: it advances them with each token it appends, and the runner
asks them (through `core.sampling.TokenMasks`) for the next allowed tokens once it has queued
a step's forward pass. Compiling a grammar against the vocabulary takes milliseconds to
seconds, so it runs on a thread pool, cached by constraint; a request waits in the queue
until its grammar is ready, while the others run.

xgrammar is imported where it is first used, not with this module: it imports transformers,
about 1.3 s that processes which never constrain an output (tensor-parallel workers) skip.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kestrel.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger("kestrel.engine")

COMPILE_THREADS = 2
MAX_CACHED_GRAMMARS = 512
MAX_JSON_WHITESPACE = 16  # deep enough for JSON indented eight levels by two spaces
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+?:\d+: ")  # xgrammar's "[01:24:21] /path/file.cc:94: "


class GrammarError(ValueError):
    """A schema, regex, choice or grammar that cannot constrain an output (says why)."""


def grammar_of(spec: StructuredOutputsParams) -> xgrammar.Grammar:
    """The grammar a constraint stands for; raises GrammarError naming what is wrong.
    Needs no tokenizer, so the server checks requests with it before they reach the engine."""
    import xgrammar  # on first use: it imports transformers (module docstring)

    # JSON may be laid out freely (models write it indented), but in runs of at most
    # MAX_JSON_WHITESPACE characters: unbounded, a small model can pad forever.
    layout = dict(any_whitespace=not spec.disable_any_whitespace)
    if not spec.disable_any_whitespace:
        layout["max_whitespace_cnt"] = MAX_JSON_WHITESPACE
    try:
        if spec.kind == "json":
            schema = json.dumps(_bounded_strings_as_patterns(json.loads(spec.json)))
            return xgrammar.Grammar.from_json_schema(schema, strict_mode=True, **layout)
        if spec.kind == "json_object":
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', **layout)
        if spec.kind == "regex":
            return xgrammar.Grammar.from_regex(spec.regex)
        if spec.kind == "choice":
            return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in spec.choice))
        return xgrammar.Grammar.from_ebnf(spec.grammar)
    except json.JSONDecodeError as error:
        raise GrammarError(f"invalid structured output json: the schema is not valid JSON ({error})") from None
    except (RuntimeError, ValueError, TypeError) as error:
        message = _LOCATION.sub("", str(error).strip())
        raise GrammarError(f"invalid structured output {spec.kind}: {message}") from None


# xgrammar 0.2.9 turns a string with minLength / maxLength into a rule that lets raw control
# characters through (invalid JSON); the same bounds as a pattern keep them out. The class
# names the Basic Multilingual Plane's characters outright: a negated class also lets
# through byte sequences that are not UTF-8 (overlong 4-byte forms, surrogates), which a
# decoder turns into several U+FFFD characters, so the string breaks its maxLength. Naming
# the planes above it too (to U+10FFFF) made xgrammar's masks 50x slower to fill (100 ms a
# step for 64 requests), so length-bounded strings hold no emoji.
_PLAIN_CHARACTERS = r"[ -!#-\[\]-\uD7FF\uE000-\uFFFF]"


def _bounded_strings_as_patterns(schema: Any) -> Any:
    """The schema with each length-bounded plain string given as an equivalent pattern."""
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _bounded_strings_as_patterns(value) for key, value in schema.items()}
    bounded = "minLength" in schema or "maxLength" in schema
    plain = not any(key in schema for key in ("pattern", "format", "enum", "const"))
    if schema.get("type") == "string" and bounded and plain:
        low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
        schema["pattern"] = f"^{_PLAIN_CHARACTERS}{{{low},{high}}}$"
    return schema


def _ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'


class GrammarCache:
    """Compiles grammars against one vocabulary on a thread pool; keeps the latest ones.
    The vocabulary's own preparation (a second or so for a large one) also runs there, on
    first use, so neither the engine's start nor its loop waits for it."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer, self._stop_token_ids = tokenizer, sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="kestrel-grammar")
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.compile_seconds = 0.0

    def compiled(self, spec: StructuredOutputsParams) -> Future:
        """A future of the constraint's `xgrammar.CompiledGrammar` (raises GrammarError now
        if the constraint is invalid)."""
        key = spec.cache_key()
        future = self._compiled.get(key)
        if future is None or (future.done() and future.exception() is not None):  # a failure is not kept
            future = self._pool.submit(self._compile, grammar_of(spec))
            self._compiled[key] = future
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return future

    def _compile(self, grammar: xgrammar.Grammar) -> Any:
        compiler = self._vocabulary_compiler()
        start = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += time.perf_counter() - start
        return compiled

    def _vocabulary_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar  # on first use: it imports transformers (module docstring)

        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Constraint:
    """One request's grammar and where its output stands in it."""

    compiled: Future
    # With a reasoning model, the grammar applies after the reasoning: until the end marker
    # (token ids) has been generated, the output is free.
    reasoning_end: tuple[int, ...] = ()
    recent: list[int] = field(default_factory=list)  # the last tokens, to spot the end marker
    matcher: xgrammar.GrammarMatcher | None = None

    @property
    def reasoning(self) -> bool:
        return bool(self.reasoning_end)


class StructuredOutputs:
    """The matchers of the engine's constrained requests; the runner's `TokenMasks`."""

    def __init__(self, grammars: GrammarCache, reasoning_end: tuple[int, ...] = ()) -> None:
        self.grammars = grammars
        self.reasoning_end = reasoning_end
        self._constraints: dict[str, _Constraint] = {}
        self.num_requests = 0
        self.num_mask_steps = 0  # steps that filled masks, and the host time they took
        self.mask_seconds = 0.0

    def add(self, request_id: str, spec: StructuredOutputsParams, prompt_token_ids: Sequence[int]) -> None:
        """Start compiling the request's grammar; raises GrammarError for an invalid one."""
        compiled = self.grammars.compiled(spec)
        thinking = bool(self.reasoning_end) and not _ends_reasoning(prompt_token_ids, self.reasoning_end)
        self._constraints[request_id] = _Constraint(compiled, self.reasoning_end if thinking else ())
        self.num_requests += 1

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._constraints

    def __bool__(self) -> bool:
        return bool(self._constraints)

    def is_ready(self, request_id: str) -> bool:
        """Whether the request may run: its grammar is compiled (or it has none)."""
        import xgrammar  # on first use: it imports transformers (module docstring)

        constraint = self._constraints.get(request_id)
        if constraint is None or constraint.matcher is not None:
            return True
        if not constraint.compiled.done() or constraint.compiled.exception() is not None:
            return False
        constraint.matcher = xgrammar.GrammarMatcher(constraint.compiled.result())
        return True

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until one of the grammars being compiled is ready, or `timeout` seconds."""
        pending = [c.compiled for c in self._constraints.values() if not c.compiled.done()]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by one generated token. False where the grammar is
        complete (the token ended it, or nothing may follow): the output should stop."""
        constraint = self._constraints.get(request_id)
        if constraint is None:
            return True
        if constraint.reasoning:
            constraint.recent = (constraint.recent + [token_id])[-len(constraint.reasoning_end) :]
            if tuple(constraint.recent) == constraint.reasoning_end:
                constraint.reasoning_end = ()
            return True
        matcher = constraint.matcher
        if not matcher.accept_token(token_id):
            logger.error("request %s sampled token %d that its grammar does not allow", request_id, token_id)
            return False
        return not matcher.is_terminated()

    def constrained(self, request_id: str) -> bool:
        constraint = self._constraints.get(request_id)
        return constraint is not None and not constraint.reasoning and constraint.matcher is not None

    def valid_drafts(self, request_id: str, drafts: Sequence[int]) -> tuple[int, ...]:
        """The longest prefix of `drafts` the request's grammar allows next (the matcher is
        left where it was)."""
        matcher = self._constraints[request_id].matcher
        count = 0
        while count < len(drafts) and not matcher.is_terminated() and matcher.accept_token(drafts[count]):
            count += 1
        if count:
            matcher.rollback(count)
        return tuple(drafts[:count])

    def fill(self, request_ids: Sequence[str], drafts: Mapping[str, Sequence[int]] | None = None) -> torch.Tensor:
        """One bitmask row per entry of `request_ids`. A request listed several times in a
        row has a verify chunk: its n-th row (from 0) is the mask after its first n drafts."""
        import xgrammar  # on first use: it imports transformers (module docstring)

        start = time.perf_counter()
        bitmasks = xgrammar.allocate_token_bitmask(len(request_ids), self.grammars.vocab_size)
        advanced: dict[str, int] = {}  # drafts accepted into each matcher for this fill
        # One thread: xgrammar's BatchGrammarMatcher took 8.4 ms a step for 64 requests on
        # the H200's host where this loop takes 1.2 ms.
        for row, request_id in enumerate(request_ids):
            matcher = self._constraints[request_id].matcher
            if request_id in advanced:
                draft = drafts[request_id][advanced[request_id]]
                advanced[request_id] += matcher.accept_token(draft)
            else:
                advanced[request_id] = 0
            if matcher.is_terminated():
                # Its grammar is complete (by its last token, with the step launched already,
                # or by a draft): this row's sample is dropped; any token keeps it sampleable.
                bitmasks[row] = -1
            else:
                matcher.fill_next_token_bitmask(bitmasks, row)
        for request_id, count in advanced.items():
            if count:
                self._constraints[request_id].matcher.rollback(count)
        self.num_mask_steps += 1
        self.mask_seconds += time.perf_counter() - start
        return bitmasks

    def failed(self, request_id: str) -> BaseException | None:
        """The compile error of the request's grammar, if compiling it failed."""
        constraint = self._constraints.get(request_id)
        if constraint is None or not constraint.compiled.done():
            return None
        return constraint.compiled.exception()

    def remove(self, request_id: str) -> None:
        self._constraints.pop(request_id, None)


def _ends_reasoning(prompt_token_ids: Sequence[int], end: tuple[int, ...]) -> bool:
    """Whether the prompt closed the reasoning already: a chat template that turns thinking
    off ends the prompt with an empty reasoning block, so the end marker is among its last
    few tokens."""
    tail = list(prompt_token_ids[-8:])
    return any(tuple(tail[i : i + len(end)]) == end for i in range(len(tail) - len(end) + 1))
