"""The sharded-optimizer layout: every element owned by exactly one rank, slices equal, bad input refused."""
import itertools

import pytest

from dualframe.dp.shard import ShardLayout, check_same_parameters, check_shard, parameter_signature
from dualframe.errors import StrategyError


def _owners(layout):
    """(tensor, element) -> list of (rank, bucket index, offset in the rank's slice)."""
    owners = {}
    for b, bucket in enumerate(layout.buckets):
        for rank in range(layout.ranks):
            for piece in bucket.pieces(rank):
                for e in range(piece.length):
                    owners.setdefault((piece.tensor, piece.start + e), []).append((rank, b, piece.offset + e))
    return owners


@pytest.mark.parametrize("sizes,ranks,limit", [
    ([6, 4, 3], 2, None), ([1], 4, None), ([5, 0, 7, 2], 3, 6), ([10, 10, 10], 4, 15), ([3, 3], 8, None),
])
def test_every_element_is_owned_once_at_its_flat_position(sizes, ranks, limit):
    layout = ShardLayout.build(sizes, ranks, bucket_elements=limit)
    owners = _owners(layout)
    assert sorted(owners) == [(t, e) for t, size in enumerate(sizes) for e in range(size)]
    for (t, e), where in owners.items():
        assert len(where) == 1
        rank, b, offset = where[0]
        bucket = layout.buckets[b]
        flat = bucket.offsets[bucket.tensors.index(t)] + e
        assert flat == rank * bucket.shard + offset  # the allgathered buffer puts it back in place
    assert sum(layout.owned_elements(r) for r in range(ranks)) == sum(sizes)
    for bucket in layout.buckets:
        assert bucket.padded % ranks == 0 and bucket.padded - bucket.length < ranks


def test_literal_layout_two_ranks():
    layout = ShardLayout.build([6, 4, 3], ranks=2)
    (bucket,) = layout.buckets
    assert (bucket.length, bucket.shard, bucket.padded) == (13, 7, 14)
    assert [(p.tensor, p.start, p.offset, p.length) for p in bucket.pieces(0)] == [(0, 0, 0, 6), (1, 0, 6, 1)]
    assert [(p.tensor, p.start, p.offset, p.length) for p in bucket.pieces(1)] == [(1, 1, 0, 3), (2, 0, 3, 3)]


def test_dtypes_never_share_a_bucket_and_buckets_respect_the_limit():
    layout = ShardLayout.build([4, 4, 4, 20, 4], 2, dtypes=["f32", "f16", "f32", "f32", "f16"], bucket_elements=10)
    assert [b.tensors for b in layout.buckets] == [(0, 2), (3,), (1, 4)]
    for bucket in layout.buckets:
        assert len(bucket.tensors) == 1 or bucket.length <= 10


def test_more_ranks_than_elements_leaves_some_ranks_empty():
    layout = ShardLayout.build([3], 8)
    assert [layout.owned_elements(r) for r in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert layout.buckets[0].pieces(7) == []


@pytest.mark.parametrize("shard,op", [("optimizer", "adasum"), ("gradients", "max"), ("Gradients", "min")])
def test_ops_a_reduce_scatter_cannot_carry_are_refused(shard, op):
    with pytest.raises(StrategyError, match=rf"needs op Average or Sum \(op: {op}\)"):
        check_shard(shard, op)


@pytest.mark.parametrize("bad", ["zero", 1, True, ["optimizer"]])
def test_unknown_shard_is_refused(bad):
    with pytest.raises(StrategyError, match="unknown shard"):
        check_shard(bad)


def test_modes_are_normalised():
    assert [check_shard(s, op) for s, op in itertools.product(["OPTIMIZER", "gradients"], ["sum", "average"])] == \
        ["optimizer"] * 2 + ["gradients"] * 2
    assert check_shard("Parameters") == "parameters"  # ZeRO-3
    with pytest.raises(StrategyError, match=r"shard='parameters' reduce-scatters .* \(op: adasum\)"):
        check_shard("parameters", "adasum")


@pytest.mark.parametrize("kwargs,match", [
    (dict(sizes=[1], ranks=0), "ranks must be"), (dict(sizes=[-1], ranks=2), "tensor 0"),
    (dict(sizes=[1, 2], ranks=2, dtypes=["f"]), "one dtype per tensor"),
    (dict(sizes=[1], ranks=2, bucket_elements=0), "bucket_elements"),
])
def test_bad_layout_arguments_are_refused(kwargs, match):
    with pytest.raises(StrategyError, match=match):
        ShardLayout.build(**kwargs)


def test_differing_parameter_sets_name_the_rank():
    same = parameter_signature([("a", (2,), "float32"), ("b", (3, 3), "float32")])
    other = parameter_signature([("a", (2,), "float32"), ("b", (3, 3), "float16")])
    check_same_parameters([same, same, same], [2, 2, 2])
    with pytest.raises(StrategyError, match="rank 2 differs from rank 0"):
        check_same_parameters([same, same, other], [2, 2, 2])
