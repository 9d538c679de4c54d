"""The hosts of a run beyond one host, drawn from the topology its evidence recorded.

Chapter 17's results record which lab hosts the run made (``hosts``: name → link-local
address), what each one held (``host_roles``), the replication mode and the failover's
steps. ``svg`` draws them as one standalone figure: the bridge (a namespace of its own,
no route out) across the middle, each host a box joined to it by its veth pair, and the
replication and failover in words beneath. Every string is evidence, so it passes
through ``lab.escape``; the bytes depend on the observation alone. Pure.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from lab import escape

_FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
_BOX_W = 150
_BOX_H = 92
_GAP = 24
_MARGIN = 24
_TOP = 56  # the title's band
_BRIDGE_GAP = 56  # from the boxes' bottom to the bridge
_LINE = 17
_MAX_HOSTS = 12
_ROLE_WIDTH = 20  # characters per line of a role inside a box
_MAX_TEXT = 60  # characters of any one label
_NOTE_WIDTH = 90


def drawable(observation: Mapping[str, Any]) -> bool:
    """Whether ``observation`` records hosts this module can draw."""
    hosts = observation.get("hosts")
    return (isinstance(hosts, Mapping) and 0 < len(hosts) <= _MAX_HOSTS
            and all(isinstance(k, str) and isinstance(v, str) for k, v in hosts.items()))


def _clip(value: object) -> str:
    text = escape.visible(str(value))
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 1] + "…"


def _text(x: float, y: float, value: str, *, size: int = 13, weight: str = "normal",
          anchor: str = "middle", fill: str = "#1f2328") -> str:
    return (f'<text x="{x:.0f}" y="{y:.0f}" font-family="{_FONT}" font-size="{size}" '
            f'font-weight="{weight}" text-anchor="{anchor}" fill="{fill}">'
            f"{escape.xml(value)}</text>")


def _notes(observation: Mapping[str, Any]) -> list[str]:
    """The replication and the failover, in words, from the observation."""
    lines = []
    if observation.get("replication"):
        lines.append(f"Replication db1 → db2: {_clip(observation['replication'])}")
    steps = observation.get("failover_steps")
    if isinstance(steps, Sequence) and not isinstance(steps, str) and steps:
        lines.append("Failover: " + " → ".join(_clip(s) for s in steps))
    network = observation.get("network")
    where = f"addresses in {_clip(network)}" if network else "link-local addresses"
    lines.append(f"Every host on one bridge in a namespace of its own; {where}; "
                 "no default route, nothing forwarded to or from the machine.")
    wrapped: list[str] = []
    for line in lines:
        wrapped += textwrap.wrap(line, _NOTE_WIDTH) or [""]
    return wrapped


def svg(observation: Mapping[str, Any], title: str) -> bytes:
    """The hosts of ``observation`` as an SVG figure titled ``title``."""
    if not drawable(observation):
        raise ValueError("the observation records no hosts to draw")
    hosts: Mapping[str, str] = observation["hosts"]
    roles = observation.get("host_roles")
    roles = roles if isinstance(roles, Mapping) else {}
    names = list(hosts)
    width = max(2 * _MARGIN + len(names) * _BOX_W + (len(names) - 1) * _GAP, 640)
    row_w = len(names) * _BOX_W + (len(names) - 1) * _GAP
    left = (width - row_w) / 2
    bridge_y = _TOP + _BOX_H + _BRIDGE_GAP
    notes = _notes(observation)
    height = bridge_y + 40 + len(notes) * _LINE + _MARGIN
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
             f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img">',
             f'<rect x="0" y="0" width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>',
             _text(_MARGIN, 30, _clip(title), size=15, weight="bold", anchor="start")]
    for index, name in enumerate(names):
        x = left + index * (_BOX_W + _GAP)
        center = x + _BOX_W / 2
        parts.append(f'<line x1="{center:.0f}" y1="{_TOP + _BOX_H}" x2="{center:.0f}" '
                     f'y2="{bridge_y}" stroke="#57606a" stroke-width="2"/>')
        parts.append(f'<rect x="{x:.0f}" y="{_TOP}" width="{_BOX_W}" height="{_BOX_H}" '
                     f'rx="6" fill="#f6f8fa" stroke="#1f4e79" stroke-width="1.5"/>')
        parts.append(_text(center, _TOP + 22, _clip(name), size=14, weight="bold"))
        parts.append(_text(center, _TOP + 40, _clip(hosts[name]), size=12, fill="#57606a"))
        role = textwrap.wrap(_clip(roles.get(name, "")), _ROLE_WIDTH)[:2]
        for line_no, line in enumerate(role):
            parts.append(_text(center, _TOP + 60 + line_no * 15, line, size=12))
        parts.append(_text(center + 6, bridge_y - 8, "veth", size=11, anchor="start",
                           fill="#57606a"))
    parts.append(f'<rect x="{_MARGIN}" y="{bridge_y}" width="{width - 2 * _MARGIN:.0f}" '
                 f'height="10" rx="5" fill="#1f4e79"/>')
    parts.append(_text(width / 2, bridge_y + 28, "bridge br0 (a namespace of its own, "
                                                 "no address)", size=12))
    for line_no, line in enumerate(notes):
        parts.append(_text(_MARGIN, bridge_y + 52 + line_no * _LINE, line, size=13,
                           anchor="start"))
    parts.append("</svg>")
    return ("\n".join(parts) + "\n").encode("utf-8")
