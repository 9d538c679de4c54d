"""A command's options dataclass is the declaration of its flags.

Each field made with ``option(...)`` carries its flag's help, metavar, choices and
spelling once; ``lab.parsing.add_options`` builds the parser from the dataclass (the
default is the field's, the kind of value its annotation's), and ``lab.parsing.
options_from`` turns the parsed arguments back into the dataclass. A field made
without ``option`` (a subcommand's name) is not a flag. Pure, no parser here: so the
modules that own a command's options, on any floor, can declare them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# The metadata key under which a field keeps its flag.
FLAG = "lab.flag"


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one field is spelled on the command line.

    ``flags``: the option strings (default ``--field-name``); ``positional``: an argument
    without a dash; ``repeat``: the flag may be given again, each value appended (the
    field is a tuple); ``remainder``: a positional taking the rest of the command line
    as it is (``lab run -- PYTEST_ARGS``; the field is a tuple).
    """

    help: str
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    positional: bool = False
    repeat: bool = False
    required: bool = False
    remainder: bool = False


def option(default: Any = dataclasses.MISSING, *, help: str, flags: tuple[str, ...] = (),
           metavar: str | None = None, choices: tuple[str, ...] | None = None,
           positional: bool = False, repeat: bool = False, remainder: bool = False) -> Any:
    """A dataclass field that is also a command-line flag (see ``Flag``).

    Without a default the flag is required (a positional, or ``--name`` that must be given).
    """
    positional = positional or remainder
    required = default is dataclasses.MISSING and not positional
    flag = Flag(help, flags, metavar, choices, positional, repeat, required, remainder)
    return dataclasses.field(default=default, metadata={FLAG: flag})


def flag_of(field: dataclasses.Field[Any]) -> Flag | None:
    """The flag ``field`` declares, or None when it is not one."""
    found = field.metadata.get(FLAG)
    return found if isinstance(found, Flag) else None
