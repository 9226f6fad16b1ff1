"""dualframe.collectives with a stand-in Horovod module: op names, the init check, one init for every process_sets form."""
import sys

import pytest

from dualframe.collectives import HorovodCollectives, check_process_sets
from dualframe.errors import NotInitializedError, StrategyError


class FakeSet:
    def __init__(self, ranks):
        self.ranks = ranks


class FakeHorovod:
    Average, Sum, Adasum, Min, Max, Product = "AVG", "SUM", "ADASUM", "MIN", "MAX", "PROD"
    ProcessSet = FakeSet

    def __init__(self):
        self.started, self.calls = False, []

    def is_initialized(self):
        return self.started

    def init(self, **kwargs):
        self.calls.append(kwargs)
        self.started = True

    def size(self):
        return 1

    def rank(self):
        return 0


def test_op_names_and_constants():
    collectives = HorovodCollectives(FakeHorovod(), "dualframe.fake")
    assert collectives.ops["sum"] == "SUM" and collectives.op_of("Average") == "AVG" and collectives.op_of("MAX") == "MAX"
    with pytest.raises(StrategyError, match="unknown op 'median'; choose one of average, sum"):
        collectives.op_of("median")


def test_check_initialized_names_the_package():
    with pytest.raises(NotInitializedError, match=r"rank\(\) needs dualframe.fake.init\(\) first"):
        HorovodCollectives(FakeHorovod(), "dualframe.fake").rank()


def test_one_init_for_rank_lists_process_set_objects_and_dynamic(monkeypatch):
    for key in [k for k in list(__import__("os").environ) if k.startswith(("HOROVOD_", "OMPI_", "PMI_", "SLURM_"))]:
        monkeypatch.delenv(key)
    given = FakeSet([1, 3])
    for argument in ([[0, 2], given], "dynamic", None):
        hvd = FakeHorovod()
        HorovodCollectives(hvd, "dualframe.fake").init(process_sets=argument)
        HorovodCollectives(hvd, "dualframe.fake").init()  # started: nothing more
        assert len(hvd.calls) == 1 and set(hvd.calls[0]) == {"process_sets"}
        sets = hvd.calls[0]["process_sets"]
        if argument is None or argument == "dynamic":
            assert sets == argument
        else:
            assert sets[0].ranks == [0, 2] and sets[1] is given
    hvd = FakeHorovod()
    HorovodCollectives(hvd, "dualframe.fake").init([0, 1])  # Horovod's order: comm first
    assert hvd.calls == [{"process_sets": None, "comm": [0, 1]}]


class RunningHorovod(FakeHorovod):
    """Horovod started on 4 ranks: its process set table, a restart, dynamic sets (``join_process_sets``)."""

    def __init__(self):
        super().__init__()
        self.started, self.table, self.shutdowns, self.added = True, {0: [0, 1, 2, 3]}, 0, []

    def size(self):
        return 4

    def init(self, **kwargs):
        super().init(**kwargs)
        self.table = {0: [0, 1, 2, 3]}
        for k, given in enumerate(kwargs["process_sets"], start=1):
            self.table[k] = sorted(given.ranks)

    def shutdown(self):
        self.shutdowns += 1
        self.started = False

    def add_process_set(self, given):
        self.added.append(given)
        self.table[max(self.table) + 1] = sorted(given.ranks)

    def _get_process_set_ids_and_ranks(self):
        return dict(self.table)


def test_a_later_init_joins_the_process_sets_horovod_does_not_run(monkeypatch):
    for key in [k for k in list(__import__("os").environ) if k.startswith(("HOROVOD_", "OMPI_", "PMI_", "SLURM_"))]:
        monkeypatch.delenv(key)
    hvd = RunningHorovod()
    monkeypatch.setattr(sys.modules[FakeSet.__module__], "_basics", hvd, raising=False)
    collectives = HorovodCollectives(hvd, "dualframe.fake")  # started plainly elsewhere (an earlier file)
    pair, odd = FakeSet([2, 0]), FakeSet([1, 3])
    collectives.init(process_sets=[pair, odd])  # Horovod restarts with them
    assert hvd.shutdowns == 1 and hvd.calls[-1]["process_sets"] == [pair, odd]
    assert (pair.process_set_id, odd.process_set_id) == (1, 2)
    again = FakeSet([0, 2])
    collectives.init(process_sets=[again])  # running already: its id, no restart
    assert hvd.shutdowns == 1 and again.process_set_id == 1
    collectives.init(process_sets=[[3]])  # the sets it ran kept, in their order: the same ids
    assert hvd.shutdowns == 2 and [s.ranks for s in hvd.calls[-1]["process_sets"]] == [[0, 2], [1, 3], [3]]
    assert hvd.table == {0: [0, 1, 2, 3], 1: [0, 2], 2: [1, 3], 3: [3]}
    with pytest.raises(StrategyError, match=r"ranks: \[0, 4\], world size: 4"):
        collectives.init(process_sets=[[0, 4]])  # refused before any restart
    collectives.init(process_sets="dynamic")
    assert hvd.shutdowns == 2 and len(hvd.calls) == 2
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    single = FakeSet([1])
    collectives.init(process_sets=[single])  # dynamic sets: added, no restart
    assert hvd.added == [single] and hvd.shutdowns == 2 and single.process_set_id == 4
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    collectives.init(process_sets=[[2]])  # elastic ranks join at other times: left alone
    assert hvd.added == [single] and hvd.shutdowns == 2


def test_process_sets_checked_against_the_world():
    hvd = FakeHorovod()
    with pytest.raises(StrategyError, match=r"process_sets\[1\] must list distinct ranks in \[0, 2\) \(ranks: \[0, 5\]"):
        check_process_sets(hvd, [[0, 1], [0, 5]], 2)
    with pytest.raises(StrategyError, match=r"process_sets\[0\] must list integer ranks"):
        check_process_sets(hvd, [["0"]], 2)
    with pytest.raises(StrategyError, match="process_sets must be a list"):
        check_process_sets(hvd, "static", 2)
    assert [s.ranks for s in check_process_sets(hvd, [(1, 0)], 2)] == [[1, 0]]


def test_under_a_launcher_init_refuses_a_rank_outside_the_job(monkeypatch):
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    hvd = FakeHorovod()
    with pytest.raises(StrategyError, match=r"ranks: \[0, 5\], world size: 2"):
        HorovodCollectives(hvd, "dualframe.fake").init(process_sets=[[0, 5]])
    assert hvd.calls == []  # refused before Horovod starts


def test_one_process_byte_collectives_and_objects_need_no_horovod_call():
    hvd = FakeHorovod()
    hvd.started = True
    collectives = HorovodCollectives(hvd, "dualframe.fake")
    assert collectives.gather_bytes(b"ab", "x") == [b"ab"]
    assert collectives.broadcast_bytes(None, 0, "x") == b"" and collectives.broadcast_bytes(b"q", 0, "x") == b"q"
    assert collectives.allgather_object({"a": 1}) == [{"a": 1}]
    assert "torch" not in sys.modules and "tensorflow" not in sys.modules
