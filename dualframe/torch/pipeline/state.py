"""A torch process stage's parameters and state under the full model's names: the stages' dicts merge into the model's."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from torch import nn

from dualframe.torch.pipeline.optimizer import gathered_state_dict, load_sharded_state_dict
from dualframe.torch.split.tied import model_state_dict, stage_part


class StageState:
    """``DistributedPipeline``'s ``named_parameters``/``state_dict``/``load_state_dict`` (its ``stage``, names, ``sharded``).

    Example:
        >>> # torch.save(pipe.state_dict(), f"stage{pipe.stage_index}.pt")  # every rank; merged dicts load into the model
    """

    stage: nn.Module
    sharded: Any
    _names: Any
    _keys: Optional[List[Tuple[str, str]]]

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """The local stage's parameters under the full model's names (``"4.weight"``)."""
        return self.stage.named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """The local stage's tensors under the full model's keys: the stages' dicts merge into the model's.

        A tied weight appears under every name the model has for it, in each stage holding a copy. With
        ``shard="parameters"`` every replica of the stage calls it (the stage is gathered, then copied).
        """
        if self.sharded is None:
            return self._state_dict(*args, **kwargs)
        return gathered_state_dict(self.sharded, lambda: self._state_dict(*args, **kwargs))

    def _state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        if self._keys is None:
            return model_state_dict(self.stage, self._names, *args, **kwargs)
        own = self.stage.state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        return OrderedDict((prefix + key, own[prefix + held]) for held, key in self._keys)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load this stage's part of the full model's ``state_dict`` (other stages' keys are ignored)."""
        if self.sharded is not None:
            return load_sharded_state_dict(self.sharded, self.stage, self._names, state_dict)
        part = stage_part(self.stage, self._names, state_dict)
        return self.stage.load_state_dict(part, strict=strict, assign=assign)

