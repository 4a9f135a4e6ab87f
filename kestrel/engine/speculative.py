"""Speculative decoding: guess a request's next tokens cheaply, then check them all in one step.

A decoding request with drafts d1..dk runs one verify chunk [last token, d1..dk]: the model
computes k + 1 positions at once and the sampler draws one token from each position's
distribution (the target model's, with the request's own sampling parameters). The engine
keeps samples up to and including the first one that differs from its draft; where all k
match, the (k + 1)-th sample comes free. The rejected drafts' state is rolled back.

Why this leaves the output distribution exactly the target model's: every proposer here drafts
deterministically (a point mass q on the draft d). Rejection sampling with such a q accepts d
with probability min(1, p(d) / q(d)) = p(d) and otherwise samples from (p - q)+ normalised,
which is p restricted to tokens other than d. Drawing x ~ p and accepting d when x == d does
both at once: it accepts with probability p(d), and a rejection's x is distributed as p
given x != d. Greedy sampling is the case p = one-hot: the longest matching prefix.

Proposers draft for the whole step at once (`Proposer.propose`): a draft model runs its
drafts as batched steps of its own; prompt lookup answers each request alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kestrel.engine import config_json

METHODS = ("ngram", "draft_model", "mtp")
# vLLM's other method names: refused by name rather than run as something else.
NOT_YET_SUPPORTED = ("eagle", "eagle3", "medusa", "mlp_speculator", "suffix")
FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
DEFAULT_LOOKUP = 5  # vLLM's n-gram length when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """What `speculative_config` / `--speculative-config` asks for (vLLM's field names)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method in NOT_YET_SUPPORTED:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported yet; supported: {', '.join(METHODS)}"
            )
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative_config method {self.method!r}; supported: {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, "
                f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model': the draft checkpoint")
        if self.method in ("ngram", "mtp") and self.model is not None:
            raise ValueError(f"speculative_config method {self.method!r} takes no 'model'")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str) -> SpeculativeConfig:
        """From a dict or its JSON text; unknown fields and missing required ones are errors."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = config_json.loads(value, "speculative_config")
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        config_json.check_fields(value, "speculative_config", FIELDS)
        fields = dict(value)
        for name in ("method", "num_speculative_tokens"):
            if fields.get(name) is None:
                raise ValueError(f"speculative_config needs {name!r}")
        low, high = fields.pop("prompt_lookup_min", None), fields.pop("prompt_lookup_max", None)
        low = low if low is not None else (high if high is not None else DEFAULT_LOOKUP)
        high = high if high is not None else low
        return cls(prompt_lookup_min=low, prompt_lookup_max=high, **fields)


@dataclass(frozen=True)
class DraftAsk:
    """One request that drafts this step: its tokens so far and how many drafts to follow them."""

    request_id: str
    token_ids: Sequence[int]
    num_tokens: int


class Proposer(Protocol):
    """Drafts deterministically (the acceptance rule above relies on it), for a step's
    requests at once; `release` forgets what it keeps of a finished request."""

    def propose(self, asks: Sequence[DraftAsk]) -> list[tuple[int, ...]]: ...

    def release(self, request_id: str) -> None: ...

    def observe(self, request_id: str, first_position: int, hidden_states: Any) -> None:
        """The target's final hidden states of a request's positions from `first_position`
        on, all of them standing (an MTP draft's input; others need not keep them)."""


class SequenceProposer:
    """A proposer that drafts for each request from its tokens alone and keeps nothing."""

    def propose(self, asks: Sequence[DraftAsk]) -> list[tuple[int, ...]]:
        return [self.propose_one(ask.token_ids, ask.num_tokens) for ask in asks]

    def propose_one(self, token_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        raise NotImplementedError

    def release(self, request_id: str) -> None:
        pass

    def observe(self, request_id: str, first_position: int, hidden_states: Any) -> None:
        pass


class NgramProposer(SequenceProposer):
    """Prompt lookup: where the sequence's last n tokens occurred before, the tokens that
    followed then are the draft. The longest n in [min, max] that matches wins, and among its
    matches the latest, whose continuation is the most likely to be repeated now."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose_one(self, token_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Windows that start early enough to be followed by at least one token.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if len(starts):
                follow = int(starts[-1]) + n
                return tuple(tokens[follow : follow + num_tokens].tolist())
        return ()


def kept_samples(samples: Sequence[int], drafts: Sequence[int]) -> int:
    """How many of a verify chunk's samples stand: those up to and including the first that
    differs from its draft (each sample is the target's token after the drafts before it)."""
    for index, draft in enumerate(drafts):
        if samples[index] != draft:
            return index + 1
    return len(samples)


class ForcedAcceptance:
    """A benchmark mode, labelled simulated wherever it is reported: each draft is accepted
    with a fixed probability whatever the model says, and an accepted draft stands as the
    token (the state holds it). It measures what verify steps cost and yield at a chosen
    acceptance rate, on random weights, where bf16 rounding makes a recorded greedy path
    unreliable; outputs are not the model's. Never set by a user-facing option."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        import random

        self.rate, self._random = rate, random.Random(seed)

    def verify(self, samples: Sequence[int], drafts: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        accepted = 0
        while accepted < len(drafts) and self._random.random() < self.rate:
            accepted += 1
        return accepted + 1, tuple(drafts[:accepted]) + (samples[accepted],)


@dataclass
class SpeculationStats:
    """Counts since start, named as vLLM's spec-decode metrics."""

    num_drafts: int = 0  # verify chunks run
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify chunk yields on average: its accepted drafts plus the one sampled after."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


# A request whose drafts came to nothing this many times in a row (none proposed, or none
# accepted) pauses drafting, for 1, 2, 4 ... up to MAX_PAUSE_STEPS steps; any accepted draft
# ends the pause. Drafting needs the last token on the host, so a step in which no request
# drafts can be planned while the one before still runs (overlapped scheduling).
MISSES_BEFORE_PAUSE = 3
MAX_PAUSE_STEPS = 8


@dataclass
class _Pause:
    misses: int = 0  # drafting rounds in a row that came to nothing
    steps_left: int = 0  # steps still to pass before the request drafts again


class Speculation:
    """The engine's drafting policy: which requests draft, how many tokens, from what."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpeculationStats()
        self.forced: ForcedAcceptance | None = None  # benchmarks only: see ForcedAcceptance
        self._pauses: dict[str, _Pause] = {}

    def drafts_now(self, request_id: str) -> bool:
        """Whether the request drafts this step (it is not pausing)."""
        pause = self._pauses.get(request_id)
        return pause is None or pause.steps_left == 0

    def pass_step(self, request_id: str) -> None:
        """A step in which a pausing request did not draft."""
        pause = self._pauses.get(request_id)
        if pause is not None and pause.steps_left:
            pause.steps_left -= 1

    def record_outcome(self, request_id: str, num_accepted: int) -> None:
        """A drafting round's outcome: accepted drafts (0 also where none was proposed)."""
        if num_accepted:
            self._pauses.pop(request_id, None)
            return
        pause = self._pauses.setdefault(request_id, _Pause())
        pause.misses += 1
        if pause.misses >= MISSES_BEFORE_PAUSE:
            pause.steps_left = min(2 ** (pause.misses - MISSES_BEFORE_PAUSE), MAX_PAUSE_STEPS)

    def verify(self, samples: Sequence[int], drafts: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        """How many samples stand, and the tokens that stand in their place (the samples
        themselves, except under forced acceptance, where accepted drafts stand)."""
        if self.forced is not None:
            return self.forced.verify(samples, drafts)
        kept = kept_samples(samples, drafts)
        return kept, tuple(samples[:kept])

    def drafts_for(self, asks: Sequence[DraftAsk]) -> dict[str, tuple[int, ...]]:
        """Drafts by request; each ask's `num_tokens` is its room, cut to the configured
        number of drafts (an ask without room drafts nothing)."""
        count = self.config.num_speculative_tokens
        asks = [dataclasses.replace(a, num_tokens=min(count, a.num_tokens)) for a in asks if a.num_tokens > 0]
        drafts = self.proposer.propose(asks) if asks else []
        return {ask.request_id: tuple(d[: ask.num_tokens]) for ask, d in zip(asks, drafts)}

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)
        self._pauses.pop(request_id, None)

    def observe(self, request_id: str, first_position: int, hidden_states: Any) -> None:
        self.proposer.observe(request_id, first_position, hidden_states)
