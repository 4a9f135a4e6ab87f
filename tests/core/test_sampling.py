"""The sampler against direct computations on known logits."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kestrel.core.sampling import Sampler, SamplingRow, apply_penalties, apply_top_p, draw, filter_logits
from kestrel.sampling_params import SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()[None, :]


def kept(params: SamplingParams, logits: torch.Tensor = LOGITS) -> set[int]:
    filtered = filter_logits(logits.clone(), [params])
    return {i for i, v in enumerate(filtered[0].tolist()) if v != float("-inf")}


def test_top_k_keeps_the_k_most_likely():
    assert kept(SamplingParams(top_k=2)) == {0, 1}
    assert kept(SamplingParams(top_k=-1)) == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert kept(SamplingParams(top_p=0.7)) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert kept(SamplingParams(top_p=0.5)) == {0}
    assert kept(SamplingParams(top_p=0.81)) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    assert kept(SamplingParams(min_p=0.5)) == {0, 1}  # threshold 0.25
    assert kept(SamplingParams(min_p=0.2)) == {0, 1, 2}  # threshold 0.1


def test_temperature_scales_logits():
    filtered = filter_logits(LOGITS.clone(), [SamplingParams(temperature=0.5)])
    assert torch.allclose(filtered, LOGITS / 0.5)


def test_top_k_rows_mixed_with_rows_without_it():
    filtered = filter_logits(torch.cat([LOGITS, LOGITS]), [SamplingParams(top_k=2), SamplingParams()])
    assert torch.isinf(filtered[0]).tolist() == [False, False, True, True]
    assert not torch.isinf(filtered[1]).any()


def test_rows_are_filtered_independently():
    filtered = filter_logits(torch.cat([LOGITS, LOGITS]), [SamplingParams(top_k=1), SamplingParams(top_p=0.81)])
    assert torch.isinf(filtered[0]).tolist() == [False, True, True, True]
    assert torch.isinf(filtered[1]).tolist() == [False, False, False, True]


def row(params: SamplingParams, prompt=(), output=(), seed=0) -> SamplingRow:
    return SamplingRow(params, random.Random(seed), prompt, output)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_penalties(logits.clone(), [row(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,))])
    assert out[0].tolist() == [1.0, -4.0, 1.0, 0.5]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits.clone(), [row(params, prompt=(3, 3), output=(1, 1, 2))])
    assert out[0].tolist() == [0.0, -(0.5 + 2 * 0.25), -(0.5 + 0.25), 0.0]


def test_draws_follow_the_distribution():
    generator = random.Random(0)
    probs = PROBS[None, :].repeat(4000, 1)
    tokens = draw(probs, [generator] * 4000)
    frequencies = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(frequencies, PROBS, atol=0.03)


def test_same_seed_same_draws_whatever_else_is_in_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0)
    sampler = Sampler()

    def seeded_tokens(batch_logits: torch.Tensor, position: int, steps: int = 20) -> list[int]:
        rows = [row(params, seed=100 + i) for i in range(batch_logits.shape[0])]
        rows[position] = row(params, seed=7)
        return [sampler.sample(batch_logits.clone(), rows)[position].token_id for _ in range(steps)]

    alone = seeded_tokens(logits[:1], 0)
    in_batch = seeded_tokens(torch.cat([logits[1:], logits[:1]]), 2)
    assert alone == in_batch
    assert len(set(alone)) > 1  # it really samples


def test_greedy_and_logprobs_with_ranks():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    sampled = Sampler().sample(logits, [row(SamplingParams(temperature=0, logprobs=2))])[0]
    expected = logits.log_softmax(-1)[0]
    assert sampled.token_id == 1
    assert sampled.logprobs.rank == 1
    assert sampled.logprobs.top_token_ids == (1, 3)
    assert sampled.logprobs.logprob == pytest.approx(float(expected[1]))
    assert math.isclose(sum(math.exp(v) for v in expected.tolist()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", -1.0, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_k", -5, "top_k"),
        ("min_p", 1.5, "min_p"),
        ("presence_penalty", 3.0, "presence_penalty"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("max_tokens", -1, "max_tokens"),
        ("n", 0, "n must"),
        ("logprobs", 50, "logprobs"),
        ("stop", [""], "stop strings"),
        ("stop", 5, "stop must be a string or a list of strings"),
        ("stop", ["ok", 7], "stop must be a string or a list of strings"),
        ("temperature", float("inf"), "temperature must be finite"),
        ("temperature", float("nan"), "temperature must be finite"),
        ("top_k", 1.5, "top_k must be an integer"),
        ("max_tokens", 8.0, "max_tokens must be an integer"),
        ("seed", 0.5, "seed must be an integer"),
        ("stop_token_ids", [2.5], "stop_token_ids and allowed_token_ids must be integer"),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_draws_over_a_large_vocabulary_never_pick_filtered_tokens():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))
    generator = random.Random(1)
    filtered = filter_logits(logits, [SamplingParams(top_k=5)] * 8)
    allowed = [set(torch.isfinite(row).nonzero()[:, 0].tolist()) for row in filtered]
    probs = filtered.softmax(-1)
    for _ in range(200):
        tokens = draw(probs, [generator] * 8).tolist()
        assert all(token in allowed[i] for i, token in enumerate(tokens))


@pytest.mark.parametrize("temperature", [0.05, 1.0, 8.0])  # peaked, typical, and nearly flat rows
def test_top_p_from_candidates_equals_the_full_sort(temperature):
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 5000, generator=generator) / temperature
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.95, 0.99, 0.999])
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    drop = torch.zeros_like(logits, dtype=torch.bool).scatter(
        1, order, sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]
    )
    expected = logits.masked_fill(drop, float("-inf"))
    assert torch.equal(apply_top_p(logits, top_p), expected)


def test_bad_words_ban_a_words_last_token_once_its_start_was_generated():
    from kestrel.core.sampling import banned_by_bad_words

    words = [(7,), (5, 9), (1, 2, 3)]
    assert banned_by_bad_words(words, []) == [7]
    assert banned_by_bad_words(words, [4, 5]) == [7, 9]
    assert banned_by_bad_words(words, [1, 2]) == [7, 3]
    assert banned_by_bad_words(words, [2, 1]) == [7]
