"""SIGINT as a test needs it, whatever this process inherited.

A process started in the background by a script (``cmd &`` without job control, as a CI
job may run the suite) inherits SIGINT ignored, and Python leaves an ignored SIGINT
ignored: Ctrl-C then raises nothing, and an exec'd child inherits it ignored too. A test
that interrupts something says which it means.
"""

from __future__ import annotations

import signal
import threading
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


def sigint_raises(heard: threading.Event | None = None) -> AbstractContextManager[None]:
    """For the block, SIGINT raises KeyboardInterrupt here, and a child exec'd in it
    starts with SIGINT at its default (as at a terminal).

    ``heard`` is set the moment the main thread takes the signal, just before it raises:
    a thread waiting on it knows the interrupt is being handled, however loaded the
    machine (the handler runs only when the main thread next gets the interpreter).
    """
    if heard is None:
        return _sigint(signal.default_int_handler)

    def handler(signum: int, frame: Any) -> None:
        heard.set()
        signal.default_int_handler(signum, frame)

    return _sigint(handler)


def sigint_ignored() -> AbstractContextManager[None]:
    """For the block, SIGINT is ignored here and in children started in it (as in a
    script's background job)."""
    return _sigint(signal.SIG_IGN)
