"""SIGINT as a test needs it, whatever this process inherited.

A process started in the background by a script (``cmd &`` without job control, as a CI
job may run the suite) inherits SIGINT ignored, and Python leaves an ignored SIGINT
ignored: Ctrl-C then raises nothing, and an exec'd child inherits it ignored too. A test
that interrupts something says which it means.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any


@contextmanager
def _sigint(handler: Any) -> Iterator[None]:
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def sigint_raises() -> AbstractContextManager[None]:
    """For the block, SIGINT raises KeyboardInterrupt here, and a child exec'd in it
    starts with SIGINT at its default (as at a terminal)."""
    return _sigint(signal.default_int_handler)


def sigint_ignored() -> AbstractContextManager[None]:
    """For the block, SIGINT is ignored here and in children started in it (as in a
    script's background job)."""
    return _sigint(signal.SIG_IGN)
