"""The one escaper: every evidence string that reaches the book's Markdown, HTML or SVG.

Evidence is untrusted text even when its signature verifies (anyone can sign with a
fresh key), so every renderer of the book (``builder``, ``pages``, ``crashpoints``,
``sidebyside``, ``model_chapter``, ``figures``) passes evidence through these
functions and through nothing else; ``tests/book/test_book_escape.py`` holds them to it.

- ``md``: inline Markdown text that is also inert HTML: one line, entities for
  ``& < > "``, a backslash before every character that starts Markdown markup
  (code spans, emphasis, links, images, tables; headings, quotes and lists at a
  line start).
  A ``javascript:`` or remote-image link cannot form: no ``[``, ``]``, ``<`` or ``(``
  survives as markup.
- ``code``: a code span when the text needs no escaping at all, else ``md``.
- ``xml``: text or an attribute value in HTML or SVG.
- ``html_text``: text inside a raw HTML block of a Markdown page (the findings grid, a
  results table): ``xml``, and every character that starts Markdown markup as an
  entity too, so the ``.md`` file reads as inert text in any Markdown renderer.
- ``mermaid``: a label inside a Mermaid diagram (its own statement and entity syntax).
"""

from __future__ import annotations

import html
import re
import unicodedata

# Text that may stand in a Markdown code span as it is: nothing to escape, no backtick.
_CODE_SAFE = re.compile(r"[A-Za-z0-9_.:/=@+,%~#() -]{1,300}")
# Every ASCII punctuation character CommonMark lets a backslash escape and that can start
# or close markup inline: backslash, code, emphasis, links, images, autolinks, tables.
_MD_SPECIAL = re.compile(r"([\\`*\[\]!|~])")
# An underscore opens or closes emphasis only at a word's edge (never inside a word, so
# identifiers like ``postgres_restart`` stay readable in the Markdown).
_MD_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
# At a line's (or a cell's) start these begin a heading, a list, a quote or a rule.
_MD_LEADING = re.compile(r"^(?:\d+(?=[.)](?:\s|$))|(?=[#+\-=>]))")
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})


def visible(text: str) -> str:
    """``text`` on one line, with control, format (bidi), surrogate, private-use and
    unassigned characters written as visible escapes (``\\x07``, ``\\u202e``)."""
    out: list[str] = []
    for c in " ".join(text.split()):
        if unicodedata.category(c) in _HIDDEN:
            code = ord(c)
            out.append(
                f"\\x{code:02x}" if code < 0x100
                else f"\\u{code:04x}" if code < 0x10000
                else f"\\U{code:08x}"
            )
        else:
            out.append(c)
    return "".join(out)


def md(text: object) -> str:
    """Evidence text made inert in Markdown and in the HTML it renders to."""
    line = visible(str(text))
    line = html.escape(line, quote=True).replace("&#x27;", "'")
    line = _MD_SPECIAL.sub(r"\\\1", line)
    line = _MD_UNDERSCORE.sub(r"\\_", line)
    return _MD_LEADING.sub(lambda m: m.group(0) + "\\", line, count=1)


def code(text: object) -> str:
    """A code span when ``text`` needs no escaping at all, else the escaped plain text."""
    value = str(text)
    return f"`{value}`" if _CODE_SAFE.fullmatch(value) else md(value)


def xml(text: object) -> str:
    """Text or an attribute value for HTML or SVG: every markup character an entity."""
    return html.escape(visible(str(text)), quote=True)


# Markdown's markup characters, written as entities inside raw HTML (they show the same).
_HTML_MD = frozenset("\\`*[]!|~")


def html_text(text: object) -> str:
    """Evidence text for a raw HTML block inside Markdown: ``xml``, and Markdown's markup
    characters as numeric entities, so no renderer of the Markdown reads a link or image."""
    return "".join(f"&#{ord(c)};" if c in _HTML_MD else html.escape(c, quote=True)
                   for c in visible(str(text)))


# Mermaid ends a statement at ';' and at a line end, reads '#...;' as an entity code
# and '<...>' as markup: all are written as entity codes.
_MERMAID_ESCAPES = {"#": "#35;", ";": "#59;", "<": "#lt;", ">": "#gt;", "`": "#96;"}


def mermaid(text: str) -> str:
    """A label inside a Mermaid diagram (already shortened by the caller): one line,
    no statement end, no entity, no markup."""
    return "".join(_MERMAID_ESCAPES.get(c, c) for c in visible(text))
