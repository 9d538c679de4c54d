"""Named quantities: what an observation's keys mean, in words and units, for the book.

``QUANTITIES`` declares, for the keys the experiments record most, a label, a unit and a
sentence of meaning; the book renders an observation as a small table of named values
(``table``) instead of ``key=value`` or JSON, and lists the declarations on the glossary
(``glossary``). A key not declared here is still readable: its name in words, a unit read
from its suffix (``_s`` is seconds, ``_ms`` milliseconds) and its value in words.
Whether a value is a fact or a measurement is the report's (``observation_kinds``), not
this table's. Pure: values in, unescaped text and escaped Markdown out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lab import escape


@dataclass(frozen=True)
class Quantity:
    """How the book names one observation key."""

    label: str
    unit: str = ""
    meaning: str = ""


_Q = Quantity
QUANTITIES: dict[str, Quantity] = {
    "effects": _Q("effects in the tool's ledger", "credit",
                  "credits the credit tool committed, counted in its own ledger"),
    "workflows": _Q("workflows", "workflow", "workflows the experiment created"),
    "tool_calls": _Q("tool calls", "call", "requests that asked the tool for an effect"),
    "post_calls": _Q("tool calls", "call", "requests that asked the tool for an effect"),
    "calls": _Q("tool calls", "call", "requests that asked the tool for an effect"),
    "lookups": _Q("lookups", "lookup", "requests that asked the tool whether an effect exists"),
    "state": _Q("final state", "", "the workflow's state in the lab's store at the end"),
    "final_state": _Q("final state", "", "the workflow's state in the lab's store at the end"),
    "lab_state": _Q("lab state", "", "the lab workflow's state behind the peer's node"),
    "states": _Q("workflows by final state", "workflow",
                 "how many workflows ended in each state"),
    "review_reason": _Q("reason held for a person", "",
                        "why the lab stopped and waits for a person to decide"),
    "manual_reviews": _Q("held for a person", "workflow",
                         "workflows that ended waiting for a person, with a reason"),
    "manual_review_reasons": _Q("reasons held for a person", "workflow",
                                "workflows waiting for a person, by reason"),
    "attempts": _Q("attempts", "attempt", "attempts the workflow used of its budget"),
    "budget": _Q("retry budget", "attempt", "attempts the step may use"),
    "claims": _Q("claims", "claim", "times a worker claimed the workflow"),
    "successful_claims": _Q("successful claims", "claim", "claims that won the workflow"),
    "seed": _Q("random seed", "", "the seed the round's random faults were drawn from"),
    "worker_processes": _Q("worker processes", "process", "worker OS processes running"),
    "lease_s": _Q("lease", "s", "how long a claim holds without a heartbeat"),
    "heartbeat_s": _Q("heartbeat interval", "s", "how often a worker renews its lease"),
    "kills": _Q("workers killed", "SIGKILL", "worker processes killed with SIGKILL"),
    "backend_terminations": _Q("database backends terminated", "termination",
                               "PostgreSQL backends of workers terminated mid-transaction"),
    "dropped_replies": _Q("replies dropped after commit", "reply",
                          "tool replies lost after the effect was committed"),
    "rejected_429": _Q("answered 429", "request", "requests the tool refused as too many"),
    "leases_expired": _Q("leases expired", "lease", "claims that ran out and were recovered"),
    "violations": _Q("invariant violations", "violation",
                     "breaches the invariant checker found in the database and ledger"),
    "fault_phase_s": _Q("fault phase", "s", "how long faults were injected"),
    "wall_s": _Q("wall-clock time", "s", "how long the whole round took"),
    "recovery_s": _Q("recovery time", "s", "from the fault to a settled workflow"),
    "server_down_seconds": _Q("server down", "s", "how long PostgreSQL was unavailable"),
    "resume_seconds": _Q("resume time", "s", "how long resuming the thread took"),
    "resumed_seconds_after_expiry": _Q("resumed after expiry", "s",
                                       "how long after the approval expired it was used"),
    "peer_window": _Q("failure window", "", "the side-by-side window this result belongs to"),
    "system": _Q("system", "", "the system whose behaviour this observation records"),
    "via": _Q("via", "", "how the system was reached"),
    "outcome": _Q("outcome", "", "the experiment's account of what happened"),
    "approval_names_this_plan": _Q("approval names this plan", "",
                                   "whether the accepted approval carries this plan's "
                                   "fingerprint"),
    "dbos_version": _Q("DBOS version", "", "the DBOS Transact release that ran"),
    "dbos_status": _Q("DBOS workflow status", "", "DBOS's own workflow_status rows"),
    "dbos_steps": _Q("DBOS recorded steps", "", "DBOS's own operation_outputs rows"),
    "dbos_config": _Q("DBOS settings", "", "the step's retry and executor settings"),
    "langgraph_state": _Q("LangGraph state", "", "the thread's checkpointed state"),
    "langgraph_versions": _Q("LangGraph versions", "", "the LangGraph packages that ran"),
    "window": _Q("kill window", "", "where in the workflow the process was killed"),
    "fence": _Q("fence", "", "the claim's fencing token"),
    "cells": _Q("matrix cells", "cell", "boundary, fault and tool-kind combinations run"),
    "crashpoints_sha256": _Q("matrix file sha256", "", "digest of the signed crash-point "
                             "matrix file"),
    "events": _Q("audit events", "event", "audit events recorded, by kind"),
}
MAX_DEPTH = 4


def quantity(key: str) -> Quantity:
    """The declared quantity for ``key``, else one read from its name."""
    if key in QUANTITIES:
        return QUANTITIES[key]
    unit = ""
    for suffix, named in (("_ms", "ms"), ("_s", "s"), ("_seconds", "s"), ("_per_s", "per s")):
        if key.endswith(suffix):
            unit = named
            key = key[: -len(suffix)]
            break
    return Quantity(key.replace("_", " ").strip() or key, unit)


def words(value: Any, depth: int = 0) -> str:
    """A value in words: yes/no, numbers as written, lists and objects as short phrases."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return f"{value:g}" if isinstance(value, float) else str(value)
    if depth >= MAX_DEPTH:
        return "(nested deeper)"
    if isinstance(value, Mapping):
        if not value:
            return "none"
        # A nested key is a name from the run (a state, a reason): shown as it is recorded,
        # unless it is a declared quantity.
        return "; ".join(f"{QUANTITIES[k].label if k in QUANTITIES else k}: {words(v, depth + 1)}"
                         for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
    if isinstance(value, list | tuple):
        if not value:
            return "none"
        nested = any(isinstance(v, Mapping | list | tuple) for v in value)
        return (" | " if nested else ", ").join(words(v, depth + 1) for v in value)
    return str(value)


_SYMBOLS = frozenset({"s", "ms", "per s"})


def _unit(quantity_: Quantity, value: Any) -> str:
    """The unit after a number: a symbol as it is, a word in the plural unless the value is 1."""
    unit = quantity_.unit
    if not unit or isinstance(value, bool) or not isinstance(value, int | float):
        return ""
    if unit in _SYMBOLS or value == 1:
        return unit
    if unit.endswith("y"):
        return unit[:-1] + "ies"
    return unit + ("es" if unit.endswith("ss") else "s")


def rows(observation: Any, kinds: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """``(label, value with unit, kind)`` per key of one observation, the keys of ``FIRST``
    first, then by label;
    a value that is not an object is one row labelled ``observed``."""
    if not isinstance(observation, Mapping):
        return [("observed", words(observation), "")]
    found: list[tuple[str, str, str]] = []
    order = [k for k in FIRST if k in observation]
    order += sorted((k for k in observation if k not in order),
                    key=lambda k: quantity(str(k)).label)
    for key in order:
        value = observation[key]
        named = quantity(str(key))
        unit = _unit(named, value)
        shown = f"{words(value)} {unit}".rstrip()
        found.append((named.label, shown, (kinds or {}).get(str(key), "")))
    return found


def table(observation: Any, kinds: Mapping[str, str] | None = None,
          param: str | None = None) -> list[str]:
    """One observation as a Markdown table of named values (escaped), a measurement marked
    as one: it may differ on another run of the same commit."""
    lines = ['<div class="values">', "",
             f"| {'Quantity' if param is None else escape.md(f'[{param}]')} | Value | |",
             "| --- | --- | --- |"]
    for label, shown, kind in rows(observation, kinds):
        note = "measured: varies by run" if kind == "measurement" else ""
        lines.append(f"| {escape.md(label)} | {escape.md(shown)} | {note} |")
    return [*lines, "", "</div>", ""]


def brief(observation: Any, keys: Sequence[str] = (), limit: int = 4) -> str:
    """A few named values on one line (``effects in the tool's ledger 1 credits``), for a
    results table: the keys named first, then the rest in order, at most ``limit``."""
    if not isinstance(observation, Mapping):
        return words(observation)
    order = [k for k in keys if k in observation]
    order += [k for k in sorted(observation, key=str) if k not in order]
    shown: list[str] = []
    for key in order:
        value = observation[key]
        if isinstance(value, Mapping | list | tuple) or key in _NOT_BRIEF:
            continue
        named = quantity(str(key))
        shown.append(f"{named.label}: {words(value)} {_unit(named, value)}".rstrip())
        if len(shown) == limit:
            break
    return "; ".join(shown)


# Keys a one-line summary leaves to the details: long prose or identifiers.
_NOT_BRIEF = frozenset({"outcome", "peer_window", "system", "via", "crashpoints_sha256",
                        "dbos_version"})
# The keys a chapter's results table names first when an observation holds them.
FIRST = ("effects", "state", "final_state", "lab_state", "review_reason", "workflows",
         "violations", "tool_calls", "post_calls", "lookups")


def glossary() -> list[str]:
    """Every declared quantity: its label, unit and meaning (escaped Markdown)."""
    lines = ["| Key | Name | Unit | Meaning |", "| --- | --- | --- | --- |"]
    for key, named in sorted(QUANTITIES.items()):
        lines.append(f"| {escape.code(key)} | {escape.md(named.label)} | "
                     f"{escape.md(named.unit)} | {escape.md(named.meaning)} |")
    return [*lines, ""]
