"""The rendered book in a real browser (headless Chromium over the DevTools protocol).

Serves ``_build/html`` on 127.0.0.1 and opens every page at 1280 px, then lays it out again at
390 px, with every other host unreachable (as on an air-gapped cluster).  Checks: no JavaScript
error from the book's own code (scripts served from 127.0.0.1; CDN scripts are blocked on
purpose, and none is needed); every formula typeset by the book's own MathJax
(``book/_ext/cpbook_mathjax.py``), with no MathJax error node and no ``\\(``, ``\\[`` or ``$$``
left as text outside code; every image loads and has alt text; every explorer
(``cpbook.widgets.explorer``) shows another panel when a control changes, and the panel of the
original values when they come back; code and printout take at most 30 % of every chapter's
height at 1280 px (``CODE_SHARE_JS``; the shares are printed and saved as ``code_share.json``
beside the screenshots) and the visible code fits its box there (``CODE_WIDTH_JS``); no page
is wider than the viewport at either width; every
internal link and its fragment resolve.  Saves each chapter's first screen at both widths, and
each explorer at 1280 px, under ``_build/screenshots/`` (next to ``html/``).

Uses ``$CPBOOK_SITE_HTML`` if set, else ``_build/html`` when it is newer than every source of
the book (``.ci/run`` builds the book first), else builds the book into a temporary folder.
Needs ``chromium`` (Debian package): skipped without it, except under ``.ci/run``, which installs
it and sets ``CPBOOK_REQUIRE_BROWSER=1``.  Talks to it with tornado's websocket client.
"""

from __future__ import annotations

import datetime
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["_config.yml", "_toc.yml", "book", "notebooks", "_static"]
WIDTHS = (1280, 390)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _newest_source() -> float:
    times = []
    for name in SOURCES:
        p = ROOT / name
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
        times += [f.stat().st_mtime for f in files if ".ipynb_checkpoints" not in f.parts]
    return max(times)


@pytest.fixture(scope="module")
def site() -> Path:
    """The built HTML: ``$CPBOOK_SITE_HTML``, or ``_build/html`` if fresh, else a new build."""
    if os.environ.get("CPBOOK_SITE_HTML"):
        return Path(os.environ["CPBOOK_SITE_HTML"])
    html = ROOT / "_build" / "html"
    if (html / "index.html").exists():
        built = max(f.stat().st_mtime for f in html.rglob("*") if f.is_file())
        if built >= _newest_source():
            return html
    out = Path(tempfile.mkdtemp(prefix="cpbook-site-"))
    subprocess.run(
        ["jupyter-book", "build", str(ROOT), "--path-output", str(out), "--keep-going"],
        check=True,
        capture_output=True,
    )
    return out / "_build" / "html"


@pytest.fixture(scope="module")
def server(site: Path):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Keep-alive, and the theme's assets cached across pages (the site does not change)."""

    protocol_version = "HTTP/1.1"

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "max-age=3600")
        super().end_headers()

    def log_message(self, *args) -> None:
        pass


def pages(site: Path) -> list[str]:
    """Every HTML page of the book, relative to the site root."""
    skip = {"_static", "_sources", "_images", "jupyter_execute"}
    return sorted(
        p.relative_to(site).as_posix()
        for p in site.rglob("*.html")
        if not skip & set(p.relative_to(site).parts)
    )


# ---- a minimal DevTools-protocol client ----------------------------------------------------
class Browser:
    """Headless Chromium with one page, driven over the DevTools websocket (tornado)."""

    def __init__(self, profile: Path) -> None:
        from tornado.ioloop import IOLoop

        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--hide-scrollbars",
                # every host but the local server fails at once: no waiting on the CDN
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        url = None
        for line in self.proc.stderr:
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise RuntimeError("chromium did not start its DevTools endpoint")
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()
        self.loop = IOLoop()
        self.events: list[dict] = []
        self._id = 0
        self._pending = None
        self.ws = self.loop.run_sync(lambda: _connect(url))
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)

    def call(self, method: str, session: bool = False, timeout: float = 30, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self.ws.write_message(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _read(self, deadline: float) -> dict:
        """The next message; a read that times out stays pending for the next call."""
        from tornado import gen

        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no message from chromium in time")
        if self._pending is None:
            self._pending = self.ws.read_message()
        raw = self.loop.run_sync(
            lambda: gen.with_timeout(datetime.timedelta(seconds=left), self._pending)
        )
        self._pending = None
        if raw is None:
            raise RuntimeError("chromium closed the DevTools connection")
        return json.loads(raw)

    def wait_event(self, method: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        while True:
            e = self._read(deadline)
            if e.get("method") == method:
                return e
            self.events.append(e)

    def resize(self, width: int, height: int = 900) -> None:
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=width < 600,
        )

    def open(self, url: str, width: int) -> None:
        self.resize(width)
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")

    def js(self, expression: str):
        r = self.call(
            "Runtime.evaluate",
            session=True,
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
        )
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def drain(self, seconds: float = 0.05) -> None:
        """Collect the events that arrive within ``seconds``."""
        deadline = time.monotonic() + seconds
        try:
            while True:
                self.events.append(self._read(deadline))
        except TimeoutError:
            pass

    def screenshot(self, path: Path, selector: str | None = None, index: int = 0) -> None:
        """The viewport, or the ``index``-th element matching ``selector``."""
        import base64

        params: dict = {"format": "png"}
        if selector:
            box = self.js(
                f"(() => {{const e = document.querySelectorAll({json.dumps(selector)})[{index}];"
                "e.scrollIntoView({block: 'start'}); const r = e.getBoundingClientRect();"
                "return {x: r.left + scrollX, y: r.top + scrollY, width: r.width,"
                "height: Math.min(r.height, innerHeight - r.top), scale: 1};})()"
            )
            params["clip"] = box
        data = self.call("Page.captureScreenshot", session=True, **params)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.loop.close()


async def _connect(url: str):
    from tornado.websocket import websocket_connect

    return await websocket_connect(url, max_message_size=64 * 2**20)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None:
        reason = "chromium is not installed (apt-get install chromium; .ci/run does this)"
        if os.environ.get("CPBOOK_REQUIRE_BROWSER"):
            pytest.fail(reason)
        pytest.skip(reason)
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


# ---- what each page must satisfy ---------------------------------------------------------
IMAGES_JS = """Array.from(document.images).map(i => ({src: i.currentSrc.slice(0, 80),
  ok: i.complete && i.naturalWidth > 0, alt: (i.getAttribute('alt') || '').trim(),
  hidden: !!i.closest('[hidden]')}))"""

WIDTH_JS = "[document.documentElement.scrollWidth, window.innerWidth]"
# At phone width: chapter figures that do not open at full size on a tap, and tables wider
# than the column without a scroll container that shows a cue (_static/cpbook.css).
PHONE_JS = r"""(() => {
  const bad = [];
  document.querySelectorAll('div.cell_output img, figure img').forEach(img => {
    if (img.closest('.cpx') || img.src.startsWith('data:')) return;
    const a = img.closest('a.cpbook-zoom');
    if (!a || a.href !== img.src) bad.push('figure does not open at full size: ' +
                                           img.src.split('/').pop());
  });
  document.querySelectorAll('article table').forEach(t => {
    const box = t.parentElement;
    if (t.scrollWidth <= box.clientWidth + 1) return;
    const cs = getComputedStyle(box);
    if (!/auto|scroll/.test(cs.overflowX) || cs.backgroundImage === 'none')
      bad.push('wide table without a scroll cue: ' + (t.textContent || '').trim().slice(0, 30));
  });
  // every state of every explorer, not only the one on show: its readout wraps inside the
  // explorer's box (a table may scroll inside itself) instead of running past the page's edge
  document.querySelectorAll('.cpx').forEach(box => {
    const panels = Array.from(box.querySelectorAll('.cpx-panel'));
    const was = panels.map(p => p.hidden);
    const wide = [];
    panels.forEach((p, i) => {
      panels.forEach((q, j) => { q.hidden = j !== i; });
      if (box.scrollWidth > box.clientWidth + 1) wide.push(i);
    });
    panels.forEach((p, i) => { p.hidden = was[i]; });
    if (box.scrollWidth > box.clientWidth + 1) wide.push('controls');
    if (wide.length) bad.push(`explorer ${box.id}: ${wide.length} of ${panels.length} ` +
                              `readouts wider than the page, e.g. ${wide.slice(0, 3)}`);
  });
  return bad;
})()"""
# At 1280 px: visible code (inputs not folded away by hide-input) fits its box, no sideways scroll.
CODE_WIDTH_JS = r"""(() => Array.from(document.querySelectorAll('div.cell_input pre'))
  .filter(pre => pre.offsetParent !== null && !pre.closest('details:not([open])'))
  .filter(pre => pre.scrollWidth > pre.clientWidth + 1)
  .map(pre => (pre.textContent || '').split('\n')
    .reduce((a, l) => (l.length > a.length ? l : a), '').trim().slice(0, 60)))()"""
# WCAG 2 contrast of the small text readers squint at: code and text in explorer readouts, and
# figure and table captions, against the first opaque background behind each (AA: >= 4.5);
# and captions lighter than the body's weight (reported with ratio 0).
CONTRAST_JS = r"""(() => {
  const rgb = c => (c.match(/[\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => [r, g, b].map(v => v / 255)
    .map(v => v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4)
    .reduce((a, v, i) => a + v * [0.2126, 0.7152, 0.0722][i], 0);
  const back = e => {
    for (; e; e = e.parentElement) {
      const c = rgb(getComputedStyle(e).backgroundColor);
      if (c.length === 3 || c[3] > 0.5) return c.slice(0, 3);
    }
    return rgb(getComputedStyle(document.body).backgroundColor).slice(0, 3);
  };
  const sel = '.cpx code, .cpx pre, .cpx-caption, .cpx output, figcaption, caption, ' +
              '.caption-text';
  return Array.from(document.querySelectorAll(sel))
    .filter(e => e.offsetParent !== null && e.textContent.trim())
    .map(e => {
      const [a, b] = [lum(rgb(getComputedStyle(e).color)), lum(back(e))];
      return {what: e.tagName.toLowerCase() + '.' + (e.className || '').toString().split(' ')[0],
              text: e.textContent.trim().slice(0, 30),
              ratio: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)};
    })
    .filter(r => r.ratio < 4.5)
    .concat(Array.from(document.querySelectorAll('figcaption p, caption, .caption-text'))
      .filter(e => e.offsetParent !== null && +getComputedStyle(e).fontWeight < 400)
      .map(e => ({what: 'light caption', text: e.textContent.trim().slice(0, 30), ratio: 0})));
})()"""
# Share of the article's height taken by code a reader sees and text it prints: visible code-cell
# inputs and the plain-text printouts of cell outputs (figures, tables and explorers are what the
# code is for, and do not count; a collapsed hide-input cell counts only as its toggle's height,
# which is not code).
CODE_SHARE_JS = r"""(() => {
  const art = document.querySelector('article.bd-article') || document.querySelector('main');
  // inside a closed <details> (a collapsed hide-input / hide-output cell) an element keeps its
  // layout box in Chromium although the page shows only the summary line: count it as 0
  const shut = e => {
    for (let d = e.closest('details'); d; d = d.parentElement && d.parentElement.closest('details'))
      if (!d.open && !e.closest('summary')) return true;
    return false;
  };
  const h = e => e.offsetParent === null || shut(e) ? 0 : e.getBoundingClientRect().height;
  const inputs = Array.from(art.querySelectorAll('div.cell_input')).reduce((a, e) => a + h(e), 0);
  const printed = Array.from(art.querySelectorAll('div.cell_output pre'))
    .reduce((a, e) => a + h(e), 0);
  return {article: art.getBoundingClientRect().height, code: inputs, printed: printed};
})()"""
CODE_SHARE_MAX = 0.30
THEME_JS = "document.documentElement.dataset.theme = %r; document.documentElement.dataset.mode = %r"
# After MathJax's first typeset: its script URLs, the typeset formulas, MathJax error nodes, and
# TeX delimiters left as text outside code (a formula that did not render).
MATH_JS = r"""(async () => {
  const mj = window.MathJax;
  if (mj && mj.startup && mj.startup.promise) await mj.startup.promise;
  if (!document.body) return {src: [], typeset: 0, errors: 0, raw: []};  // a redirect page
  const prose = document.body.cloneNode(true);
  prose.querySelectorAll('pre, code, script, style, textarea, mjx-container')
       .forEach(e => e.remove());
  const text = prose.textContent;
  return {src: Array.from(document.scripts).map(e => e.src).filter(u => /mathjax/i.test(u)),
          typeset: document.querySelectorAll('mjx-container').length,
          errors: document.querySelectorAll('mjx-merror, [data-mjx-error]').length,
          raw: ['\\(', '\\[', '$$'].filter(t => text.includes(t))};
})()"""

# For every explorer and every control: does some other value show another panel?
EXPLORERS_JS = """Array.from(document.querySelectorAll('.cpx')).map(root => {
  const visible = () => Array.from(root.querySelectorAll('.cpx-panel'))
                             .findIndex(p => !p.hidden);
  const ctrls = Array.from(root.querySelectorAll('[data-cpx-control]'));
  const map = JSON.parse(root.getAttribute('data-cpx-map'));
  const start = visible();
  const result = {id: root.id, ready: root.getAttribute('data-cpx-ready'), start: start,
                  controls: {}};
  for (const c of ctrls) {
    const orig = c.value;
    const n = c.tagName === 'SELECT' ? c.options.length : (+c.max + 1);
    const changed = [];
    for (let v = 0; v < n; v++) {
      if (String(v) === orig) continue;
      c.value = String(v);
      c.dispatchEvent(new Event(c.tagName === 'SELECT' ? 'change' : 'input'));
      const out = c.parentNode.querySelector('output');
      const key = ctrls.map(x => x.value).join('.');
      const names = JSON.parse(c.getAttribute('data-cpx-names'));
      changed.push({value: v, panel: visible(), want: map[key],
                    label: out ? out.textContent : c.options[c.selectedIndex].textContent,
                    name: names[v]});
    }
    c.value = orig;
    c.dispatchEvent(new Event('change'));
    result.controls[c.getAttribute('data-cpx-control')] = changed;
  }
  result.back = visible();
  return result;
})"""


def own_errors(events: list[dict], origin: str) -> list[str]:
    """JavaScript exceptions and console errors raised by scripts the site serves itself."""
    errors = []
    for e in events:
        if e.get("method") == "Runtime.exceptionThrown":
            d = e["params"]["exceptionDetails"]
            frames = (d.get("stackTrace") or {}).get("callFrames") or []
            urls = [f.get("url", "") for f in frames] or [d.get("url", "")]
            if any(u.startswith(origin) or u == "" for u in urls[:1]):
                text = d.get("exception", {}).get("description") or d.get("text")
                errors.append(f"{urls[0] or 'inline'}: {text}")
        elif e.get("method") == "Log.entryAdded":
            entry = e["params"]["entry"]
            if entry["level"] == "error" and entry.get("source") == "javascript":
                if entry.get("url", "").startswith(origin):
                    errors.append(f"{entry.get('url')}: {entry['text']}")
    return errors


def test_every_page_in_chromium(browser: Browser, site: Path, server: str):
    t0 = time.monotonic()
    problems: list[str] = []
    shots = site.parent / "screenshots"
    shots.mkdir(exist_ok=True)
    explorers = formulas = 0
    shares: dict[str, float] = {}
    all_pages = pages(site)
    assert any(p.startswith("notebooks/") for p in all_pages)
    wide, narrow = WIDTHS
    for page in all_pages:
        browser.open(urljoin(server, page), wide)
        browser.drain()
        problems += [f"{page}: JS error {e}" for e in own_errors(browser.events, server)]
        math = browser.js(MATH_JS)
        formulas += math["typeset"]
        problems += [
            f"{page}: MathJax from {u} (not the book)"
            for u in math["src"]
            if not u.startswith(server)
        ]
        problems += [f"{page}: formula left as TeX text ({t})" for t in math["raw"]]
        if math["errors"]:
            problems.append(f"{page}: {math['errors']} MathJax error node(s)")
        for img in browser.js(IMAGES_JS):
            if not img["alt"]:
                problems.append(f"{page}: image without alt text ({img['src']})")
            if not img["ok"]:
                problems.append(f"{page}: image did not load ({img['src']})")
        chapter = page.startswith("notebooks/")
        if chapter:
            m = browser.js(CODE_SHARE_JS)
            shares[Path(page).stem] = share = (m["code"] + m["printed"]) / m["article"]
            problems += [
                f"{page}: visible code wider than its box at {wide}px: {line!r}"
                for line in browser.js(CODE_WIDTH_JS)
            ]
            if share > CODE_SHARE_MAX:
                problems.append(
                    f"{page}: code and printout take {share:.0%} of the page's height at "
                    f"{wide}px (at most {CODE_SHARE_MAX:.0%})"
                )
        for theme in ("dark", "light"):
            browser.js(THEME_JS % (theme, theme))
            low = browser.js(CONTRAST_JS)
            problems += [
                f"{page} ({theme}): contrast {r['ratio']:.2f} < 4.5 for {r['what']} {r['text']!r}"
                for r in low[:5]
            ]
            if chapter and theme == "dark":
                browser.screenshot(shots / f"{Path(page).stem}-{wide}-dark.png")
        if chapter:
            browser.screenshot(shots / f"{Path(page).stem}-{wide}.png")
        for i, ex in enumerate(browser.js(EXPLORERS_JS)):
            explorers += 1
            problems += explorer_problems(page, ex)
            browser.screenshot(shots / f"{Path(page).stem}-explorer{i}-{wide}.png", ".cpx", i)
        # the same page, re-laid out at each width (CSS media queries apply without a reload)
        for width in WIDTHS:
            browser.resize(width)
            scroll, inner = browser.js(WIDTH_JS)
            if scroll > inner:
                problems.append(f"{page} at {width}px: page is {scroll}px wide")
            if width < 600:
                problems += [f"{page} at {width}px: {p}" for p in browser.js(PHONE_JS)]
        if chapter:
            browser.screenshot(shots / f"{Path(page).stem}-{narrow}.png")
    (shots / "code_share.json").write_text(json.dumps(shares, indent=1) + "\n")
    print("code share at 1280px: " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()))
    assert not problems, "\n".join(problems)
    assert explorers >= 3, f"only {explorers} explorers in the book"
    assert formulas >= 50, f"only {formulas} formulas typeset in the book"
    print(
        f"{len(all_pages)} pages, {explorers} explorers, {formulas} formulas typeset offline, "
        f"{time.monotonic() - t0:.0f} s"
    )


def explorer_problems(page: str, ex: dict) -> list[str]:
    where = f"{page}: explorer {ex['id']}"
    if ex["ready"] != "1":
        return [f"{where}: its script did not run"]
    out = []
    if not ex["controls"]:
        out.append(f"{where}: no controls")
    for name, changes in ex["controls"].items():
        if changes and all(c["panel"] == ex["start"] for c in changes):
            out.append(f"{where}: control {name} never changes the output")
        if any(c["panel"] < 0 for c in changes):
            out.append(f"{where}: control {name} leaves no panel visible")
        if any(c["panel"] != c["want"] for c in changes):
            out.append(f"{where}: control {name} shows a panel of other values")
        if any(c["label"] != c["name"] for c in changes):
            out.append(f"{where}: control {name} reads a value it does not hold")
    if ex["back"] != ex["start"]:
        out.append(f"{where}: restoring the controls does not restore the panel")
    return out


def test_internal_links_resolve(site: Path):
    ids: dict[Path, set[str]] = {}

    def ids_of(path: Path) -> set[str]:
        if path not in ids:
            text = path.read_text(errors="replace")
            ids[path] = set(re.findall(r'\bid="([^"]+)"', text)) | set(
                re.findall(r'\bname="([^"]+)"', text)
            )
        return ids[path]

    broken = []
    for page in pages(site):
        path = site / page
        for href in re.findall(r'<a\b[^>]*\bhref="([^"]+)"', path.read_text(errors="replace")):
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:")):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page}: {href} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                if unquote(parts.fragment) not in ids_of(target):
                    broken.append(f"{page}: {href} (no such anchor)")
    assert not broken, "\n".join(broken)
