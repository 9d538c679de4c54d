"""The names of the PostgreSQL providers, spelled once.

A module of constants (and the ``--lab-postgres`` flag made of them), so the command
line can offer the choices without importing psycopg or the launcher (``lab.pg.cluster``
does the providing).
"""

from __future__ import annotations

from typing import Any

from lab.options import option

AUTO = "auto"
DSN = "dsn"
CONTAINER = "container"
EMBEDDED = "embedded"
# What a run may ask for: ``auto`` tries the other three in this order.
MODES = (AUTO, DSN, CONTAINER, EMBEDDED)
# pytest only: no server at all (describing or collecting the suite, never an evidence run).
NONE = "none"
PLUGIN_MODES = (*MODES, NONE)
# The help of every command's --lab-postgres, said once.
MODE_HELP = ("where the run's PostgreSQL comes from (auto: a DSN, a container, then an "
             "embedded server)")


def mode_option() -> Any:
    """The ``--lab-postgres`` field of a command's options (``lab.options.option``): every
    command that provisions a server declares the flag with this one spelling and help."""
    return option(AUTO, help=MODE_HELP, choices=MODES)
