"""Warm-up: the largest steps the planner may send, run on throwaway sequences.

This is the profiling forward: it sets the peak activation memory the KV budget must leave
room for, compiles kernels and settles the allocators, so the first real requests do not pay
for any of that. It reserves and releases state through the providers like any request.
"""

from __future__ import annotations

from collections.abc import Sequence

from kestrel.core.batch import KV_GROUP
from kestrel.core.runner import ModelRunner, SequenceWork
from kestrel.core.state import OutOfPagesError
from kestrel.sampling_params import SamplingParams

WARM_UP_SEQ_LEN = 1024  # throwaway prompts are at most this long: activations scale with tokens
WARM_UP_PREFIX = "warm-up-"  # the warm-up runs before any request exists, so ids cannot clash
WARM_UP_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def warm_up(
    runner: ModelRunner, num_tokens: int, num_seqs: int, max_seq_len: int, smaller_prefills: Sequence[int] = ()
) -> None:
    """A full prefill budget, then a full decode batch, as far as the state pools hold them;
    then a prefill step of each of `smaller_prefills` tokens (the runtime's choice: see
    `DeviceRuntime.warm_up_smaller_prefills`)."""
    decodes = [1] * min(num_seqs, num_tokens)  # every step keeps to the token budget
    for step in (_prefills(num_tokens, num_seqs, max_seq_len), decodes):
        if step:
            _throwaway_step(runner, step)
    for tokens in smaller_prefills:
        _throwaway_step(runner, _prefills(tokens, num_seqs, max_seq_len))


def _prefills(num_tokens: int, num_seqs: int, max_seq_len: int) -> list[int]:
    """Prompt lengths that add up to `num_tokens` where `num_seqs` sequences hold them."""
    seq_len = max(1, min(max_seq_len, WARM_UP_SEQ_LEN, num_tokens))
    whole = min(num_tokens // seq_len, num_seqs)
    rest = num_tokens - whole * seq_len
    return [seq_len] * whole + ([rest] if rest and whole < num_seqs else [])


def _throwaway_step(runner: ModelRunner, lengths: list[int]) -> None:
    work: list[SequenceWork] = []
    try:
        for index, length in enumerate(lengths):
            request_id = f"{WARM_UP_PREFIX}{index}"
            try:
                work.append(_reserve(runner, request_id, length))
            except OutOfPagesError:
                _release(runner, request_id)
                break
        if work:
            runner.execute(work)
    finally:
        for item in work:
            _release(runner, item.request_id)


def _reserve(runner: ModelRunner, request_id: str, length: int) -> SequenceWork:
    ids = {name: tuple(group.provider.reserve(request_id, length)) for name, group in runner.groups.items()}
    page_ids = ids.pop(KV_GROUP)
    return SequenceWork(
        request_id=request_id,
        token_ids=(0,) * length,
        num_cached_tokens=0,
        page_ids=page_ids,
        num_samples=1,
        params=WARM_UP_PARAMS,
        seed=0,
        state_ids=ids,
    )


def _release(runner: ModelRunner, request_id: str) -> None:
    for group in runner.groups.values():
        group.provider.release(request_id)
    runner.release(request_id)
