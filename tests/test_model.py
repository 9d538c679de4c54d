"""Model-generation traces through the real llama-cpp-python path, offline.

The models are tiny GGUF files the suite writes itself (``tiny_gguf``): random
weights, a character-level vocabulary, loaded and sampled by llama.cpp exactly
as the publication model is. ``test_model_at_lab_model_path`` runs a real model
(``LAB_MODEL_PATH``) and checks its report; it is skipped only without one.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import hashlib
import itertools
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import tiny_gguf
from hypothesis import assume, given
from hypothesis import strategies as st

from lab import cli, grammar, model, plan

THREADS = 1  # the tiny models are fastest on one thread; recorded like any setting
PROPOSAL = '{"version":1,"action":"issue_credit","account":"%s","amount_minor":%s,"currency":"CNY"}'
EXTRA_CASES = [
    {"id": "account-a", "account": "account-a", "amount_minor": 500, "prompt": "Issue 500 to a."},
    {"id": "too-much", "account": "account-b", "amount_minor": 20000, "prompt": "Issue 20000."},
    {"id": "no-such", "account": "account-z", "amount_minor": 7, "prompt": "Pay account-z 7."},
]


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf.build(tmp_path_factory.mktemp("gguf") / "tiny.gguf", seed=0)


@pytest.fixture(scope="module")
def engine(tiny_path: Path) -> model.Engine:
    return model.Engine(model.verify_model(tiny_path), threads=THREADS)


@pytest.fixture(scope="module")
def tiny_report(engine: model.Engine, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    traces = tmp_path_factory.mktemp("traces")
    return model.run(engine, model.DEFAULT_CASES, traces)


def accepts(engine: model.Engine, gbnf: str, text: str) -> bool:
    """Whether llama.cpp's grammar sampler lets ``text`` through and then lets it end.

    Each character is one token of the tiny vocabulary: offer only that token
    to the grammar sampler, see whether it survives, accept it, and at the
    end offer the end-of-generation token.
    """
    import llama_cpp

    sampler = llama_cpp.llama_sampler_init_grammar(
        engine.llm._model.vocab, gbnf.encode("utf-8"), b"root"
    )
    assert sampler, "llama.cpp refused the grammar"
    try:
        for char in [*text, None]:
            token = tiny_gguf.EOS if char is None else tiny_gguf.token_of(char)
            data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 0.0, 0.0))
            candidates = llama_cpp.llama_token_data_array(data, 1, -1, False)
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates))
            if math.isinf(data[0].logit):
                return False
            if char is not None:
                llama_cpp.llama_sampler_accept(sampler, token)
        return True
    finally:
        llama_cpp.llama_sampler_free(sampler)


def rows(report: dict[str, Any], mode: str) -> Iterator[dict[str, Any]]:
    return (r for r in report["cases"] if r["mode"] == mode)


# -- the grammar ----------------------------------------------------------------------


def _regex(sequences: list[tuple[grammar.Digits, ...]]) -> re.Pattern[str]:
    return re.compile("|".join("".join(f"[{a}-{b}]" for a, b in s) for s in sequences))


def test_amount_range_is_exactly_the_schemas() -> None:
    spec = plan.PROPOSAL_SCHEMA["properties"]["amount_minor"]
    pattern = _regex(grammar.integer_range(spec["minimum"], spec["maximum"]))
    # Every digit string of up to six digits, leading zeros included.
    matched = {
        "".join(digits)
        for length in range(1, 7)
        for digits in itertools.product("0123456789", repeat=length)
        if pattern.fullmatch("".join(digits))
    }
    assert matched == {str(n) for n in range(1, 10_001)}


@given(st.integers(0, 3000), st.integers(0, 3000))
def test_any_integer_range_is_exact(low: int, high: int) -> None:
    assume(low <= high)
    pattern = _regex(grammar.integer_range(low, high))
    for n in range(0, high + 1100):
        assert bool(pattern.fullmatch(str(n))) == (low <= n <= high), n
        assert not pattern.fullmatch("0" + str(n))


def test_grammar_refuses_schemas_it_would_not_enforce() -> None:
    loose = copy.deepcopy(plan.PROPOSAL_SCHEMA)
    loose["properties"]["account"] = {"type": "string", "pattern": "^account-"}
    with pytest.raises(ValueError, match="account"):
        grammar.from_schema(loose)
    optional = copy.deepcopy(plan.PROPOSAL_SCHEMA)
    optional["required"] = optional["required"][:-1]
    with pytest.raises(ValueError, match="required"):
        grammar.from_schema(optional)
    negative = copy.deepcopy(plan.PROPOSAL_SCHEMA)
    negative["properties"]["amount_minor"]["minimum"] = -5
    with pytest.raises(ValueError, match="-5"):
        grammar.from_schema(negative)


def test_llama_cpp_enforces_the_schemas_ranges(engine: model.Engine) -> None:
    gbnf = grammar.PROPOSAL.gbnf
    for amount in ("1", "9", "10", "500", "1200", "9999", "10000"):
        assert accepts(engine, gbnf, PROPOSAL % ("account-a", amount)), amount
    for amount in ("0", "-3", "10001", "99999", "0500", "500.0", "5e2", '"500"', "true"):
        assert not accepts(engine, gbnf, PROPOSAL % ("account-a", amount)), amount
    assert accepts(engine, gbnf, PROPOSAL % ("account-b", "1"))
    assert not accepts(engine, gbnf, PROPOSAL % ("account-c", "1"))
    assert not accepts(engine, gbnf, PROPOSAL[:-1] % ("account-a", "1") + ',"approved":true}')
    assert not accepts(engine, gbnf, '{"version":1,"action":"issue_credit"}')
    assert not accepts(engine, gbnf, (PROPOSAL % ("account-a", "1")).replace("CNY", "USD"))
    pretty = json.dumps(json.loads(PROPOSAL % ("account-b", "1200")), indent=2)
    assert accepts(engine, gbnf, pretty)


def test_grammar_is_built_from_the_schema(engine: model.Engine) -> None:
    wider = copy.deepcopy(plan.PROPOSAL_SCHEMA)
    wider["properties"]["amount_minor"]["maximum"] = 20_000
    wider_gbnf = grammar.from_schema(wider).gbnf
    assert accepts(engine, wider_gbnf, PROPOSAL % ("account-a", "20000"))
    assert not accepts(engine, grammar.PROPOSAL.gbnf, PROPOSAL % ("account-a", "20000"))


def test_longest_sentence_fits_the_token_budget(engine: model.Engine) -> None:
    ws = " " * grammar.MAX_WS
    longest = (
        "{" + ws + '"version":' + ws + "1," + ws + '"action":' + ws + '"issue_credit",'
        + ws + '"account":' + ws + '"account-a",' + ws + '"amount_minor":' + ws + "10000,"
        + ws + '"currency":' + ws + '"CNY"' + ws + "}"
    )  # fmt: skip
    assert accepts(engine, grammar.PROPOSAL.gbnf, longest)
    assert not accepts(engine, grammar.PROPOSAL.gbnf, longest.replace(ws + "}", ws + " }"))
    assert len(longest) == grammar.PROPOSAL.max_chars
    assert grammar.PROPOSAL.max_chars < model.MAX_TOKENS


# -- the tiny model and the report --------------------------------------------------


def test_tiny_model_is_deterministic_bytes(tmp_path: Path) -> None:
    one = tiny_gguf.build(tmp_path / "one.gguf", seed=3).read_bytes()
    two = tiny_gguf.build(tmp_path / "two.gguf", seed=3).read_bytes()
    assert one == two
    assert one != tiny_gguf.build(tmp_path / "three.gguf", seed=4).read_bytes()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constrained_candidates_that_stop_are_schema_valid(seed: int, tmp_path: Path) -> None:
    path = tiny_gguf.build(tmp_path / "m.gguf", seed=seed)
    engine = model.Engine(model.verify_model(path), threads=THREADS)
    cases = model.load_cases(_cases_file(tmp_path, EXTRA_CASES))
    report = model.run(engine, cases, tmp_path / "traces")
    constrained = list(rows(report, "constrained"))
    assert len(constrained) == len(EXTRA_CASES)
    for row in constrained:
        # The grammar's longest sentence is under the budget: it always stops.
        assert row["finish_reason"] == "stop"
        jsonschema.validate(json.loads(row["candidate_text"]), plan.PROPOSAL_SCHEMA)
        assert row["schema_valid"] is True
        assert row["admission"]["admitted"] is True
        assert row["admission_agrees"] is True
    # The random model can never honour an out-of-range request under the grammar.
    too_much = next(r for r in constrained if r["case"] == "too-much")
    assert too_much["matches_authored_request"] is False
    assert model.check(report) == []


def test_report_keeps_the_seeds_fields(tiny_report: dict[str, Any], tiny_path: Path) -> None:
    for field in (
        "tested_at_utc", "model", "revision", "model_file", "model_sha256", "model_bytes",
        "license", "engine", "engine_version", "platform", "cpu_only", "threads",
        "temperature", "seed", "cases", "limitations", "context", "max_tokens", "grammar",
        "load_seconds", "total_seconds", "summary",
    ):  # fmt: skip
        assert field in tiny_report, field
    assert tiny_report["model_sha256"] == hashlib.sha256(tiny_path.read_bytes()).hexdigest()
    assert tiny_report["model_bytes"] == tiny_path.stat().st_size
    assert tiny_report["model_file"] == "tiny.gguf"
    assert tiny_report["cpu_only"] is True
    assert tiny_report["temperature"] == 0.0
    assert tiny_report["seed"] == 42
    assert tiny_report["threads"] == THREADS
    assert [(r["case"], r["mode"]) for r in tiny_report["cases"]] == [
        ("account-a", "unconstrained"),
        ("account-a", "constrained"),
        ("account-b", "unconstrained"),
        ("account-b", "constrained"),
    ]
    for row in tiny_report["cases"]:
        for field in (
            "prompt", "proposal", "expected_account", "expected_amount_minor",
            "matches_authored_request", "admission", "elapsed_seconds", "generated_text",
            "generated_text_sha256", "mode", "prompt_tokens", "completion_tokens",
            "tokens_per_second", "finish_reason", "trace",
        ):  # fmt: skip
            assert field in row, field
        assert row["completion_tokens"] > 0
        assert row["prompt_tokens"] > 0
        assert row["elapsed_seconds"] > 0


def test_an_unpinned_model_is_named_for_what_it_is(tiny_report: dict[str, Any]) -> None:
    assert tiny_report["publication_model"] is False
    assert tiny_report["model"] == "unidentified GGUF model (general.name 'lab-tiny-random-llama')"
    assert "Qwen" not in tiny_report["model"]
    assert tiny_report["revision"] is None
    assert tiny_report["license"].startswith("unknown")
    assert "not the pinned publication model" in tiny_report["limitations"][0]
    claiming = copy.deepcopy(tiny_report)
    claiming["model"] = model.PINNED.name
    assert "a file other than the pinned model claims to be it" in model.check(claiming)


def test_a_generation_cut_off_by_the_budget_is_not_admitted(
    engine: model.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model, "MAX_TOKENS", 10)
    report = model.run(engine, model.DEFAULT_CASES[:1], tmp_path)
    (row,) = rows(report, "constrained")
    assert row["finish_reason"] == "length"
    assert row["completion_tokens"] == 10
    assert row["generated_text"].startswith("{")
    for row in report["cases"]:
        if row["finish_reason"] != "stop":
            assert row["candidate_text"] is None
            assert row["candidates_found"] is None
            assert row["admission"] == {
                "admitted": False,
                "state": "not_attempted",
                "reason": "generation did not stop naturally (finish_reason 'length')",
            }
    assert model.check(report) == []


@pytest.mark.parametrize("mode", model.MODES)
def test_a_complete_object_cut_off_is_never_repaired(mode: str) -> None:
    text = "Plan: " + PROPOSAL % ("account-a", "500") if mode == "unconstrained" else ""
    text = text or PROPOSAL % ("account-a", "500")
    judged = model.judge(text, "length", mode, model.DEFAULT_CASES[0])
    assert judged["candidate_text"] is None
    assert judged["matches_authored_request"] is False
    assert judged["admission"]["admitted"] is False


def test_two_runs_write_the_same_report_apart_from_times(tiny_path: Path, tmp_path: Path) -> None:
    reports = []
    traces = []
    for _ in range(2):
        engine = model.Engine(model.verify_model(tiny_path), threads=THREADS)
        report = model.run(engine, model.DEFAULT_CASES, tmp_path / "traces")
        reports.append(report)
        traces.append(
            {
                p.name: json.loads(p.read_text())["response"]["choices"]
                for p in sorted((tmp_path / "traces").iterdir())
            }
        )
    assert model.without_times(reports[0]) == model.without_times(reports[1])
    assert traces[0] == traces[1]
    assert reports[0]["tested_at_utc"] != reports[1]["tested_at_utc"]


def test_traces_hold_every_raw_generation(tiny_report: dict[str, Any]) -> None:
    folder = Path(tiny_report["traces_dir"])
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"{case}.{mode}.json" for case in ("account-a", "account-b") for mode in model.MODES
    )
    for row in tiny_report["cases"]:
        trace = json.loads((folder / row["trace"]).read_text())
        assert trace["response"]["choices"][0]["message"]["content"] == row["generated_text"]
        assert trace["messages"][0] == {"role": "system", "content": model.SYSTEM_PROMPT}
        assert (trace["grammar"] is not None) == (row["mode"] == "constrained")


# -- admission and extraction ---------------------------------------------------------


def test_extraction_follows_the_seed() -> None:
    one = PROPOSAL % ("account-a", "500")
    assert model.extract_candidates(f"Sure! {one} Done.") == [one]
    assert model.extract_candidates(f"{one}\n{one}") == [one, one]
    assert model.extract_candidates('{"no": "action"} and {broken') == []
    nested = '{"plan": ' + one + "}"
    assert model.extract_candidates(nested) == [one]
    # The exact text goes to admission, so a duplicate key is still seen and refused.
    duplicated = one[:-1] + ',"account":"account-b"}'
    assert model.extract_candidates(duplicated) == [duplicated]
    assert model.admit_in_process(duplicated)["admitted"] is False


def test_unconstrained_text_goes_through_the_seeds_scan() -> None:
    case = model.DEFAULT_CASES[1]
    text = "Here is the plan: " + PROPOSAL % ("account-b", "1200") + " Thanks."
    judged = model.judge(text, "stop", "unconstrained", case)
    assert judged["admission"]["admitted"] is True
    assert judged["matches_authored_request"] is True
    assert judged["admission_agrees"] is True
    two = model.judge(text + text, "stop", "unconstrained", case)
    assert two["candidates_found"] == 2
    assert two["admission"]["state"] == "not_attempted"


def test_mismatch_and_rejection_stay_visible() -> None:
    case = model.DEFAULT_CASES[0]
    wrong_account = model.judge(PROPOSAL % ("account-b", "3"), "stop", "constrained", case)
    assert wrong_account["admission"]["admitted"] is True
    assert wrong_account["matches_authored_request"] is False
    negative = model.judge(PROPOSAL % ("account-a", "-3"), "stop", "unconstrained", case)
    assert negative["schema_valid"] is False
    assert negative["admission"]["admitted"] is False
    assert negative["admission"]["state"] == "rejected"
    assert negative["admission"]["reason"] == negative["admission_in_process"]["reason"]
    assert negative["admission_agrees"] is True
    float_amount = model.judge(PROPOSAL % ("account-a", "500.0"), "stop", "unconstrained", case)
    assert float_amount["matches_authored_request"] is False
    assert float_amount["admission"]["admitted"] is False


def test_plancheck_subprocess_is_the_readers_boundary() -> None:
    decision = model.admit_by_plancheck(PROPOSAL % ("account-a", "500"))
    assert decision["admitted"] is True
    assert decision["next_required_stage"] == "persist_then_wait_for_approval"
    assert (
        decision["fingerprint"]
        == model.admit_in_process(PROPOSAL % ("account-a", "500"))["fingerprint"]
    )
    assert model.PLANCHECK[:1] == (sys.executable,)


# -- the checker ----------------------------------------------------------------------


def test_checker_accepts_an_honest_report(tiny_report: dict[str, Any]) -> None:
    assert model.check(tiny_report) == []


@pytest.mark.parametrize(
    ("doctor", "problem"),
    [
        (lambda r: r["cases"].pop(1), "account-a: modes ['unconstrained']"),
        (lambda r: r["cases"][1].update(generated_text="{}"), "generated_text_sha256"),
        (
            lambda r: r["cases"][1].update(matches_authored_request=True),
            "matches_authored_request is wrong",
        ),
        (
            lambda r: r["cases"][1].update(finish_reason="length"),
            "did not stop naturally was used",
        ),
        (lambda r: r["cases"][1].pop("admission"), "no admission decision recorded"),
        (lambda r: r["cases"][1].update(admission_agrees=False), "disagree"),
        (lambda r: r["summary"]["constrained"].update(admitted=0), "summary"),
    ],
)
def test_checker_sees_a_doctored_report(
    tiny_report: dict[str, Any], doctor: Any, problem: str
) -> None:
    report = copy.deepcopy(tiny_report)
    doctor(report)
    assert any(problem in p for p in model.check(report)), model.check(report)


def test_checker_sees_an_invalid_constrained_candidate(tiny_report: dict[str, Any]) -> None:
    report = copy.deepcopy(tiny_report)
    row = report["cases"][1]
    bad = PROPOSAL % ("account-a", "-3")
    row.update(generated_text=bad, candidate_text=bad, schema_valid=True)
    row["generated_text_sha256"] = hashlib.sha256(bad.encode()).hexdigest()
    problems = model.check(report)
    assert (
        "account-a/constrained: constrained candidate that stopped naturally is not schema-valid"
        in problems
    )
    assert "account-a/constrained: admission decision differs from admission re-run now" in problems


def test_check_command(tiny_report: dict[str, Any], tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(tiny_report))
    done = _python("-m", "lab.model", "check", str(good))
    assert done.returncode == 0, done.stderr
    assert "4 generations checked" in done.stdout
    doctored = copy.deepcopy(tiny_report)
    doctored["cases"][3]["matches_authored_request"] = True
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doctored))
    done = _python("-m", "lab.model", "check", str(bad))
    assert done.returncode == 1
    assert "account-b/constrained: matches_authored_request is wrong" in done.stderr


# -- the command ----------------------------------------------------------------------


def test_command_writes_report_and_shows_progress(
    tiny_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two threads on a busy two-core machine make tiny models crawl (every op
    # waits at a barrier for a descheduled thread); the setting is recorded.
    monkeypatch.setattr(model, "THREADS", THREADS)
    output = tmp_path / "book" / "model-experiment.json"
    sha = hashlib.sha256(tiny_path.read_bytes()).hexdigest()
    argv = ["model", "run", "--model", str(tiny_path), "--expect-sha256", sha]
    argv += ["--output", str(output), "--traces", str(tmp_path / "traces")]
    argv += ["--cases", str(_cases_file(tmp_path, EXTRA_CASES[1:2]))]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(output)
    assert "too-much constrained: stop" in err
    report = json.loads(output.read_text())
    assert report["threads"] == model.THREADS
    assert model.check(report) == []


def test_threads_come_from_the_arguments_when_given(
    tiny_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = argparse.Namespace(
        model=str(tiny_path), expect_sha256=None, cases=None, threads=1,
        output=str(tmp_path / "r.json"), traces=str(tmp_path / "t"),
    )  # fmt: skip
    assert model.cli_main(args) == 0
    assert json.loads((tmp_path / "r.json").read_text())["threads"] == 1


def _python(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], input=stdin, capture_output=True, text=True, check=False
    )


def _cases_file(folder: Path, cases: list[dict[str, Any]] | str) -> Path:
    path = folder / "cases.json"
    path.write_text(cases if isinstance(cases, str) else json.dumps(cases))
    return path


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        ("missing", "model file not found"),
        ("not-gguf", "not a GGUF file (no GGUF magic)"),
        ("wrong-sha", "is not the expected " + "0" * 64),
        ("bad-sha", "--expect-sha256 is not 64 lowercase hex digits"),
        ("unloadable", "llama.cpp could not load"),
        ("bad-cases", "is not {id, account, amount_minor, prompt}"),
        ("duplicate-cases", "are not unique"),
    ],
)
def test_unusable_input_stops_before_generating(
    problem: str, message: str, tiny_path: Path, tmp_path: Path
) -> None:
    path, expect = tiny_path, None
    cases = None
    if problem == "missing":
        path = tmp_path / "absent.gguf"
    elif problem == "not-gguf":
        path = tmp_path / "weights.gguf"
        path.write_bytes(b"PK\x03\x04 a zip, not a model")
    elif problem == "wrong-sha":
        expect = "0" * 64
    elif problem == "bad-sha":
        expect = "ABC"
    elif problem == "unloadable":
        path = tmp_path / "cut.gguf"
        path.write_bytes(tiny_path.read_bytes()[:4096])
    elif problem == "bad-cases":
        cases = _cases_file(tmp_path, [{"id": "../escape", "account": "a", "amount_minor": 1}])
    elif problem == "duplicate-cases":
        cases = _cases_file(tmp_path, [EXTRA_CASES[0], EXTRA_CASES[0]])
    argv = ["-m", "lab.cli", "model", "run", "--model", str(path)]
    argv += ["--output", str(tmp_path / "out" / "r.json"), "--traces", str(tmp_path / "traces")]
    if expect is not None:
        argv += ["--expect-sha256", expect]
    if cases is not None:
        argv += ["--cases", str(cases)]
    done = _python(*argv)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("lab model run: ")
    assert message in done.stderr
    assert done.stdout == ""
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "traces").exists()


def test_cases_file_may_ask_for_what_admission_refuses(tmp_path: Path) -> None:
    cases = model.load_cases(_cases_file(tmp_path, EXTRA_CASES))
    assert [c.id for c in cases] == ["account-a", "too-much", "no-such"]
    assert cases[2].account == "account-z"


# -- a real model ---------------------------------------------------------------------


def test_model_at_lab_model_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run ``lab model run`` on LAB_MODEL_PATH and check the report it writes.

    ``LAB_MODEL_THREADS`` sets the thread count (default ``model.THREADS``).
    """
    path = os.environ.get("LAB_MODEL_PATH")
    if not path:
        pytest.skip("set LAB_MODEL_PATH to a GGUF model to run a real model")
    output = tmp_path / "model-experiment.json"
    args = argparse.Namespace(
        model=path,
        expect_sha256=None,
        cases=None,
        threads=int(os.environ.get("LAB_MODEL_THREADS", model.THREADS)),
        output=str(output),
        traces=str(tmp_path / "traces"),
    )
    assert model.cli_main(args) == 0, capsys.readouterr().err
    report = json.loads(output.read_text())
    assert model.check(report) == []
    assert report["publication_model"] is (report["model_sha256"] == model.PINNED_SHA256)
    print(json.dumps({"summary": report["summary"], "total_seconds": report["total_seconds"]}))
