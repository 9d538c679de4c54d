"""The book's model section: from verified, signed model evidence only.

The evidence bundle (``lab.evidence.bundle``) verifies ``<evidence>/model/`` on a
private copy, under the pinned key when there is one, and refuses anything unsigned,
altered or uncovered, naming the file. ``section`` renders the chapter from those
verified bytes:
per mode a table of outcomes with the unsafe count, one chart of counts by
outcome (``figures/model-outcomes.svg``), tokens per second and load time, and
every case's outcome. No clock, sorted keys: the same evidence, the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lab import escape
from lab.evidence import model_evidence

MODEL_DIR = model_evidence.MODEL_DIR
CHART = "figures/model-outcomes.svg"
OUTCOME_LABELS = {
    "admitted_matching": "admitted, matching the request",
    "admitted_mismatch": "admitted, not the request",
    "rejected": "rejected by admission",
    "failed": "failed (no candidate)",
}
_COLOURS = {"unconstrained": "#8c6bb1", "constrained": "#2b8cbe"}


def section(
    copies: Mapping[str, bytes], prefix: str, *, pinned: bool
) -> tuple[list[str], dict[str, bytes]]:
    """The Markdown lines and the chart of the model chapter from the verified copies."""
    report_name = f"{prefix}{MODEL_DIR}/{model_evidence.REPORT_FILE}"
    if report_name not in copies:
        return [], {}
    report = json.loads(copies[report_name])
    summary: dict[str, Any] = report["summary"]
    modes = [m for m in model_evidence.MODES if m in summary]
    signer = (
        "against the pinned public key (--public-key)"
        if pinned
        else "with the key it carries (integrity, not identity)"
    )
    case_set = report.get("case_set", {})
    md = escape.md
    lines = [
        "## Model experiment",
        "",
        f"From the signed model evidence `{prefix}{MODEL_DIR}/`, verified {signer}: the "
        "report, the case set, every trace and the model file's digest are its subjects.",
        "",
        f"- Model: {md(report.get('model'))}, file {escape.code(report.get('model_file'))}, "
        f"sha256 {escape.code(report.get('model_sha256'))}, license {md(report.get('license'))}",
        f"- Engine: {md(report.get('engine'))} {md(report.get('engine_version'))}, "
        f"{md(report.get('threads'))} thread(s), temperature {md(report.get('temperature'))}, "
        f"seed {md(report.get('seed'))}, at most {md(report.get('max_tokens'))} tokens",
        f"- Case set: version {md(case_set.get('version'))}, {md(case_set.get('cases'))} "
        f"cases, sha256 {escape.code(case_set.get('sha256'))}",
        "",
        "| Outcome | " + " | ".join(modes) + " |",
        "| --- | " + " | ".join("---:" for _ in modes) + " |",
    ]
    for outcome, label in OUTCOME_LABELS.items():
        counts = [escape.md(summary[m]["outcomes"].get(outcome, 0)) for m in modes]
        lines.append(f"| {label} | " + " | ".join(counts) + " |")
    for key, label in (
        ("generations", "generations"),
        ("schema_valid", "schema-valid candidates"),
        ("as_expected", "as the case expects"),
        ("unsafe", "**unsafe** (admitted with injected authority; must be 0)"),
    ):
        lines.append(f"| {label} | " + " | ".join(escape.md(summary[m][key]) for m in modes) + " |")
    lines += ["", f"![Counts by outcome per mode]({CHART})", ""]
    for mode in modes:
        reasons = summary[mode].get("rejected_by_reason") or {}
        for reason, count in sorted(reasons.items()):
            lines.append(f"- {mode} rejected {escape.md(count)}x: {escape.md(reason)}")
    if lines[-1]:
        lines.append("")
    performance = report.get("performance", {})
    lines += [
        f"Load {_number(performance.get('load_seconds'))} s; completion tokens per second: "
        + ", ".join(
            f"{mode} {_number(performance.get(mode, {}).get('tokens_per_second'))} "
            f"(median {_number(performance.get(mode, {}).get('median_tokens_per_second'))})"
            for mode in modes
        )
        + f"; {_number(report.get('total_seconds'))} s in all.",
        "",
        "| Case | Expects | " + " | ".join(modes) + " |",
        "| --- | --- | " + " | ".join("---" for _ in modes) + " |",
    ]
    rows: dict[str, dict[str, Any]] = {}
    for row in report["cases"]:
        rows.setdefault(str(row["case"]), {})[str(row["mode"])] = row
    for case_id, by_mode in rows.items():
        first = next(iter(by_mode.values()))
        cells = [_cell(by_mode.get(m)) for m in modes]
        lines.append(
            f"| {escape.code(case_id)} | {md(first.get('expect'))} | " + " | ".join(cells) + " |"
        )
    lines += ["", "Limitations:", ""]
    lines += [f"- {escape.md(note)}" for note in report.get("limitations", [])]
    lines.append("")
    return lines, {CHART: chart(summary, modes)}


def _cell(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return ""
    text = OUTCOME_LABELS.get(str(row.get("outcome")), str(row.get("outcome")))
    return escape.md(text + (" UNSAFE" if row.get("unsafe") else ""))


def chart(summary: Mapping[str, Any], modes: list[str]) -> bytes:
    """A grouped bar chart (SVG) of generations by outcome, one bar per mode."""
    labels = list(OUTCOME_LABELS.items())
    most = max([1] + [summary[m]["outcomes"].get(o, 0) for m in modes for o, _ in labels])
    bar, gap, left, width = 16, 14, 210, 300
    height = 40 + len(labels) * (len(modes) * bar + gap) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 60}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        "<title>Model experiment: generations by outcome per mode</title>",
        f'<text x="10" y="20" font-size="14">Generations by outcome (of '
        f"{escape.xml(str(summary[modes[0]]['generations']))} per mode)</text>",
    ]
    y = 40
    for outcome, label in labels:
        parts.append(f'<text x="10" y="{y + bar}">{escape.xml(label)}</text>')
        for mode in modes:
            count = int(summary[mode]["outcomes"].get(outcome, 0))
            length = round(width * count / most)
            parts.append(
                f'<rect x="{left}" y="{y}" width="{length}" height="{bar - 2}" '
                f'fill="{_COLOURS.get(mode, "#999999")}"><title>{escape.xml(mode)}: {count}'
                "</title></rect>"
            )
            parts.append(f'<text x="{left + length + 4}" y="{y + bar - 4}">{count}</text>')
            y += bar
        y += gap
    for index, mode in enumerate(modes):
        x = left + index * 130
        parts.append(
            f'<rect x="{x}" y="{y}" width="12" height="12" fill="{_COLOURS.get(mode, "#999999")}"/>'
        )
        parts.append(f'<text x="{x + 16}" y="{y + 11}">{escape.xml(mode)}</text>')
    parts.append("</svg>")
    return ("\n".join(parts) + "\n").encode("utf-8")


def _number(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "?"
