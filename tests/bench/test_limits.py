"""The physical limits the benchmarks print beside their measurements."""

from __future__ import annotations

import pytest

from kestrel.bench.throughput import memory_limit_tokens_per_s


def test_memory_limit_counts_weights_per_step_and_each_tokens_context():
    # 2 requests share each of 4 decode steps (1000 weight bytes each); the 8 decoded tokens
    # read a mean context of 10 + 4 / 2 = 12 tokens of 10 bytes: 4000 + 960 bytes at 1000 B/s.
    limit = memory_limit_tokens_per_s(2, 10, 4, 8, 1000, 10, 1000.0)
    assert limit == pytest.approx(8 / 4.96)


def test_memory_limit_shares_weights_only_up_to_the_batch():
    alone = memory_limit_tokens_per_s(4, 0, 2, 1, 100, 0, 100.0)  # 8 steps of one request
    batched = memory_limit_tokens_per_s(4, 0, 2, 4, 100, 0, 100.0)  # 2 steps of four
    assert batched == pytest.approx(4 * alone)
