"""The command line explains itself, and the reference pages say what the code says.

Every option and positional of every ``lab`` command has help and shows its default (or
says it is required), ``lab --version`` answers, a mistyped command is answered with the
one meant, and the generated pages of ``docs/`` (commands, environment variables, exit
codes, the architecture's floors table) are what ``python -m lab.reference`` draws now.
Every relative link of the README and of ``docs/`` names a file that exists.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from lab import cli, parsing, reference, verify

ROOT = Path(__file__).resolve().parents[1]


def test_every_option_of_every_command_has_help_and_a_default() -> None:
    """No option or positional of ``lab`` lacks help or hides its default."""
    assert parsing.undocumented(cli.build_parser()) == []


def test_an_option_without_help_is_named() -> None:
    """The check above can fail: a parser with a bare option is reported, by name."""
    parser = parsing.Parser(prog="lab")
    commands = parser.add_subparsers(dest="command", required=True)
    sub = commands.add_parser("thing", help="a command")
    sub.add_argument("--bare", default=3)
    sub.add_argument("--explained", default=4, help="with help")
    assert parsing.undocumented(parser) == ["lab thing --bare: no help"]


def _help(words: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        cli.main([*words[1:], "--help"])
    assert stop.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_prints_each_default(capsys: pytest.CaptureFixture[str]) -> None:
    """``lab COMMAND --help`` shows every option's default as the reference page does."""
    checked = 0
    for command in parsing.walk(cli.build_parser()):
        text = _help(command.words, capsys)
        for action in command.options:
            default = parsing.default_text(action)
            if default is not None:
                assert f"(default: {default})" in text, (command.words, action.dest)
                checked += 1
            elif parsing.is_required(action) and action.option_strings:
                assert f"{action.help} (required)" in text, (command.words, action.dest)
    assert checked > 100


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """``lab --version`` prints the distribution's version and the tree that ran."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"lab \d+\.\d+\.\d+\S* \(.+\)\n", out), out
    assert str(ROOT / "lab") in out


@pytest.mark.parametrize(("argv", "meant"), [
    (["evidenc"], "evidence"),
    (["evidence", "verfy"], "verify"),
    (["chaos", "--disk-full-fs", "tmps"], "tmpfs"),
])
def test_a_mistyped_choice_names_the_one_meant(
    argv: list[str], meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A usage error (exit 2) that names the closest valid choice."""
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    assert f"did you mean {meant!r}?" in capsys.readouterr().err


def test_a_choice_far_from_any_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing close: the plain usage error, no suggestion."""
    with pytest.raises(SystemExit):
        cli.main(["zzzzzz"])
    err = capsys.readouterr().err
    assert "invalid choice: 'zzzzzz'" in err and "did you mean" not in err


def test_the_reference_pages_are_current() -> None:
    """Each generated page equals what the code and the data files draw now."""
    assert [str(path.relative_to(ROOT)) for path in reference.stale()] == []


def test_the_reference_names_every_command_and_option() -> None:
    """The commands page has a heading per command and a row per option."""
    page = (ROOT / "docs" / "reference" / "commands.md").read_text(encoding="utf-8")
    for command in parsing.walk(cli.build_parser()):
        if not command.options:
            continue
        assert f"## `{' '.join(command.words)}`" in page
        for action in command.options:
            name = action.option_strings[0] if action.option_strings else action.dest
            assert f"`{name}`" in page, (command.words, name)


def test_a_stale_page_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--check`` exits 1 naming the page; a rewrite makes it current."""
    docs = tmp_path / "docs"
    for name in ("environment.toml", "floors.toml", "architecture.md"):
        (docs / name).parent.mkdir(parents=True, exist_ok=True)
        (docs / name).write_text((ROOT / "docs" / name).read_text(encoding="utf-8"))
    monkeypatch.setattr(reference, "ROOT", tmp_path)
    monkeypatch.setattr(reference, "DOCS", docs)
    assert reference.main(["--check"]) == 1
    assert reference.main([]) == 0
    assert reference.main(["--check"]) == 0
    floors = (docs / "floors.toml").read_text().replace('"plan", ', '"plan", "newroom", ', 1)
    (docs / "floors.toml").write_text(floors)
    assert reference.stale() == [docs / "architecture.md"]


_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_relative_link_of_the_docs_exists() -> None:
    """A link of README.md or docs/ to a moved or missing file fails, naming it."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = sorted(
        f"{page.relative_to(ROOT)}: {target}"
        for page in pages
        for target in _LINK.findall(page.read_text(encoding="utf-8"))
        if "://" not in target and not (page.parent / target).exists()
    )
    assert broken == []


def test_the_parser_class_is_used_throughout() -> None:
    """Every command's parser shows defaults and suggests: none is a plain ArgumentParser."""
    kinds = {type(command.parser) for command in parsing.walk(cli.build_parser())}
    assert kinds == {parsing.Parser}
    assert all(isinstance(command.parser.formatter_class, type) and issubclass(
        command.parser.formatter_class, parsing.HelpFormatter)
        for command in parsing.walk(cli.build_parser()))
    assert isinstance(cli.build_parser(), argparse.ArgumentParser)


def test_an_options_dataclass_declares_its_flags() -> None:
    """``option(...)`` fields become flags with their help, default, metavar and kind,
    and parsing them gives back the dataclass; a field without ``option`` is no flag."""
    import dataclasses

    from lab.options import option

    @dataclasses.dataclass(frozen=True)
    class Declared:
        thing_command: str
        target: str = option(help="what to act on", positional=True)
        count: int = option(3, help="how many", metavar="N")
        ratio: float | None = option(None, help="a share")
        tag: tuple[str, ...] = option((), help="repeatable")
        loud: bool = option(False, help="say more")
        mode: str = option("a", help="which", choices=("a", "b"))

    parser = parsing.Parser(prog="lab thing")
    parsing.add_options(parser, Declared)
    assert parsing.undocumented(parser) == []
    assert [a.dest for a in parser._actions][1:] == [
        "target", "count", "ratio", "tag", "loud", "mode"]
    args = parser.parse_args(["t", "--count", "5", "--tag", "p", "--tag", "q", "--loud",
                              "--ratio", "0.5"])
    args.thing_command = "x"
    assert cli.options_from(Declared, args) == Declared(
        "x", "t", 5, 0.5, ("p", "q"), True, "a")
    defaults = parser.parse_args(["t"])
    defaults.thing_command = "x"
    assert cli.options_from(Declared, defaults) == Declared("x", "t")
    text = " ".join(parser.format_help().split())
    assert "--count N how many (default: 3)" in text and "say more (default: off)" in text


def test_a_remainder_takes_the_rest_of_the_command_line() -> None:
    """``option(remainder=True)``: a positional taking everything after it as it is
    (``lab run -- PYTEST_ARGS``), not required, a tuple in the options."""
    import dataclasses

    from lab.options import option

    @dataclasses.dataclass(frozen=True)
    class Declared:
        name: str = option("n", help="a name")
        rest: tuple[str, ...] = option((), help="after --: the rest", remainder=True)

    parser = parsing.Parser(prog="lab thing")
    parsing.add_options(parser, Declared)
    action = parser._actions[-1]
    assert action.nargs == argparse.REMAINDER and not parsing.is_required(action)
    assert cli.options_from(Declared, parser.parse_args(["--name", "m", "--", "-q", "--x"])) \
        == Declared("m", ("--", "-q", "--x"))
    assert cli.options_from(Declared, parser.parse_args([])) == Declared()
    assert "after --: the rest (default: none)" in " ".join(parser.format_help().split())


def test_a_group_declares_the_inherited_flags_its_subcommands_do_not() -> None:
    """``inherited=False``: a subcommand's parser gets only the fields its class adds;
    the group's parser declares the base's, and both parsed together are the options."""
    import dataclasses

    from lab.options import option

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Group:
        schema: str = option(help="the schema")

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Leaf(Group):
        item: str = option(help="the item", positional=True)

    parser = parsing.Parser(prog="lab group")
    parsing.add_options(parser, Group)
    leaf = parser.add_subparsers(dest="group_command").add_parser("leaf")
    parsing.add_options(leaf, Leaf, inherited=False)
    assert [a.dest for a in leaf._actions][1:] == ["item"]
    args = parser.parse_args(["--schema", "s", "leaf", "i"])
    del args.group_command
    assert cli.options_from(Leaf, args) == Leaf(schema="s", item="i")


def test_options_named_by_module_are_imported_when_the_command_is_used(
        tmp_path: Path) -> None:
    """``add_options(parser, "module:Class")`` imports nothing while the command line is
    built: ``lab X`` pays for X's module only. Parsing, ``--help`` and ``walk`` build
    the flags; a name that is no options dataclass is a programming error.

    In a child interpreter: a module imported from outside the tree into this process
    would make the run's evidence fail its check of what ran (rightly).
    """
    import subprocess
    import sys

    (tmp_path / "deferred_options.py").write_text(
        "import dataclasses\n"
        "from lab.options import option\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class Declared:\n"
        "    count: int = option(3, help='how many', metavar='N')\n"
        "NOT_OPTIONS = 1\n", encoding="utf-8")
    (tmp_path / "check.py").write_text(
        "import argparse, sys\n"
        "from lab import parsing\n"
        "root = parsing.Parser(prog='lab')\n"
        "commands = root.add_subparsers(dest='command')\n"
        "used, walked, helped = (commands.add_parser(n) for n in ('used', 'walked', 'helped'))\n"
        "for sub in (used, walked, helped):\n"
        "    parsing.add_options(sub, 'deferred_options:Declared')\n"
        "assert 'deferred_options' not in sys.modules, 'imported while building'\n"
        "parsed = vars(root.parse_args(['used', '--count', '5']))\n"
        "assert parsed == {'command': 'used', 'count': 5}, parsed\n"
        "assert 'deferred_options' in sys.modules, 'parsing did not import it'\n"
        "assert '--count N' in helped.format_help()\n"
        "command = next(c for c in parsing.walk(root) if c.words == ('lab', 'walked'))\n"
        "assert [a.dest for a in command.options] == ['count']\n"
        "try:\n"
        "    parsing.add_options(argparse.ArgumentParser(), 'deferred_options:NOT_OPTIONS')\n"
        "except TypeError as exc:\n"
        "    assert 'NOT_OPTIONS' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('a name that is no options dataclass was accepted')\n"
        "print('ok')\n", encoding="utf-8")
    checked = subprocess.run([sys.executable, str(tmp_path / "check.py")], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert (checked.returncode, checked.stdout.strip()) == (0, "ok"), checked.stderr


@pytest.mark.parametrize("words", [("evidence", "verify"), ("evidence", "show"),
                                   ("manifest", "sync"), ("manifest", "check")])
def test_these_commands_take_their_flags_from_their_options(words: tuple[str, ...]) -> None:
    """Converted commands: each flag's help is the one their options dataclass declares."""
    import dataclasses

    from lab.evidence import manifest
    from lab.options import flag_of

    kind = verify.EvidenceOptions if words[0] == "evidence" else manifest.ManifestOptions
    declared = {f.name: flag.help for f in dataclasses.fields(kind)
                if (flag := flag_of(f)) is not None}
    command = next(c for c in parsing.walk(cli.build_parser()) if c.words == ("lab", *words))
    assert {a.dest: a.help for a in command.options} == declared


_SH_BLOCK = re.compile(r"```sh\n(.*?)```", re.S)


def _doc_commands() -> list[tuple[str, str]]:
    """(page, command) for each command line in the ``sh`` blocks of README.md and docs/
    (the author's guide runs its own, in tests/test_authoring.py)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found: list[tuple[str, str]] = []
    for page in pages:
        if page.name == "authoring.md":
            continue
        for block in _SH_BLOCK.findall(page.read_text(encoding="utf-8")):
            for line in block.splitlines():
                for command in line.split("#", 1)[0].split("&&"):
                    command = command.rsplit("|", 1)[-1].strip()
                    if command:
                        found.append((str(page.relative_to(ROOT)), command))
    return found


def test_every_command_the_docs_print_exists_and_parses() -> None:
    """A documented command names a script that exists, a module that imports, a file
    that is there, or ``lab`` arguments its parser accepts, so a renamed command or
    option cannot linger in the docs. (CI runs the README's two commands themselves.)"""
    import importlib.util
    import shlex

    problems: list[str] = []
    commands = _doc_commands()
    for page, command in commands:
        words = [w for w in shlex.split(command) if not re.fullmatch(r"[A-Z_]+=\S*", w)]
        program, arguments = words[0], words[1:]
        if program.endswith("/lab"):
            try:
                cli.build_parser().parse_args(arguments)
            except SystemExit:
                problems.append(f"{page}: {command}: lab does not accept it")
        elif program.endswith("/python") and arguments[:1] == ["-m"]:
            if importlib.util.find_spec(arguments[1]) is None:
                problems.append(f"{page}: {command}: no module {arguments[1]}")
            problems += [f"{page}: {command}: no file {a}" for a in arguments[2:]
                         if a.startswith("tests/") and not (ROOT / a).is_file()]
        elif program.startswith(".venv/bin/"):
            # A tool the lock installs (ruff, mypy): declared in pyproject.toml.
            declared = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
            if f'"{program.removeprefix(".venv/bin/")}' not in declared:
                problems.append(f"{page}: {command}: no dependency provides it")
        elif not (ROOT / program).is_file():
            problems.append(f"{page}: {command}: no such program in the checkout")
    assert problems == []
    assert ("README.md", "scripts/run-lab") in commands
