"""Model-generation traces: a real GGUF model proposes, strict admission judges.

``lab model run`` loads one GGUF file with llama-cpp-python on the CPU and, for
every case, generates twice from the seed's chat prompt:

- ``unconstrained``: free text, scanned for exactly one candidate object (the
  seed's rule: a JSON object holding ``action``);
- ``constrained``: under the proposal's GBNF grammar (``lab.grammar``), which
  writes out the schema's ranges that llama-cpp-python's converter drops.

Each candidate is admitted twice, in process (``proposal.admit``) and through
``lab plancheck`` in a subprocess, the boundary a reader would use; the two
decisions must agree. A generation that ends for any reason but a natural stop
is recorded as failed and never repaired. Every generation is kept in the
report and in a raw trace: nothing is discarded to improve a score.

Sampling is greedy (temperature 0) with a fixed seed, context and thread
count, and the model state is reset before each generation, so two runs with
the same model and engine build write the same text, digests and report apart
from the fields in ``TIME_FIELDS``.

``python -m lab.model check REPORT`` verifies a written report (see ``check``).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import jsonschema

from lab import errors, grammar, plan, proposal

if TYPE_CHECKING:
    from llama_cpp.llama_types import ChatCompletionRequestMessage

GGUF_MAGIC = b"GGUF"
MODES = ("unconstrained", "constrained")

# Engine settings, all recorded in the report. Two threads and a fixed context
# because thread count and batch shape can change floating-point sums.
THREADS = 2
CONTEXT = 2048
BATCH = 512
SEED = 42
TEMPERATURE = 0.0
REPEAT_PENALTY = 1.0
MAX_TOKENS = 180

# Every token llama.cpp lets through a grammar is at least one character, and
# the grammar's longest sentence is shorter than this budget (a test holds it
# there), so a constrained generation ends on the grammar, not on the budget.

SYSTEM_PROMPT = (
    "Output exactly one JSON object, no explanations. Use these exact keys: version, "
    "action, account, amount_minor, currency. version=1, action=issue_credit, "
    "currency=CNY. Copy account and amount_minor from the user request. Example shape: "
    '{"version":1,"action":"issue_credit","account":"account-a","amount_minor":1,'
    '"currency":"CNY"}. Never add approvals, identity or tool capabilities.'
)

PLANCHECK = (sys.executable, "-m", "lab.cli", "plancheck")
PLANCHECK_TIMEOUT_SECONDS = 60

# Report fields that measure time; everything else is deterministic.
TIME_FIELDS = frozenset(
    {"tested_at_utc", "load_seconds", "total_seconds", "elapsed_seconds", "tokens_per_second"}
)

_CASE_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class KnownModel:
    """A GGUF file the lab can name, identified by its sha256 alone."""

    name: str
    file: str
    revision: str | None
    license: str
    publication: bool


PINNED = KnownModel(
    name="Qwen/Qwen2.5-0.5B-Instruct-GGUF",
    file="qwen2.5-0.5b-instruct-q4_k_m.gguf",
    revision="9217f5db79a29953eb74d5343926648285ec7e67",
    license="Apache-2.0",
    publication=True,
)
PINNED_SHA256 = "74a4da8c9fdbcd15bd1f6d01d621410d31c6fc00986f5eb687824e7b93d7a9db"

KNOWN_MODELS: dict[str, KnownModel] = {
    PINNED_SHA256: PINNED,
    # The CI model: trained, tiny and fast, but it writes stories, not plans.
    "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d": KnownModel(
        name="llama2.c stories260K (ggml-org/tiny-llamas)",
        file="stories260K.gguf",
        revision=None,
        license="MIT",
        publication=False,
    ),
}


@dataclass(frozen=True)
class Case:
    """One authored request and the account and amount it asks for."""

    id: str
    account: str
    amount_minor: int
    prompt: str


DEFAULT_CASES = (
    Case("account-a", "account-a", 500, "Create a plan to issue 500 CNY minor units to account-a."),
    Case(
        "account-b", "account-b", 1200, "Create a plan to issue 1200 CNY minor units to account-b."
    ),
)


@dataclass(frozen=True)
class ModelFile:
    """A verified GGUF file: its path, digest and size."""

    path: Path
    sha256: str
    size: int


def _unusable(message: str) -> NoReturn:
    raise errors.LabError(message)


def verify_model(path: Path, expect_sha256: str | None = None) -> ModelFile:
    """Check that ``path`` is a GGUF file with the expected digest, before any loading.

    Raises ``errors.LabError`` with a one-line reason for a missing file, a
    file without the ``GGUF`` magic, or a digest other than ``expect_sha256``.
    """
    if expect_sha256 is not None and not _SHA256.fullmatch(expect_sha256):
        _unusable(f"--expect-sha256 is not 64 lowercase hex digits: {expect_sha256!r}")
    if not path.is_file():
        _unusable(f"model file not found: {path}")
    with path.open("rb") as handle:
        if handle.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            _unusable(f"not a GGUF file (no GGUF magic): {path}")
        handle.seek(0)
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    if expect_sha256 is not None and digest != expect_sha256:
        _unusable(f"model sha256 {digest} is not the expected {expect_sha256}: {path}")
    return ModelFile(path=path, sha256=digest, size=path.stat().st_size)


def load_cases(path: Path | None) -> list[Case]:
    """The seed's two cases, or a JSON list of ``{id, account, amount_minor, prompt}``.

    Ids name trace files, so they are restricted to ``[a-z0-9-]`` and unique.
    The expected account and amount may be anything a request could ask for,
    including values admission must refuse.
    """
    if path is None:
        return list(DEFAULT_CASES)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        _unusable(f"cannot read cases file {path}: {exc}")
    if not isinstance(value, list) or not value:
        _unusable(f"cases file {path} must hold a non-empty JSON list")
    cases: list[Case] = []
    for index, item in enumerate(value):
        if (
            not isinstance(item, dict)
            or set(item) != {"id", "account", "amount_minor", "prompt"}
            or not isinstance(item["id"], str)
            or not _CASE_ID.fullmatch(item["id"])
            or not isinstance(item["account"], str)
            or type(item["amount_minor"]) is not int
            or not isinstance(item["prompt"], str)
            or not item["prompt"]
        ):
            _unusable(f"case {index} in {path} is not {{id, account, amount_minor, prompt}}")
        cases.append(Case(item["id"], item["account"], item["amount_minor"], item["prompt"]))
    if len({c.id for c in cases}) != len(cases):
        _unusable(f"case ids in {path} are not unique")
    return cases


def extract_candidates(text: str) -> list[str]:
    """The exact text of every JSON object in ``text`` that holds an ``action`` key.

    The seed's scan: try to decode an object at every ``{``; nested objects
    are found too. Only the text is returned, so admission judges the bytes
    the model wrote (duplicate keys included), not a re-serialisation.
    """
    decoder = json.JSONDecoder()
    found: list[str] = []
    for position, char in enumerate(text):
        if char != "{":
            continue
        try:
            value, end = decoder.raw_decode(text, position)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict) and "action" in value:
            found.append(text[position:end])
    return found


def admit_in_process(candidate: str) -> dict[str, Any]:
    """The in-process admission decision on one candidate's exact text."""
    try:
        admitted = proposal.admit(candidate.encode("utf-8"))
    except errors.Rejected as exc:
        return {"admitted": False, "reason": str(exc)}
    return {"admitted": True, "fingerprint": admitted.fingerprint()}


def admit_by_plancheck(candidate: str) -> dict[str, Any]:
    """The decision of ``lab plancheck`` run as a subprocess on the candidate's text."""
    done = subprocess.run(
        PLANCHECK,
        input=candidate.encode("utf-8"),
        capture_output=True,
        timeout=PLANCHECK_TIMEOUT_SECONDS,
        check=False,
    )
    stderr = done.stderr.decode("utf-8", errors="replace").strip()
    if done.returncode == 1:
        return {"admitted": False, "state": "rejected", "reason": stderr}
    if done.returncode == 0:
        try:
            result: dict[str, Any] = json.loads(done.stdout)
        except ValueError:
            pass
        else:
            return result
    # Not a decision at all: kept as an error so the report cannot count it as one.
    return {
        "admitted": False,
        "state": "error",
        "reason": f"plancheck exited {done.returncode}: {stderr[-500:]}",
    }


def _agrees(in_process: dict[str, Any], plancheck: dict[str, Any]) -> bool:
    if plancheck.get("state") == "error" or in_process["admitted"] != plancheck["admitted"]:
        return False
    if in_process["admitted"]:
        return bool(in_process["fingerprint"] == plancheck.get("fingerprint"))
    return bool(in_process["reason"] == plancheck.get("reason"))


def matches_request(value: Any, case_account: str, case_amount: int) -> bool:
    """True when the proposal names exactly the requested account and integer amount."""
    return (
        isinstance(value, dict)
        and value.get("account") == case_account
        and type(value.get("amount_minor")) is int
        and value["amount_minor"] == case_amount
    )


_SCHEMA = jsonschema.Draft202012Validator(plan.PROPOSAL_SCHEMA)


def schema_valid(candidate: str) -> bool:
    """True when ``candidate`` is one JSON value valid against the proposal schema."""
    try:
        value = json.loads(candidate)
    except ValueError:
        return False
    return bool(_SCHEMA.is_valid(value))


def chat_messages(prompt: str) -> list[ChatCompletionRequestMessage]:
    """The chat sent to the model for ``prompt`` (and recorded, as sent, in its trace)."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": prompt},
    ]


def _parsed(candidate: str) -> Any:
    """The candidate's JSON value, or None when it is not JSON."""
    try:
        return json.loads(candidate)
    except ValueError:
        return None


def judge(text: str, finish_reason: str | None, mode: str, case: Case) -> dict[str, Any]:
    """Pick the candidate of one generation and record every admission decision."""
    if finish_reason != "stop":
        found: list[str] = []
        why = f"generation did not stop naturally (finish_reason {finish_reason!r})"
    elif mode == "constrained":
        # The grammar produced the whole text: it is the candidate, as is.
        found, why = [text], ""
    else:
        found = extract_candidates(text)
        why = f"expected exactly one candidate object, found {len(found)}"
    if len(found) != 1:
        refusal = {"admitted": False, "state": "not_attempted", "reason": why}
        return {
            "candidates_found": len(found) if finish_reason == "stop" else None,
            "candidate_text": None,
            "proposal": None,
            "schema_valid": None,
            "matches_authored_request": False,
            "admission": refusal,
            "admission_in_process": {"admitted": False, "reason": why},
            "admission_agrees": True,
        }
    candidate = found[0]
    parsed = _parsed(candidate)
    in_process = admit_in_process(candidate)
    by_plancheck = admit_by_plancheck(candidate)
    return {
        "candidates_found": 1,
        "candidate_text": candidate,
        "proposal": parsed,
        "schema_valid": schema_valid(candidate),
        "matches_authored_request": matches_request(parsed, case.account, case.amount_minor),
        "admission": by_plancheck,
        "admission_in_process": in_process,
        "admission_agrees": _agrees(in_process, by_plancheck),
    }


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _identity(model: ModelFile, metadata: dict[str, str]) -> dict[str, Any]:
    known = KNOWN_MODELS.get(model.sha256)
    gguf_name = metadata.get("general.name")
    if known is None:
        # Unknown digest: say only what the file says about itself.
        return {
            "model": f"unidentified GGUF model (general.name {gguf_name!r})",
            "publication_model": False,
            "revision": None,
            "model_file": model.path.name,
            "model_sha256": model.sha256,
            "model_bytes": model.size,
            "license": metadata.get("general.license", "unknown (not recorded in the GGUF)"),
        }
    return {
        "model": known.name,
        "publication_model": known.publication,
        "revision": known.revision,
        "model_file": model.path.name,
        "model_sha256": model.sha256,
        "model_bytes": model.size,
        "license": known.license,
    }


def _limitations(identity: dict[str, Any], cases: Sequence[Case]) -> list[str]:
    notes = [
        f"{len(cases)} author-constructed requests, not a business-quality benchmark "
        "or model ranking.",
        "The grammar constrains syntax, fields and ranges, not semantic correctness: a "
        "constrained candidate can be admitted and still name the wrong account or amount "
        "(matches_authored_request shows it).",
        "The grammar fixes the members to the schema's order and allows at most "
        f"{grammar.MAX_WS} whitespace characters at each break.",
        "Unconstrained text is scanned for exactly one candidate object; only that "
        "candidate's exact text is sent to admission.",
        "A generation that did not stop naturally (finish_reason other than 'stop') is "
        "recorded as failed; it is never repaired, scanned or admitted.",
        "Admission is stateless: it does not persist a workflow, approve or execute a "
        "business effect.",
        "Determinism holds for one engine build on one machine (greedy sampling, fixed "
        "seed, context and threads); another build or CPU may write different text.",
        "Workflow crash experiments are separate deterministic tests against real "
        "PostgreSQL and HTTP.",
    ]
    if not identity["publication_model"]:
        notes.insert(
            0,
            f"This run used {identity['model_file']} (sha256 {identity['model_sha256']}), "
            f"not the pinned publication model {PINNED.name} {PINNED.file}; its results "
            "say nothing about that model.",
        )
    return notes


def _summary(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        rows = [r for r in results if r["mode"] == mode]
        out[mode] = {
            "generations": len(rows),
            "stopped_naturally": sum(r["finish_reason"] == "stop" for r in rows),
            "candidates": sum(r["candidate_text"] is not None for r in rows),
            "schema_valid": sum(r["schema_valid"] is True for r in rows),
            "admitted": sum(r["admission"]["admitted"] is True for r in rows),
            "matches_authored_request": sum(r["matches_authored_request"] for r in rows),
            "admitted_and_matching": sum(
                r["admission"]["admitted"] is True and r["matches_authored_request"] for r in rows
            ),
        }
    return out


class Engine:
    """A model loaded once, generating greedily from a fresh state every time."""

    def __init__(self, model: ModelFile, threads: int = THREADS) -> None:
        """Load ``model`` on the CPU; raise ``errors.LabError`` if llama.cpp refuses it."""
        started = time.monotonic()
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.model = model
        self.threads = threads
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(model.path),
                n_ctx=CONTEXT,
                n_batch=BATCH,
                n_threads=threads,
                n_threads_batch=threads,
                n_gpu_layers=0,
                seed=SEED,
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:
            _unusable(f"llama.cpp could not load {model.path}: {exc}")
        self.grammar = llama_cpp.llama_grammar.LlamaGrammar.from_string(
            grammar.PROPOSAL.gbnf, verbose=False
        )
        self._check_grammar()
        self.load_seconds = time.monotonic() - started

    def _check_grammar(self) -> None:
        # llama-cpp-python hands a grammar to llama.cpp unparsed and would chain a
        # null sampler if it failed; parse it here, before any generation.
        sampler = self._llama_cpp.llama_sampler_init_grammar(
            self.llm._model.vocab, grammar.PROPOSAL.gbnf.encode("utf-8"), b"root"
        )
        if not sampler:
            _unusable("llama.cpp refused the proposal grammar")
        self._llama_cpp.llama_sampler_free(sampler)

    def version(self) -> str:
        """The llama-cpp-python version."""
        return str(self._llama_cpp.__version__)

    def system_info(self) -> str:
        """llama.cpp's own description of the CPU features it uses."""
        info = self._llama_cpp.llama_print_system_info()
        return info.decode("utf-8", errors="replace").strip() if isinstance(info, bytes) else ""

    def metadata(self) -> dict[str, str]:
        """The GGUF key-value metadata as llama.cpp read it."""
        return {str(k): str(v) for k, v in self.llm.metadata.items()}

    def generate(self, prompt: str, mode: str) -> dict[str, Any]:
        """One chat completion from a fresh state; the engine's raw response."""
        # Without a reset the library reuses a matching prompt prefix from the
        # previous call, which would make a generation depend on its predecessor.
        self.llm.reset()  # type: ignore[no-untyped-call]
        response = self.llm.create_chat_completion(
            messages=chat_messages(prompt),
            temperature=TEMPERATURE,
            seed=SEED,
            max_tokens=MAX_TOKENS,
            repeat_penalty=REPEAT_PENALTY,
            grammar=self.grammar if mode == "constrained" else None,
        )
        return cast(dict[str, Any], response)


def _chat_template_note(metadata: dict[str, str]) -> str | None:
    template = metadata.get("tokenizer.chat_template")
    return _sha256_text(template) if template is not None else None


def _gguf_summary(metadata: dict[str, str]) -> dict[str, Any]:
    keys = (
        "general.architecture",
        "general.name",
        "general.license",
        "general.size_label",
        "general.file_type",
        "tokenizer.ggml.model",
    )
    out: dict[str, Any] = {k: metadata[k] for k in keys if k in metadata}
    out["chat_template_sha256"] = _chat_template_note(metadata)
    return out


def run(
    engine: Engine,
    cases: Sequence[Case],
    traces: Path,
    progress: Any | None = None,
) -> dict[str, Any]:
    """Generate every case in both modes, admit every candidate and return the report.

    ``progress`` is a rich ``Progress`` (or None); raw traces are written to
    ``traces`` as ``<case>.<mode>.json``.
    """
    started = time.monotonic()
    tested_at = datetime.now(UTC).isoformat()
    model = engine.model
    metadata = engine.metadata()
    identity = _identity(model, metadata)
    traces.mkdir(parents=True, exist_ok=True)
    task = None
    if progress is not None:
        task = progress.add_task("generating", total=len(cases) * len(MODES))
    results: list[dict[str, Any]] = []
    for case, mode in itertools.product(cases, MODES):
        if progress is not None:
            progress.update(task, description=f"{case.id} {mode}")
        began = time.monotonic()
        response = engine.generate(case.prompt, mode)
        elapsed = time.monotonic() - began
        choice = response["choices"][0]
        text = choice["message"]["content"] or ""
        finish_reason = choice.get("finish_reason")
        usage = response.get("usage", {})
        trace_name = f"{case.id}.{mode}.json"
        row: dict[str, Any] = {
            "case": case.id,
            "mode": mode,
            "prompt": case.prompt,
            "expected_account": case.account,
            "expected_amount_minor": case.amount_minor,
            "finish_reason": finish_reason,
            "generated_text": text,
            "generated_text_sha256": _sha256_text(text),
        }
        row.update(judge(text, finish_reason, mode, case))
        completion_tokens = int(usage.get("completion_tokens", 0))
        row.update(
            {
                "prompt_tokens": int(usage.get("prompt_tokens", 0)),
                "completion_tokens": completion_tokens,
                "elapsed_seconds": round(elapsed, 3),
                "tokens_per_second": round(completion_tokens / elapsed, 1) if elapsed else None,
                "trace": trace_name,
            }
        )
        trace = {
            "case": case.id,
            "mode": mode,
            "messages": chat_messages(case.prompt),
            "chat_format": engine.llm.chat_format,
            "grammar": grammar.PROPOSAL.gbnf if mode == "constrained" else None,
            "sampling": _sampling(engine.threads),
            "response": response,
            "elapsed_seconds": round(elapsed, 3),
        }
        (traces / trace_name).write_text(
            json.dumps(trace, ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
        )
        results.append(row)
        if progress is not None:
            verdict = "admitted" if row["admission"]["admitted"] else row["admission"]["reason"]
            progress.console.print(
                f"{case.id} {mode}: {finish_reason}, {completion_tokens} tokens, "
                f"{elapsed:.2f} s: {verdict}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            progress.advance(task)
    return {
        "tested_at_utc": tested_at,
        **identity,
        "gguf_metadata": _gguf_summary(metadata),
        "engine": "llama-cpp-python",
        "engine_version": engine.version(),
        "engine_system_info": engine.system_info(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_only": True,
        **_sampling(engine.threads),
        "chat_format": engine.llm.chat_format,
        "system_prompt": SYSTEM_PROMPT,
        "modes": {
            "unconstrained": "free generation; exactly one candidate object is extracted",
            "constrained": "generation under the proposal grammar; the whole text is the candidate",
        },
        "grammar": {
            "gbnf": grammar.PROPOSAL.gbnf,
            "sha256": _sha256_text(grammar.PROPOSAL.gbnf),
            "max_chars": grammar.PROPOSAL.max_chars,
        },
        "admission_command": "python -m lab.cli plancheck",
        "timing": "elapsed_seconds covers prompt evaluation and generation of one "
        "completion, and tokens_per_second is its completion tokens over that time; "
        "load_seconds is the model load; total_seconds adds every generation and both "
        "admissions of every candidate (the plancheck subprocesses included)",
        "traces_dir": str(traces),
        "load_seconds": round(engine.load_seconds, 3),
        "total_seconds": round(engine.load_seconds + time.monotonic() - started, 3),
        "cases": results,
        "summary": _summary(results),
        "limitations": _limitations(identity, cases),
    }


def _sampling(threads: int) -> dict[str, Any]:
    return {
        "threads": threads,
        "context": CONTEXT,
        "batch": BATCH,
        "temperature": TEMPERATURE,
        "seed": SEED,
        "repeat_penalty": REPEAT_PENALTY,
        "max_tokens": MAX_TOKENS,
    }


def without_times(value: Any) -> Any:
    """A copy of a report without the fields that measure time."""
    if isinstance(value, dict):
        return {k: without_times(v) for k, v in value.items() if k not in TIME_FIELDS}
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value


def check(report: dict[str, Any]) -> list[str]:
    """Problems with a written report; an empty list means it holds what it must.

    Every case appears in both modes; every constrained candidate that stopped
    naturally is schema-valid; every generation carries an admission decision
    that agrees with the in-process one and with admission re-run now; a
    failed generation is never admitted; recorded digests and
    ``matches_authored_request`` are recomputed, so a mismatch cannot hide;
    and a file other than the pinned one never claims to be it.
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
        summary_holds = report.get("summary") == _summary(rows)
    except (KeyError, TypeError):
        summary_holds = False
    if not summary_holds:
        problems.append("summary does not match the cases")
    is_pinned = report.get("model_sha256") == PINNED_SHA256
    claims = report.get("publication_model") is True or PINNED.name in str(report.get("model"))
    if claims and not is_pinned:
        problems.append("a file other than the pinned model claims to be it")
    if is_pinned and report.get("model") != PINNED.name:
        problems.append("the pinned model is not named as such")
    return problems


def _check_row(row: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    text = row.get("generated_text")
    if not isinstance(text, str) or row.get("generated_text_sha256") != _sha256_text(text):
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
        if not isinstance(candidate, str) or not schema_valid(candidate):
            problems.append("constrained candidate that stopped naturally is not schema-valid")
    if isinstance(candidate, str):
        if row.get("schema_valid") != schema_valid(candidate):
            problems.append("recorded schema_valid is wrong")
        now = admit_in_process(candidate)
        if now["admitted"] != admission["admitted"] or (
            now["admitted"] and now["fingerprint"] != admission.get("fingerprint")
        ):
            problems.append("admission decision differs from admission re-run now")
        parsed = _parsed(candidate)
        expected = matches_request(
            parsed, row.get("expected_account", ""), row.get("expected_amount_minor", 0)
        )
        if row.get("matches_authored_request") != expected:
            problems.append("matches_authored_request is wrong")
    elif row.get("matches_authored_request") is not False or admission["admitted"]:
        problems.append("no candidate, yet matched or admitted")
    return problems


def cli_main(args: argparse.Namespace) -> int:
    """``lab model run``: exit 0 with the report written, 2 on unusable input."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = Console(stderr=True)
    threads = getattr(args, "threads", None) or THREADS
    try:
        model = verify_model(Path(args.model), args.expect_sha256)
        cases = load_cases(Path(args.cases) if args.cases else None)
        engine = Engine(model, threads)
    except errors.LabError as exc:
        print(f"lab model run: {exc}", file=sys.stderr)
        return 2
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        report = run(engine, cases, Path(args.traces), progress)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    print(output)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.model check REPORT``: exit 0 when the report holds, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m lab.model")
    commands = parser.add_subparsers(dest="command", required=True)
    checker = commands.add_parser("check", help="verify a model-experiment report")
    checker.add_argument("report", type=Path)
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.report.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"cannot read report {args.report}: {exc}", file=sys.stderr)
        return 1
    problems = check(report) if isinstance(report, dict) else ["report is not a JSON object"]
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    print(f"{args.report}: {len(report['cases'])} generations checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
