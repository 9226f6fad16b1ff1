"""dualframe.torch.Pipeline: GPipe results equal the unsplit module's for balances, chunks, checkpoint modes."""
import copy
import threading
import time

import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.errors import ScheduleError, StageError
from dualframe.pipeline.schedule import gpipe, one_process_ticks, register, unregister
from dualframe.observe.timeline import render_png


def mlp(seed=0, dtype=torch.float64, dropout=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3)).to(dtype)


def step(model, x, seed=5):
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    out = model(x)
    out.pow(2).mean().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def assert_same(a, b, atol=1e-6):
    out, grad_x, grads = a
    ref_out, ref_grad_x, ref_grads = b
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=0)
    torch.testing.assert_close(grad_x, ref_grad_x, atol=atol, rtol=0)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=atol, rtol=0)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance, chunks, batch", [([4, 4], 4, 10), ([1, 3, 4], 3, 7), ([2, 2, 2, 2], 5, 5),
                                                    ([8], 3, 8), ([3, 5], 1, 6)])
def test_gpipe_equals_the_unsplit_module(balance, chunks, batch, checkpoint):
    reference = mlp()
    pipe = hvd.Pipeline(copy.deepcopy(reference), balance, ["cpu"] * len(balance), chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(batch, 6, dtype=torch.float64)
    assert_same(step(pipe, x), step(reference, x))


def fifo_gpipe(stages, chunks):
    """GPipe with backwards in forward order (F0 F1 B0 B1): a schedule registered for the test only."""
    return [sorted(actions, key=lambda a: (a.kind == "B", a.micro)) for actions in gpipe(stages, chunks)]


@pytest.fixture
def fifo():
    register("fifo", fifo_gpipe, one_process=True)
    yield "fifo"
    unregister("fifo")


def test_a_registered_schedule_runs_in_its_order_and_equals_the_unsplit_module(fifo):
    reference, m, n = mlp(), 3, 2
    pipe = hvd.Pipeline(copy.deepcopy(reference), [4, 4], ["cpu", "cpu"], chunks=m, checkpoint="never",
                        schedule=fifo)
    x = torch.randn(7, 6, dtype=torch.float64)
    with pipe.record() as timeline:
        result = step(pipe, x)
    assert_same(result, step(reference, x))
    backward = sorted((e for e in timeline.events if e.kind == "B"), key=lambda e: e.start)
    assert [(e.micro_batch, e.stage) for e in backward] == [c for t in one_process_ticks("fifo", m, n, "B") for c in t]
    assert [e.micro_batch for e in backward if e.stage == 1] == [0, 1, 2]  # gpipe would run 2, 1, 0
    assert pipe.schedule == "fifo"


class Untouchable(nn.Module):
    def forward(self, x):
        raise AssertionError("no compute may run for a refused schedule")


def test_1f1b_is_refused_by_name_before_any_compute_with_the_reason_and_what_to_use():
    with pytest.raises(ScheduleError) as error:
        hvd.Pipeline(nn.Sequential(Untouchable(), Untouchable()), [1, 1], ["cpu", "cpu"], chunks=4, schedule="1F1B")
    assert str(error.value).startswith(
        "the one-process Pipeline cannot run schedule '1f1b': 1f1b interleaves backward with forward")
    assert "needs the loss inside the pipeline" in str(error.value)
    assert "use schedule='gpipe' here, or DistributedPipeline(..., schedule='1f1b', loss_fn=...)" in str(error.value)
    with pytest.raises(ScheduleError, match=r"cannot run schedule 'zb-h1': zb-h1 interleaves backward with forward as "
                                            r"1f1b does .* DistributedPipeline\(\.\.\., schedule='zb-h1', loss_fn=\.\.\.\)"):
        hvd.Pipeline(nn.Sequential(Untouchable(), Untouchable()), [1, 1], ["cpu", "cpu"], chunks=4, schedule="zb-h1")
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zigzag'; choose one of gpipe, 1f1b"):
        hvd.Pipeline(mlp(), [4, 4], ["cpu", "cpu"], schedule="zigzag")
    assert hvd.Pipeline(mlp(), [4, 4], ["cpu", "cpu"]).schedule == "gpipe"


def test_float32_within_1e6_and_grads_accumulate_over_steps():
    reference = mlp(dtype=torch.float32)
    pipe = hvd.Pipeline(copy.deepcopy(reference), [3, 5], ["cpu", "cpu"], chunks=4)
    x = torch.randn(13, 6)
    step(pipe, x), step(reference, x)
    assert_same(step(pipe, x), step(reference, x))  # second backward adds to .grad, as in plain torch


def test_dropout_with_checkpointing_still_gives_correct_gradients():
    # Recomputation must replay the same dropout mask as the forward; compare with the pipeline's own
    # output by a finite check: gradient of sum(out * w) equals w through the saved mask.
    pipe = hvd.Pipeline(mlp(dropout=0.5), [3, 5], ["cpu", "cpu"], chunks=4, checkpoint="always")
    never = hvd.Pipeline(copy.deepcopy(pipe.partitions[0]) + copy.deepcopy(pipe.partitions[1]), [3, 5],
                         ["cpu", "cpu"], chunks=4, checkpoint="never")
    x = torch.randn(8, 6, dtype=torch.float64)
    assert_same(step(pipe, x, seed=3), step(never, x, seed=3))


def test_input_without_grad_and_eval_mode():
    reference = mlp()
    pipe = hvd.Pipeline(copy.deepcopy(reference), [4, 4], ["cpu", "cpu"], chunks=3)
    x = torch.randn(9, 6, dtype=torch.float64)
    pipe(x).sum().backward()
    reference(x).sum().backward()
    for g, r in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(g.grad, r.grad, atol=1e-6, rtol=0)
    pipe.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference.eval()(x), atol=1e-6, rtol=0)


def test_deferred_batch_norm_tracks_whole_mini_batch_statistics():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).double()
    plain = hvd.Pipeline(copy.deepcopy(reference), [2, 2], ["cpu", "cpu"], chunks=4, checkpoint="always")
    deferred = hvd.Pipeline(copy.deepcopy(reference), [2, 2], ["cpu", "cpu"], chunks=4, checkpoint="always",
                            deferred_batch_norm=True)
    assert isinstance(deferred.partitions[0][1], hvd.DeferredBatchNorm)
    for _ in range(2):
        x = torch.randn(16, 4, dtype=torch.float64) * 3 + 1
        for model in (reference, plain, deferred):
            model(x).sum().backward()
    ref_bn, plain_bn, deferred_bn = reference[1], plain.partitions[0][1], deferred.partitions[0][1]
    torch.testing.assert_close(deferred_bn.running_mean, ref_bn.running_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(deferred_bn.running_var, ref_bn.running_var, atol=1e-6, rtol=0)
    assert int(deferred_bn.num_batches_tracked) == 2
    # per micro-batch BatchNorm (and its recomputation) drifts away from the whole-batch statistics
    assert not torch.allclose(plain_bn.running_var, ref_bn.running_var, atol=1e-3)
    assert int(plain_bn.num_batches_tracked) > 2


class SleepFn(torch.autograd.Function):
    """x * scale that sleeps in forward and in backward (sleep releases the GIL)."""

    @staticmethod
    def forward(ctx, x, scale, seconds):
        ctx.save_for_backward(x, scale)
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        time.sleep(ctx.seconds)
        return grad * scale, (grad * x).sum(), None


class Sleep(nn.Module):
    """A stage of known duration, so that stages on "cpu" can overlap in threads."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return SleepFn.apply(x, self.scale, self.seconds)


def test_cells_of_a_tick_overlap_and_the_timeline_holds_every_cell(tmp_path):
    m, n = 4, 3
    pipe = hvd.Pipeline(nn.Sequential(*[Sleep(0.05) for _ in range(n)]), [1] * n, ["cpu"] * n, chunks=m,
                        checkpoint="never", overlap_cpu=True)
    with pipe.record() as timeline:
        pipe(torch.ones(m, 2)).sum().backward()
    events = timeline.events
    assert sorted((e.kind, e.micro_batch, e.stage) for e in events) == sorted(
        (k, i, j) for k in "FB" for i in range(m) for j in range(n))
    # Cells of one tick run at the same time: their intervals intersect (robust to a loaded machine,
    # unlike a wall-clock bound; the bubble itself is measured by scripts/bench_pipeline.py).
    by_cell = {(e.kind, e.micro_batch, e.stage): e for e in events}
    overlapping = total = 0
    for kind in "FB":
        for tick in one_process_ticks("gpipe", m, n, kind):
            if len(tick) > 1:
                cells = [by_cell[(kind, i, j)] for i, j in tick]
                total += 1
                overlapping += max(c.start for c in cells) < min(c.end for c in cells)
    assert overlapping >= total - 1, f"only {overlapping} of {total} multi-cell ticks overlapped"
    assert "theoretical (n-1)/(m+n-1) = 0.333" in timeline.summary()
    assert open(render_png(events, tmp_path / "t.png"), "rb").read(4) == b"\x89PNG"


class ThreadOf(nn.Module):
    """Identity that notes the thread each call runs in."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def forward(self, x):
        self.seen.add(threading.get_ident())
        return x


@pytest.mark.parametrize("overlap_cpu, threads", [(False, 1), (True, 2)])
def test_cells_sharing_a_device_run_in_the_calling_thread_unless_overlap_cpu(overlap_cpu, threads):
    seen = set()
    reference = mlp()
    layers = list(copy.deepcopy(reference))
    pipe = hvd.Pipeline(layers[:4] + [ThreadOf(seen)] + layers[4:], [4, 5], ["cpu", "cpu"], chunks=4,
                        overlap_cpu=overlap_cpu)
    x = torch.randn(10, 6, dtype=torch.float64)
    assert_same(step(pipe, x), step(reference, x))
    # stage 1 shares ticks with stage 0 (pool thread with overlap_cpu) and runs the last tick alone
    assert len(seen) == threads and threading.get_ident() in seen
    with pytest.raises(TypeError, match=r"overlap_cpu must be True or False \(overlap_cpu: 'yes'\)"):
        hvd.Pipeline(mlp(), [4, 4], ["cpu", "cpu"], chunks=2, overlap_cpu="yes")


def test_a_failing_stage_names_its_cell_and_no_thread_hangs():
    class Boom(nn.Module):
        def forward(self, x):
            if x.shape[0] == 2:  # the last, smaller micro-batch
                raise RuntimeError("bad rows")
            return x

    pipe = hvd.Pipeline(nn.Sequential(nn.Linear(3, 3), Boom()), [1, 1], ["cpu", "cpu"], chunks=3)
    before = threading.active_count()
    with pytest.raises(StageError, match=r"stage 1 failed on micro-batch 2 \(F2 at tick 3\): RuntimeError: bad rows") as info:
        pipe(torch.randn(8, 3))
    assert ">F2<" in str(info.value)
    time.sleep(0.05)
    assert threading.active_count() <= before


def test_a_recomputation_replays_its_own_devices_generator_and_no_other():
    from dualframe.torch.split.rng import replay_on

    forward, recompute = replay_on(torch.device("cpu"))()
    with forward:
        first = torch.rand(3)
    torch.rand(3)
    state = torch.get_rng_state()
    with recompute:
        assert torch.equal(torch.rand(3), first)  # the forward's draws again
    assert torch.equal(torch.get_rng_state(), state)  # and the generator goes on from where it stood
    forward, recompute = replay_on(torch.device("meta"))()  # a stage on another device (a GPU's stand-in)
    with forward:
        pass
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with recompute:  # a CPU stage drawing in its own thread meanwhile sees its generator untouched
        assert torch.equal(torch.rand(3), expected)


class Pair(nn.Module):
    """Returns a tuple (x, tanh(x)): an output that is not one tensor."""

    def forward(self, x):
        return x, torch.tanh(x)


def test_a_sequential_ending_in_a_tuple_joins_it_over_micro_batches_as_a_graph_output():
    reference = nn.Sequential(*list(mlp())[:4], Pair())
    pipe = hvd.Pipeline(copy.deepcopy(reference), [2, 3], ["cpu", "cpu"], chunks=3, checkpoint="always")
    x = torch.randn(7, 6, dtype=torch.float64)
    got, want = pipe(x), reference(x)
    assert isinstance(got, tuple) and len(got) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    (got[0].sum() + got[1].pow(2).sum()).backward()
    (want[0].sum() + want[1].pow(2).sum()).backward()
    for p, q in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=0)


def test_a_sequential_takes_one_tensor_and_keeps_its_partitions_keys():
    pipe = hvd.Pipeline(mlp(), [4, 4], ["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"the input must be one tensor \(got Tensor, Tensor\)"):
        pipe(x, x)
    with pytest.raises(TypeError, match=r"the input must be one tensor \(got x=Tensor\)"):
        pipe(x=x)
    assert list(pipe.state_dict())[:2] == ["partitions.0.0.weight", "partitions.0.0.bias"]
