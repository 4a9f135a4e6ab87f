"""The shared expert of Qwen3-Next-style MoE layers: stacked with the routed experts where it
has their width, a separate MLP where not; the same sum either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.core.parallel import SINGLE
from kestrel.models.hybrid import SharedExpertMoe
from kestrel.models.qwen3_next import Qwen3NextRecipe
from tests.checkpoints import _family_configs, tokenizer


def shared_expert_weights(moe: SharedExpertMoe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up, down of the shared expert, wherever the layer keeps them."""
    if moe.num_stacked > moe.num_experts:
        gate, up = moe.experts.w13.weight[moe.num_experts].chunk(2)
        return gate, up, moe.experts.w2.weight[moe.num_experts]
    gate, up = moe.shared_expert.gate_up_proj.weight.chunk(2)
    return gate, up, moe.shared_expert.down_proj.weight


@pytest.mark.parametrize("shared_width, stacked", [(32, True), (48, False)])
def test_shared_expert_adds_its_gated_output_to_the_routed_sum(shared_width, stacked):
    config = _family_configs(len(tokenizer()), tokenizer().eos_token_id)["qwen3-next"]
    config.shared_expert_intermediate_size = shared_width
    spec = Qwen3NextRecipe().spec(config)
    assert spec.stacks_shared_expert == stacked
    torch.manual_seed(0)
    moe = SharedExpertMoe(spec, SINGLE)
    for param in moe.parameters():
        param.data.normal_(0, 0.2)
    hidden = torch.randn(9, spec.hidden_size)
    weights, experts = moe.route(hidden)
    gate, up, down = shared_expert_weights(moe)
    shared = (F.silu(hidden @ gate.T) * (hidden @ up.T)) @ down.T
    shared_gate = moe.gate.weight[moe.num_experts :]  # the router's last row
    expected = moe.grouped(hidden, weights, experts) + torch.sigmoid(hidden @ shared_gate.T) * shared
    torch.testing.assert_close(moe(hidden), expected, atol=1e-5, rtol=1e-5)
