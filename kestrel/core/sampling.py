"""The sampler: logit bias and allow-lists, penalties, temperature, top-k / top-p / min-p,
seeded draws and logprobs (of the model's own distribution, before any of these).

Every request draws from its own generator, so a seeded request samples the same tokens
whatever else shares its batch. The generators are host-side `random.Random`s: one uniform
per row costs a fraction of a microsecond on the host, where a device generator per row
would cost a kernel launch per row.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kestrel.core.batch import host_to_device, values_to_device
from kestrel.core.parallel import TensorParallel
from kestrel.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One row of logits to sample from."""

    params: SamplingParams
    generator: random.Random
    prompt_token_ids: tuple[int, ...] | list[int]  # read only when penalties are on
    output_token_ids: tuple[int, ...] | list[int]


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's logprob and rank, and the top-N alternatives (model distribution)."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


class TokenMasks(Protocol):
    """Which tokens each constrained request may sample next (a grammar's allowed tokens), as
    bitmasks filled on the host. The runner asks once it has queued the forward pass, so the
    host fills them while the device computes the logits."""

    def constrained(self, request_id: str) -> bool: ...

    def fill(self, request_ids: Sequence[str]) -> torch.Tensor:
        """int32 [len(request_ids), ceil(vocab / 32)] on the host; bit j of word i allows token 32i + j."""
        ...


@dataclass(frozen=True)
class RowMasks:
    """Bitmasks (as `TokenMasks.fill` makes them) for some rows of a step's logits."""

    rows: tuple[int, ...]
    bitmasks: torch.Tensor


def apply_token_bitmasks(logits: torch.Tensor, masks: RowMasks) -> torch.Tensor:
    """Set every token a row's bitmask does not allow to -inf, in place."""
    device = logits.device
    words = host_to_device(masks.bitmasks, device)
    bits = torch.arange(32, dtype=torch.int32, device=device)
    banned = ((words[:, :, None] >> bits) & 1).flatten(1)[:, : logits.shape[-1]] == 0
    if len(masks.rows) == logits.shape[0]:  # every row constrained: no gather and scatter
        return logits.masked_fill_(banned, float("-inf"))
    index = values_to_device(list(masks.rows), torch.long, device)
    logits[index] = logits[index].masked_fill(banned, float("-inf"))
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output, HF's rule), presence and frequency (output only, OpenAI's)."""
    for index, row in enumerate(rows):
        params = row.params
        if not params.uses_penalties:
            continue
        line = logits[index]
        if params.repetition_penalty != 1:
            seen = values_to_device(
                sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), torch.long, logits.device
            )
            if seen.numel():
                values = line[seen]
                penalised = torch.where(
                    values > 0, values / params.repetition_penalty, values * params.repetition_penalty
                )
                line[seen] = penalised
        if (params.presence_penalty or params.frequency_penalty) and row.output_token_ids:
            ids = values_to_device(list(row.output_token_ids), torch.long, logits.device)
            counts = torch.zeros_like(line).index_add_(0, ids, torch.ones_like(ids, dtype=line.dtype))
            line -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def apply_token_constraints(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Logit bias (added) and allow-lists (everything else -inf), row by row, in place."""
    for index, row in enumerate(rows):
        params = row.params
        line = logits[index]
        if params.allowed_token_ids is not None:
            allowed = values_to_device(list(params.allowed_token_ids), torch.long, logits.device)
            kept = line[allowed]
            line.fill_(float("-inf"))
            line[allowed] = kept
        if params.logit_bias:
            ids = values_to_device(list(params.logit_bias), torch.long, logits.device)
            line[ids] += values_to_device(list(params.logit_bias.values()), line.dtype, logits.device)
        banned = banned_by_bad_words(params.bad_words_token_ids, row.output_token_ids)
        if banned:
            line[values_to_device(banned, torch.long, logits.device)] = float("-inf")
    return logits


def banned_by_bad_words(words: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """Each word's last token, where the tokens generated last are the word's first ones."""
    banned = []
    for word in words:
        prefix = list(word[:-1])
        if not prefix or list(output_token_ids[len(output_token_ids) - len(prefix) :]) == prefix:
            banned.append(word[-1])
    return banned


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; filtered-out entries become -inf."""
    device = logits.device
    if any(p.temperature != 1.0 for p in params):
        temperature = values_to_device([p.temperature for p in params], logits.dtype, device)
        logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    if any(p.top_k for p in params):
        # Only the largest k in use is needed: topk, not a sort of the whole vocabulary;
        # rows without top-k keep everything.
        widest = min(max(p.top_k for p in params), vocab)
        top_k = values_to_device([min(p.top_k, vocab) for p in params], torch.long, device)
        largest = logits.topk(widest, dim=-1).values
        kth = largest.gather(1, (top_k - 1).clamp(min=0)[:, None])
        kth = kth.masked_fill((top_k == 0)[:, None], float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1 for p in params):
        top_p = values_to_device([p.top_p for p in params], logits.dtype, device)
        logits = apply_top_p(logits, top_p)
    if any(p.min_p > 0 for p in params):
        min_p = values_to_device([p.min_p for p in params], logits.dtype, device)
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


TOP_P_CANDIDATES = 1024


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (-inf elsewhere).

    On the CPU the nucleus is looked for among the top TOP_P_CANDIDATES tokens first (a real
    model's nucleus is small, and a topk is far cheaper than sorting the vocabulary); rows
    whose candidates do not reach top_p then sort. Whether they do is a host check of a
    device result: free on the CPU, but on a GPU it would stall the host until every queued
    step has run, so there the whole row is sorted, without a check.
    """
    all_probs = logits.softmax(dim=-1)
    if logits.device.type == "cpu":
        values, order = logits.topk(min(TOP_P_CANDIDATES, logits.shape[-1]), dim=-1)
        probs = all_probs.gather(1, order)
        if not bool((probs.sum(dim=-1) >= top_p).all()):
            values, order = logits.sort(dim=-1, descending=True)
            probs = all_probs.gather(1, order)
    else:
        values, order = logits.sort(dim=-1, descending=True)
        probs = all_probs.gather(1, order)
    mass_before = probs.cumsum(dim=-1) - probs
    kept = values.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, kept)


CDF_BLOCK = 256


def draw(probs: torch.Tensor, generators: Sequence[random.Random]) -> torch.Tensor:
    """Sample one token per row by inverting the row's CDF at one uniform draw from its generator.

    One random number per row (not one per vocabulary entry), and a two-level CDF (block
    sums, then a cumulative sum inside the chosen block only) keep this cheap on the CPU.
    """
    rows, vocab = probs.shape
    uniforms = values_to_device([g.random() for g in generators], probs.dtype, probs.device)
    padding = (-vocab) % CDF_BLOCK
    blocks = (F.pad(probs, (0, padding)) if padding else probs).view(rows, -1, CDF_BLOCK)
    block_mass = blocks.sum(dim=-1)
    block_cdf = block_mass.cumsum(dim=-1)
    targets = (uniforms * block_cdf[:, -1])[:, None]
    # right=True: the first entry whose CDF exceeds the target, so zero-mass entries never win.
    block = torch.searchsorted(block_cdf, targets, right=True).clamp(max=blocks.shape[1] - 1)
    mass_before = block_cdf.gather(1, block) - block_mass.gather(1, block)
    within = blocks[torch.arange(rows, device=probs.device), block[:, 0]]
    offset = torch.searchsorted(within.cumsum(dim=-1) + mass_before, targets, right=True)[:, 0]
    # Rounding can push the target past the block's last entry: take its last non-zero one.
    positions = torch.arange(CDF_BLOCK, device=probs.device)
    last_nonzero = torch.where(within > 0, positions, -1).max(dim=-1).values
    return block[:, 0] * CDF_BLOCK + torch.minimum(offset, last_nonzero)


@dataclass(frozen=True)
class LogprobTensors:
    """Per row, on the device: the chosen token, its logprob and rank, and the row's top
    entries (as many as the widest request asked for)."""

    chosen: torch.Tensor
    chosen_logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_values: torch.Tensor

    @classmethod
    def of(cls, logprobs: torch.Tensor, chosen: torch.Tensor, widest: int) -> LogprobTensors:
        top_values, top_ids = logprobs.topk(widest, dim=-1)
        chosen_logprobs = logprobs.gather(1, chosen[:, None])[:, 0]
        ranks = (logprobs > chosen_logprobs[:, None]).sum(dim=-1) + 1
        return cls(chosen, chosen_logprobs, ranks, top_ids, top_values)

    def tensors(self) -> list[torch.Tensor]:
        return [self.chosen, self.chosen_logprobs, self.ranks, self.top_ids, self.top_values]

    @staticmethod
    def package(host: Sequence[torch.Tensor], num_top: Sequence[int]) -> list[TokenLogprobs]:
        """`tensors()` as copied to the host, into one TokenLogprobs per row."""
        chosen, chosen_logprobs, ranks, top_ids, top_values = (t.tolist() for t in host)
        return [
            TokenLogprobs(
                token_id=chosen[index],
                logprob=chosen_logprobs[index],
                rank=ranks[index],
                top_token_ids=tuple(top_ids[index][:count]),
                top_logprobs=tuple(top_values[index][:count]),
            )
            for index, count in enumerate(num_top)
        ]


@dataclass(frozen=True)
class DeviceSamples:
    """One step's draws, still on the device: a token per row, and logprob details for the
    rows that asked. `tensors()` go to the host together; `package` reads them there."""

    tokens: torch.Tensor
    logprob_rows: tuple[int, ...]
    num_top: tuple[int, ...]
    logprobs: LogprobTensors | None

    def tensors(self) -> list[torch.Tensor]:
        return [self.tokens] + (self.logprobs.tensors() if self.logprobs is not None else [])

    def package(self, host: Sequence[torch.Tensor]) -> list[SampledToken]:
        token_list = host[0].tolist()
        details = LogprobTensors.package(host[1:], self.num_top) if self.logprobs is not None else []
        by_row = dict(zip(self.logprob_rows, details))
        return [SampledToken(token_id=t, logprobs=by_row.get(i)) for i, t in enumerate(token_list)]


@dataclass(frozen=True)
class LastSamples:
    """The tokens a step sampled, still on the device, and which row is whose (a request's
    last row where it drew several): the next step may take its inputs from them."""

    rows: dict[str, int]
    tokens: torch.Tensor | None  # None on a tensor-parallel worker until rank 0 shares them


class Sampler:
    """Samples rows of logits. It owns the sampling state that outlives a step: each request's
    generator (seeded at its first draw, forgotten at `forget`) and the last step's samples."""

    def __init__(self) -> None:
        self._generators: dict[str, random.Random] = {}
        self.last: LastSamples | None = None

    def generator(self, request_id: str, seed: int) -> random.Random:
        generator = self._generators.get(request_id)
        if generator is None:
            generator = self._generators[request_id] = random.Random(seed)
        return generator

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def share_last(self, parallel: TensorParallel, device: torch.device) -> None:
        """Every tensor-parallel rank takes the tokens rank 0 sampled last step (only rank 0
        samples); all ranks call this in the same steps, because they all run the same work."""
        if parallel.size == 1:
            return
        tokens = self.last.tokens
        if tokens is None:
            tokens = torch.empty(max(self.last.rows.values()) + 1, dtype=torch.long, device=device)
            self.last = LastSamples(self.last.rows, tokens)
        parallel.broadcast_from_first(tokens)

    def remember(self, sampled_ids: Sequence[str], tokens: torch.Tensor | None) -> None:
        """Keep this step's samples (on a worker, only whose rows they are) for the next step."""
        rows = {request_id: row for row, request_id in enumerate(sampled_ids)}
        self.last = LastSamples(rows, tokens) if rows else None

    def sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: RowMasks | None = None
    ) -> list[SampledToken]:
        """`logits` [rows, vocab] in float32, straight from the model; waits for the device."""
        samples = self.sample_on_device(logits, rows, masks)
        return samples.package([t.cpu() for t in samples.tensors()])

    def sample_on_device(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: RowMasks | None = None
    ) -> DeviceSamples:
        """Queue the draws without waiting for the device (host-side uniforms included).
        `masks` (a grammar's allowed tokens) apply first, before bias, penalties and filters."""
        raw_logprobs = None
        if any(row.params.logprobs is not None for row in rows):
            raw_logprobs = logits.log_softmax(dim=-1)
        if masks is not None:
            logits = apply_token_bitmasks(logits.clone(), masks)
        if any(row.params.constrains_tokens or row.params.uses_penalties for row in rows):
            owned = logits if masks is not None else logits.clone()  # never change the model's logits
            logits = apply_penalties(apply_token_constraints(owned, rows), rows)
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if len(random_rows) == len(rows):
            tokens = self._draw(logits, rows)
        elif not random_rows:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = logits.argmax(dim=-1)
            index = values_to_device(random_rows, torch.long, logits.device)
            tokens[index] = self._draw(logits[index], [rows[i] for i in random_rows])
        if raw_logprobs is None:
            return DeviceSamples(tokens, (), (), None)
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        num_top = tuple(rows[i].params.logprobs for i in wanted)
        index = values_to_device(wanted, torch.long, tokens.device)
        details = LogprobTensors.of(raw_logprobs[index], tokens[index], max(num_top))
        return DeviceSamples(tokens, tuple(wanted), num_top, details)

    @staticmethod
    def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        filtered = filter_logits(logits, [row.params for row in rows])
        return draw(filtered.softmax(dim=-1), [row.generator for row in rows])
