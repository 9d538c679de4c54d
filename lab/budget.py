"""An experiment's wall-clock budget: when it runs out, the experiment fails, loudly.

The plugin arms a budget (``arm``, ``disarm``) around an experiment's setup and body: the
seconds ``experiments/manifest.json`` gives it (a default, and an override per
experiment). Expiry raises ``BudgetExpired`` in the main thread, wherever it waits: a
sleep, a lock, a retry loop against a dead server. The exception unwinds the
experiment through its fixtures' finalizers, which kill and reap its processes, stop
its server and detach its mounts (``lab.leftovers`` then checks nothing is left). Its
message names what the experiment waited for: the innermost ``waiting(...)`` block,
and the line of lab or experiment code it was in.

``BudgetExpired`` is a ``BaseException``: a retry loop's ``except Exception`` cannot
swallow it and wait on.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

# What the innermost waits of the main thread are for (a wait elsewhere is not named).
_WAITS: list[str] = []


class BudgetExpired(BaseException):
    """An experiment's wall-clock budget ran out."""


@contextmanager
def waiting(what: str) -> Iterator[None]:
    """Name what the block waits for, so an expired budget can say it."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        _WAITS.append(what)
    try:
        yield
    finally:
        if main and _WAITS:
            _WAITS.pop()


def _where(frame: FrameType | None) -> str:
    """The innermost frame of lab or experiment code: ``path:line in function``."""
    found = ""
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/lab/" in path or "/experiments/" in path:
            short = path[path.rfind("/lab/") + 1:] if "/lab/" in path else path[
                path.rfind("/experiments/") + 1:]
            found = f"{short}:{frame.f_lineno} in {frame.f_code.co_name}"
            break
        frame = frame.f_back
    return found


def message(label: str, seconds: float, frame: FrameType | None) -> str:
    """What an expired budget says: whose, how long, what it waited for, where."""
    what = _WAITS[-1] if _WAITS else "(no named wait)"
    where = _where(frame)
    return (f"{label}: its budget of {seconds:g} s ran out while waiting for {what}"
            + (f" (at {where})" if where else ""))


def arm(seconds: float, label: str) -> bool:
    """Start a budget that ``disarm`` ends (for a hook that cannot hold a ``with``);
    False when it cannot be armed here."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(
            signal, "setitimer"):
        return False

    def expire(signum: int, frame: FrameType | None) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise BudgetExpired(message(label, seconds, frame))

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return True


def disarm() -> None:
    """End the budget ``arm`` started (nothing when none runs)."""
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        # The timer first: no alarm may arrive once the handler is the default (exit).
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
    del _WAITS[:]


def expired_in(excinfo: BaseException | None) -> bool:
    """Whether ``excinfo`` is (or was caused by) an expired budget."""
    seen = 0
    while excinfo is not None and seen < 20:
        if isinstance(excinfo, BudgetExpired):
            return True
        excinfo = excinfo.__cause__ or excinfo.__context__
        seen += 1
    return False


