"""The examples (``examples/NAME.py``, which users run as ``python examples/NAME.py``) loaded into a test's process from
their files, the way Python runs them: their sibling ``_shared`` importable under that name (``python`` puts the
script's folder first on the path; here it is loaded by file into ``sys.modules``, and the path stays untouched)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(module_name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = sys.modules[module_name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (``_shared`` for the helpers the examples share)."""
    shared = sys.modules.get("_shared") or _load("_shared", EXAMPLES / "_shared.py")
    return shared if name == "_shared" else _load(f"examples_{name}", EXAMPLES / f"{name}.py")
