"""The ``lab`` command line's own argparse pieces: defaults shown, "did you mean", a walk,
and the flags built from a command's options dataclass.

``lab.cli`` declares the commands and the module owning each command's options
declares its flags (``lab.options.option``); this module builds them (``add_options``)
and says how every one of them explains itself, so ``lab X --help`` and the generated
reference (``lab.reference``) show the same help and the same default for each option.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import re
import typing
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from lab import options

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Options = TypeVar("Options", bound="DataclassInstance")

# Parsed attributes that choose the handler rather than carry an option (unless the
# options ask for one by name, as ``lab evidence``'s and ``lab manifest``'s do).
_DISPATCH = frozenset({"command", "handler", "evidence_command", "manifest_command",
                       "model_command", "bench_command", "review_command", "book_command"})


def options_from(kind: type[Options], args: argparse.Namespace) -> Options:
    """The one place where parsed arguments become a command's typed, frozen options.

    Every parsed option must be a field of ``kind`` and every field a parsed option, so
    no flag is dropped or invented on the way; a list (``action="append"``, a remainder)
    becomes a tuple.
    """
    fields = {field.name for field in dataclasses.fields(kind)}
    parsed = {name: value for name, value in vars(args).items()
              if name in fields or name not in _DISPATCH}
    if parsed.keys() != fields:
        raise TypeError(f"{kind.__name__} does not match the parser: "
                        f"{sorted(parsed.keys() ^ fields)}")
    return kind(**{name: tuple(value) if isinstance(value, list) else value
                   for name, value in parsed.items()})


# What a default is called when it says "not given" rather than a value.
_NOTHING = "none"
# A help text that says its default itself: "(default HEAD)", "(default: 2)".
_OWN_DEFAULT = re.compile(r"\(default\b")


def is_required(action: argparse.Action) -> bool:
    """Whether ``action`` must be given: a required option, or a positional taking one value.

    argparse marks a remainder positional (``-- PYTEST_ARGS``) required; it is not.
    """
    if action.nargs == argparse.REMAINDER:
        return False
    return action.required or (not action.option_strings and action.nargs is None)


def default_text(action: argparse.Action) -> str | None:
    """The default ``action`` shows, as text; None when it has none to show (required).

    A help text that already says its default ("(default HEAD)") is left to say it.
    """
    default = action.default
    if default == argparse.SUPPRESS or is_required(action):
        return None
    if action.help and _OWN_DEFAULT.search(action.help):
        return None
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "on" if default else "off"
    if default is None or default == [] or default == ():
        return _NOTHING
    return str(default)


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (or says it is required)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if text == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction
                                                   | argparse._HelpAction):
            return text
        default = default_text(action)
        if default is not None:
            return f"{text} (default: {default.replace('%', '%%')})"
        if is_required(action) and action.option_strings:
            return f"{text} (required)"
        return text


class Parser(argparse.ArgumentParser):
    """An argument parser that shows defaults and suggests the command meant.

    A mistyped choice (``lab evidenc``) names the closest valid one; subparsers are made
    of this class too, so every level suggests.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        # Builders deferred until this parser is used (``add_options`` with a name): so
        # ``lab worker`` imports the worker's module, not every command's.
        self._later: list[Callable[[argparse.ArgumentParser], None]] = []

    def later(self, build: Callable[[argparse.ArgumentParser], None]) -> None:
        """Call ``build`` with this parser when it is first used (parsed, helped, walked)."""
        self._later.append(build)

    def complete(self) -> None:
        """Run the builders ``later`` deferred, once, in the order they were deferred."""
        while self._later:
            self._later.pop(0)(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """``argparse``'s, on the completed parser (a subcommand's too: argparse hands
        the rest of the command line to its parser's ``parse_known_args``)."""
        self.complete()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        """``argparse``'s, on the completed parser (a usage error prints it)."""
        self.complete()
        return super().format_usage()

    def format_help(self) -> str:
        """``argparse``'s, on the completed parser (``--help`` prints it)."""
        self.complete()
        return super().format_help()

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            choices = [str(choice) for choice in action.choices or ()]
            close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
            if not close or "did you mean" in exc.message:
                raise
            raise argparse.ArgumentError(
                action, f"{exc.message}; did you mean {close[0]!r}?") from None


@dataclasses.dataclass(frozen=True)
class Command:
    """One parser of the ``lab`` command line: its words, what it does, its parser."""

    words: tuple[str, ...]
    summary: str
    parser: argparse.ArgumentParser

    @property
    def options(self) -> list[argparse.Action]:
        """The options and positionals of this command (not ``--help`` or its commands)."""
        return [action for action in self.parser._actions
                if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)]


def walk(parser: argparse.ArgumentParser, words: tuple[str, ...] = ("lab",),
         summary: str = "") -> Iterator[Command]:
    """``parser`` and every parser under it, depth first, in the order they were added,
    each with all its options (deferred ones built)."""
    if isinstance(parser, Parser):
        parser.complete()
    yield Command(words, summary or (parser.description or ""), parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, child in action.choices.items():
                yield from walk(child, (*words, name), helps.get(name, ""))


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """Each option of ``parser`` (or a command under it) without help, or with no default
    shown though it is not required, as ``lab run --chapter: why``."""
    problems: list[str] = []
    for command in walk(parser):
        for action in command.options:
            name = f"{' '.join(command.words)} {'/'.join(action.option_strings) or action.dest}"
            text = action.help or ""
            if not text.strip() or text == argparse.SUPPRESS:
                problems.append(f"{name}: no help")
            elif (action.default != argparse.SUPPRESS and not is_required(action)
                  and default_text(action) is None and not _OWN_DEFAULT.search(text)):
                problems.append(f"{name}: no default shown")
    return problems


def _value_type(annotation: Any) -> tuple[type, bool]:
    """The type of one value of a field annotated ``annotation``, and whether it repeats."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) is tuple:
        return args[0], True
    if args:  # ``X | None``
        return _value_type(args[0])[0], False
    return annotation, False


def add_version(parser: argparse.ArgumentParser, version: str) -> None:
    """``--version``, printing ``version`` (``%(prog)s`` is the program's name)."""
    parser.add_argument("--version", action="version", version=version)


def _options_class(name: str) -> type[Any]:
    """The options dataclass ``name`` ("lab.module:Class") names, imported now."""
    module, _, attribute = name.partition(":")
    kind = getattr(importlib.import_module(module), attribute)
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        raise TypeError(f"{name} is not an options dataclass")
    return kind


def _own_fields(kind: type[Any]) -> list[dataclasses.Field[Any]]:
    """The fields ``kind`` declares itself, not those it inherits from a dataclass base."""
    inherited = {field.name for base in kind.__mro__[1:] if dataclasses.is_dataclass(base)
                 for field in dataclasses.fields(base)}
    return [field for field in dataclasses.fields(kind) if field.name not in inherited]


def add_options(parser: argparse.ArgumentParser, kind: type[Any] | str, *,
                inherited: bool = True) -> None:
    """Add the flags the options dataclass ``kind`` declares (``lab.options.option``).

    The default is the field's and the value's type its annotation's; a ``bool`` is a
    switch, a tuple a repeatable flag. Fields that declare no flag are left out, and so
    are inherited fields with ``inherited=False`` (a command group's parser declares
    those, e.g. ``lab review --schema``). ``kind`` named as ``"lab.module:Class"`` is
    imported only when a ``Parser`` is first used, so building the ``lab`` command
    line imports no command's module.
    """
    if isinstance(kind, str):
        name = kind
        if isinstance(parser, Parser):
            parser.later(lambda built: add_options(built, _options_class(name),
                                                   inherited=inherited))
            return
        kind = _options_class(name)
    hints = typing.get_type_hints(kind)
    for field in dataclasses.fields(kind) if inherited else _own_fields(kind):
        flag = options.flag_of(field)
        if flag is None:
            continue
        value_type, repeats = _value_type(hints[field.name])
        settings: dict[str, Any] = {"help": flag.help}
        if flag.metavar is not None:
            settings["metavar"] = flag.metavar
        if flag.choices is not None:
            settings["choices"] = flag.choices
        if value_type is not str and value_type is not bool:
            settings["type"] = value_type
        if flag.positional:
            if flag.remainder:
                settings.update(nargs=argparse.REMAINDER, default=field.default)
            elif field.default is not dataclasses.MISSING:
                settings.update(nargs="?", default=field.default)
            parser.add_argument(field.name, **settings)
            continue
        names = flag.flags or (f"--{field.name.replace('_', '-')}",)
        if value_type is bool:
            parser.add_argument(*names, dest=field.name, action="store_true", help=flag.help)
        elif flag.repeat or repeats:
            # argparse appends to a copy of a list default; the options hold a tuple.
            parser.add_argument(*names, dest=field.name, action="append", default=[], **settings)
        elif flag.required:
            parser.add_argument(*names, dest=field.name, required=True, **settings)
        else:
            parser.add_argument(*names, dest=field.name, default=field.default, **settings)
