"""The built site in a real browser: headless Chromium, driven over the DevTools protocol.

``check`` opens pages of a built book in Chromium (Debian's ``chromium``) and
reports, per page, what a reader would hit: a blank page (no text, or a screenshot
of one colour), an image that did not load, a link inside the site to a missing page
or anchor, a console error or an uncaught exception, a failed load, and any request
that left the machine (the site must work offline). It saves a full-page screenshot
of each.

The protocol runs over ``--remote-debugging-pipe`` (file descriptors 3 and 4,
NUL-separated JSON): no port, no WebSocket library, no third-party client. The
profile is a fresh temporary directory every time.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import io
import json
import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from lab import errors, files

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
)
WIDTH, HEIGHT = 1280, 900
NARROW = 390  # px: a phone held upright
WIDTHS = (WIDTH, NARROW)
MIN_FIGURE_TEXT = 10.0  # px: the smallest figure text a reader is shown
_FONT_SIZE = re.compile(rb'font-size="([0-9.]+)"')
MAX_SHOT_HEIGHT = 6000  # px: a long page is shot down to here
MIN_TEXT = 80  # characters of visible text below which a page counts as blank
TIMEOUT = 60.0
PAGE_LIMIT = 16 * files.MIB
_LOCAL_SCHEMES = ("file", "data", "about", "chrome-error")
_ID = re.compile(r'\sid="([^"]+)"')

_PROBE = """(() => {
  const images = [...document.images].map(i => ({src: i.currentSrc || i.src,
      ok: i.complete && i.naturalWidth > 0}));
  const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
  const root = document.documentElement;
  const cut = [...document.querySelectorAll('td, th')].map(c => c.innerText.trim())
      .filter(t => t.endsWith('\u2026'));
  const figures = [...document.images].map(i => ({src: i.currentSrc || i.src,
      natural: i.naturalWidth, shown: i.getBoundingClientRect().width}));
  return JSON.stringify({text: document.body ? document.body.innerText.trim().length : 0,
                         title: document.title, images, links, cut, figures,
                         scroll_width: root.scrollWidth, width: window.innerWidth});
})()"""


class BrowserMissing(errors.MissingExtra):
    """No Chromium: set CHROMIUM or install it (Debian: apt-get install chromium)."""


class BrowserFailed(errors.CheckFailed):
    """Chromium did not start, answer or finish in time."""


@dataclass
class PageResult:
    """What Chromium showed for one page."""

    page: str
    screenshot: Path
    problems: list[str] = field(default_factory=list)
    width: int = WIDTH
    text_length: int = 0
    images: int = 0
    links: int = 0


def find_chromium() -> str:
    """The Chromium binary: ``$CHROMIUM``, else ``chromium`` on PATH."""
    found = os.environ.get("CHROMIUM") or shutil.which("chromium")
    if not found:
        raise BrowserMissing("no chromium: set CHROMIUM or apt-get install chromium")
    return found


class _Pipe:
    """The DevTools protocol over Chromium's pipe: commands on fd 3, replies on fd 4."""

    def __init__(self, chromium: str, profile: Path) -> None:
        to_child, self._to_browser = os.pipe()
        self._from_browser, from_child = os.pipe()

        def wire() -> None:  # runs in the child before exec: the fds Chromium expects
            # Copies above 9 first, so neither end can be closed by the other's dup2.
            high_in = fcntl.fcntl(to_child, fcntl.F_DUPFD, 10)
            high_out = fcntl.fcntl(from_child, fcntl.F_DUPFD, 10)
            os.dup2(high_in, 3)
            os.dup2(high_out, 4)
            os.close(high_in)
            os.close(high_out)

        self.process = subprocess.Popen(
            [chromium, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            # close_fds would close 3 and 4 after wire(); the pipe's own ends are
            # non-inheritable (os.pipe), so nothing else of ours reaches Chromium.
            preexec_fn=wire, close_fds=False,
        )
        os.close(to_child)
        os.close(from_child)
        self._buffer = b""
        self._next = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None) -> dict[str, Any]:
        """Send one command and wait for its reply; events seen meanwhile are kept."""
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise BrowserFailed(f"chromium: {method}: {reply['error'].get('message')}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self.events.append(reply)

    def wait_for(self, method: str, session: str) -> None:
        """Wait until the event ``method`` arrives for ``session``."""
        seen = next((e for e in self.events
                     if e.get("method") == method and e.get("sessionId") == session), None)
        while seen is None:
            event = self._read()
            self.events.append(event)
            if event.get("method") == method and event.get("sessionId") == session:
                seen = event

    def _read(self) -> dict[str, Any]:
        deadline = time.monotonic() + TIMEOUT
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_browser], [], [], max(left, 0))
            if not ready:
                raise BrowserFailed(f"chromium did not answer within {TIMEOUT:.0f} s")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                tail = (self.process.stderr.read().decode("utf-8", "replace").strip()
                        if self.process.stderr else "")
                raise BrowserFailed("chromium closed its pipe: "
                                    + (tail.splitlines()[-1] if tail else "no output"))
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        parsed: dict[str, Any] = json.loads(message)
        return parsed

    def close(self) -> None:
        """Ask the browser to quit, then make sure it did."""
        with contextlib.suppress(OSError):  # already gone: nothing to ask
            os.write(self._to_browser, json.dumps(
                {"id": self._next + 1, "method": "Browser.close", "params": {}}).encode() + b"\0")
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        if self.process.stderr:
            self.process.stderr.close()


def check(site: Path, pages: Sequence[str], screenshots: Path,
          chromium: str | None = None, widths: Sequence[int] = (WIDTH,)) -> list[PageResult]:
    """Open each of ``pages`` (file names inside ``site``) in one headless Chromium at each
    of ``widths`` (px) and return what it showed, page by page, width by width;
    screenshots go to ``screenshots/<page>.png`` (``<page>-<width>.png`` at a width other
    than ``WIDTH``)."""
    binary = chromium or find_chromium()
    site = site.resolve()
    screenshots.mkdir(parents=True, exist_ok=True)
    results: list[PageResult] = []
    with tempfile.TemporaryDirectory(prefix="lab-chromium-") as profile:
        pipe = _Pipe(binary, Path(profile))
        try:
            for page in pages:
                for width in widths:
                    results.append(_visit(pipe, site, page, screenshots, width))
        finally:
            pipe.close()
    return results


def _visit(pipe: _Pipe, site: Path, page: str, screenshots: Path,
           width: int = WIDTH) -> PageResult:
    target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
        "sessionId"]
    for domain in ("Page", "Runtime", "Log", "Network"):
        pipe.send(f"{domain}.enable", session=session)
    pipe.send("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": width < WIDTH},
        session=session)
    start = len(pipe.events)
    path = site / page
    stem = Path(page).stem if width == WIDTH else f"{Path(page).stem}-{width}"
    result = PageResult(page=page, screenshot=screenshots / f"{stem}.png", width=width)
    if not path.is_file():
        result.problems.append(f"{page}: no such page in the site")
        pipe.send("Target.closeTarget", {"targetId": target})
        return result
    pipe.send("Page.navigate", {"url": path.as_uri()}, session=session)
    pipe.wait_for("Page.loadEventFired", session)
    probe = pipe.send("Runtime.evaluate", {"expression": _PROBE, "returnByValue": True},
                      session=session)
    seen = json.loads(probe["result"]["value"])
    metrics = pipe.send("Page.getLayoutMetrics", session=session)
    size = metrics.get("cssContentSize") or metrics.get("contentSize") or {}
    height = min(int(size.get("height", HEIGHT)), MAX_SHOT_HEIGHT)
    shot = pipe.send("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": width, "height": max(height, HEIGHT), "scale": 1}},
        session=session)
    data = base64.b64decode(shot["data"])
    result.screenshot.write_bytes(data)
    events = [e for e in pipe.events[start:] if e.get("sessionId") == session]
    pipe.send("Target.closeTarget", {"targetId": target})
    result.text_length, result.images, result.links = (
        int(seen["text"]), len(seen["images"]), len(seen["links"]))
    result.problems += _problems(page, seen, events, data, site)
    result.problems += layout_problems(f"{page} at {width} px", seen, site)
    return result


def layout_problems(where: str, seen: Mapping[str, Any], site: Path) -> list[str]:
    """What breaks the page for a reader at this width: the page wider than the window,
    a table cell cut off with "…", figure text drawn under ``MIN_FIGURE_TEXT`` px."""
    found: list[str] = []
    if int(seen["scroll_width"]) > int(seen["width"]):
        found.append(f"{where}: the page is {seen['scroll_width']} px wide in a "
                     f"{seen['width']} px window (horizontal overflow)")
    for text in seen["cut"]:
        found.append(f"{where}: a table cell ends in '…': {str(text)[-60:]}")
    for image in seen["figures"]:
        natural, shown = float(image["natural"] or 0), float(image["shown"] or 0)
        smallest = _smallest_font(str(image["src"]), site)
        if natural > 0 and smallest is not None and smallest * shown / natural < MIN_FIGURE_TEXT:
            found.append(f"{where}: figure text drawn at {smallest * shown / natural:.1f} px "
                         f"(under {MIN_FIGURE_TEXT:g}): {image['src']}")
    return found


def _smallest_font(src: str, site: Path) -> float | None:
    """The smallest ``font-size`` an SVG of the site declares, None for anything else."""
    parts = urlsplit(src)
    target = Path(unquote(parts.path))
    if parts.scheme != "file" or target.suffix != ".svg" or not target.is_relative_to(site) \
            or not target.is_file():
        return None
    sizes = [float(m) for m in _FONT_SIZE.findall(
        files.read_bytes(target, PAGE_LIMIT, f"figure {target.name}"))]
    return min(sizes) if sizes else None


def _problems(page: str, seen: dict[str, Any], events: list[dict[str, Any]], shot: bytes,
              site: Path) -> list[str]:
    found: list[str] = []
    if int(seen["text"]) < MIN_TEXT:
        found.append(f"{page}: blank page ({seen['text']} characters of text)")
    if _one_colour(shot):
        found.append(f"{page}: the screenshot is a single colour")
    for image in seen["images"]:
        if not image["ok"]:
            found.append(f"{page}: image did not load: {image['src']}")
    for href in seen["links"]:
        problem = _link_problem(page, href, site)
        if problem:
            found.append(problem)
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            detail = params.get("exceptionDetails", {})
            found.append(f"{page}: uncaught exception: {detail.get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in
                            params.get("args", []))
            found.append(f"{page}: console error: {args}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            found.append(f"{page}: console error: {entry.get('text')} {entry.get('url', '')}")
        elif method == "Network.loadingFailed":
            found.append(f"{page}: a load failed: {params.get('errorText')}")
        elif method == "Network.requestWillBeSent":
            url = str(params.get("request", {}).get("url", ""))
            if urlsplit(url).scheme not in _LOCAL_SCHEMES:
                found.append(f"{page}: a request left the machine: {url}")
    return found


def _one_colour(png: bytes) -> bool:
    try:
        from PIL import Image  # Pillow: with cairosvg in the book and dev extras
    except ImportError as exc:
        raise errors.MissingExtra(f"checking screenshots needs Pillow: {exc}") from exc
    with Image.open(io.BytesIO(png)) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1)
    return colours is not None


def _link_problem(page: str, href: str, site: Path) -> str | None:
    parts = urlsplit(href)
    if parts.scheme != "file":
        return None  # a link out of the site is the reader's choice, not a load
    target = Path(unquote(parts.path))
    if not target.is_relative_to(site):
        return f"{page}: link leaves the site folder: {href}"
    if not target.is_file():
        return f"{page}: broken link: {target.relative_to(site)}"
    if parts.fragment and target.suffix == ".html":
        text = files.read_bytes(target, PAGE_LIMIT, f"page {target.name}")
        ids = set(_ID.findall(text.decode("utf-8", "replace")))
        if unquote(parts.fragment) not in ids:
            return f"{page}: broken anchor: {target.relative_to(site)}#{parts.fragment}"
    return None
