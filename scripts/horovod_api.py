"""Every public name of Horovod's TensorFlow and Keras modules beside dualframe's: present, same object, same signature.

    python scripts/horovod_api.py                          # the table, on stdout
    python scripts/horovod_api.py --write docs/horovod_api.md
    python scripts/horovod_api.py --check docs/horovod_api.md   # exit 1 when the file is out of date

A public name is an attribute of Horovod's module without a leading underscore that is not a module.
Horovod's signature is read with ``inspect`` from the imported module or, where importing it fails
(parts of Horovod's Keras code on Keras 3), from its source with ``ast``. The rule dualframe keeps:
Horovod's parameters first, with the same names, kinds, order and defaults; dualframe's additions
after them, keyword-only. tests/tensorflow/test_horovod_api.py holds the tree to this rule and to
the table in docs/horovod_api.md.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import pathlib
import sys
import types
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = pathlib.Path(__file__).resolve().parents[1]

#: (Horovod's module, dualframe's module, the attribute path below dualframe's module or "").
MODULES: List[Tuple[str, str, str]] = [
    ("horovod.tensorflow", "dualframe.tensorflow", ""),
    ("horovod.tensorflow.keras", "dualframe.tensorflow.keras", ""),
    ("horovod.tensorflow.keras.callbacks", "dualframe.tensorflow.keras", "callbacks"),
    ("horovod.tensorflow.keras.elastic", "dualframe.tensorflow.keras", "elastic"),
]
#: Horovod's constants, for defaults read from source (``op=Average``).
OP_VALUES = {"Average": 0, "Sum": 1, "Adasum": 2, "Min": 3, "Max": 4, "Product": 5}
#: Names whose imported signature is a decorator's ``(*args, **kwargs)``: where the real one is written.
REAL_SIGNATURES = {"init": ("horovod/common/basics.py", "HorovodBasics", "init")}

#: (module, name, what Horovod's object is an instance of, dualframe's, the test that checks dualframe's).
WRAPPED = [
    ("tf", "DistributedGradientTape", "`tf.GradientTape` and the wrapped tape's class", "the same",
     "tests/tensorflow/test_dp_tensorflow.py::test_the_tape_is_an_instance_of_tf_gradient_tape_and_of_the_wrapped_tapes_class"),
    ("tf", "PartialDistributedGradientTape", "`tf.GradientTape` and the wrapped tape's class", "the same",
     "tests/tensorflow/test_dp_tensorflow.py::test_the_tape_is_an_instance_of_tf_gradient_tape_and_of_the_wrapped_tapes_class"),
    ("tf, tf.keras", "DistributedOptimizer", "the wrapped optimizer's class", "the same (a Keras 3 optimizer's)",
     "tests/tensorflow/test_horovod_api.py::test_the_wrapped_optimizer_is_an_instance_of_the_users_class_and_trains_the_same"),
]
Param = Tuple[str, str, str]  # name, kind, default (normalized text; "" for none)


@dataclass
class Row:
    """One Horovod name: where, its status, Horovod's parameters and dualframe's additions."""

    module: str
    name: str
    status: str
    horovod: str = ""
    added: str = ""


def _default_text(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return ""
    kind = type(value)
    if kind.__name__ == "ProcessSet" and getattr(value, "process_set_id", None) == 0:
        return "global_process_set"
    if kind.__name__ == "NoneCompressor" or getattr(value, "__name__", "") == "NoneCompressor":
        return "Compression.none"
    return repr(value)


def _source_default(node: Optional[ast.expr]) -> str:
    if node is None:
        return ""
    text = ast.unparse(node)
    if text in OP_VALUES:
        return repr(OP_VALUES[text])
    try:
        return repr(ast.literal_eval(node))
    except ValueError:
        return text


def signature_of(obj: Any) -> Optional[List[Param]]:
    """Parameters of a function, or of a class's ``__init__`` (less ``self``); None when not callable."""
    if not callable(obj):
        return None
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None
    if inspect.isclass(obj) and params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.kind.name, _default_text(p.default)) for p in params]


def _source_params(args: ast.arguments) -> List[Param]:
    out: List[Param] = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for k, (a, d) in enumerate(zip(positional, defaults)):
        kind = "POSITIONAL_ONLY" if k < len(args.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append((a.arg, kind, _source_default(d)))
    if args.vararg:
        out.append((args.vararg.arg, "VAR_POSITIONAL", ""))
    out += [(a.arg, "KEYWORD_ONLY", _source_default(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append((args.kwarg.arg, "VAR_KEYWORD", ""))
    return out


def source_names(path: pathlib.Path) -> Dict[str, Optional[List[Param]]]:
    """Public top-level names of a Horovod source file and their parameters (classes: ``__init__``'s)."""
    tree = ast.parse(path.read_text())
    names: Dict[str, Optional[List[Param]]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = _source_params(node.args)
        elif isinstance(node, ast.ClassDef):
            init = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
            names[node.name] = _source_params(init[0].args)[1:] if init else None
        elif isinstance(node, ast.ImportFrom):
            names.update({(a.asname or a.name): None for a in node.names if a.name != "*"})
        elif isinstance(node, ast.Assign):
            names.update({t.id: None for t in node.targets if isinstance(t, ast.Name)})
    return {k: v for k, v in names.items() if not k.startswith("_")}


def _horovod_root() -> pathlib.Path:
    import horovod  # the package's __init__ needs no framework

    return pathlib.Path(horovod.__file__).resolve().parent


def _real_signature(name: str) -> Optional[List[Param]]:
    if name not in REAL_SIGNATURES:
        return None
    rel, owner, method = REAL_SIGNATURES[name]
    tree = ast.parse((_horovod_root().parent / rel).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == owner:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == method:
                    return _source_params(f.args)[1:]
    return None


def horovod_names(module: str) -> Tuple[Dict[str, Any], Dict[str, Optional[List[Param]]]]:
    """({name: object} when the module imports, else {}), {name: parameters} of every public name."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # Keras 3 breaks parts of Horovod's Keras code: read its source instead
        rel = module.replace(".", "/")
        path = _horovod_root().parent / (rel + ".py")
        return {}, source_names(path if path.exists() else _horovod_root().parent / rel / "__init__.py")
    objects = {n: getattr(mod, n) for n in dir(mod)
               if not n.startswith("_") and not isinstance(getattr(mod, n), types.ModuleType)}
    params = {}
    for n, obj in objects.items():
        sig = signature_of(obj)
        if sig is not None and [k for _, k, _ in sig] == ["VAR_POSITIONAL", "VAR_KEYWORD"]:
            sig = _real_signature(n) or sig
        params[n] = sig
    return objects, params


def compare(horovod: Optional[List[Param]], ours: Optional[List[Param]]) -> Tuple[str, str]:
    """(status, dualframe's additions) of one callable, by the rule in the module docstring."""
    if horovod is None or ours is None:  # a value, or a class (Compression) against a namespace object
        return "present", ""
    plain = [p for p in horovod if p[1] not in ("VAR_POSITIONAL", "VAR_KEYWORD")]
    ours_plain = [p for p in ours if p[1] not in ("VAR_POSITIONAL", "VAR_KEYWORD")]
    for k, want in enumerate(plain):
        got = ours_plain[k] if k < len(ours_plain) else None
        if got != want:
            return f"different: parameter {k + 1} is {_show(got)}, Horovod's {_show(want)}", ""
    for var in ("VAR_POSITIONAL", "VAR_KEYWORD"):
        if any(p[1] == var for p in horovod) and not any(p[1] == var for p in ours):
            return f"different: no {'*args' if var == 'VAR_POSITIONAL' else '**kwargs'}", ""
    extra = ours_plain[len(plain):]
    wrong = [p[0] for p in extra if p[1] != "KEYWORD_ONLY"]
    if wrong:
        return f"different: additions not keyword-only ({', '.join(wrong)})", ""
    return "same signature", ", ".join(p[0] for p in extra)


def _show(p: Optional[Param]) -> str:
    if p is None:
        return "missing"
    kind = {"KEYWORD_ONLY": "keyword-only ", "POSITIONAL_ONLY": "positional-only "}.get(p[1], "")
    return f"{kind}{p[0]}" + (f"={p[2]}" if p[2] else "")


def _signature_text(params: Optional[List[Param]]) -> str:
    if params is None:
        return ""
    parts = []
    for name, kind, default in params:
        name = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(kind, "") + name
        parts.append(f"{name}={default}" if default else name)
    return "(" + ", ".join(parts) + ")"


def rows() -> List[Row]:
    """One row per public name of every module in MODULES."""
    out: List[Row] = []
    for horovod_module, ours_module, attribute in MODULES:
        objects, params = horovod_names(horovod_module)
        ours: Any = importlib.import_module(ours_module)
        for part in filter(None, attribute.split(".")):
            ours = getattr(ours, part)
        for name in sorted(params):
            row = Row(horovod_module, name, "missing", _signature_text(params[name]))
            if hasattr(ours, name):
                mine = getattr(ours, name)
                if name in objects and mine is objects[name]:
                    row.status = "Horovod's own"
                else:
                    row.status, row.added = compare(params[name], signature_of(mine))
            out.append(row)
    return out


def table(found: List[Row]) -> str:
    """The markdown page: counts per module, then every name."""
    lines = [
        "# Horovod's TensorFlow and Keras API in dualframe",
        "",
        "Every public name of Horovod 0.28.1's `horovod.tensorflow`, `horovod.tensorflow.keras` and its",
        "`callbacks` and `elastic` modules, and what `dualframe.tensorflow` / `dualframe.tensorflow.keras` have",
        "under that name. *Horovod's own*: the same object, re-exported. *same signature*: dualframe's own",
        "code with Horovod's parameters (names, order, kinds, defaults), dualframe's additions keyword-only",
        "after them (listed). Generated by `python scripts/horovod_api.py --write docs/horovod_api.md`;",
        "`tests/tensorflow/test_horovod_api.py` fails when this page and the code disagree.",
        "",
        "| module | names | Horovod's own | same signature | present | different | missing |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for module in dict.fromkeys(r.module for r in found):
        mine = [r for r in found if r.module == module]
        count = {s: sum(r.status.startswith(s) for r in mine)
                 for s in ("Horovod's own", "same signature", "present", "different", "missing")}
        lines.append(f"| `{module}` | {len(mine)} | " + " | ".join(str(v) for v in count.values()) + " |")
    lines += ["", "| module | name | status | dualframe's keyword-only additions | Horovod's parameters |",
              "| --- | --- | --- | --- | --- |"]
    for r in found:
        short = r.module.replace("horovod.tensorflow", "tf")
        lines.append(f"| {short} | `{r.name}` | {r.status} | {r.added} | `{r.horovod}` |" if r.horovod
                     else f"| {short} | `{r.name}` | {r.status} | {r.added} | |")
    lines += ["", "## Wrapped objects", "",
              "What Horovod's wrappers are an instance of, and dualframe's (user code tests it with `isinstance`):",
              "", "| module | name | Horovod's is an instance of | dualframe's | tested by |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {module} | `{name}` | {horovod} | {ours} | `{test}` |" for module, name, horovod, ours, test in WRAPPED]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=pathlib.Path, help="write the table to this file")
    parser.add_argument("--check", type=pathlib.Path, help="exit 1 when this file differs from the table")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    text = table(rows())
    if args.check:
        if not args.check.exists() or args.check.read_text() != text:
            print(f"{args.check} is out of date: python scripts/horovod_api.py --write {args.check}")
            return 1
        return 0
    if args.write:
        args.write.write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
