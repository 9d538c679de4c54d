"""The book's HTML: one page's Markdown rendered into the site's template.

Each page gets the book's navigation twice: a sidebar on a wide screen, and a menu that
opens under the title on a screen narrower than 800 px (no script: a ``<details>``), a
contents list of its own sections, and a pager. A chapter is listed under its own number
(``ch09_chaos`` is 9). The style sheet is the site's only one; nothing is remote. Every
string reaches the HTML through ``lab.escape``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from markdown_it import MarkdownIt
from markdown_it.token import Token

from lab import escape

STYLE_FILE = "style.css"
NARROW = 800  # px: under this the sidebar gives way to a menu under the title
_CHAPTER = re.compile(r"ch(\d\d)(?:_.*)?")

STYLE = """\
body { margin: 0; font: 15px/1.5 "DejaVu Sans", Helvetica, Arial, sans-serif; color: #1b1f23; }
nav.side { position: fixed; top: 0; bottom: 0; left: 0; width: 15rem; overflow-y: auto;
      padding: 1rem; background: #f4f6f8; border-right: 1px solid #d8dee4; box-sizing: border-box; }
nav ul { list-style: none; padding-left: 0; margin: 0.5rem 0; }
nav li { margin: 0.2rem 0; }
nav a[aria-current] { font-weight: bold; color: #1b1f23; }
.verdict { font-weight: bold; padding: 0.2rem 0.5rem; border-radius: 4px; display: inline-block; }
.PASS { background: #dcffe4; color: #0b5a1d; }
.FAIL, .PARTIAL { background: #ffdce0; color: #86181d; }
header.narrow { display: none; }
main { margin-left: 15rem; padding: 1rem 2rem 4rem; max-width: 72rem; box-sizing: border-box;
       overflow-wrap: break-word; }
main h1, main h2, main h3 { overflow-wrap: anywhere; }
nav.contents { background: #f4f6f8; border: 1px solid #d8dee4; border-radius: 4px;
               padding: 0.5rem 1rem; margin: 1rem 0; display: inline-block; max-width: 100%;
               box-sizing: border-box; }
nav.contents ul ul { padding-left: 1rem; margin: 0; font-size: 90%; }
@media (min-width: 1100px) {
  nav.contents { float: right; margin: 0 0 1rem 1.5rem; max-width: 20rem; }
  .grid, .cards, .scroll, table { clear: both; }  /* a table keeps the page's full width */
}
main table td:first-child { min-width: 9rem; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 13px; display: block;
        max-width: 100%; overflow-x: auto; }
th, td { border: 1px solid #d8dee4; padding: 0.25rem 0.5rem; vertical-align: top;
         text-align: left; overflow-wrap: anywhere; min-width: 6rem; }
th { background: #f4f6f8; }
table.values td, table.values th { min-width: 0; }
code { font-family: "DejaVu Sans Mono", monospace; font-size: 90%; background: #f4f6f8;
       padding: 0 0.2rem; overflow-wrap: anywhere; }
pre { background: #f4f6f8; padding: 0.5rem; overflow-x: auto; }
img { max-width: 100%; height: auto; border: 1px solid #d8dee4; }
/* A figure keeps its size (its labels stay legible) and scrolls inside its paragraph. */
p:has(> img) { overflow-x: auto; }
p > img { max-width: none; }
details summary { cursor: pointer; color: #0550ae; }
.scroll { max-width: 100%; overflow-x: auto; border: 1px solid #d8dee4; }
.scroll table { display: table; margin: 0; }
.scroll td, .scroll th { min-width: 7rem; overflow-wrap: normal; }
.grid td { min-width: 8rem; }
.mark { font-weight: bold; white-space: nowrap; padding: 0 0.2rem; border-radius: 3px; }
.mark.safe { background: #dcffe4; color: #0b5a1d; }
.mark.unsafe { background: #ffdce0; color: #86181d; }
.mark.needs-a-person { background: #fff5b1; color: #5c4500; }
.mark.does-not-apply, .mark.not-in-this-run { background: #eef1f4; color: #3d4853; }
.source { font-size: 90%; color: #3d4853; }
.pager { margin-top: 3rem; display: flex; justify-content: space-between; gap: 1rem;
         flex-wrap: wrap; }
@media (max-width: 800px) {
  nav.side { display: none; }
  header.narrow { display: block; background: #f4f6f8; border-bottom: 1px solid #d8dee4;
                  padding: 0.5rem 1rem; }
  header.narrow p { margin: 0.2rem 0; }
  main { margin-left: 0; padding: 0.5rem 1rem 3rem; }
  /* The findings grid and results tables as cards: a row, then each cell under its name. */
  .grid table, .grid tbody, .grid tr, .grid td, .grid th,
  .cards table, .cards tbody, .cards tr, .cards td { display: block; min-width: 0; }
  .grid thead, .cards thead { display: none; }
  .grid tr, .cards tr { border: 1px solid #d8dee4; border-radius: 4px;
                        margin-bottom: 0.75rem; }
  .grid td, .grid th, .cards td { border: none; border-top: 1px solid #eef1f4; }
  .grid td::before, .cards td::before { content: attr(data-label) ": "; font-weight: bold; }
}
"""

TEMPLATE = """\
<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="stylesheet" href="{style}">
</head>
<body>
<nav class="side" aria-label="The book">
<p><a href="index.html">The durable agent workflow lab</a></p>
<p class="verdict {status}">Gate: {status}</p>
<ul>
{links}
</ul>
</nav>
<header class="narrow">
<p><a href="index.html">The durable agent workflow lab</a>
<span class="verdict {status}">Gate: {status}</span></p>
<details><summary>Pages of the book</summary>
<nav aria-label="The book (menu)"><ul>
{links}
</ul></nav>
</details>
</header>
<main>
{body}
<p class="pager">{pager}</p>
</main>
</body>
</html>
"""


def markdown_it() -> MarkdownIt:
    """The book's Markdown engine: CommonMark with tables and the book's own raw HTML."""
    # Raw HTML on, since the only HTML in a page is the book's own (evidence reaches it
    # only through escape.md, which leaves no '<'). markdown-it's link validation still
    # drops javascript:, vbscript:, file: and data: URLs.
    return MarkdownIt("commonmark", {"html": True}).enable("table")


def page_href(href: str) -> str:
    """A link to another page's Markdown becomes a link to its HTML."""
    target, hash_mark, fragment = href.partition("#")
    if target.endswith(".md") and "/" not in target and ":" not in target:
        return f"{target[:-3]}.html{hash_mark}{fragment}"
    return href


def nav_title(name: str, title: str) -> str:
    """A page's name in the navigation: a chapter under its own number (``9. Chaos``)."""
    found = _CHAPTER.fullmatch(name)
    return f"{int(found.group(1))}. {title}" if found else title


def _slug(text: str, taken: set[str]) -> str:
    base = "s-" + (re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "section")
    slug, n = base, 1
    while slug in taken:
        n += 1
        slug = f"{base}-{n}"
    taken.add(slug)
    return slug


def contents(tokens: list[Token]) -> str:
    """Give every level-2 and level-3 heading an id and return the page's contents list
    (HTML, empty when the page has fewer than two sections)."""
    taken: set[str] = set()
    entries: list[tuple[int, str, str]] = []
    for at, token in enumerate(tokens):
        if token.type != "heading_open" or token.tag not in ("h2", "h3"):
            continue
        inline = tokens[at + 1]
        text = "".join(c.content for c in inline.children or []
                       if c.type in ("text", "code_inline"))
        slug = _slug(text, taken)
        token.attrSet("id", slug)
        entries.append((int(token.tag[1]), slug, text))
    if sum(1 for level, *_ in entries if level == 2) < 2:
        return ""
    html = ['<nav class="contents" aria-label="On this page"><strong>On this page</strong>',
            "<ul>"]
    open_sub = False
    for level, slug, text in entries:
        item = f'<li><a href="#{slug}">{escape.xml(text)}</a>'
        if level == 3:
            if not open_sub:
                html[-1] = html[-1].removesuffix("</li>")
                html.append("<ul>")
                open_sub = True
            html.append(item + "</li>")
            continue
        if open_sub:
            html.append("</ul></li>")
            open_sub = False
        html.append(item + "</li>")
    if open_sub:
        html.append("</ul></li>")
    html += ["</ul>", "</nav>"]
    return "\n".join(html)


def html_page(name: str, markdown: str, titles: Mapping[str, str], status: str) -> bytes:
    """One page of the site: the Markdown rendered, with navigation and a contents list."""
    engine = markdown_it()
    tokens = engine.parse(markdown)
    for token in tokens:
        for child in token.children or []:
            if child.type == "link_open":
                child.attrSet("href", page_href(str(child.attrGet("href") or "")))
    toc = contents(tokens)
    body = engine.renderer.render(tokens, engine.options, {}).rstrip("\n")
    if toc:
        head, sep, rest = body.partition("</h1>")
        body = f"{head}{sep}\n{toc}{rest}" if sep else f"{toc}\n{body}"
    names = list(titles)
    links = "\n".join(
        f'<li><a href="{escape.xml(n)}.html"'
        + (' aria-current="page"' if n == name else "")
        + f">{escape.xml(nav_title(n, titles[n]))}</a></li>"
        for n in names
    )
    at = names.index(name)
    pager = []
    if at > 0:
        pager.append(f'<a href="{escape.xml(names[at - 1])}.html">← '
                     f"{escape.xml(nav_title(names[at - 1], titles[names[at - 1]]))}</a>")
    if at + 1 < len(names):
        pager.append(f'<a href="{escape.xml(names[at + 1])}.html">'
                     f"{escape.xml(nav_title(names[at + 1], titles[names[at + 1]]))} →</a>")
    document = TEMPLATE.format(
        title=escape.xml(f"{titles[name]} · durable agent workflow lab"),
        style=STYLE_FILE,
        status=escape.xml(status),
        links=links,
        body=body,
        pager=" ".join(pager),
    )
    return document.encode("utf-8")
