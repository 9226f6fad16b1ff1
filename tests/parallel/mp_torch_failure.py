"""Collectives that disagree across ranks (shape, dtype, op, root rank) raise on every rank instead of hanging.

Every rank runs every test; each mismatch is made by rank-dependent arguments to the same call, so
both ranks reach every collective. After each error Horovod keeps working (checked by a good allreduce).
"""
import pytest
import torch

import dualframe.torch as hvd


def setup_module():
    hvd.init()


def still_works(name):
    total = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=name)
    assert torch.equal(total, torch.full((2,), float(hvd.size())))


@pytest.mark.parametrize("case, message", [
    ("shape", r"Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape \[[34]\], but another rank sent a tensor of shape \[[34]\]"),
    ("dtype", r"Mismatched data types: One rank had type float(32|64), but another rank had type float(32|64)"),
    ("op", r"Mismatched reduction operation"),
    ("root", r"Mismatched BROADCAST root ranks"),
])
def test_mismatch_is_an_error_on_every_rank(case, message):
    r = hvd.rank()
    calls = {
        "shape": lambda: hvd.allreduce(torch.ones(3 + r), name="mismatch.shape"),
        "dtype": lambda: hvd.allreduce(torch.ones(3, dtype=(torch.float32, torch.float64)[r]), name="mismatch.dtype"),
        "op": lambda: hvd.allreduce(torch.ones(3), op=(hvd.Average, hvd.Sum)[r], name="mismatch.op"),
        "root": lambda: hvd.broadcast(torch.ones(3), root_rank=r, name="mismatch.root"),
    }
    with pytest.raises(hvd.HorovodInternalError, match=message):
        calls[case]()
    still_works(f"after.{case}")
