"""Multi-token prediction (MTP) heads, as Qwen3-Next and Qwen3.5 checkpoints carry them under
`mtp.*`: speculative decoding's `mtp` method runs them as a draft model.

Row i of the head takes the target model's final hidden state at position i and the token at
position i + 1, and predicts the token at i + 2:

    h = fc([norm_e(embed(token[i + 1])), norm_h(target_hidden[i])])
    h = one full-attention decoder layer (h), attending to the head's own earlier rows
    logits = lm_head(norm(h))

The head keeps its own KV (one attention layer) in its own pool. Its second input, the
hidden states, does not fit the `forward(input_ids, positions, context)` contract, so the head
owns two persistent buffers: `hidden_input`, which the proposer fills before each step, and
`hidden_output`, where each step leaves its normed output (the next chained draft's hidden
state). Fixed addresses let captured CUDA graphs read and write them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kestrel.core.forward import ForwardContext
from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.weight_bindings import SkippedPrefix, WeightBindings
from kestrel.layers import ops
from kestrel.layers.embedding import VocabParallelEmbedding, vocab_rows
from kestrel.layers.linear import ColumnParallelLinear, Linear
from kestrel.layers.norm import OffsetRMSNorm
from kestrel.layers.rotary import rotary_cos_sin
from kestrel.models.hybrid import MTP_HEADS, HybridDecoderLayer
from kestrel.models.spec import FULL_ATTENTION, DecoderSpec

TARGET_LAYERS = SkippedPrefix("model.layers.", "the target model's layers (the MTP draft runs its own)")
TARGET_NORM = SkippedPrefix("model.norm.", "the target model's final norm")


def mtp_spec(target: DecoderSpec, hf_config: object) -> DecoderSpec:
    """The head's spec: the target's, with its MTP layers (full attention) as the only layers."""
    num_layers = getattr(hf_config, "mtp_num_hidden_layers", None) or getattr(hf_config, "num_nextn_predict_layers", 0)
    if num_layers != 1:
        raise ValueError(
            f"{target.architecture}: speculative decoding's 'mtp' method needs one multi-token prediction "
            f"layer in the config (mtp_num_hidden_layers), got {num_layers}"
        )
    if getattr(hf_config, "mtp_use_dedicated_embeddings", False):
        raise ValueError(f"{target.architecture}: MTP layers with dedicated embeddings are not supported yet")
    return dataclasses.replace(
        target,
        architecture=f"{target.architecture}MTP",
        num_layers=1,
        layer_types=(FULL_ATTENTION,),
        layers=(),  # rebuilt for the one layer
        moe=target.moe and dataclasses.replace(target.moe, sparse_step=1, dense_layers=()),
    )


class MtpHead(nn.Module):
    """The `mtp.*` tensors of a checkpoint."""

    def __init__(self, spec: DecoderSpec, parallel: TensorParallel) -> None:
        super().__init__()
        hidden = spec.hidden_size
        self.fc = Linear(2 * hidden, hidden)
        self.layers = nn.ModuleList([HybridDecoderLayer(spec, 0, parallel)])
        self.norm = OffsetRMSNorm(hidden, spec.rms_norm_eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(hidden, spec.rms_norm_eps)
        self.pre_fc_norm_embedding = OffsetRMSNorm(hidden, spec.rms_norm_eps)


class _Embeddings(nn.Module):
    def __init__(self, spec: DecoderSpec, parallel: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, parallel)


class MtpForCausalLM(nn.Module):
    use_gemv = False  # for the LM head, as `Linear.use_gemv`

    def __init__(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        if parallel.size > 1:
            raise ValueError("the MTP draft runs with tensor_parallel_size 1 only so far")
        self.spec, self.parallel = spec, parallel
        self.model = _Embeddings(spec, parallel)
        self.mtp = MtpHead(spec, parallel)
        rows = {None: vocab_rows(spec.vocab_size, parallel)}
        self.lm_head = (
            None if spec.tie_word_embeddings else ColumnParallelLinear(spec.hidden_size, rows, quantizable=False)
        )
        self.hidden_input: torch.Tensor | None = None
        self.hidden_output: torch.Tensor | None = None

    def allocate_hidden_buffers(self, max_rows: int) -> None:
        """The two hidden-state buffers, `max_rows` rows each (a step's token budget)."""
        weight = self.mtp.fc.weight
        self.hidden_input = torch.zeros(max_rows, self.spec.hidden_size, dtype=weight.dtype, device=weight.device)
        self.hidden_output = torch.zeros_like(self.hidden_input)

    @property
    def matvec_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        rows = input_ids.shape[0]
        mtp = self.mtp
        embedded = mtp.pre_fc_norm_embedding(self.model.embed_tokens(input_ids))
        target_hidden = mtp.pre_fc_norm_hidden(self.hidden_input[:rows])
        hidden = mtp.fc(torch.cat([embedded, target_hidden], dim=-1))
        rotary = rotary_cos_sin(positions, self.spec.rope, self.spec.rotary_dim, hidden.dtype)
        hidden, residual = mtp.layers[0](hidden, None, rotary, context)
        hidden = mtp.norm(hidden, residual)[0]
        self.hidden_output[:rows].copy_(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(hidden, self.matvec_weight, use_gemv=self.use_gemv)
        return logits[:, : self.spec.vocab_size].float()


class MtpRecipe:
    """The MTP draft of a Qwen3-Next / Qwen3.5 checkpoint: the target's recipe reads the config
    and names the experts; this one keeps the head and the embeddings it shares."""

    def __init__(self, target_recipe: object) -> None:
        self.target = target_recipe
        self.architectures = tuple(f"{name}MTP" for name in target_recipe.architectures)

    def spec(self, hf_config: object) -> DecoderSpec:
        return mtp_spec(self.target.spec(hf_config), hf_config)

    def build(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> nn.Module:
        return MtpForCausalLM(spec, parallel)

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        bindings = self.target.bindings(model, spec)
        bindings.skip_instead(MTP_HEADS.prefix, (TARGET_LAYERS, TARGET_NORM))
        return bindings
