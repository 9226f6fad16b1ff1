"""Import-only stand-in for Horovod on a GPU machine where it cannot be built (scripts/gpu_check.sh): one process only.

Every horovod.* module exists; every attribute is a class that can be subclassed but raises when called.
"""
import importlib.abc
import importlib.machinery
import sys
import types


class _AbsentType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentType(f"{cls.__name__}.{name}", (_Absent,), {})


class _Absent(metaclass=_AbsentType):
    def __new__(cls, *args, **kwargs):
        if cls.__name__.startswith("absent:"):
            raise RuntimeError(f"Horovod is not installed here ({cls.__name__})")
        return super().__new__(cls)


def _attr(module_name):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentType(f"absent:{module_name}.{name}", (_Absent,), {})
    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("horovod."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _attr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = _attr("horovod")
