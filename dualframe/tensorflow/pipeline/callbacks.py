"""Keras callbacks across a process pipeline's ranks: what they see as the model, which rank runs which, one stop decision.

Every rank runs the callbacks that steer training (EarlyStopping, ReduceLROnPlateau,
LearningRateScheduler, ModelCheckpoint, BackupAndRestore, History, yours) on the logs every rank
shares, so they decide alike; the ones that only write (ProgbarLogger, TensorBoard, CSVLogger,
RemoteMonitor) run on one rank, the reporter (the last stage of replica 0), and the others' messages
are silenced. Callbacks see a ``PipelineModel``: the stage's weights and optimizer, ``save`` and
``save_weights`` writing the merged full model once (ModelCheckpoint), and BackupAndRestore's backup
written as stage checkpoints (``dualframe.tensorflow.reliability.stage_checkpoint``: every stage its variables,
optimizer state and RNG states).
"""
from __future__ import annotations

import json
import os
from typing import Any, List, Optional, Sequence

import keras

from dualframe.errors import StrategyError
from dualframe.tensorflow.collectives import hvd

#: Callbacks that only write what they see: they run on the reporting rank only.
WRITERS = (keras.callbacks.ProgbarLogger, keras.callbacks.TensorBoard, keras.callbacks.CSVLogger,
           keras.callbacks.RemoteMonitor)
#: Keras callbacks whose batch hooks decide alike on every rank (they read the shared logs) or decide nothing.
_AGREED = WRITERS + (keras.callbacks.History, keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore,
                     keras.callbacks.TerminateOnNaN, keras.callbacks.EarlyStopping,
                     keras.callbacks.ReduceLROnPlateau, keras.callbacks.LearningRateScheduler)


class PipelineModel:
    """What callbacks see as ``self.model`` on one rank of a ``DistributedPipeline``.

    ``get_weights``/``set_weights``/``trainable_variables`` are the stage's (EarlyStopping's best
    weights are each stage's own); ``save(path)`` and ``save_weights(path)`` gather the stages'
    weights (a collective) and rank 0 writes the full model's ``.keras`` or ``.weights.h5``;
    ``stop_training`` is agreed among the ranks by ``fit``.

    Example:
        >>> model = PipelineModel(pipe)                                    # doctest: +SKIP
        >>> keras.callbacks.ModelCheckpoint("best.keras").set_model(model)  # doctest: +SKIP
    """

    def __init__(self, pipe: Any, callbacks: Sequence[Any] = ()) -> None:
        self.pipe = pipe
        #: BackupAndRestore files: saved and loaded as stage checkpoints.
        self.backups = {c._weights_path for c in callbacks if isinstance(c, keras.callbacks.BackupAndRestore)}
        self.stop_training = False
        self.history: Any = None
        self.built = True
        self.train_function = None  # TensorBoard writes no graph of a pipeline
        self._initial_epoch: Optional[int] = None

    @property
    def optimizer(self) -> Any:
        return self.pipe.optimizer

    @property
    def trainable_variables(self) -> List[Any]:
        return self.pipe.trainable_variables

    @property
    def layers(self) -> List[Any]:
        return self.pipe.layers

    def get_weights(self) -> List[Any]:
        return self.pipe.get_weights()

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Give the stage back weights ``get_weights`` returned (this stage's, not the full model's)."""
        for layer in self.pipe.layers:
            count = len(layer.weights)
            layer.set_weights(list(weights[:count]))
            weights = weights[count:]

    def _full_model(self) -> Any:
        """The full Keras model holding every stage's weights (on rank 0; a collective on every rank)."""
        model = self.pipe.keras_model
        if model is None:
            raise StrategyError("saving the full model needs the pipeline built from a keras.Model (a Sequential or "
                                "a functional model), not a list of layers")
        weights = self.pipe.gather_weights()
        if hvd.rank() == 0:
            model.set_weights(weights)
        return model

    def save(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        """The full model as a ``.keras`` file, written by rank 0 (every rank calls it)."""
        model = self._full_model()
        if hvd.rank() == 0:
            model.save(filepath, overwrite=overwrite, **kwargs)

    def save_weights(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        """The full model's weights as a ``.weights.h5`` file, written by rank 0 (every rank calls it).

        A BackupAndRestore's file (``backups``) is a marker instead: every stage saves its variables,
        optimizer state and RNG states into ``filepath + ".stages"`` and rank 0 writes the marker.
        """
        if filepath in self.backups:
            self._save_stages(filepath)
            return
        model = self._full_model()
        if hvd.rank() == 0:
            model.save_weights(filepath, overwrite=overwrite, **kwargs)

    def _save_stages(self, filepath: str) -> None:
        from dualframe.tensorflow.reliability.stage_checkpoint import save_stage_checkpoint  # it imports distributed_pipeline

        folder = f"{filepath}.stages"
        step = self.pipe._compiled.steps
        save_stage_checkpoint(folder, self.pipe, self.pipe.optimizer, step=step, keep=2)
        if hvd.rank() == 0:
            with open(filepath, "w") as marker:
                json.dump({"stage_checkpoints": os.path.basename(folder), "step": step}, marker)

    def load_weights(self, filepath: str, **kwargs: Any) -> None:
        """Load a BackupAndRestore's stage checkpoints (the newest step every stage holds)."""
        from dualframe.tensorflow.reliability.stage_checkpoint import load_stage_checkpoint

        if filepath not in self.backups:
            raise StrategyError(f"a pipeline loads the stage checkpoints of a BackupAndRestore only ({filepath}); "
                                f"load a merged file with hvd.load_stage_checkpoint")
        load_stage_checkpoint(f"{filepath}.stages", self.pipe, self.pipe.optimizer)


def is_reporter(pipe: Any) -> bool:
    """Whether this rank prints and writes: the last stage of replica 0."""
    return bool(pipe.is_last and pipe.replica == 0)


def follow_saves(callback: Any) -> None:
    """Off rank 0, a checkpoint callback decides as on rank 0 but only joins the save's collectives.

    ModelCheckpoint and BackupAndRestore create folders, copy and write files from every process
    that runs them (``os.makedirs`` without ``exist_ok``: ranks racing to create one folder fail);
    rank 0 does that, the other ranks take part in the gather or the stage save only.
    """
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        def save(epoch: int, batch: Optional[int], logs: Any) -> None:
            filepath = callback._get_file_path(epoch, batch, logs)
            if callback._should_save_model(epoch, batch, logs, filepath):  # updates ``best`` as on rank 0
                if callback.save_weights_only:
                    callback.model.save_weights(filepath)
                else:
                    callback.model.save(filepath)
        callback._save_model = save
    elif isinstance(callback, keras.callbacks.BackupAndRestore):
        callback._save_model = lambda: callback.model.save_weights(callback._weights_path)
        callback.delete_checkpoint = False  # rank 0 removes the backup at the end


def rank_callbacks(pipe: Any, model: PipelineModel, callbacks: Optional[Sequence[Any]]) -> List[Any]:
    """This rank's callbacks: the writers on the reporter only, the others everywhere (silent off the reporter)."""
    mine: List[Any] = []
    for callback in list(callbacks or []):
        if isinstance(callback, WRITERS) and not is_reporter(pipe):
            continue
        if not is_reporter(pipe) and isinstance(getattr(callback, "verbose", None), int):
            callback.verbose = 0
        if hvd.rank() != 0:
            follow_saves(callback)
        mine.append(callback)
    return mine


def decides_per_batch(callbacks: Optional[Sequence[Any]]) -> bool:
    """Whether a callback outside Keras's known ones has a batch hook (it might stop training on one rank only)."""
    for callback in list(callbacks or []):
        if isinstance(callback, _AGREED):
            continue
        base = keras.callbacks.Callback
        if any(getattr(type(callback), hook) is not getattr(base, hook)
               for hook in ("on_train_batch_end", "on_batch_end", "on_train_batch_begin")):
            return True
    return False


def agree_stop(stop: bool, name: str) -> bool:
    """Whether any rank's callbacks asked to stop (a collective): every rank then stops at the same step."""
    return any(hvd.allgather_object(bool(stop), name=name))
