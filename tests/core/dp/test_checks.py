"""dualframe.dp.checks: Horovod's ``groups`` rule, written once for both adapters."""
import pytest

from dualframe.dp.checks import check_groups
from dualframe.errors import StrategyError


class Member:
    """A stand-in for a parameter or variable: only its identity counts."""


def test_none_and_a_positive_int_pass_through():
    assert check_groups(None, "variable") is None
    assert check_groups(3, "variable") == 3


@pytest.mark.parametrize("bad, shown", [(0, "0"), (-2, "-2"), (True, "True"), ("two", "'two'"), (2.0, "2.0")])
def test_anything_but_an_int_at_least_one_or_lists_is_refused_with_the_value(bad, shown):
    with pytest.raises(StrategyError, match=rf"groups must be an int >= 1 or a list of lists of parameters "
                                            rf"\(groups: {shown}\)"):
        check_groups(bad, "parameter")


def test_groups_that_are_not_lists_of_lists_are_refused():
    a = Member()
    for bad in ([a], [[a], 3], ([a], "b")):
        with pytest.raises(StrategyError, match=r"groups must be an int >= 1 or a list of lists of variables"):
            check_groups(bad, "variable")


def test_lists_come_back_as_lists_of_the_same_members():
    a, b, c = Member(), Member(), Member()
    out = check_groups(([a, b], (c,)), "variable")
    assert out == [[a, b], [c]] and out[0][0] is a
    assert check_groups([], "variable") == []


def test_a_member_listed_twice_is_refused_naming_the_group_and_the_adapters_detail():
    a, b = Member(), Member()
    with pytest.raises(StrategyError, match=r"^a parameter can appear only once in groups \(again in groups\[1\], "
                                            r"id \d+\)$"):
        check_groups([[a], [b, a]], "parameter", describe=lambda m: f", id {id(m)}")
    with pytest.raises(StrategyError, match=r"^a variable can appear only once in groups \(again in groups\[0\]\)$"):
        check_groups([[a, a]], "variable")


def test_the_adapter_says_what_may_be_listed():
    a, stranger = Member(), Member()
    known = {id(a)}
    assert check_groups([[a]], "parameter", is_member=lambda m: id(m) in known) == [[a]]
    with pytest.raises(StrategyError, match=r"groups\[1\] holds something that is not a parameter of the optimizer "
                                            r"\(Member\)"):
        check_groups([[a], [stranger]], "parameter", is_member=lambda m: id(m) in known)
