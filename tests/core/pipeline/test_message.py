"""The graph pipeline's message layout (dualframe.pipeline.message): header, tensor places, structure tail."""
from array import array

import pytest

from dualframe.errors import StrategyError
from dualframe.pipeline import message
from dualframe.pipeline.layout import MAX_DIMS


class Ints:
    """A toy framework: its tensors are ints, its one leaf a complex number."""

    def is_tensor(self, value):
        return type(value) is int

    def encode(self, value):
        return {"complex": [value.real, value.imag]} if isinstance(value, complex) else None

    def decode(self, kind, body):
        assert kind == "complex"
        return complex(*body)


def _layout(raw: bytes) -> message.MessageLayout:
    return message.read_layout(lambda n: array("q", raw[:8 * n]).tolist())


def test_header_places_each_tensor_at_a_multiple_of_8_after_it():
    tensors = [("a", 0, (2, 3)), ("mask", 7, (3,)), ("ids", 4, ()), ("empty", 0, (0, 4)), ("b", 3, (5,))]
    raw = message.header(tensors, tail=11)
    assert len(raw) == message.header_bytes(5) == 8 * (2 + 5 * (2 + MAX_DIMS))
    layout = _layout(raw)
    assert [(p.dtype, p.shape, p.size) for p in layout.parts] == [
        ("float32", (2, 3), 24), ("bool", (3,), 3), ("int64", (), 8), ("float32", (0, 4), 0), ("bfloat16", (5,), 10)]
    start = len(raw)
    assert [p.offset - start for p in layout.parts] == [0, 24, 32, 40, 40]
    assert (layout.tail_offset - start, layout.tail_size) == (56, 11)


def test_header_refuses_too_many_dimensions_naming_the_value():
    with pytest.raises(StrategyError, match=r"value 'h' has 9 dimensions; a message carries at most 8"):
        message.header([("h", 0, (1,) * 9)])


def test_structure_round_trips_plain_values_leaves_and_containers():
    values = [5, (None, True, 2.5), {"shape": [2, 3], "z": 1j}, "s", [7]]
    tensors, tail = message.structure(values, Ints())
    assert tensors == [5, 2, 3, 7] and tail
    assert message.rebuild(tail, [50, 20, 30, 70], Ints()) == [
        50, (None, True, 2.5), {"shape": [20, 30], "z": 1j}, "s", [70]]


def test_tensors_only_need_no_tail():
    assert message.structure([1, 2], Ints()) == ([1, 2], b"")
    assert message.rebuild(b"", [3, 4], Ints()) == [3, 4]


def test_unsendable_values_are_refused_by_name():
    message.check_sendable([1, (None, "a"), {"k": [2.5]}], "abc", lambda x: False)
    assert message.unsendable({1: 2}, lambda x: False) == "dict"
    with pytest.raises(StrategyError, match=r"value 'b' crosses between process stages and holds a object"):
        message.check_sendable([1, [object()]], "ab", lambda x: False)
