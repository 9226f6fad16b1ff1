"""The tensorflow adapter's Backend passes the conformance suite (dualframe.testing.conformance), one process."""
import copy

import pytest

import dualframe.tensorflow.plan_probe as plan_probe
from dualframe.testing import conformance
from dualframe.tensorflow.backend import BACKEND


@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda check: check.__name__)
def test_backend_conforms(check, tmp_path):
    check(BACKEND, str(tmp_path))


def test_plan_probe_conforms():
    conformance.check_plan_probe(plan_probe)


def test_a_wrong_number_is_reported():
    # The suite must fail on a backend that gets a number wrong, naming the check and the values.
    class Doubling(type(BACKEND.batches)):
        def concat(self, parts):
            return super().concat(list(parts) * 2)

    wrong = copy.copy(BACKEND)
    wrong.batches = Doubling()
    with pytest.raises(AssertionError, match=r"concat: expected \[0\.0, 1\.0"):
        conformance.check_batches(wrong, "")
