"""A stand-in for ``torchvision`` in the SGLang test venvs of this CPU machine (installed there as
``torchvision/__init__.py`` by ``scripts/test_sglang_matrix.sh``).

SGLang's multimodal model configs import torchvision when ``sglang.srt.configs`` is imported, which the attention
registry does. PyPI's torchvision wheels are built against CUDA torch and cannot load beside the CPU torch, and
no code path the tests run uses torchvision. Every ``torchvision.*`` module imports as an empty stand-in whose
attributes are placeholders (so are theirs): calling one raises, so a test that did reach torchvision would fail,
not pass on the stand-in.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}(): torchvision is a stand-in in this test venv")

    def __hash__(self) -> int:  # placeholders key dicts built at import time (transformers' interpolation table)
        return hash(self._name)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Placeholder) and other._name == self._name

    def __mro_entries__(self, bases):  # `class X(torchvision.Something)` still defines X
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


__path__ = []
__version__ = "0.0.0+stand-in"
sys.modules[__name__].__class__ = _StubModule
sys.meta_path.insert(0, _Finder())
