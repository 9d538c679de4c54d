"""Fixture plugin: SIGINT as a test needs it, whatever this process inherited.

A process started in the background by a script (``cmd &`` without job control, as a CI
job may run the suite) inherits SIGINT ignored, and Python leaves an ignored SIGINT
ignored: Ctrl-C then raises nothing, and an exec'd child inherits it ignored too. A test
that interrupts something says which it means, with ``sigint``.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest


@contextmanager
def _sigint(handler: Any) -> Iterator[None]:
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Sigint:
    """``raises()``: SIGINT raises KeyboardInterrupt here, and an exec'd child starts with
    it at its default; ``ignored()``: SIGINT ignored here and in children started in the
    block, as in a script's background job."""

    @staticmethod
    def raises() -> AbstractContextManager[None]:
        return _sigint(signal.default_int_handler)

    @staticmethod
    def ignored() -> AbstractContextManager[None]:
        return _sigint(signal.SIG_IGN)


@pytest.fixture
def sigint() -> Sigint:
    """SIGINT set for a block, restored after it (see ``Sigint``)."""
    return Sigint()
