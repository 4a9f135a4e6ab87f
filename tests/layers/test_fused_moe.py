"""The Triton fused-MoE path against the torch grouped path (SparseMoe), and its sort."""

from __future__ import annotations

import os

import pytest
import torch

from kestrel.layers.fused_moe import fused_moe, sort_by_expert
from kestrel.layers.moe import SparseMoe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)",
)


def test_sort_groups_rows_by_expert_in_whole_blocks():
    experts = torch.tensor([[2, 0], [2, 1], [0, 2]])
    row_ids, block_experts = sort_by_expert(experts, num_experts=4, block_m=4)
    padding = experts.numel()
    blocks = row_ids.view(-1, 4).tolist()
    assert blocks[:3] == [[1, 4, padding, padding], [3, padding, padding, padding], [0, 2, 5, padding]]
    assert block_experts.tolist()[:3] == [0, 1, 2]
    assert all(e == -1 for e in block_experts.tolist()[3:])  # expert 3 got nothing
    assert all(all(r == padding for r in block) for block in blocks[3:])


@pytest.mark.parametrize("tokens, top_k, renormalize", [(1, 2, True), (5, 2, False), (37, 3, True)])
def test_fused_moe_matches_the_torch_path(tokens, top_k, renormalize):
    torch.manual_seed(0)
    hidden_size, inter, num_experts = 48, 40, 6
    moe = SparseMoe(hidden_size, inter, num_experts, top_k, renormalize).to(DEVICE)
    for param in moe.parameters():
        param.data.normal_(0, 0.2)
    hidden = torch.randn(tokens, hidden_size, device=DEVICE)
    weights, experts = moe.route(hidden)
    expected = moe.grouped(hidden, weights, experts)
    got = fused_moe(hidden, moe.experts.w13.weight, moe.experts.w2.weight, weights, experts)
    torch.testing.assert_close(got, expected, atol=2e-3 if DEVICE == "cuda" else 1e-5, rtol=1e-3)
