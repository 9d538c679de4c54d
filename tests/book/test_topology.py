"""The hosts figure: drawn from what a result recorded, escaped, and placed by a directive."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

import pytest

from lab.book import pages, topology

OBSERVATION: dict[str, Any] = {
    "hosts": {"db1": "169.254.7.1", "db2": "169.254.7.2", "ledger": "169.254.7.3",
              "w1": "169.254.7.4", "w2": "169.254.7.5"},
    "host_roles": {"db1": "workflow database: primary at the start",
                   "db2": "workflow database: streaming standby",
                   "ledger": "credit tool and its ledger's server",
                   "w1": "lab worker", "w2": "lab worker"},
    "network": "169.254.7.0/24",
    "replication": "sync",
    "failover_steps": ["fenced", "promoted", "commits alone"],
}


def _texts(drawn: bytes) -> list[str]:
    root = ET.fromstring(drawn)  # noqa: S314 - the renderer's own output
    return [node.text or "" for node in root.iter("{http://www.w3.org/2000/svg}text")]


def test_every_host_its_address_and_role_and_the_failover_are_drawn() -> None:
    drawn = topology.svg(OBSERVATION, "The lab hosts")
    texts = _texts(drawn)
    for name, address in OBSERVATION["hosts"].items():
        assert name in texts and address in texts
    assert "lab worker" in texts
    assert "streaming standby" in " ".join(texts)
    assert any(t.startswith("Replication db1 → db2: sync") for t in texts)
    assert any("fenced → promoted → commits alone" in t for t in texts)
    assert any("169.254.7.0/24" in t for t in texts)
    assert drawn == topology.svg(OBSERVATION, "The lab hosts"), "the bytes are deterministic"


def test_hostile_names_are_inert() -> None:
    hostile = {**OBSERVATION, "hosts": {"<script>alert(1)</script>": "\"'&<>"},
               "host_roles": {"<script>alert(1)</script>": "<img src=x onerror=y>"}}
    drawn = topology.svg(hostile, "<b>t</b>")
    assert b"<script" not in drawn and b"<img" not in drawn and b"<b>" not in drawn
    assert "<script>alert(1)</script>" in _texts(drawn)


@pytest.mark.parametrize("observation", [
    {}, {"hosts": []}, {"hosts": {}}, {"hosts": {"a": 1}},
    {"hosts": {f"h{i}": "169.254.0.1" for i in range(13)}},
])
def test_what_records_no_hosts_is_not_drawn(observation: dict[str, Any]) -> None:
    assert not topology.drawable(observation)
    with pytest.raises(ValueError):
        topology.svg(observation, "t")


def _evidence(observation: dict[str, Any]) -> pages.Evidence:
    report = {
        "status": "PASS", "limits": [],
        "experiments": [{"chapter": "ch17_x", "name": "test_a", "outcome": "passed",
                         "results": 1, "duration": 0.5, "claim": "c",
                         "tests": ["x.py::test_a[after_claim]"]}],
        "tests": [{"nodeid": "x.py::test_a[after_claim]", "chapter": "ch17_x",
                   "experiment": "test_a", "outcome": "passed", "claim": "c", "events": [],
                   "timeline": [], "trace_ids": [], "observations": [observation]}],
    }
    return pages.Evidence(report=report, copies={}, pinned_by=None,  # type: ignore[arg-type]
                          figure_paths={}, sources={})


def test_the_directive_draws_the_named_result_into_the_figures() -> None:
    evidence = _evidence(OBSERVATION)
    markdown = pages.expand("p", "{{ hosts ch17_x/test_a[after_claim] }}\n", evidence)
    title = "The lab hosts of ch17_x, [after_claim]"
    assert "![The lab hosts of ch17_x, \\[after_claim\\]](figures/hosts-after_claim.svg)" in (
        markdown)
    assert evidence.rendered["figures/hosts-after_claim.svg"] == topology.svg(OBSERVATION, title)


def test_the_directive_fails_naming_a_result_without_hosts() -> None:
    evidence = _evidence({"replication": "sync"})
    with pytest.raises(pages.DirectiveError, match="recorded its hosts"):
        pages.expand("p", "{{ hosts ch17_x/test_a[after_claim] }}\n", evidence)
