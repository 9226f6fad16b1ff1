"""The core never imports a framework or Horovod: proven in a fresh interpreter."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE_MODULES = sorted(
    "dualframe." + p.stem for p in (ROOT / "dualframe").glob("*.py")
    if p.stem not in ("__init__", "__main__", "keras")
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
