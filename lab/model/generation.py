"""The model experiment's report: generate every case in both modes, and check a report.

``run`` generates every case of a case set twice from the seed's chat prompt
(``unconstrained``: free text, scanned for one candidate; ``constrained``:
under the proposal's GBNF grammar), judges each generation with
``candidates.judge`` and keeps every raw response as a trace: nothing is
discarded to improve a score. Two runs with the same model and engine build
write the same report apart from the fields in ``TIME_FIELDS``.

``check`` verifies a written report from its rows alone: it recomputes digests,
schema validity, admission, matching, outcome and safety, and the summary.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import platform
import statistics
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lab.evidence import model_evidence
from lab.model import candidates, engine, grammar
from lab.model.cases import Case, CaseSet, Injection
from lab.model.engine import Engine, ModelFile

MODES = candidates.MODES
REPORT_FILE = model_evidence.REPORT_FILE
TRACES_DIR = model_evidence.TRACES_DIR

# Report fields that measure time; everything else is deterministic.
TIME_FIELDS = frozenset(
    {
        "tested_at_utc",
        "load_seconds",
        "total_seconds",
        "elapsed_seconds",
        "tokens_per_second",
        "performance",
    }
)


def sha256_text(text: str) -> str:
    """The hex sha256 of a text's UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def identity(model: ModelFile, metadata: Mapping[str, str]) -> dict[str, Any]:
    """What the report says the model is: a known digest's name, else only what the file says."""
    known = engine.KNOWN_MODELS.get(model.sha256)
    common = {
        "model_file": model.path.name,
        "model_sha256": model.sha256,
        "model_bytes": model.size,
    }
    if known is None:
        return {
            "model": f"unidentified GGUF model (general.name {metadata.get('general.name')!r})",
            "publication_model": False,
            "revision": None,
            **common,
            "license": metadata.get("general.license", "unknown (not recorded in the GGUF)"),
        }
    return {
        "model": known.name,
        "publication_model": known.publication,
        "revision": known.revision,
        **common,
        "license": known.license,
    }


def _limitations(ident: Mapping[str, Any], count: int) -> list[str]:
    notes = [
        f"{count} author-constructed requests, not a business-quality benchmark or model ranking.",
        "The grammar constrains syntax, fields and ranges, not semantic correctness: a "
        "constrained candidate can be admitted and still name the wrong account or amount "
        "(matches_authored_request shows it).",
        "The grammar fixes the members to the schema's order and allows at most "
        f"{grammar.MAX_WS} whitespace characters at each break.",
        "Unconstrained text is scanned for exactly one candidate object; only that "
        "candidate's exact text is sent to admission.",
        "A generation that did not stop naturally (finish_reason other than 'stop') is "
        "recorded as failed; it is never repaired, scanned or admitted.",
        "unsafe counts admitted plans that carry what the request tried to inject or "
        "anything admission should have refused, judged independently of admission.",
        "Admission is stateless: it does not persist a workflow, approve or execute a "
        "business effect.",
        "Determinism holds for one engine build on one machine (greedy sampling, fixed "
        "seed, context and threads); another build or CPU may write different text.",
        "Workflow crash experiments are separate deterministic tests against real "
        "PostgreSQL and HTTP.",
    ]
    if not ident["publication_model"]:
        notes.insert(
            0,
            f"This run used {ident['model_file']} (sha256 {ident['model_sha256']}), "
            f"not the pinned publication model {engine.PINNED.name} {engine.PINNED.file}; "
            "its results say nothing about that model.",
        )
    return notes


def summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts per mode: outcomes, rejection reasons, expectations met, and unsafe plans."""
    out: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        outcomes = Counter(r["outcome"] for r in mine)
        reasons = Counter(
            str(r["admission"].get("reason")) for r in mine if r["outcome"] == "rejected"
        )
        out[mode] = {
            "generations": len(mine),
            "stopped_naturally": sum(r["finish_reason"] == "stop" for r in mine),
            "candidates": sum(r["candidate_text"] is not None for r in mine),
            "schema_valid": sum(r["schema_valid"] is True for r in mine),
            "admitted": sum(r["admission"]["admitted"] is True for r in mine),
            "matches_authored_request": sum(r["matches_authored_request"] is True for r in mine),
            "admitted_and_matching": outcomes["admitted_matching"],
            "outcomes": {name: outcomes[name] for name in candidates.OUTCOMES},
            "rejected_by_reason": dict(sorted(reasons.items())),
            "as_expected": sum(r["as_expected"] is True for r in mine),
            "unsafe": sum(r["unsafe"] is True for r in mine),
        }
    return out


def performance(rows: Sequence[Mapping[str, Any]], load_seconds: float) -> dict[str, Any]:
    """Load time and tokens per second, per mode and overall."""

    def rates(mine: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        tokens = sum(int(r["completion_tokens"]) for r in mine)
        seconds = sum(float(r["elapsed_seconds"]) for r in mine)
        per = [float(r["tokens_per_second"]) for r in mine if r["tokens_per_second"]]
        return {
            "completion_tokens": tokens,
            "generation_seconds": round(seconds, 3),
            "tokens_per_second": round(tokens / seconds, 1) if seconds else None,
            "median_tokens_per_second": round(statistics.median(per), 1) if per else None,
        }

    return {
        "load_seconds": round(load_seconds, 3),
        "all": rates(rows),
        **{mode: rates([r for r in rows if r["mode"] == mode]) for mode in MODES},
    }


def _gguf_summary(metadata: Mapping[str, str]) -> dict[str, Any]:
    keys = (
        "general.architecture",
        "general.name",
        "general.license",
        "general.size_label",
        "general.file_type",
        "tokenizer.ggml.model",
    )
    out: dict[str, Any] = {k: metadata[k] for k in keys if k in metadata}
    template = metadata.get("tokenizer.chat_template")
    out["chat_template_sha256"] = sha256_text(template) if template is not None else None
    return out


def _case_fields(case: Case) -> dict[str, Any]:
    return {
        "prompt": case.prompt,
        "expect": case.expect,
        "expected_account": case.account,
        "expected_amount_minor": case.amount_minor,
        "expected_currency": case.currency,
        "injects": case.injects.to_json(),
    }


def case_of(row: Mapping[str, Any]) -> Case:
    """The case a report row was judged against, rebuilt from the row itself."""
    injects = row.get("injects") or {}
    return Case(
        id=str(row.get("case")),
        account=str(row.get("expected_account")),
        amount_minor=row.get("expected_amount_minor"),  # type: ignore[arg-type]
        prompt=str(row.get("prompt")),
        currency=str(row.get("expected_currency")),
        expect=str(row.get("expect")),
        injects=Injection(tuple(injects.get("keys", ())), tuple(injects.get("values", ()))),
    )


def run(
    model_engine: Engine,
    case_set: CaseSet,
    traces: Path,
    progress: Any | None = None,
) -> dict[str, Any]:
    """Generate every case in both modes, judge every candidate and return the report.

    ``progress`` is a rich ``Progress`` (or None); raw traces are written to
    ``traces`` as ``<case>.<mode>.json``.
    """
    started = time.monotonic()
    tested_at = datetime.now(UTC).isoformat()
    metadata = model_engine.metadata()
    ident = identity(model_engine.model, metadata)
    traces.mkdir(parents=True, exist_ok=True)
    task = None
    if progress is not None:
        task = progress.add_task("generating", total=len(case_set.cases) * len(MODES))
    results: list[dict[str, Any]] = []
    for case, mode in itertools.product(case_set.cases, MODES):
        if progress is not None:
            progress.update(task, description=f"{case.id} {mode}")
        row, elapsed = _generate(model_engine, case, mode, traces)
        results.append(row)
        if progress is not None:
            verdict = "admitted" if row["admission"]["admitted"] else row["admission"]["reason"]
            unsafe = " UNSAFE" if row["unsafe"] else ""
            progress.console.print(
                f"{case.id} {mode}: {row['finish_reason']}, {row['completion_tokens']} tokens, "
                f"{elapsed:.2f} s: {row['outcome']}{unsafe}: {verdict}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            progress.advance(task)
    return {
        "tested_at_utc": tested_at,
        **ident,
        "gguf_metadata": _gguf_summary(metadata),
        **_setup(model_engine, case_set),
        "load_seconds": round(model_engine.load_seconds, 3),
        "total_seconds": round(model_engine.load_seconds + time.monotonic() - started, 3),
        "performance": performance(results, model_engine.load_seconds),
        "cases": results,
        "summary": summary(results),
        "limitations": _limitations(ident, len(case_set.cases)),
    }


def _generate(
    model_engine: Engine, case: Case, mode: str, traces: Path
) -> tuple[dict[str, Any], float]:
    """One generation of ``case`` in ``mode``, judged: its report row (its raw trace
    written to ``traces``) and its elapsed seconds."""
    began = time.monotonic()
    response = model_engine.generate(case.prompt, mode)
    elapsed = time.monotonic() - began
    choice = response["choices"][0]
    text = choice["message"]["content"] or ""
    finish_reason = choice.get("finish_reason")
    usage = response.get("usage", {})
    trace_name = f"{case.id}.{mode}.json"
    row: dict[str, Any] = {
        "case": case.id,
        "mode": mode,
        **_case_fields(case),
        "finish_reason": finish_reason,
        "generated_text": text,
        "generated_text_sha256": sha256_text(text),
    }
    row.update(candidates.judge(text, finish_reason, mode, case))
    completion_tokens = int(usage.get("completion_tokens", 0))
    row.update(
        {
            "prompt_tokens": int(usage.get("prompt_tokens", 0)),
            "completion_tokens": completion_tokens,
            "elapsed_seconds": round(elapsed, 3),
            "tokens_per_second": round(completion_tokens / elapsed, 1) if elapsed else None,
            "trace": f"{TRACES_DIR}/{trace_name}",
        }
    )
    trace = {
        "case": case.id,
        "mode": mode,
        "messages": engine.chat_messages(case.prompt),
        "chat_format": model_engine.chat_format(),
        "grammar": grammar.PROPOSAL.gbnf if mode == "constrained" else None,
        "sampling": engine.sampling(model_engine.threads),
        "response": response,
        "elapsed_seconds": round(elapsed, 3),
    }
    (traces / trace_name).write_text(
        json.dumps(trace, ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
    )
    return row, elapsed


def _setup(model_engine: Engine, case_set: CaseSet) -> dict[str, Any]:
    """The report's description of how it was generated: engine, platform, sampling,
    prompt, cases, modes, grammar, admission and what its timings mean."""
    return {
        "engine": "llama-cpp-python",
        "engine_version": model_engine.version(),
        "engine_system_info": model_engine.system_info(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_only": True,
        **engine.sampling(model_engine.threads),
        "chat_format": model_engine.chat_format(),
        "system_prompt": engine.SYSTEM_PROMPT,
        "case_set": case_set.describe(),
        "modes": {
            "unconstrained": "free generation; exactly one candidate object is extracted",
            "constrained": "generation under the proposal grammar; the whole text is the candidate",
        },
        "grammar": {
            "gbnf": grammar.PROPOSAL.gbnf,
            "sha256": sha256_text(grammar.PROPOSAL.gbnf),
            "max_chars": grammar.PROPOSAL.max_chars,
        },
        "admission_command": "python -m lab.cli plancheck",
        "timing": "elapsed_seconds covers prompt evaluation and generation of one "
        "completion, and tokens_per_second is its completion tokens over that time; "
        "load_seconds is the model load; total_seconds adds every generation and both "
        "admissions of every candidate (the plancheck subprocesses included)",
        "traces_dir": TRACES_DIR,
    }


def without_times(value: Any) -> Any:
    """A copy of a report without the fields that measure time."""
    if isinstance(value, dict):
        return {k: without_times(v) for k, v in value.items() if k not in TIME_FIELDS}
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value


def check(report: Mapping[str, Any]) -> list[str]:
    """Problems with a written report; an empty list means it holds what it must.

    Every case appears in both modes; every constrained candidate that stopped
    naturally is schema-valid; every generation carries an admission decision
    that agrees with the in-process one and with admission re-run now; a
    failed generation is never admitted; recorded digests, matching, outcome
    and safety are recomputed, so a mismatch cannot hide; and a file other
    than the pinned one never claims to be it.
    """
    problems: list[str] = []
    rows = report.get("cases")
    if not isinstance(rows, list) or not rows:
        return ["report has no cases"]
    seen: dict[str, set[str]] = {}
    for row in rows:
        if not isinstance(row, dict):
            problems.append(f"case entry is not an object: {row!r}")
            continue
        where = f"{row.get('case')}/{row.get('mode')}"
        seen.setdefault(str(row.get("case")), set()).add(str(row.get("mode")))
        problems += [f"{where}: {p}" for p in _check_row(row)]
    for case_id, modes in seen.items():
        if modes != set(MODES):
            problems.append(f"{case_id}: modes {sorted(modes)}, expected {list(MODES)}")
    if len(rows) != len(seen) * len(MODES):
        problems.append("a case and mode appear more than once")
    try:
        summary_holds = report.get("summary") == summary(rows)
    except (KeyError, TypeError, AttributeError):
        summary_holds = False
    if not summary_holds:
        problems.append("summary does not match the cases")
    is_pinned = report.get("model_sha256") == engine.PINNED_SHA256
    claims = report.get("publication_model") is True or engine.PINNED.name in str(
        report.get("model")
    )
    if claims and not is_pinned:
        problems.append("a file other than the pinned model claims to be it")
    if is_pinned and report.get("model") != engine.PINNED.name:
        problems.append("the pinned model is not named as such")
    return problems


def _check_row(row: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    text = row.get("generated_text")
    if not isinstance(text, str) or row.get("generated_text_sha256") != sha256_text(text):
        problems.append("generated_text_sha256 does not match the generated text")
    admission = row.get("admission")
    if not isinstance(admission, dict) or not isinstance(admission.get("admitted"), bool):
        return [*problems, "no admission decision recorded"]
    if admission["admitted"] and not admission.get("fingerprint"):
        problems.append("admitted without a fingerprint")
    if not admission["admitted"] and not admission.get("reason"):
        problems.append("refused without a reason")
    if admission.get("state") == "error":
        problems.append(f"plancheck did not decide: {admission.get('reason')}")
    if row.get("admission_agrees") is not True:
        problems.append("plancheck and in-process admission disagree")
    candidate = row.get("candidate_text")
    stopped = row.get("finish_reason") == "stop"
    if not stopped and (candidate is not None or admission["admitted"]):
        problems.append("a generation that did not stop naturally was used")
    if row.get("mode") == "constrained" and stopped:
        if candidate != text:
            problems.append("constrained candidate is not the generated text")
        if not isinstance(candidate, str) or not candidates.schema_valid(candidate):
            problems.append("constrained candidate that stopped naturally is not schema-valid")
    case = case_of(row)
    if isinstance(candidate, str):
        if row.get("schema_valid") != candidates.schema_valid(candidate):
            problems.append("recorded schema_valid is wrong")
        now = candidates.admit_in_process(candidate)
        if now["admitted"] != admission["admitted"] or (
            now["admitted"] and now["fingerprint"] != admission.get("fingerprint")
        ):
            problems.append("admission decision differs from admission re-run now")
        if row.get("matches_authored_request") != candidates.matches_request(
            candidates.parsed(candidate), case
        ):
            problems.append("matches_authored_request is wrong")
    elif row.get("matches_authored_request") is not False or admission["admitted"]:
        problems.append("no candidate, yet matched or admitted")
    try:
        result = candidates.outcome(row)
    except (KeyError, TypeError):
        return [*problems, "outcome cannot be recomputed"]
    if row.get("outcome") != result:
        problems.append(f"outcome is {row.get('outcome')!r}, recomputed {result!r}")
    if row.get("as_expected") != candidates.as_expected(case, result):
        problems.append("as_expected is wrong")
    reasons = candidates.unsafe_reasons(
        candidate if isinstance(candidate, str) else None,
        admission,
        row.get("candidates_found"),
        case,
    )
    if row.get("unsafe_reasons") != reasons or row.get("unsafe") is not bool(reasons):
        problems.append(f"recorded safety is wrong (recomputed: {reasons or 'safe'})")
    return problems
