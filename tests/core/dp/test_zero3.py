"""ZeRO-3's plan: blocks from the module tree, every element of every block owned by one rank, prefetch order, refusals."""
import pytest

from dualframe.dp.shard import check_shard
from dualframe.dp.zero3 import GatherOrder, ParameterShardPlan, block_of, block_paths, check_unshared
from dualframe.errors import StrategyError

# A small transformer's tree: embeddings, a ModuleList of blocks (each with an attention whose
# forward reads its child projection's weight), a final norm, a head.
TREE = [("embed", False), ("layers", True), ("layers.0", False), ("layers.0.attn", False),
        ("layers.0.attn.out_proj", False), ("layers.0.mlp", True), ("layers.0.mlp.0", False),
        ("layers.1", False), ("layers.1.attn", False), ("norm", False), ("head", False)]


def test_blocks_descend_through_containers_only():
    assert block_paths(TREE) == ["", "embed", "layers.0", "layers.1", "norm", "head"]
    # A root Sequential of layers: each layer a block.
    assert block_paths([("0", False), ("1", False), ("1.bn", False)]) == ["", "0", "1"]
    # A container inside a block is the block's, not a block of its own.
    assert block_of("layers.0.mlp.0.weight", block_paths(TREE)) == 2
    assert block_of("layers.0.attn.out_proj.weight", block_paths(TREE)) == 2
    assert block_of("pos", block_paths(TREE)) == 0
    assert block_of("layers.10.w", ["", "layers.1", "layers.10"]) == 2


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_element_owned_once(ranks):
    names = ["pos", "embed.weight", "layers.0.attn.w", "layers.0.mlp.0.weight", "layers.0.mlp.0.bias",
             "layers.1.attn.w", "head.weight", "head.bias"]
    sizes = [5, 40, 33, 17, 0, 33, 12, 3]
    plan = ParameterShardPlan.build(names, sizes, block_paths(TREE), ranks,
                                    dtypes=["float32"] * 7 + ["float16"])
    assert [b.path for b in plan.blocks] == ["", "embed", "layers.0", "layers.1", "head"]
    seen = {}
    for block in plan.blocks:
        for bucket in block.layout.buckets:
            for rank in range(ranks):
                for piece in bucket.pieces(rank):
                    t = block.tensors[piece.tensor]
                    for e in range(piece.start, piece.start + piece.length):
                        seen.setdefault((t, e), []).append(rank)
    assert sorted(seen) == [(t, e) for t, size in enumerate(sizes) for e in range(size)]
    assert all(len(owners) == 1 for owners in seen.values())
    assert sum(plan.owned_elements(r) for r in range(ranks)) == sum(sizes)
    # Each rank keeps 1/N, within one padding element per bucket.
    buckets = sum(len(b.layout.buckets) for b in plan.blocks)
    assert all(abs(plan.owned_elements(r) - sum(sizes) / ranks) <= buckets for r in range(ranks))
    assert plan.largest_block() == max(b.gathered_elements for b in plan.blocks) >= 40


def test_gather_order_prefetches_neighbours():
    order = GatherOrder()
    for b in (3, 1, 4, 1, 5):
        order.seen(b)
    assert order.order == [3, 1, 4, 5]
    assert [order.next_forward(b) for b in order.order] == [1, 4, 5, None]
    assert [order.next_backward(b) for b in order.order] == [None, 3, 1, 4]
    assert order.next_forward(9) is None and order.next_backward(9) is None


def test_last_blocks_kept_gathered_once_the_order_is_settled():
    order = GatherOrder()
    for b in (3, 1, 4, 5):
        order.seen(b)
    assert not any(order.kept(b, 4) for b in order.order)  # the first step: the order may still grow
    order.settled = True
    assert [b for b in order.order if order.kept(b, 1)] == [5]
    assert [b for b in order.order if order.kept(b, 2)] == [4, 5]
    assert [b for b in order.order if order.kept(b, 9)] == [3, 1, 4, 5]
    assert not any(order.kept(b, 0) for b in order.order)


def test_refusals():
    assert check_shard("Parameters") == "parameters"
    with pytest.raises(StrategyError, match=r"embed.weight is also head.weight\); untie it"):
        check_unshared({"embed.weight": ["embed.weight", "head.weight"]})
    with pytest.raises(StrategyError, match="one name, size and dtype per parameter"):
        ParameterShardPlan.build(["a"], [1, 2], [""], 2)
    with pytest.raises(StrategyError, match="ranks must be an int >= 1"):
        ParameterShardPlan.build(["a"], [1], [""], 0)
