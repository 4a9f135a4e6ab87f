"""Every tensor-parallel layer type against its unsharded self: each rank loads its slice
from the same checkpoint tensors, and the ranks' parts, summed or joined as the layer's
collective would, equal the whole layer's output."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kestrel.core.parallel import TensorParallel
from kestrel.core.weight_bindings import WeightBindingError
from kestrel.layers.embedding import VocabParallelEmbedding, vocab_rows
from kestrel.layers.linear import ColumnParallelLinear, FusedColumnLinear, RowParallelLinear, ShardSlice
from kestrel.layers.moe import SparseMoe
from kestrel.layers.rotary import RopeSpec
from kestrel.models.dense import attention_shards
from kestrel.models.spec import DecoderSpec

RANKS = 2


@dataclass(frozen=True)
class WithoutCollectives(TensorParallel):
    """One rank's layer with its collective left out, so the test can combine the parts."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def ranks() -> list[TensorParallel]:
    return [WithoutCollectives(rank, RANKS) for rank in range(RANKS)]


def load(module: torch.nn.Module, tensors: dict[str, torch.Tensor], shard_ids: dict[str, str | None]) -> None:
    for name, tensor in tensors.items():
        param_name, shard_id = shard_ids.get(name, (name, None))
        module.load_shard(dict(module.named_parameters())[param_name], tensor, shard_id)


def test_column_parallel_stack_joins_back_into_the_whole():
    torch.manual_seed(0)
    q, k = torch.randn(8, 6), torch.randn(4, 6)
    x = torch.randn(3, 6)
    whole = ColumnParallelLinear(6, {"q": ShardSlice.whole(8), "k": ShardSlice.whole(4)})
    load(whole, {"q": q, "k": k}, {"q": ("weight", "q"), "k": ("weight", "k")})
    parts = []
    for parallel in ranks():
        shards = {"q": ShardSlice(parallel.rank * 4, 4, 8), "k": ShardSlice(parallel.rank * 2, 2, 4)}
        layer = ColumnParallelLinear(6, shards)
        load(layer, {"q": q, "k": k}, {"q": ("weight", "q"), "k": ("weight", "k")})
        parts.append(layer.split(layer(x)))
    full_q, full_k = whole.split(whole(x))
    torch.testing.assert_close(torch.cat([p[0] for p in parts], dim=-1), full_q)
    torch.testing.assert_close(torch.cat([p[1] for p in parts], dim=-1), full_k)


def test_a_fused_checkpoint_tensor_gives_each_rank_its_rows_of_every_part():
    """Phi-3's qkv_proj: q then k whole in one tensor; each rank takes its rows of each."""
    torch.manual_seed(1)
    q, k = torch.randn(8, 6), torch.randn(4, 6)
    for parallel in ranks():
        shards = {"q": ShardSlice(parallel.rank * 4, 4, 8), "k": ShardSlice(parallel.rank * 2, 2, 4)}
        fused, separate = FusedColumnLinear(6, shards), ColumnParallelLinear(6, shards)
        fused.load_shard(fused.weight, torch.cat((q, k)), None)
        load(separate, {"q": q, "k": k}, {"q": ("weight", "q"), "k": ("weight", "k")})
        assert torch.equal(fused.weight, separate.weight)
        with pytest.raises(WeightBindingError, match=r"parts \['q', 'k'\]: expected 12 rows, got \(11, 6\)"):
            fused.load_shard(fused.weight, torch.cat((q, k))[:11], None)


def test_row_parallel_partial_products_sum_to_the_whole():
    torch.manual_seed(1)
    weight, x = torch.randn(5, 8), torch.randn(3, 8)
    partial_sum = 0
    for parallel in ranks():
        layer = RowParallelLinear(8, 5, parallel)
        layer.load_shard(layer.weight, weight, None)
        columns = slice(parallel.rank * 4, parallel.rank * 4 + 4)
        partial_sum = partial_sum + layer(x[:, columns])
    torch.testing.assert_close(partial_sum, x @ weight.T)


def test_vocab_parallel_embedding_and_head_cover_an_uneven_vocabulary():
    torch.manual_seed(2)
    vocab, hidden = 11, 4  # 6 rows per rank, the last one padded
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 5, 6, 10, 3])
    looked_up, logits = 0, []
    states = torch.randn(2, hidden)
    for parallel in ranks():
        embedding = VocabParallelEmbedding(vocab, hidden, parallel)
        embedding.load_shard(embedding.weight, table, None)
        looked_up = looked_up + embedding(ids)
        head = ColumnParallelLinear(hidden, {None: vocab_rows(vocab, parallel)})
        head.load_shard(head.weight, table, None)
        logits.append(head(states))
    torch.testing.assert_close(looked_up, table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], states @ table.T)


def test_sharded_experts_sum_to_the_whole_mixture():
    torch.manual_seed(3)
    hidden, inter, experts, top_k = 6, 8, 3, 2
    tensors = {}
    for e in range(experts):
        tensors[f"{e}:gate"], tensors[f"{e}:up"] = torch.randn(inter, hidden), torch.randn(inter, hidden)
        tensors[f"{e}:down"] = torch.randn(hidden, inter)
    router = torch.randn(experts, hidden)
    x = torch.randn(5, hidden)

    def build(parallel: TensorParallel) -> SparseMoe:
        moe = SparseMoe(hidden, inter, experts, top_k, True, parallel)
        moe.gate.weight.data.copy_(router)
        for shard, tensor in tensors.items():
            target = moe.experts.w2 if shard.endswith("down") else moe.experts.w13
            target.load_shard(target.weight, tensor, shard)
        return moe

    whole = build(TensorParallel())
    parts = sum(build(parallel)(x) for parallel in ranks())
    torch.testing.assert_close(parts, whole(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads, expected", [(4, [(0, 2), (2, 2)]), (1, [(0, 1), (0, 1)])])
def test_kv_heads_split_or_replicate_across_ranks(kv_heads, expected):
    spec = DecoderSpec(
        architecture="test",
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=kv_heads,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope=RopeSpec(theta=10000.0),
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    for parallel, (first, count) in zip(ranks(), expected):
        shards = attention_shards(spec, parallel)
        assert shards["k"] == ShardSlice(first * 8, count * 8, kv_heads * 8)
        assert shards["q"] == ShardSlice(parallel.rank * 16, 16, 32)


def test_uneven_head_split_is_a_clear_error():
    with pytest.raises(ValueError, match="num_attention_heads \\(6\\) is not divisible by tensor_parallel_size 4"):
        TensorParallel(0, 4).split(6, "num_attention_heads")


def test_deltanet_projection_ranks_hold_their_key_heads_and_the_value_heads_under_them():
    from kestrel.models.hybrid import DeltaNetShard, LinearAttentionProjection
    from kestrel.models.spec import LinearAttentionSpec

    torch.manual_seed(4)
    linear = LinearAttentionSpec(
        num_key_heads=2, num_value_heads=4, key_head_dim=3, value_head_dim=2, conv_kernel=4, grouped_projection=False
    )
    hidden = 5
    tensors = {
        "qkv": torch.randn(linear.conv_channels, hidden),
        "z": torch.randn(linear.value_size, hidden),
        "b": torch.randn(4, hidden),
        "a": torch.randn(4, hidden),
    }
    x = torch.randn(2, hidden)
    q, k, v = (x @ part.T for part in tensors["qkv"].split((6, 6, 8)))
    z, b, a = (x @ tensors[name].T for name in ("z", "b", "a"))
    for parallel in ranks():
        layer = LinearAttentionProjection(hidden, DeltaNetShard.of(linear, parallel))
        for name, tensor in tensors.items():
            layer.load_shard(layer.weight, tensor, name)
        got_qkv, got_z, got_b, got_a = layer.split(layer(x))
        key_cols = slice(3 * parallel.rank, 3 * parallel.rank + 3)  # one key head of 3 dims
        value_cols = slice(4 * parallel.rank, 4 * parallel.rank + 4)  # its two value heads of 2
        heads = slice(2 * parallel.rank, 2 * parallel.rank + 2)
        torch.testing.assert_close(got_qkv, torch.cat((q[:, key_cols], k[:, key_cols], v[:, value_cols]), dim=-1))
        torch.testing.assert_close(got_z, z[:, value_cols])
        torch.testing.assert_close(got_b, b[:, heads])
        torch.testing.assert_close(got_a, a[:, heads])
