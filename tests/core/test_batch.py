"""The plain-data layout's host arrays: page tables and KV slots, against a per-token loop."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from kestrel.core.batch import BatchLayout, SequenceChunk, page_table, to_device


def _chunk(draw, page_size: int, next_page: list[int]) -> SequenceChunk:
    cached = draw(st.integers(0, 40))
    query_len = draw(st.integers(1, 40))
    num_pages = -(-(cached + query_len) // page_size)
    pages = tuple(range(next_page[0], next_page[0] + num_pages))
    next_page[0] += num_pages + draw(st.integers(0, 3))  # gaps: pages need not be contiguous
    return SequenceChunk(query_len, cached, pages[::-1])  # and need not be in order


@st.composite
def layouts(draw) -> BatchLayout:
    page_size = draw(st.sampled_from([1, 4, 16]))
    next_page = [1]
    chunks = tuple(_chunk(draw, page_size, next_page) for _ in range(draw(st.integers(1, 6))))
    return BatchLayout(chunks=chunks, num_decodes=0, page_size=page_size)


@given(layouts())
def test_slot_mapping_matches_a_per_token_walk(layout: BatchLayout) -> None:
    expected = [
        chunk.page_ids[position // layout.page_size] * layout.page_size + position % layout.page_size
        for chunk in layout.chunks
        for position in range(chunk.num_cached_tokens, chunk.seq_len)
    ]
    assert layout.slot_mapping().tolist() == expected


def test_page_table_pads_short_rows_and_extra_rows_with_the_fill() -> None:
    chunks = (SequenceChunk(1, 0, (7,)), SequenceChunk(1, 20, (3, 5, 9)))
    table = page_table(chunks, fill=2, num_rows=3)
    assert table.tolist() == [[7, 2, 2], [3, 5, 9], [2, 2, 2]]
    assert table.dtype == np.int64


def test_to_device_keeps_values_and_dtype() -> None:
    values = np.array([[1, 2], [3, 4]], dtype=np.int64)
    tensor = to_device(values, torch.device("cpu"))
    assert tensor.dtype == torch.long and tensor.tolist() == [[1, 2], [3, 4]]
