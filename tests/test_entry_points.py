"""Commands take typed options: argparse stays in ``lab/cli.py``, a namespace goes nowhere.

Each command's options dataclass (defined in the module that owns the command) declares
its flags, once (``lab.options.option``); ``lab.parsing.add_options`` builds them and
``lab.cli.options_from`` is the one place parsed arguments become the frozen options;
handlers and ``publish`` take and pass those. These tests hold the line: no other module
of ``lab/`` mentions argparse (except ``lab/parsing.py``, the parser's own pieces, and
the child processes that parse their own argv), none but those declares a flag with
``add_argument``, every option of every command is a field of its options, ``lab/
publish.py`` builds no namespace, and every option's default is its flag's.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from lab import cli, parsing, publish, reproduce, review, runner, verify
from lab.bench import command as bench_command
from lab.book import builder
from lab.evidence import manifest
from lab.faults import chaos_command, crashpoints, soak
from lab.model import command as model_command
from lab.options import flag_of
from lab.runtime import processes

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lab"
# Modules run as ``python -m`` child processes that parse their own argv: argparse stays
# in their parser and its caller, since nothing else calls them in-process.
SELF_PARSING = {
    "lab/runtime/toolprocess.py",
    "lab/peers/dbos_peer.py",
    "lab/peers/langgraph_peer.py",
    "lab/peers/temporal_peer.py",
    "lab/evidence/environment.py",
    "lab/reference.py",
}
ALLOWED = {"lab/cli.py", "lab/parsing.py", *SELF_PARSING}

# (argv, the options it becomes, what the command requires): with nothing else given,
# the options must equal the dataclass's own defaults, i.e. every default is the flag's.
LEAVES: list[tuple[list[str], type[Any], dict[str, Any]]] = [
    (["worker", "--schema", "s", "--tool", "t"], processes.WorkerOptions,
     {"schema": "s", "tool": "t"}),
    (["run"], runner.RunOptions, {}),
    (["reproduce", "e"], reproduce.ReproduceOptions, {"evidence": "e"}),
    (["evidence", "verify"], verify.EvidenceOptions, {"evidence_command": "verify"}),
    (["evidence", "show"], verify.EvidenceOptions, {"evidence_command": "show"}),
    (["evidence", "compare", "a", "b"], reproduce.CompareOptions,
     {"evidence_command": "compare", "first": "a", "second": "b"}),
    (["manifest", "sync"], manifest.ManifestOptions, {"manifest_command": "sync"}),
    (["manifest", "check"], manifest.ManifestOptions, {"manifest_command": "check"}),
    (["model", "run"], model_command.RunOptions, {}),
    (["model", "check", "r"], model_command.CheckOptions, {"report": "r"}),
    (["publish", "--out", "o"], publish.PublishOptions, {"out": "o"}),
    (["chaos"], chaos_command.ChaosOptions, {}),
    (["soak"], soak.SoakOptions, {}),
    (["crashpoints"], crashpoints.CrashpointsOptions, {}),
    (["bench", "throughput"], bench_command.ThroughputOptions, {}),
    (["bench", "claim"], bench_command.ClaimOptions, {}),
    (["bench", "suite"], bench_command.SuiteOptions, {}),
    (["bench", "startup"], bench_command.StartupOptions, {}),
    (["review", "--schema", "s", "list"], review.ReviewOptions, {"schema": "s"}),
    (["review", "--schema", "s", "show", "w"], review.ShowOptions,
     {"schema": "s", "workflow": "w"}),
    (["review", "--schema", "s", "requeue", "w"], review.RequeueOptions,
     {"schema": "s", "workflow": "w"}),
    (["review", "--schema", "s", "resolve", "w", "--as", "failed", "--reason", "r"],
     review.ResolveOptions, {"schema": "s", "workflow": "w", "outcome": "failed", "reason": "r"}),
    (["book", "build"], builder.BuildOptions, {}),
]
# Commands with no options at all: they read stdin.
NO_OPTIONS = {("plancheck",)}


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_argparse_is_mentioned_only_by_the_cli_and_self_parsing_children() -> None:
    """A handler that takes ``argparse.Namespace`` (or imports argparse) fails here."""
    mentions = sorted(
        _relative(path) for path in PACKAGE.rglob("*.py")
        if "argparse" in path.read_text(encoding="utf-8")
    )
    assert [name for name in mentions if name not in ALLOWED] == []


def test_self_parsing_children_are_run_as_main() -> None:
    """The exception is only for modules that are themselves a process's entry point."""
    for name in sorted(SELF_PARSING):
        source = (ROOT / name).read_text(encoding="utf-8")
        assert 'if __name__ == "__main__":' in source, name


def test_publish_builds_no_namespace() -> None:
    """``publish`` calls the steps with their typed options, not fabricated namespaces."""
    tree = ast.parse((PACKAGE / "publish.py").read_text(encoding="utf-8"))
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert "Namespace" not in names | attributes
    assert "argparse" not in names
    called = {
        ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)
    }
    assert {"runner.RunOptions", "model_command.RunOptions"} <= called


@pytest.mark.parametrize(("argv", "kind", "required"), LEAVES,
                         ids=[" ".join(a for a in argv if not a.startswith("-"))
                              for argv, _, _ in LEAVES])
def test_every_default_is_the_flags_default(
    argv: list[str], kind: type[Any], required: dict[str, Any]
) -> None:
    """Parsed with nothing optional given, the options are the dataclass's own defaults."""
    parsed = cli.build_parser().parse_args(argv)
    options = cli.options_from(kind, parsed)
    assert options == kind(**required)
    assert dataclasses.is_dataclass(options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(options, dataclasses.fields(options)[0].name, None)


def test_no_flag_is_declared_with_add_argument() -> None:
    """``lab``'s flags are declared by options dataclasses only: ``add_argument`` is called
    by ``lab.parsing`` (which builds them) and by the self-parsing children, nowhere else
    (``lab/cli.py`` creates the commands; the flags chaos and soak share are fields made
    by ``chaos_settings.fault_option``)."""
    callers = sorted(
        _relative(path) for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
    )
    assert sorted(set(callers) - SELF_PARSING) == ["lab/parsing.py"]
    assert not (PACKAGE / "fault_arguments.py").exists()


def _parsers_of(argv: list[str]) -> list[argparse.ArgumentParser]:
    """The parsers ``argv`` passes through: ``lab``'s, its command's, its subcommand's."""
    parsers = [cli.build_parser()]
    for word in argv:
        subs = [a for a in parsers[-1]._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and word in subs[0].choices:
            parsers.append(subs[0].choices[word])
    return parsers


@pytest.mark.parametrize(("argv", "kind", "required"), LEAVES,
                         ids=[" ".join(a for a in argv if not a.startswith("-"))
                              for argv, _, _ in LEAVES])
def test_every_option_is_a_field_of_its_options(
    argv: list[str], kind: type[Any], required: dict[str, Any]
) -> None:
    """The options of a command (and of its group, ``lab review --schema``) are exactly
    the flags its dataclass declares, with the declared help and spelling: the options
    come from ``add_options``, not from a second declaration."""
    declared = {field.name: flag for field in dataclasses.fields(kind)
                if (flag := flag_of(field)) is not None}
    built = [action for parser in _parsers_of(argv)[1:]
             for action in next(parsing.walk(parser)).options]
    assert {action.dest: action.help for action in built} == {
        name: flag.help for name, flag in declared.items()}
    for action in built:
        flag = declared[action.dest]
        spelled = flag.flags or (() if flag.positional
                                 else (f"--{action.dest.replace('_', '-')}",))
        assert tuple(action.option_strings) == spelled


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [path]
    return [leaf for name, sub in subs[0].choices.items() for leaf in _leaves(sub, (*path, name))]


def test_every_command_is_in_the_table() -> None:
    """A new command (or subcommand) needs a row above: its options are checked too."""
    parser = cli.build_parser()
    tabled = set()
    for argv, _, _ in LEAVES:
        parsed = vars(parser.parse_args(argv))
        tabled.add((parsed["command"], *(value for name, value in sorted(parsed.items())
                                         if name.endswith("_command"))))
    assert sorted(set(_leaves(parser, ())) - tabled - NO_OPTIONS) == []


def test_a_flag_without_a_field_is_a_programming_error() -> None:
    """``options_from`` neither drops a parsed option nor invents one."""

    @dataclasses.dataclass(frozen=True)
    class Narrow:
        chapter: tuple[str, ...] = ()

    with pytest.raises(TypeError, match="evidence"):
        cli.options_from(Narrow, cli.build_parser().parse_args(["run"]))


def test_lists_become_tuples() -> None:
    """Repeated flags and the pytest remainder arrive as tuples in the frozen options."""
    parsed = cli.build_parser().parse_args(["run", "--chapter", "a", "--chapter", "b", "--", "-q"])
    options = cli.options_from(runner.RunOptions, parsed)
    assert options.chapter == ("a", "b")
    assert options.pytest_args == ("--", "-q")
