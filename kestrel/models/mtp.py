"""Multi-token prediction (MTP) heads: speculative decoding's `mtp` method runs them as a
draft model. Qwen3-Next and Qwen3.5 checkpoints carry one under `mtp.*`; DeepSeek-V3 releases
append theirs after the decoder's layers (`model.layers.<num_hidden_layers>.*`).

Row i of the head takes the target model's final hidden state at position i and the token at
position i + 1, and predicts the token at i + 2:

    h = project([norm_e(embed(token[i + 1])), norm_h(target_hidden[i])])
    h = one decoder layer of the target's kind (h), attending to the head's own earlier rows
    logits = lm_head(norm(h))

The two layouts differ in names and parts, not in arithmetic (`MtpDraft` holds it): Qwen's
head shares the target's embeddings and LM head and uses offset norms; DeepSeek's layer
carries its own copies (`embed_tokens`, `shared_head.head`) and plain RMS norms. A chained
draft's hidden state is the head's normed output, as SGLang chains both.

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
    """The head's spec: the target's, with its MTP layer as the only layer, an MoE layer where
    the target's layer at that index would be one (DeepSeek's first layers are dense)."""
    num_layers = getattr(hf_config, "mtp_num_hidden_layers", None) or getattr(hf_config, "num_nextn_predict_layers", 0)
    if num_layers != 1:
        raise ValueError(
            f"{target.architecture}: speculative decoding's 'mtp' method needs one multi-token prediction "
            f"layer in the config (mtp_num_hidden_layers or num_nextn_predict_layers), got {num_layers}"
        )
    if getattr(hf_config, "mtp_use_dedicated_embeddings", False):
        raise ValueError(f"{target.architecture}: MTP layers with dedicated embeddings are not supported yet")
    sparse = target.is_moe_layer(target.num_layers)
    return dataclasses.replace(
        target,
        architecture=f"{target.architecture}MTP",
        num_layers=1,
        layer_types=(FULL_ATTENTION,),
        layers=(),  # rebuilt for the one layer
        moe=dataclasses.replace(target.moe, sparse_step=1, dense_layers=()) if sparse else None,
    )


class MtpDraft(nn.Module):
    """The head's arithmetic (module docstring); a layout names its parts: `embed`,
    `embedding_norm`, `hidden_norm`, `projection`, `layer`, `final_norm`, `matvec_weight`."""

    use_gemv = False  # for the LM head, as `Linear.use_gemv`

    def __init__(self, spec: DecoderSpec, parallel: TensorParallel) -> None:
        super().__init__()
        if parallel.size > 1:
            raise ValueError("the MTP draft runs with tensor_parallel_size 1 only so far")
        self.spec, self.parallel = spec, parallel
        self.hidden_input: torch.Tensor | None = None
        self.hidden_output: torch.Tensor | None = None

    def allocate_hidden_buffers(self, max_rows: int) -> None:
        """The two hidden-state buffers, `max_rows` rows each (a step's token budget)."""
        weight = self.projection.weight
        self.hidden_input = torch.zeros(max_rows, self.spec.hidden_size, dtype=weight.dtype, device=weight.device)
        self.hidden_output = torch.zeros_like(self.hidden_input)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        rows = input_ids.shape[0]
        embedded = self.embedding_norm(self.embed(input_ids))
        target_hidden = self.hidden_norm(self.hidden_input[:rows])
        hidden = self.projection(torch.cat([embedded, target_hidden], dim=-1))
        rotary = rotary_cos_sin(positions, self.spec.rope, self.spec.rotary_dim, hidden.dtype)
        hidden, residual = self.layer(hidden, None, rotary, context)
        hidden = self.final_norm.of_stream(hidden, residual)
        self.hidden_output[:rows].copy_(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(hidden, self.matvec_weight, use_gemv=self.use_gemv)
        return logits[:, : self.spec.vocab_size].float()


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


class MtpForCausalLM(MtpDraft):
    """Qwen's layout: `mtp.*`, with the target's embeddings and LM head."""

    def __init__(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> None:
        super().__init__(spec, parallel)
        self.model = _Embeddings(spec, parallel)
        self.mtp = MtpHead(spec, parallel)
        rows = {None: vocab_rows(spec.vocab_size, parallel)}
        self.lm_head = (
            None if spec.tie_word_embeddings else ColumnParallelLinear(spec.hidden_size, rows, quantizable=False)
        )

    # The parts `MtpDraft` computes with, by their names in this layout.
    embed = property(lambda self: self.model.embed_tokens)
    embedding_norm = property(lambda self: self.mtp.pre_fc_norm_embedding)
    hidden_norm = property(lambda self: self.mtp.pre_fc_norm_hidden)
    projection = property(lambda self: self.mtp.fc)
    layer = property(lambda self: self.mtp.layers[0])
    final_norm = property(lambda self: self.mtp.norm)

    @property
    def matvec_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight


class MtpRecipe:
    """The MTP draft of a checkpoint: the target's recipe reads the config and names the
    experts; it also builds the head in its layout and binds it (`build_mtp`, `mtp_bindings`)."""

    def __init__(self, target_recipe: object) -> None:
        self.target = target_recipe
        self.architectures = tuple(f"{name}MTP" for name in target_recipe.architectures)

    def spec(self, hf_config: object) -> DecoderSpec:
        return mtp_spec(self.target.spec(hf_config), hf_config)

    def build(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> nn.Module:
        return self.target.build_mtp(spec, parallel)

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        return self.target.mtp_bindings(model, spec)


def qwen_mtp_bindings(target_recipe: object, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
    """Qwen's layout: the target's bindings, with `mtp.*` bound and the target's layers skipped."""
    bindings = target_recipe.bindings(model, spec)
    bindings.skip_instead(MTP_HEADS.prefix, (TARGET_LAYERS, TARGET_NORM))
    return bindings
