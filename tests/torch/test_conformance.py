"""The torch adapter's Backend passes the conformance suite (dualframe.testing.conformance), one process."""
import dualframe.torch.plan.probe as plan_probe
from dualframe.testing.conformance import ConformanceTests
from dualframe.torch.backend import BACKEND


class TestTorchBackend(ConformanceTests):
    """Every check of the suite, the plan probe, and the suite catching a wrong number (tests in the base class)."""

    backend, probe = BACKEND, plan_probe
