"""A model's call as data: a sample or a batch (a tuple, a dict of keyword inputs, one value) as positional and
keyword arguments, and the keyword form torch.export captures and each later call is checked against.

``as_call`` reads what a user hands over where one object stands for a whole call (``sample=``, a
``DistributedPipeline`` batch): a tuple is the positional arguments, a dict whose keys name the
forward's parameters (``{"input_ids": ..., "attention_mask": ...}``, how Hugging Face models are fed)
the keyword arguments, anything else the only positional argument (so a model whose ``forward(batch)``
takes one dict still gets it whole).
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, NamedTuple, Tuple

import torch
from torch.utils import _pytree as pytree

Call = Tuple[Tuple[Any, ...], Dict[str, Any]]
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def keyword_inputs(value: Any, signature: inspect.Signature) -> bool:
    """Whether ``value`` is a dict of keyword inputs: string keys naming the forward's parameters.

    Example:
        >>> keyword_inputs({"x": 1}, inspect.signature(lambda x, mask=None: x))
        True
        >>> keyword_inputs({"tokens": 1}, inspect.signature(lambda batch: batch))
        False
    """
    if not isinstance(value, Mapping) or not value or not all(isinstance(k, str) for k in value):
        return False
    params = signature.parameters
    named = {name for name, p in params.items() if p.kind in _NAMED}
    if not any(k in named for k in value):
        return False
    return all(k in named for k in value) or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def as_call(inputs: Any, signature: inspect.Signature) -> Call:
    """``inputs`` as call arguments: a tuple positional, a dict of keyword inputs by name, else the only argument."""
    if isinstance(inputs, tuple):
        return inputs, {}
    if keyword_inputs(inputs, signature):
        return (), dict(inputs)
    return (inputs,), {}


def canonical(signature: inspect.Signature, args: Tuple[Any, ...], kwargs: Mapping[str, Any], owner: str) -> Call:
    """The call bound to ``signature``: every named argument by keyword, in the signature's order.

    Arguments a caller gave positionally and by keyword alike come out the same, so a call can be
    checked against the one torch.export captured. Positional-only and ``*args`` values stay positional
    (and, when ``*args`` is used, the parameters before it).

    Raises:
        TypeError: the arguments do not fit the signature, naming ``owner``'s forward.
    """
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{owner}.forward{signature}: {error}") from None
    kinds = {name: signature.parameters[name].kind for name in bound.arguments}
    star = any(kinds[n] is inspect.Parameter.VAR_POSITIONAL and v for n, v in bound.arguments.items())
    positional: List[Any] = []
    keywords: Dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = kinds[name]
        if kind is inspect.Parameter.VAR_POSITIONAL:
            positional.extend(value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            keywords.update(value)
        elif kind is inspect.Parameter.POSITIONAL_ONLY or (star and kind is inspect.Parameter.POSITIONAL_OR_KEYWORD):
            positional.append(value)
        else:
            keywords[name] = value
    return tuple(positional), keywords


def _has_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


class ExportCall(NamedTuple):
    """How torch.export was called: the tensor-bearing arguments' structure, and the constants bound into forward."""

    spec: Any                   # pytree spec of (args, tensor keyword arguments)
    constants: Dict[str, Any]   # keyword arguments holding no tensor (flags such as use_cache=False)

    @staticmethod
    def split(call: Call) -> Tuple[Call, Dict[str, Any]]:
        """``call`` without its tensor-free keyword arguments, and those arguments."""
        args, kwargs = call
        tensors = {k: v for k, v in kwargs.items() if _has_tensor(v)}
        return (args, tensors), {k: v for k, v in kwargs.items() if k not in tensors}

    def leaves(self, call: Call, owner: str) -> List[Any]:
        """The call's leaves in the captured order, after checking it has the captured form.

        Raises:
            TypeError: other inputs, or other flags, than the sample that was captured.
        """
        tensors, constants = self.split(call)
        flat, spec = pytree.tree_flatten(tensors)
        if spec != self.spec:
            raise TypeError(f"{owner} was captured (torch.export) with the inputs {_names(self.spec)} of sample=; "
                            f"call it with the same (got {_names(spec)}), or pass a sample shaped like the batches")
        if set(constants) != set(self.constants) or any(
                not _same(constants[k], self.constants[k]) for k in constants):
            raise TypeError(f"{owner} was captured with the flags {self.constants} (sample=), and torch.export keeps "
                            f"them as constants; call it with the same flags (got {constants})")
        return flat


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 -- an object without a plain ==: the same object only
        return a is b


def _names(spec: Any) -> str:
    """The argument names of a call's spec: positional ones as ``#k``, keyword ones by name."""
    args_spec, kwargs_spec = spec.children()
    names = [f"#{k}" for k in range(args_spec.num_children)] + list(kwargs_spec.context or [])
    return "(" + ", ".join(names) + ")"
