"""A Keras rank's several pipeline stages (virtual stages): one stage work per stage, their results joined."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf

from dualframe.pipeline.action import Action
from dualframe.tensorflow.pipeline.sparse import added


def stage_actions(actions: Sequence[Action], j: int) -> List[Action]:
    """Stage j's actions among a rank's (each naming its stage), without the stage: what one stage's work reads.

    Example:
        >>> [str(a) for a in stage_actions([Action.parse(t) for t in "0F0 3F0 3B0 0B0".split()], 3)]
        ['F0', 'B0']
    """
    return [Action(a.kind, a.micro) for a in actions if a.stage == j]


class VirtualStageWorks:
    """The works of the stages one rank holds, by stage j; what ``DistributedPipeline`` reads of a step's work.

    ``gradients`` follow the rank's trainable variables (its stages' layers in order); the loss and the
    outputs are the last stage's, where this rank holds it.

    Example:
        >>> works = VirtualStageWorks({0: work0, 3: work3}, last=3)   # doctest: +SKIP
        >>> role.step(actions, micro_inputs, works.works, train=True)  # doctest: +SKIP
    """

    def __init__(self, works: Dict[int, Any], last: int) -> None:
        self.works, self.last = works, last

    def step_gradients(self) -> List[Any]:
        """Every held stage's gradient sums, stage by stage, one per variable in the rank's trainable variables' order:
        a variable two held stages read (a layer called in both) gets the sum of their shares (IndexedSlices joined)."""
        sums: Dict[int, Any] = {}
        for j in sorted(self.works):
            for variable, gradient in zip(self.works[j].stage.trainable_weights, self.works[j].step_gradients()):
                sums[id(variable)] = added(sums.get(id(variable)), gradient)
        return list(sums.values())

    @property
    def loss_sum(self) -> float:
        """The step's summed weighted loss on the rank holding the last stage, 0 elsewhere."""
        return self.works[self.last].loss_sum if self.last in self.works else 0.0

    @property
    def outputs(self) -> List[tf.Tensor]:
        """Inference: the last stage's micro-batch outputs, where this rank holds it."""
        return self.works[self.last].outputs if self.last in self.works else []

    @property
    def peak_live(self) -> int:
        """Most micro-batches held at once, summed over the rank's stages (each stage's own peak)."""
        return sum(work.peak_live for work in self.works.values())
