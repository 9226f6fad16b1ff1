"""The error types dualframe raises; each subclasses the built-in exception a caller would expect."""


class DualframeError(Exception):
    """Base class of every error dualframe raises on purpose."""


class NotInitializedError(DualframeError, RuntimeError, ValueError):
    """A distributed call was made before ``init()``.

    A ValueError too, as Horovod raises for ``rank()`` / ``size()`` before ``init()`` (``except ValueError``
    in a Horovod script catches it); a RuntimeError, as dualframe raised before.
    """


class TopologyError(DualframeError, ValueError):
    """Launcher variables (HOROVOD_*, OMPI_*, PMI_*, SLURM_*) are malformed or inconsistent."""


class StrategyError(DualframeError, ValueError):
    """A strategy argument breaks a rule (an unknown op, a count below one, ...)."""


class BalanceError(StrategyError):
    """A ``balance`` does not describe a valid split of the model's layers."""


class DeviceError(StrategyError):
    """A ``devices`` list does not match the partitions or names an unknown device."""


class ChunksError(StrategyError):
    """``chunks`` is invalid for the batch it must cut into micro-batches."""


class ScheduleError(StrategyError):
    """A pipeline schedule is unknown or inconsistent."""


class MissingDependencyError(DualframeError, ImportError):
    """A framework or Horovod is not importable; the message says how to install it."""


class StageError(DualframeError, RuntimeError):
    """A pipeline stage raised on one micro-batch; the message shows the schedule with that cell marked."""

    def __init__(self, message: str, micro_batch: int = -1, stage: int = -1, tick: int = -1) -> None:
        super().__init__(message)
        self.micro_batch, self.stage, self.tick = micro_batch, stage, tick


class SplitPointError(BalanceError):
    """A ``split_points`` entry does not name a place where a new stage can begin."""


class TraceError(DualframeError, TypeError):
    """A model cannot be captured as a graph; the message says why and what to do."""


class DataError(DualframeError, ValueError):
    """The data given to a pipeline's ``fit``, ``evaluate`` or ``predict`` cannot be split across its ranks."""
