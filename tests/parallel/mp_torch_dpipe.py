"""DistributedPipeline on 2 processes (one stage each), GPipe, 1F1B and ZB-H1, against one process training the whole model."""
import copy
import os

import horovod.torch as horovod
import pytest
import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.errors import BalanceError, ChunksError, ScheduleError, StrategyError
from dualframe.torch.pipeline.distributed import DistributedPipeline
from torch_cases import (check_pipeline_training, merged_state_dict, pipeline_batches, pipeline_model,  # on sys.path
                         pipeline_reference)

STEPS, BATCH, CHUNKS = 4, 10, 4  # micro-batches of 3, 3, 2, 2 rows


def batches():
    return pipeline_batches(BATCH, STEPS)  # the same seeds as the cluster's pipeline test


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()
    assert hvd.size() == 2


def test_bad_input_is_refused_on_every_rank_before_communication():
    with pytest.raises(BalanceError, match=r"balance must sum to the number of layers \(balance: \[2, 2\] = 2 \+ 2 = 4, layers: 5\)"):
        DistributedPipeline(pipeline_model(), [2, 2], chunks=2, loss_fn=nn.MSELoss())
    with pytest.raises(StrategyError, match=r"multiple of the number of stages \(processes: 2, stages: 3\)"):
        DistributedPipeline(pipeline_model(), [2, 2, 1], chunks=2, loss_fn=nn.MSELoss())
    with pytest.raises(ChunksError, match=r"chunks must be an int >= 1 \(chunks: 0\)"):
        DistributedPipeline(pipeline_model(), [3, 2], chunks=0, loss_fn=nn.MSELoss())
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zigzag'; choose one of gpipe, 1f1b"):
        DistributedPipeline(pipeline_model(), [3, 2], chunks=2, schedule="zigzag", loss_fn=nn.MSELoss())
    with pytest.raises(StrategyError, match=r"data_parallel x stages must equal the number of processes \(data_parallel: 2"):
        DistributedPipeline(pipeline_model(), [3, 2], chunks=2, loss_fn=nn.MSELoss(), data_parallel=2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_training_equals_one_process(schedule):
    model, data = pipeline_model(), batches()
    pipe = DistributedPipeline(copy.deepcopy(model), balance=[3, 2], chunks=CHUNKS, schedule=schedule,
                               loss_fn=nn.MSELoss())
    assert [name for name, _ in pipe.named_parameters()] == (["0.weight", "0.bias", "2.weight", "2.bias"]
                                                            if hvd.rank() == 0 else ["4.weight", "4.bias"])
    # Inputs are read on the first stage, targets on the last: the others pass None.
    check_pipeline_training(pipe, data, pipeline_reference(model, data))
    assert pipe.records.records[-1].wall > 0


def test_1f1b_and_zb_h1_keep_fewer_activations_alive_than_gpipe():
    x, y = torch.randn(64, 6), torch.randn(64, 3)
    peaks = {}
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        pipe = DistributedPipeline(pipeline_model(), balance=[3, 2], chunks=8, schedule=schedule, loss_fn=nn.MSELoss())
        pipe.train_step(x, y)
        peaks[schedule] = pipe.meter.peak_bytes
        assert pipe.meter.live_bytes == 0
    if hvd.rank() == 0:  # stage 0 holds all 8 micro-batches with GPipe, at most 2 with 1F1B and ZB-H1
        assert peaks["1f1b"] * 3 < peaks["gpipe"], peaks
        assert peaks["zb-h1"] <= peaks["1f1b"], peaks  # B keeps the graph until W, within 1F1B's count


def train_pipeline(model, data, schedule, checkpoint, balance=(3, 2)):
    """A pipeline of (a copy of) ``model`` trained on ``data``: its losses and the merged state_dict."""
    pipe = DistributedPipeline(copy.deepcopy(model), balance=list(balance), chunks=CHUNKS, schedule=schedule,
                               loss_fn=nn.MSELoss(), checkpoint=checkpoint)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        losses.append(pipe.train_step(x, y))
        optimizer.step()
    assert pipe.meter.live_bytes == 0
    return losses, merged_state_dict(pipe)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_checkpointed_stages_train_as_one_process_in_float64(schedule, checkpoint):
    model, data = pipeline_model().double(), [(x.double(), y.double()) for x, y in batches()]
    expected_losses, expected_state = pipeline_reference(model, data)
    losses, state = train_pipeline(model, data, schedule, checkpoint)
    assert losses == pytest.approx(expected_losses, abs=1e-9)
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, atol=1e-9, rtol=0)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_checkpointing_replays_dropout_masks_and_updates_batch_norm_once(schedule):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 16), nn.ReLU(),
                          nn.Dropout(0.2), nn.Linear(16, 3))
    runs = {}
    for checkpoint in ("never", "always"):
        torch.manual_seed(5)  # the same masks drawn in the same order on each rank
        runs[checkpoint] = train_pipeline(model, batches()[:3], schedule, checkpoint, balance=(3, 4))
    assert runs["always"][0] == pytest.approx(runs["never"][0], abs=1e-6)
    for key, value in runs["never"][1].items():  # BatchNorm's running statistics and step count included
        torch.testing.assert_close(runs["always"][1][key], value, atol=1e-6, rtol=0)


def test_checkpointing_keeps_fewer_activations_alive_and_bad_modes_are_refused():
    x, y = torch.randn(64, 6), torch.randn(64, 3)
    peaks = {}
    for checkpoint in ("never", "except_last", "always"):
        pipe = DistributedPipeline(pipeline_model(), balance=[3, 2], chunks=8, loss_fn=nn.MSELoss(),
                                   checkpoint=checkpoint)
        pipe.train_step(x, y)
        peaks[checkpoint] = pipe.meter.peak_bytes
    if hvd.rank() == 0:  # GPipe: stage 0 holds 8 micro-batches' activations; checkpointed, their inputs and one graph
        assert peaks["always"] * 2.5 < peaks["never"], peaks
        assert peaks["except_last"] == peaks["always"], peaks  # 8 inputs and one micro-batch's graph either way
    with pytest.raises(StrategyError, match=r"unknown checkpoint 'sometimes'; choose one of always, except_last, never"):
        DistributedPipeline(pipeline_model(), [3, 2], chunks=2, loss_fn=nn.MSELoss(), checkpoint="sometimes")


def test_inference_forward_equals_the_whole_model():
    model = pipeline_model()
    pipe = DistributedPipeline(copy.deepcopy(model), balance=[3, 2], chunks=3, loss_fn=nn.MSELoss())
    x = torch.randn(7, 6)
    with torch.no_grad():
        out = pipe(x)
        expected = model(x)
    if pipe.is_last:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    else:
        assert out is None


def test_load_state_dict_takes_this_stage_part_of_the_full_dict():
    pipe = DistributedPipeline(pipeline_model(), balance=[3, 2], chunks=2, loss_fn=nn.MSELoss())
    torch.manual_seed(99)
    other = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    pipe.load_state_dict(other.state_dict())
    merged = merged_state_dict(pipe)
    for key, value in other.state_dict().items():
        assert torch.equal(merged[key], value), key


def test_bad_batches_are_refused_on_every_rank():
    pipe = DistributedPipeline(pipeline_model(), balance=[3, 2], chunks=4, loss_fn=nn.MSELoss())
    with pytest.raises(ChunksError, match=r"the batch is smaller than chunks \(batch: 3, chunks: 4\)"):
        pipe.train_step(torch.randn(3, 6), torch.randn(3, 3))
    with pytest.raises(StrategyError, match=r"the first stage of the pipeline got inputs=None"):
        pipe.train_step(None, torch.randn(8, 3))
    with pytest.raises(ChunksError, match=r"targets must have one row per input row \(inputs: 8 rows, targets: 6 rows\)"):
        pipe.train_step(torch.randn(8, 6), torch.randn(6, 3))
    # After refusing, the pipeline still trains.
    assert pipe.train_step(torch.randn(8, 6), torch.randn(8, 3)) > 0


def test_mpi_waits_yield_the_core_unless_the_launch_said_otherwise():
    # dualframe.launch.mpi_defaults, applied when dualframe.torch was imported, before hvd.init() started MPI.
    assert os.environ.get("OMPI_MCA_mpi_yield_when_idle") == "1"
    # Under horovodrun --gloo, Horovod's Gloo controller cycles every 5 ms (Horovod's own default, 1 ms,
    # under mpirun), the job having set no HOROVOD_CYCLE_TIME of its own.
    gloo = os.environ.get("HOROVOD_CONTROLLER") == "gloo"
    assert os.environ.get("HOROVOD_CYCLE_TIME") == ("5" if gloo else None)


def test_messages_go_over_mpi_under_mpi_and_over_zeromq_under_gloo():
    # mpirun: Horovod on MPI, so activations and gradients go rank to rank over mpi4py; horovodrun
    # --gloo: no MPI world, so over ZeroMQ (the training tests above ran that way).
    pipe = DistributedPipeline(pipeline_model(), [3, 2], chunks=2, loss_fn=nn.MSELoss())
    gloo = "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ
    assert horovod.mpi_enabled() is not gloo
    assert pipe.transport == ("zmq" if gloo else "mpi") and pipe.direct is not None


@pytest.mark.parametrize("transport,by_argument", [("horovod", False), ("zmq", True)])
def test_every_transport_asked_for_trains_as_one_process(transport, by_argument, monkeypatch):
    # Asked by the variable, or by transport= against a variable saying otherwise: the argument wins.
    monkeypatch.setenv("DUALFRAME_PIPELINE_TRANSPORT", "horovod" if by_argument else transport)
    model, data = pipeline_model(), batches()[:2]
    expected_losses, _ = pipeline_reference(model, data)
    pipe = DistributedPipeline(copy.deepcopy(model), [3, 2], chunks=CHUNKS, schedule="1f1b", loss_fn=nn.MSELoss(),
                               transport=transport if by_argument else None)
    assert pipe.transport == transport
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(data):
        optimizer.zero_grad()
        assert pipe.train_step(x, y) == pytest.approx(expected_losses[step], abs=1e-5), f"{transport} step {step}"
        optimizer.step()


def test_asking_for_mpi_point_to_point_where_there_is_none_is_refused_on_every_rank(monkeypatch):
    monkeypatch.setenv("DUALFRAME_PIPELINE_TRANSPORT", "mpi")
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ:
        with pytest.raises(StrategyError, match=r"=mpi needs mpi point-to-point on every rank \(2 of 2 lack it; "
                                                r"here: Horovod runs on Gloo"):
            DistributedPipeline(pipeline_model(), [3, 2], chunks=2, loss_fn=nn.MSELoss())
    else:
        assert DistributedPipeline(pipeline_model(), [3, 2], chunks=2, loss_fn=nn.MSELoss()).transport == "mpi"
    monkeypatch.setenv("DUALFRAME_PIPELINE_TRANSPORT", "horovod")
    assert DistributedPipeline(pipeline_model(), [3, 2], chunks=2, loss_fn=nn.MSELoss()).direct is None
    # A bad transport= is refused on every rank before any communication (so no rank waits on the others).
    with pytest.raises(StrategyError, match=r"transport must be one of auto, mpi, zmq, horovod, or None to read "
                                            r"DUALFRAME_PIPELINE_TRANSPORT \(transport: 'nccl'\)"):
        DistributedPipeline(pipeline_model(), [3, 2], chunks=2, loss_fn=nn.MSELoss(), transport="nccl")
