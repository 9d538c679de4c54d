"""The book's reproduction section, from a verified reproduction record (pure).

"Reproduced independently by KEY on DATE, N of N experiments identical in their facts",
then the experiments that differ, each with the facts that did not hold and both values.
Only a reproduction an independent trusted key vouches for gets that section; one that
is not pinned, or is signed by the original's own key, is named as such, with the reason
and no table. Every string from the evidence goes through the book's one escaper.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lab import escape

_WIDTH = 80


def _value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return escape.md(text if len(text) <= _WIDTH else text[: _WIDTH - 1] + "…")


def lines(data: bytes | None, *, by: str | None = None,
          withheld: str | None = None) -> list[str]:
    """Markdown lines for a verified reproduction record's bytes (none: no section).

    ``data`` is ``reproduction.json`` as ``reproduction_evidence.book_files`` verified it
    (signed, schema-checked, of this very run) and ``by`` the independent trusted key
    that vouches for it (its origin and fingerprint). ``withheld``: a reproduction was
    verified but is not shown, and why (not pinned, not independent).
    """
    if withheld is not None:
        label = "Not independent" if withheld.startswith("not independent") else "Not pinned"
        return [f"**{label}**: this run's reproduction is not shown: {escape.md(withheld)}.",
                ""]
    if data is None:
        return []
    if by is None:
        return ["**Not pinned**: this run's reproduction is not shown: no independent "
                "trusted key vouches for it.", ""]
    record: Mapping[str, Any] = json.loads(data)
    comparison = record["comparison"]
    experiments = comparison["experiments"]
    same = sum(1 for e in experiments if e["same"])
    day = escape.md(str(record["reproduced_at_utc"])[:10])
    runs = int(comparison["runs"])
    out = [
        f"Reproduced independently by {escape.code(by)} on {day}, {same} of "
        f"{len(experiments)} experiments identical in their "
        f"facts over {runs} re-run(s) of commit "
        f"{escape.md(str(record['original']['commit'])[:12])} "
        f"(verdict: {escape.md(str(comparison['verdict']))}).",
        "",
    ]
    failed = [e for e in experiments if not e["passed"]]
    if failed:
        out += ["Not passed in every run: "
                + ", ".join(escape.md(f"{e['chapter']}/{e['name']}") for e in failed) + ".", ""]
    differing = [e for e in experiments if not e["same"]]
    if differing:
        out += ["| Experiment | Fact | Original | Re-runs | Held |",
                "| --- | --- | --- | --- | --- |"]
        for e in differing:
            for fact in e["facts"]:
                claimed = fact.get("original_kind")
                misdeclared = claimed is not None and claimed != fact.get("kind", claimed)
                if fact["held"] == len(fact["values"]) and not misdeclared:
                    continue
                values = ", ".join(_value(v) for v in fact["values"])
                if misdeclared:
                    values += (f" (the original calls it a {escape.md(str(claimed))}; the "
                               f"commit declares a {escape.md(str(fact.get('kind')))})")
                out.append(
                    f"| {escape.md(e['chapter'] + '/' + e['name'])} | "
                    f"{escape.md(str(fact['key']))} | "
                    f"{_value(fact['original'])} | {values} | {fact['held']} of {runs} |"
                )
        out.append("")
    return out
