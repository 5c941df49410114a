"""Every difference between the SGLang versions the adapter supports, in one place.

Supported: ``sglang`` 0.5.17.x (the last release pinning torch 2.11) and 0.5.23.x (the newest). On any other
SGLang the entry point logs one warning and registers nothing. To add a version, add a row to ``SUPPORTED_SGLANG``
and, where it differs, a shim below (one line saying why, and when it can go), chosen by detecting the feature in
the running SGLang, never by its version number. ``tests/unit/test_sglang_adapter_matrix.py`` runs against both.
"""

from __future__ import annotations

import functools
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_SGLANG: tuple[tuple[SpecifierSet, str], ...] = (
    (SpecifierSet(">=0.5.17,<0.5.18"), "sglang 0.5.17.x"),
    (SpecifierSet(">=0.5.23,<0.5.24"), "sglang 0.5.23.x"),
)


@functools.cache
def installed_sglang() -> Version:
    """The installed SGLang's version; ``ValueError`` when none is installed."""
    try:
        return Version(metadata.version("sglang"))
    except metadata.PackageNotFoundError:
        raise ValueError(f"no SGLang is installed (no distribution named sglang); supported: "
                         f"{supported_sglang_text()}") from None
    except InvalidVersion as err:
        raise ValueError(f"the installed sglang has a version that is not PEP 440 ({err})") from None


def supported_sglang_text() -> str:
    return ", ".join(label for _, label in SUPPORTED_SGLANG)


def is_supported(version: Version) -> bool:
    # dev/rc suffixes and local labels do not change the API generation: compare the release only.
    release = Version(version.base_version)
    return any(release in spec for spec, _ in SUPPORTED_SGLANG)


def unsupported_sglang_reason() -> str | None:
    """Why the installed SGLang cannot run dcp-triton (none installed, or an unsupported version), or ``None``."""
    try:
        version = installed_sglang()
    except ValueError as err:
        return str(err)
    if is_supported(version):
        return None
    return f"sglang=={version} is not supported by the dcp-triton attention backend; supported: " \
           f"{supported_sglang_text()}"


def check_supported_sglang() -> None:
    """Raise ``ValueError`` naming the installed SGLang and the supported ones unless it is supported."""
    reason = unsupported_sglang_reason()
    if reason is not None:
        raise ValueError(reason)


def resolved_server_arg(model_runner, name: str):
    """A server argument as SGLang resolved it (its defaults and overrides applied), ``None`` when it has none."""
    from sglang.srt.arg_groups.overrides import resolved_view

    return getattr(resolved_view(model_runner.server_args), name, None)


def runtime_spec_arg(name: str, default):
    """A speculative setting as SGLang's runtime config holds it now (``get_spec()``): an adaptive run
    (``--speculative-adaptive``) overrides its draft-token count there, not in the server arguments, while it builds
    each candidate step count's target backend and graphs. ``default`` where no config is published (tests)."""
    try:
        from sglang.srt.runtime_context import get_spec

        return getattr(get_spec(), name)
    except (ImportError, ValueError, AttributeError):
        return default
