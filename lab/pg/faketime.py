"""libfaketime's preload library, for the clock-step faults: which one, and who can read it.

The locked ``libfaketime`` wheel ships ``libfaketime.so.1`` (built for x86_64 Linux), so a
bare machine can step a server's clock; Debian's (``apt-get install libfaketime``) is the
fallback elsewhere, and ``LAB_FAKETIME_LIB`` names another. ``lab.pg.embedded`` preloads it
into the server it launches.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from lab import errors

FAKETIME_ENV = "LAB_FAKETIME_LIB"
FAKETIME_PACKAGE = "libfaketime"
FAKETIME_IN_PACKAGE = ("vendor", "libfaketime", "src", "libfaketime.so.1")
FAKETIME_PATHS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
)


def faketime_from_package() -> Path | None:
    """The ``libfaketime`` wheel's preload library (without importing it), or None.

    The wheel ships one build, for x86_64 Linux: elsewhere it is not offered.
    """
    import importlib.util
    import platform

    if platform.machine() != "x86_64":
        return None
    try:
        spec = importlib.util.find_spec(FAKETIME_PACKAGE)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        library = Path(location).joinpath(*FAKETIME_IN_PACKAGE)
        if os.access(library, os.R_OK):
            return library.resolve()
    return None


def find_faketime(environ: Mapping[str, str] | None = None) -> Path:
    """libfaketime's preload library, or ``errors.ProvisioningError`` naming the install.

    ``LAB_FAKETIME_LIB`` when set (a path, and nothing else; ``libfaketime``: the wheel's
    only), else the locked wheel's, else Debian's.
    """
    env = os.environ if environ is None else environ
    chosen = env.get(FAKETIME_ENV, "")
    if chosen == FAKETIME_PACKAGE:
        # Only the wheel's: run as a machine without Debian's would (CI's newcomer step).
        found = faketime_from_package()
        if found is None:
            raise errors.ProvisioningError(
                f"{FAKETIME_ENV}={FAKETIME_PACKAGE}: the libfaketime package's library is not "
                "installed here (it is in uv.lock, for x86_64)")
        return found
    if chosen:
        candidates = [chosen]
    else:
        candidates = [str(found) for found in (faketime_from_package(),) if found is not None]
        candidates += FAKETIME_PATHS
    for candidate in candidates:
        if os.access(candidate, os.R_OK):
            return Path(candidate)
    if env.get(FAKETIME_ENV):
        raise errors.ProvisioningError(f"{FAKETIME_ENV} names no readable library: "
                                       f"{env[FAKETIME_ENV]}")
    raise errors.ProvisioningError(
        "clock-step faults need libfaketime: the locked libfaketime package "
        "(scripts/ensure-venv installs it; its library is for x86_64), Debian's "
        f"(apt-get install libfaketime), or {FAKETIME_ENV}=path/to/libfaketime.so.1"
    )


def readable_by_all(path: Path) -> bool:
    """Whether any user can read ``path``: every directory above it searchable by others."""
    try:
        if not path.stat().st_mode & stat.S_IROTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in path.resolve().parents)
    except OSError:
        return False
