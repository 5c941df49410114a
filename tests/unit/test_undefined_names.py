"""Every Python file of the repository names only what it defines or imports (pyflakes' undefined-name checks).

Most benchmark and device scripts run only on a GPU machine, where a name missing after a refactor (an import
dropped with the code that moved) costs a device call before it shows; here it fails on CPU, in CI."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyflakes import api as pyflakes_api
from pyflakes import messages
from pyflakes.reporter import Reporter

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("dcp_plugin", "kernels", "adapters", "benchmarks", "scripts", "examples", "tests")
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(Reporter):
    def __init__(self):
        super().__init__(None, None)
        self.found = []

    def flake(self, message):
        if isinstance(message, UNDEFINED):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):  # noqa: N802 - pyflakes' name
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):  # noqa: N802 - pyflakes' name
        self.found.append(f"{filename}: {msg}")


def undefined_names(paths) -> list[str]:
    reporter = _Collect()
    for path in paths:
        pyflakes_api.checkPath(str(path), reporter)
    return reporter.found


def test_the_check_sees_a_missing_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import json\n\n\ndef f():\n    return time.perf_counter(), json\n")
    assert undefined_names([probe]) == [f"{probe}:5:12: undefined name 'time'"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_file_uses_an_undefined_name(folder):
    paths = sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    assert paths, f"no Python files under {folder}/"
    found = undefined_names(paths)
    assert not found, "\n".join(found)
