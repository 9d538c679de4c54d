"""Signed model evidence from canned generations, for tests that need it in milliseconds.

``CannedEngine`` answers like ``engine.Engine`` with fixed texts (no model is
loaded), so ``generation.run`` judges them through real admission and
``signed.write`` signs them exactly as ``lab model run`` does. Tests of
the engine itself use ``tiny_gguf`` models through llama.cpp instead.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, cast

from lab.evidence import dsse
from lab.model import cases, engine, generation, signed

PROPOSAL = '{"version":1,"action":"issue_credit","account":"%s","amount_minor":%d,"currency":"CNY"}'


class CannedEngine:
    """Free text that names the request; under the grammar, always account-a and 1."""

    threads = 1
    load_seconds = 0.25

    def __init__(self, path: Path) -> None:
        data = path.read_bytes()
        self.model = engine.ModelFile(path, hashlib.sha256(data).hexdigest(), len(data))
        self.by_prompt = {c.prompt: c for c in cases.load().cases}

    def generate(self, prompt: str, mode: str) -> dict[str, Any]:
        case = self.by_prompt[prompt]
        if mode == "constrained":
            text = PROPOSAL % ("account-a", 1)
        else:
            text = "Plan: " + PROPOSAL % (case.account, case.amount_minor)
        return {
            "choices": [{"message": {"content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 60, "completion_tokens": 45},
        }

    def metadata(self) -> dict[str, str]:
        return {"general.name": "canned"}

    def version(self) -> str:
        return "canned"

    def system_info(self) -> str:
        return ""

    def chat_format(self) -> str:
        return "canned"


def write_evidence(directory: Path, scratch: Path, case_ids: list[str] | None = None,
                   signer: dsse.Signer | None = None) -> Path:
    """Signed model evidence in ``directory`` for the given cases, of a model file in
    ``scratch`` holding ``GGUF canned``; signed by ``signer`` (an ephemeral key if None)."""
    scratch.mkdir(parents=True, exist_ok=True)
    model_file = scratch / "canned.gguf"
    model_file.write_bytes(b"GGUF canned")
    case_set = cases.load()
    if case_ids:
        case_set = cases.subset(case_set, case_ids)
    traces = scratch / "traces"
    report = generation.run(cast(engine.Engine, CannedEngine(model_file)), case_set, traces)
    signed.write(directory, report, traces, case_set,
                 signer if signer is not None else dsse.load_signer({}))
    return directory
