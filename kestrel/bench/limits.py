"""What a step must at least read and compute: the physical limits the benchmarks print
beside their measurements.

The bytes are the ones a step really touches. Every dense weight is read once per step, but
a mixture-of-experts layer reads only the experts its tokens were routed to: at batch 1 its
top-k, at larger batches the expected number of distinct experts hit (uniform routing). Each
sequence also reads its KV context and reads and writes its recurrent state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.core.layer_spec import AttentionLayer
from kestrel.layers.moe import RoutedExperts
from kestrel.layers.quantized import WIDE_MIN_ROWS, Fp8Weight, Int4VnniWeight, Int4Weight, PackedWeight


@dataclass(frozen=True)
class ExpertStack:
    """One MoE layer's routed experts."""

    num_experts: int
    top_k: int
    bytes_per_expert: int
    params_per_expert: int

    def expected_distinct(self, batch: int) -> float:
        """Distinct experts `batch` tokens hit when each picks top_k of them uniformly."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)


@dataclass(frozen=True)
class ModelCost:
    dense_weight_bytes: int  # read every step: attention, dense MLPs, shared experts, routers, LM head
    dense_params: int  # multiplied by every token (neither the embedding table nor the LM head)
    lm_head_params: int  # multiplied by sampled positions only
    experts: tuple[ExpertStack, ...]
    kv_bytes_per_token: int  # one token of context, over every attention layer
    recurrent_bytes_per_sequence: int  # one sequence's state, over every linear-attention layer
    attention_width: int  # sum over attention layers of heads x head_dim (the score FLOPs)
    # Packed 4-bit weights with a bfloat16 copy: what a step of WIDE_MIN_ROWS rows or more reads
    # beyond `dense_weight_bytes` (the copy, not the 4-bit codes).
    wide_extra_bytes: int = 0
    num_params: int = 0  # every weight, counted unpacked

    @classmethod
    def of(cls, parts) -> ModelCost:
        """The cost of the model an engine runs (its parameters as loaded, its pools)."""
        model, spec = parts.runner.model, parts.spec
        # Every mixture of experts says what its routed experts are (`routed_experts`).
        experts = tuple(_expert_stack(m.routed_experts()) for m in model.modules() if hasattr(m, "routed_experts"))
        expert_bytes = sum(stack.bytes_per_expert * stack.num_experts for stack in experts)
        expert_params = sum(stack.params_per_expert * stack.num_experts for stack in experts)
        table = spec.vocab_size * spec.hidden_size
        element = torch.empty((), dtype=parts.dtype).element_size()
        packed = [w for w in (getattr(m, "weight", None) for m in model.modules()) if isinstance(w, PackedWeight)]
        int4 = [w for w in packed if isinstance(w, Int4Weight | Int4VnniWeight)]
        wide_bytes = sum(_bytes(w.wide) for w in int4 if w.wide is not None)
        narrow_bytes = sum(w.narrow_bytes for w in int4 if w.wide is not None)
        # Off CUDA a float8 weight is read through its dequantized reference, not its float8 values.
        unread_fp8 = sum(_bytes(w.values) for w in packed if isinstance(w, Fp8Weight) and w.reference is not None)
        all_bytes = sum(_bytes(p) for p in model.parameters()) - wide_bytes - unread_fp8  # one row reads the codes
        all_params = sum(p.numel() for p in model.parameters()) + _packed_params_unpacked(packed)
        # An untied embedding table is only looked up (a few rows a step); a tied one is the LM head.
        dense_bytes = all_bytes - expert_bytes - (0 if spec.tie_word_embeddings else table * element)
        dense_params = all_params - expert_params - table * (1 if spec.tie_word_embeddings else 2)
        kv = parts.kv.spec
        recurrent = parts.recurrent.spec.bytes_per_slot() if parts.recurrent is not None else 0
        width = sum(layer.num_heads * layer.head_dim for layer in spec.layers if isinstance(layer, AttentionLayer))
        kv_per_token = kv.bytes_per_page() // kv.page_size
        wide_extra = wide_bytes - narrow_bytes
        return cls(dense_bytes, dense_params, table, experts, kv_per_token, recurrent, width, wide_extra, all_params)

    def weight_bytes(self, batch: int) -> float:
        """Weight bytes one decode step of `batch` sequences reads."""
        routed = sum(stack.expected_distinct(batch) * stack.bytes_per_expert for stack in self.experts)
        wide = self.wide_extra_bytes if batch >= WIDE_MIN_ROWS else 0
        return self.dense_weight_bytes + wide + routed

    def decode_step_bytes(self, batch: int, mean_context: float) -> float:
        """Bytes one decode step of `batch` sequences of `mean_context` tokens moves."""
        per_sequence = mean_context * self.kv_bytes_per_token + 2 * self.recurrent_bytes_per_sequence
        return self.weight_bytes(batch) + batch * per_sequence

    def flops_per_token(self, context: float) -> float:
        """FLOPs one token costs in the decoder layers (routed experts: its top-k), attending
        to `context` tokens; the LM head is counted apart."""
        active = self.dense_params + sum(stack.top_k * stack.params_per_expert for stack in self.experts)
        return 2 * active + 4 * self.attention_width * context


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _packed_params_unpacked(packed: list[PackedWeight]) -> int:
    """What packing hides from a count of parameter elements: each packed weight holds rows x
    columns weights in fewer, wider elements, plus its scales (and any bfloat16 copy)."""
    hidden = 0
    for weight in packed:
        rows, columns = weight.shape
        hidden += rows * columns - sum(t.numel() for t in weight.tensors().values())
    return hidden


def _expert_stack(routed: RoutedExperts) -> ExpertStack:
    """The routed experts; an always-on expert stacked after them counts as dense."""
    params = sum(t.numel() // t.shape[0] for t in routed.tensors)
    num_bytes = sum(t.numel() // t.shape[0] * t.element_size() for t in routed.tensors)
    return ExpertStack(routed.num_experts, routed.top_k, num_bytes, params)


def memory_limit_tokens_per_s(
    cost: ModelCost, prompts: int, input_len: int, output_len: int, batch: int, bandwidth: float
) -> float:
    """Output tokens/s if the bytes decoding must read moved at `bandwidth`: the weights each
    decode step reads (up to `batch` requests share one) and every decoded token's context
    and recurrent state.

    Attention kernels read KV while matmuls compute, one after the other in each layer, so a
    long-context run is bound by both limits in sequence rather than by the larger alone.
    """
    tokens = prompts * output_len
    concurrency = min(prompts, batch)
    steps = tokens / concurrency
    per_token = (input_len + output_len / 2) * cost.kv_bytes_per_token + 2 * cost.recurrent_bytes_per_sequence
    return tokens / ((steps * cost.weight_bytes(concurrency) + tokens * per_token) / bandwidth)


def compute_limit_tokens_per_s(cost: ModelCost, prompts: int, input_len: int, output_len: int, rate: float) -> float:
    """Output tokens/s if every necessary FLOP ran at `rate`: every token through the decoder
    layers, sampled positions (one per output token) through the LM head."""
    tokens = prompts * (input_len + output_len)
    mean_context = (input_len + output_len) / 2
    total = tokens * cost.flops_per_token(mean_context) + 2 * cost.lm_head_params * prompts * output_len
    return prompts * output_len / (total / rate)
