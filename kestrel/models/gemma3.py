"""Gemma3ForCausalLM (text): sliding-window layers between global ones, each kind with its own
rope base; norms whose weights are offsets from one, four per block (around attention and
around the MLP); GELU-tanh MLPs; embeddings scaled by sqrt(hidden_size); scores scaled by
query_pre_attn_scalar ** -0.5.

The layers share one KV pool, each attending with its own window (AttentionLayer carries
it); the window layers' smaller state group can follow without touching this recipe.
"""

from __future__ import annotations

import torch
from torch import nn

from kestrel.core.forward import ForwardContext
from kestrel.core.parallel import SINGLE, TensorParallel
from kestrel.core.weight_bindings import WeightBindings
from kestrel.layers.norm import OffsetRMSNorm
from kestrel.layers.rotary import RopeSpec, rotary_cos_sin
from kestrel.models.dense import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderMLP,
    DenseDecoderRecipe,
    decoder_bindings,
    read_dense_spec,
    rope_from_parameters,
)
from kestrel.models.spec import FULL_ATTENTION, SLIDING_ATTENTION, DecoderSpec

_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION)


class Gemma3DecoderLayer(nn.Module):
    """norm -> attention -> norm, added to the stream; norm -> MLP -> norm, added likewise.

    As in `ResidualBlock`, each residual add happens inside the next norm that reads the sum."""

    def __init__(self, spec: DecoderSpec, index: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(spec, index, parallel, OffsetRMSNorm)
        self.mlp = DecoderMLP(spec, parallel)
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")
        for name in norms + ("post_feedforward_layernorm",):
            setattr(self, name, OffsetRMSNorm(spec.hidden_size, spec.rms_norm_eps))

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's last normed output, the stream before adding it)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        attended = self.post_attention_layernorm(self.self_attn(hidden, rotary, context))
        hidden, residual = self.pre_feedforward_layernorm(attended, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(DecoderForCausalLM):
    def __init__(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> None:
        super().__init__(spec, parallel, Gemma3DecoderLayer, OffsetRMSNorm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        # HF rounds the scale to the weights' dtype before multiplying.
        hidden = hidden * torch.tensor(self.spec.hidden_size**0.5, dtype=hidden.dtype)
        ropes = {kind: self.spec.rope_of(index) for index, kind in enumerate(self.spec.layer_types)}
        rotary = {
            kind: rotary_cos_sin(positions, rope, self.spec.rotary_dim, hidden.dtype) for kind, rope in ropes.items()
        }
        residual = None
        for kind, layer in zip(self.spec.layer_types, self.model.layers):
            hidden, residual = layer(hidden, residual, rotary[kind], context)
        return self.model.norm(hidden, residual)[0]


def _rope(parameters: dict, kind: str) -> RopeSpec:
    """One layer kind's rope, from transformers' per-kind `rope_parameters`."""
    if kind not in parameters:
        raise ValueError(f"Gemma 3 config has no rope parameters for {kind!r} layers")
    return rope_from_parameters(dict(parameters[kind]), 10000.0)


class Gemma3Recipe(DenseDecoderRecipe):
    architectures = ("Gemma3ForCausalLM",)

    def spec(self, hf_config: object) -> DecoderSpec:
        layer_types = tuple(hf_config.layer_types)
        unknown = sorted(set(layer_types) - set(_KINDS))
        if unknown:
            raise ValueError(f"Gemma 3 layer types {unknown} are not supported; supported: {list(_KINDS)}")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(hf_config, name, None) is not None:
                raise ValueError(f"Gemma 3 with {name} is not supported yet")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not supported (an encoder, not a decoder)")
        parameters = dict(getattr(hf_config, "rope_parameters", None) or {})
        return read_dense_spec(
            hf_config,
            "Gemma3ForCausalLM",
            rope=_rope(parameters, FULL_ATTENTION),
            local_rope=_rope(parameters, SLIDING_ATTENTION),
            qk_norm=True,
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            sliding_window=hf_config.sliding_window,
            layer_types=layer_types,
            hidden_act=hf_config.hidden_activation,
            attention_scale=hf_config.query_pre_attn_scalar**-0.5,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
        )

    def build(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> nn.Module:
        return Gemma3ForCausalLM(spec, parallel)

    def bindings(self, model: nn.Module, spec: DecoderSpec) -> WeightBindings:
        return decoder_bindings(model, spec)
