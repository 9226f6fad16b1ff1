"""The core never imports a framework or Horovod: proven in a fresh interpreter."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
ADAPTERS = ("torch", "tensorflow")
CORE_MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts[:-1] if p.stem == "__init__" else
             p.relative_to(ROOT).with_suffix("").parts)
    for p in (ROOT / "dualframe").rglob("*.py")
    if p.relative_to(ROOT / "dualframe").parts[0] not in ADAPTERS + ("__main__.py", "keras.py")
)


def test_core_imports_no_framework():
    code = (
        "import sys, importlib\n"
        f"for name in ['dualframe'] + {CORE_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow', 'keras', 'horovod', 'mpi4py'))\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"the core loaded {result.stdout.strip()} {result.stderr[-2000:]}"


def test_every_core_module_has_a_docstring():
    for path in (ROOT / "dualframe").rglob("*.py"):
        text = path.read_text().lstrip()
        assert text.startswith('"""'), f"{path.relative_to(ROOT)} has no module docstring"


# --- No import cycles: the module-level import graph of dualframe, from the source (no import runs) -----------

def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level(body):
    """Statements that run when the module is imported: not function bodies, not ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _module_level(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _module_level(getattr(node, field, None) or [])


def _ancestors(name: str):
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph(root: pathlib.Path, package: str):
    """{module: modules of ``package`` its import runs at module level}.

    ``import a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` too: those count, except the importer's own
    ancestors (already being imported when it runs). ``from a import b`` depends on ``a.b`` when that is
    a module, and on ``a``'s ``__init__`` only for names that are not submodules.
    """
    paths = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        own = _ancestors(name)
        targets = set()
        for node in _module_level(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                found = {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                subs = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in paths}
                found = subs | ({base} if len(subs) < len(node.names) else set())
            else:
                continue
            for target in found:
                targets |= ({target} | (_ancestors(target) - own)) & paths.keys()
        graph[name] = targets - {name}
    return graph


def find_cycle(graph):
    """One import cycle as ``[a, b, ..., a]``, or None (a depth-first walk; ``stack`` is the current path)."""
    done, stack = set(), []

    def visit(name):
        stack.append(name)
        for target in sorted(graph.get(name, ())):
            if target in stack:
                return stack[stack.index(target):] + [target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if name not in done:
            cycle = visit(name)
            if cycle:
                return cycle
    return None


def test_dualframe_has_no_import_cycle():
    cycle = find_cycle(import_graph(ROOT, "dualframe"))
    assert cycle is None, (
        f"import cycle: {' -> '.join(cycle)}; move the shared part into a module both import, or (rarely) "
        f"import inside the function that needs it, with a comment saying why")


def _write(root: pathlib.Path, files):
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cycle_finder_names_a_direct_cycle_and_ignores_imports_inside_functions(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import x\n", "pkg/b.py": "import pkg.a\nx = 1\n",
                      "pkg/c.py": "def f():\n    from pkg import d\n", "pkg/d.py": "from . import c\n"})
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.d"] == {"pkg.c"} and graph["pkg.c"] == set()
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_cycle_finder_sees_a_package_init_run_by_a_submodule_import(tmp_path):
    # The layering fixed in dualframe.tensorflow: the adapter's __init__ imports a module that imports the
    # keras subpackage, whose __init__ reads the adapter's (half-run) __init__.
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/tf/__init__.py": "from pkg.tf.elastic import run\n",
                      "pkg/tf/elastic.py": "from pkg.tf.keras.state import run\n",
                      "pkg/tf/keras/__init__.py": "from pkg.tf import *\n", "pkg/tf/keras/state.py": "run = 1\n"})
    assert find_cycle(import_graph(tmp_path, "pkg")) == [
        "pkg.tf", "pkg.tf.elastic", "pkg.tf.keras", "pkg.tf"]


def test_keras_package_only_re_exports_the_tensorflow_adapter():
    # As Horovod's _keras: the code lives in dualframe/tensorflow/, the keras package names it.
    package = ROOT / "dualframe" / "tensorflow" / "keras"
    assert sorted(p.name for p in package.glob("*.py")) == ["__init__.py"], "keras/ holds re-exports only"
    for node in ast.parse((package / "__init__.py").read_text()).body[1:]:
        assert isinstance(node, (ast.Import, ast.ImportFrom)) or (
            isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]), (
            f"dualframe/tensorflow/keras/__init__.py line {node.lineno} is not a re-export: move it into "
            f"dualframe/tensorflow/")


# --- A public name never shares its package with a submodule of that name ------------------------------------
# Importing dualframe/tensorflow/shard.py would rebind the package attribute ``shard`` (the dataset
# function in __all__) to the module, so ``hvd.shard(...)`` would break only after that import. A name the
# package itself imports from its namesake submodule at load time is safe (the module is bound first), and so
# is a public name that is the submodule itself.

def _public_names(init: pathlib.Path):
    names = set()
    for node in ast.walk(ast.parse(init.read_text())):
        targets = [node.target] if isinstance(node, ast.AugAssign) else getattr(node, "targets", [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            for element in ast.walk(node.value):
                if isinstance(element, ast.Constant) and isinstance(element.value, str):
                    names.add(element.value)
    return names


def _bound_at_load(init: pathlib.Path, package: str):
    """Names the package's __init__ imports at load from the package itself or from their namesake submodule."""
    return {alias.asname or alias.name for node in ast.parse(init.read_text()).body if isinstance(node, ast.ImportFrom)
            for alias in node.names if node.module in (package, f"{package}.{alias.name}")}


def test_no_public_name_is_shadowed_by_a_submodule():
    for init in (ROOT / "dualframe").rglob("__init__.py"):
        submodules = {p.stem for p in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir() if p.is_dir()}
        clashes = sorted((_public_names(init) & submodules) - _bound_at_load(init, _module_name(init, ROOT)))
        assert not clashes, f"{init.parent.relative_to(ROOT)}: public names {clashes} are also submodule names"
