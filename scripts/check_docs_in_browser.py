"""Open every page of the built docs in headless Chromium, 1280 px wide, and fail on what a reader would hit.

Usage (the nox session ``docs`` runs both, after ``mkdocs build --strict``)::

    check_docs_in_browser.py SITE_DIR [--screenshots DIR] [--width 1280] [--markdown FILE ...]
    check_docs_in_browser.py --self-test        # proves the check fails on a page with the defects below

A page fails when, at that window width:

* a table or a code block is wider than the page's content column (it scrolls or sticks out);
* text is cut off or spills over: past the edge of a box that clips it, past its table cell (over the
  next cell), or past the content column. Measured on the text's own line boxes: where a browser breaks
  a line (it may break `bf16-true` after its hyphen with one font and not with another) is not checked,
  only whether every line shown lies where it can be read;
* a code block has a line longer than 100 columns (``--max-columns``), also in ``--markdown`` files
  (the README, which is not part of the site);
* the browser console has an error (a script error, a resource that failed to load);
* an internal link, anchor or asset is broken (HTTP status other than 200, a ``#fragment`` that is not
  an ``id`` on its page);
* the page loads anything from another host: the docs must work offline and on air-gapped clusters;
* opened from disk (``file://``, the site as a downloaded folder), the page does not load, the console
  has an error, a link or asset names a file that is missing or a folder (which a browser shows as a
  file listing, not as the page), or, on the home page, search finds nothing. Browsers block
  fetch and XHR on ``file://``, so this is where a site built without Material's ``offline`` plugin
  fails: its search cannot load its index.

The site is served on 127.0.0.1 under the path of ``site_url`` (as GitHub Pages serves it), and a missing
path gets ``404.html`` with status 404, so the 404 page is checked where readers meet it: at a deep URL
(and not from disk, where no server shows it: its links are absolute under ``site_url``'s path).
Chromium is Debian's ``chromium`` and ``chromium-driver``, driven by selenium with explicit paths, so
selenium never looks for (or downloads) a browser of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]

# Runs in the page: the content column, every table and code block that needs more width than it has,
# every link and asset, and every id (for #fragment links). Theme-agnostic enough to measure the old
# theme for comparison: Material's `.md-content__inner`, else the first `[role=main]`, `main`, `article`.
MEASURE_JS = r"""
const column = ['.md-content__inner', '[role=main]', 'main', 'article']
  .map((selector) => document.querySelector(selector)).find(Boolean) || document.body;
const style = getComputedStyle(column);
const colRect = column.getBoundingClientRect();
const colLeft = colRect.left + parseFloat(style.paddingLeft);
const colRight = colRect.right - parseFloat(style.paddingRight);
const label = (el) => {
  const text = (el.tagName === 'TABLE' ? (el.querySelector('tr') || el).innerText : el.innerText) || '';
  return text.replace(/\s+/g, ' ').trim().slice(0, 70);
};
const heading = (el) => {
  let node = el, found = '';
  while (node && node !== column && !found) {
    let prev = node.previousElementSibling;
    while (prev && !/^H[1-6]$/.test(prev.tagName)) prev = prev.previousElementSibling;
    if (prev) found = prev.innerText.replace(/\s*¶\s*$/, '').trim();
    node = node.parentElement;
  }
  return found;
};
const overflows = [];
const blocks = [...column.querySelectorAll('table')].map((el) => ['table', el, el])
  .concat([...column.querySelectorAll('pre')].map((el) => ['code block', el, el.querySelector('code') || el]));
for (const [kind, outer, inner] of blocks) {
  // Too wide: the block, or anything between it and the column, scrolls or clips sideways, or the block
  // itself sticks out of the column. (Wrappers may reach past the column by design: Material's table
  // wrapper has negative margins; only what is inside them counts.)
  const rect = inner.getBoundingClientRect();
  let needed = Math.max(inner.scrollWidth, rect.width), tooWide = rect.right > colRight + 1 || rect.left < colLeft - 1;
  for (let node = inner; node && node !== column; node = node.parentElement) {
    needed = Math.max(needed, node.scrollWidth);
    if (node.scrollWidth > node.clientWidth + 1) tooWide = true;
  }
  if (!tooWide) continue;
  const entry = {kind, label: label(outer), heading: heading(outer), needed: Math.round(needed),
                 available: Math.round(colRight - colLeft)};
  if (kind === 'code block') entry.columns = Math.max(...outer.innerText.split('\n').map((l) => l.length));
  overflows.push(entry);
}
// Cut off or spilling over, measured on the text itself (each text node's line boxes), so where a browser
// breaks a line (after the hyphen of `bf16-true`, with one font and not another) does not matter, only
// whether every line it shows can be read: text past the edge of a box that clips it (overflow hidden or
// clip), text past its table cell's edge (written over the next cell), text past the column's edges. Text
// inside a box that scrolls is the check above's (a table or code block that scrolls is too wide).
const spills = [];
const reported = new Set();
const range = document.createRange();
const walker = document.createTreeWalker(column, NodeFilter.SHOW_TEXT);
const outside = (r, box) => r.right > box.right + 1 || r.left < box.left - 1 || r.bottom > box.bottom + 1 ||
  r.top < box.top - 1;
const paddingBox = (el) => {
  const r = el.getBoundingClientRect(), s = getComputedStyle(el);
  return {left: r.left + parseFloat(s.borderLeftWidth), top: r.top + parseFloat(s.borderTopWidth),
          right: r.left + parseFloat(s.borderLeftWidth) + el.clientWidth,
          bottom: r.top + parseFloat(s.borderTopWidth) + el.clientHeight};
};
const spill = (kind, box, text) => {
  if (reported.has(box)) return;
  reported.add(box);
  const where = box.closest('table, pre') || box;
  spills.push({kind, text: text.replace(/\s+/g, ' ').trim().slice(0, 50), heading: heading(where)});
};
for (let text = walker.nextNode(); text; text = walker.nextNode()) {
  if (!text.data.trim()) continue;
  range.selectNodeContents(text);
  const rects = [...range.getClientRects()].filter((r) => r.width > 0 && r.height > 0);
  if (!rects.length) continue;
  let scrolls = false;
  for (let el = text.parentElement; el && el !== column; el = el.parentElement) {
    const s = getComputedStyle(el);
    const overflow = [s.overflowX, s.overflowY];
    if (overflow.some((o) => o === 'auto' || o === 'scroll')) { scrolls = true; break; }
    if (overflow.some((o) => o === 'hidden' || o === 'clip') && rects.some((r) => outside(r, paddingBox(el)))) {
      spill('cut off by its box', el, text.data);
    }
    if (/^T[DH]$/.test(el.tagName) && rects.some((r) => outside(r, el.getBoundingClientRect()))) {
      spill('spills out of its table cell', el, text.data);
    }
  }
  const edges = {left: colLeft, right: colRight, top: -Infinity, bottom: Infinity};
  if (!scrolls && rects.some((r) => outside(r, edges))) {
    spill('reaches past the content column', text.parentElement, text.data);
  }
}
const longest = [...column.querySelectorAll('pre')].map((el) => ({
  label: label(el), heading: heading(el),
  columns: Math.max(...el.innerText.replace(/\n$/, '').split('\n').map((l) => l.length))}));
// A link inside a code block (a cross-reference that autorefs or a highlighter made of output text): the
// block is meant to show text as a terminal prints it.
const linkedCode = [...column.querySelectorAll('pre a[href]')].map((a) => ({
  text: a.innerText.replace(/\s+/g, ' ').trim().slice(0, 40), heading: heading(a.closest('pre'))}));
// The page's heading and its menu entry (Material's primary navigation marks the current page's link):
// a reader who clicks "The problem and the fix" should land on a page headed that way.
const h1 = column.querySelector('h1');
const active = document.querySelector('.md-nav--primary a.md-nav__link--active');
const titles = {heading: h1 ? h1.innerText.replace(/\s*¶\s*$/, '').replace(/\s+/g, ' ').trim() : null,
                menu: active ? active.innerText.replace(/\s+/g, ' ').trim() : null};
const refs = [];
for (const [selector, attr] of [['a[href]', 'href'], ['link[href]', 'href'], ['script[src]', 'src'],
                                ['img[src]', 'src'], ['source[src]', 'src'], ['iframe[src]', 'src']]) {
  for (const el of document.querySelectorAll(selector)) refs.push({tag: el.tagName.toLowerCase(), url: el[attr]});
}
return {
  url: location.href, title: document.title, innerWidth: window.innerWidth,
  column: {selector: column.className || column.tagName, width: Math.round(colRight - colLeft)},
  height: document.documentElement.scrollHeight, overflows, spills, longest, refs, linkedCode, titles,
  ids: [...document.querySelectorAll('[id], a[name]')].map((el) => el.id || el.getAttribute('name')),
};
"""


@dataclass
class Report:
    """What the check found, page by page; `failures` is what makes it exit 1."""

    failures: list[str] = field(default_factory=list)
    pages: list[dict] = field(default_factory=list)
    from_disk: list[str] = field(default_factory=list)
    """The pages opened from disk (file://), besides `pages`, which the server showed."""

    def fail(self, page: str, message: str) -> None:
        self.failures.append(f"{page}: {message}")


# --- the site, served as a host would serve it -----------------------------------------------------------


def site_prefix(site_dir: Path) -> str:
    """The path part of `site_url`, read from the built site: 404.html uses it for every link."""
    sitemap = site_dir / "sitemap.xml"
    if sitemap.exists():
        match = re.search(r"<loc>([^<]+)</loc>", sitemap.read_text())
        if match and match.group(1).startswith(("http://", "https://")):
            path = urllib.parse.urlsplit(match.group(1)).path
            # The first <loc> is the home page: the site's root.
            return path if path.endswith("/") else path.rsplit("/", 1)[0] + "/"
    return "/"


class SiteHandler(http.server.SimpleHTTPRequestHandler):
    """Serves SITE_DIR under PREFIX; anything else, or a missing file, is 404.html with status 404."""

    prefix = "/"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def handle(self) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the browser moved on to the next page
            super().handle()

    def send_head(self) -> object:
        path = urllib.parse.urlsplit(self.path).path
        if path.startswith(self.prefix):
            self.path = "/" + self.path[len(self.prefix) :]
            target = Path(self.translate_path(self.path))
            if target.is_dir() and not path.endswith("/"):
                self.send_response(301)  # as hosts do; the base class would drop the prefix
                self.send_header("Location", path + "/")
                self.end_headers()
                return None
            if target.is_file() or (target / "index.html").is_file():
                return super().send_head()  # also redirects a folder without its slash, as hosts do
        missing = Path(self.directory, "404.html")
        body = missing.read_bytes() if missing.exists() else b"not found"
        self.send_response(404)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        return None


@contextlib.contextmanager
def serve(site_dir: Path, prefix: str | None = None) -> Iterator[str]:
    """Serve the site on 127.0.0.1 (a free port) under `prefix` (default: site_url's path); yield its URL."""
    prefix = site_prefix(site_dir) if prefix is None else "/" + prefix.strip("/") + "/" * bool(prefix.strip("/"))
    handler = functools.partial(type("Handler", (SiteHandler,), {"prefix": prefix}), directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}{prefix}"
    finally:
        server.shutdown()
        server.server_close()


def site_pages(site_dir: Path) -> list[str]:
    """Every HTML page of the site, as paths relative to its root (`index.html` pages as their folder)."""
    pages = []
    for html in sorted(site_dir.rglob("*.html")):
        relative = html.relative_to(site_dir).as_posix()
        if relative == "404.html":
            continue
        pages.append(relative[: -len("index.html")] if relative.endswith("index.html") else relative)
    return pages


# --- the browser -------------------------------------------------------------------------------------------


def find_tool(names: list[str], env: str) -> str:
    for name in [os.environ.get(env, ""), *names]:
        if name and (path := shutil.which(name)):
            return path
    raise SystemExit(
        f"check_docs_in_browser: none of {', '.join(names)} found (set {env}); on Debian: apt-get install -y "
        "--no-install-recommends chromium chromium-driver"
    )


@contextlib.contextmanager
def chromium(width: int) -> Iterator[object]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as error:
        raise SystemExit(f"check_docs_in_browser: {error}; pip install selenium (the docs extra has it)") from None
    options = webdriver.ChromeOptions()
    options.binary_location = find_tool(["chromium", "chromium-browser", "google-chrome"], "CHROMIUM")
    profile = tempfile.mkdtemp(prefix="docs-check-chromium-")
    for flag in [*CHROMIUM_FLAGS, f"--window-size={width},1000", f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    service = Service(executable_path=find_tool(["chromedriver"], "CHROMEDRIVER"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        # The layout viewport exactly `width` px wide, whatever the window decorations take.
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": 1000, "deviceScaleFactor": 1, "mobile": False},
        )
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def network_events(driver: object) -> list[dict]:
    events = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"].startswith("Network."):
            events.append(message)
    return events


def load(driver: object, url: str) -> tuple[dict, list[dict], list[dict]]:
    """Open `url`, wait until it has settled, and return (measurements, console entries, network events)."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get_log("browser")
    driver.get_log("performance")
    driver.get(url)
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
    # Material's search worker and its scripts run after `load`: give them a moment to fail, if they do.
    driver.execute_async_script("const done = arguments[arguments.length - 1]; setTimeout(done, 300);")
    measured = driver.execute_script(MEASURE_JS)
    return measured, driver.get_log("browser"), network_events(driver)


def screenshot(driver: object, path: Path, width: int, height: int) -> None:
    import base64

    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": min(height, 8000), "scale": 1},
        },
    )
    path.write_bytes(base64.b64decode(shot["data"]))


# --- the checks --------------------------------------------------------------------------------------------

SEARCH_SECONDS = 10.0
"""How long search from disk may take to show results: about 1 s here (Material's worker builds its
index in the shim's iframe); a search that never gets its index shows "Initializing search" forever."""


def check_page(
    report: Report,
    page: str,
    measured: dict,
    console: list[dict],
    events: list[dict],
    base: str,
    max_columns: int,
    expect_status: int = 200,
) -> None:
    report.pages.append({"page": page, **{k: measured[k] for k in ("column", "overflows", "innerWidth")}})
    for item in measured["overflows"]:
        where = f" under '{item['heading']}'" if item["heading"] else ""
        extra = f", {item['columns']} columns" if "columns" in item else ""
        report.fail(
            page,
            f"{item['kind']}{where} is wider than the content column ({item['needed']} px needed, "
            f"{item['available']} px there{extra}): '{item['label']}'",
        )
    for item in measured["spills"]:
        where = f" under '{item['heading']}'" if item["heading"] else ""
        report.fail(page, f"text{where} {item['kind']}, unreadable: '{item['text']}'")
    for block in measured["longest"]:
        if block["columns"] > max_columns:
            where = f" under '{block['heading']}'" if block["heading"] else ""
            report.fail(page, f"code block{where} has a {block['columns']}-column line (at most {max_columns})")
    for item in measured.get("linkedCode", []):
        where = f" under '{item['heading']}'" if item["heading"] else ""
        report.fail(page, f"code block{where} has a link on '{item['text']}': output text rendered as a link")
    titles = measured.get("titles") or {}
    if titles.get("heading") and titles.get("menu") and not titles["heading"].startswith(titles["menu"]):
        report.fail(page, f"heading '{titles['heading']}' does not start with its menu entry '{titles['menu']}'")
    for entry in console:
        if entry.get("level") != "SEVERE":
            continue
        text = entry.get("message", "")
        if expect_status != 200 and measured["url"].split("#")[0] in text and "404" in text:
            continue  # the 404 page's own status, which is the point of it
        report.fail(page, f"console error: {text}")
    origin = urllib.parse.urlsplit(base)
    requested = {}
    for event in events:
        params = event["params"]
        if event["method"] == "Network.requestWillBeSent":
            requested[params["requestId"]] = params["request"]["url"]
            url = urllib.parse.urlsplit(params["request"]["url"])
            if url.scheme in ("http", "https", "ws", "wss") and url.netloc != origin.netloc:
                report.fail(page, f"loads {params['request']['url']} from another host (the docs must work offline)")
        elif event["method"] == "Network.responseReceived":
            status, url = params["response"]["status"], params["response"]["url"]
            wanted = expect_status if url.split("#")[0] == measured["url"].split("#")[0] else 200
            if urllib.parse.urlsplit(url).netloc == origin.netloc and status not in (wanted, 304):
                report.fail(page, f"{url} answered HTTP {status}")
        elif event["method"] == "Network.loadingFailed" and not params.get("canceled"):
            url = requested.get(params["requestId"], params["requestId"])
            report.fail(page, f"{url} failed to load: {params.get('errorText')}")


def check_links(report: Report, base: str, refs: dict[str, list[dict]], ids: dict[str, set[str]]) -> None:
    """Every same-site link and asset answers 200; every #fragment is an id on its page."""
    statuses: dict[str, int] = {}
    for page, page_refs in refs.items():
        seen = set()
        for ref in page_refs:
            url = ref["url"]
            if not url.startswith(("http://", "https://")) or urllib.parse.urlsplit(url).netloc != (
                urllib.parse.urlsplit(base).netloc
            ):
                continue  # other hosts' links are for readers to follow, not for the site to load
            target, _, fragment = url.partition("#")
            if (target, fragment) in seen:
                continue
            seen.add((target, fragment))
            if target not in statuses:
                try:
                    with urllib.request.urlopen(target, timeout=30) as response:
                        statuses[target] = response.status
                except urllib.error.HTTPError as error:
                    statuses[target] = error.code
            if statuses[target] != 200:
                report.fail(page, f"broken {ref['tag']} to {url} (HTTP {statuses[target]})")
            elif fragment and target in ids and urllib.parse.unquote(fragment) not in ids[target]:
                report.fail(page, f"broken {ref['tag']} to {url}: no id '{urllib.parse.unquote(fragment)}' there")


def page_file(site_dir: Path, page: str) -> Path:
    """The file a page name of `site_pages` stands for: a folder's page is its index.html."""
    return site_dir / (page + "index.html" if page == "" or page.endswith("/") else page)


def search_word(site_dir: Path) -> str | None:
    """A word that search must find: the longest word of the home page's title, from the search index."""
    index = site_dir / "search" / "search_index.json"
    if not index.exists():
        return None
    docs = json.loads(index.read_text()).get("docs") or [{}]
    words = re.findall(r"[A-Za-z]{4,}", re.sub(r"<[^>]+>", " ", docs[0].get("title", "")))
    return max(words, key=len) if words else None


def check_search(report: Report, driver: object, name: str, word: str, seconds: float = SEARCH_SECONDS) -> None:
    """Type `word` into the page's search box; fail unless results show within `seconds`.

    Search can fail from disk without a console error: the index never arrives and "Initializing
    search" stays up. Only a search that finds something proves that it works.
    """
    from selenium.common.exceptions import TimeoutException, WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        box = driver.find_element(By.CSS_SELECTOR, "input[data-md-component=search-query]")
        if not box.is_displayed():  # narrow windows: the box opens from the header's search button
            driver.find_element(By.CSS_SELECTOR, "label.md-header__button[for=__search]").click()
        box.send_keys(word)
    except WebDriverException as error:
        report.fail(name, f"search box cannot be used: {error.msg.splitlines()[0]}")
        return
    try:
        WebDriverWait(driver, seconds).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item"))
    except TimeoutException:
        meta = driver.execute_script("return (document.querySelector('.md-search-result__meta') || {}).innerText")
        shown = f" (it shows '{' '.join(meta.split())}')" if meta else ""
        report.fail(name, f"search finds nothing for '{word}' within {seconds:.0f} s{shown}")
    for entry in driver.get_log("browser"):
        if entry.get("level") == "SEVERE":
            report.fail(name, f"console error while searching: {entry.get('message', '')}")


def check_from_disk(
    report: Report, driver: object, site_dir: Path, pages: list[str], search_seconds: float = SEARCH_SECONDS
) -> None:
    """Open every page through file://, as a reader does who downloaded the site, and fail on what breaks.

    Browsers allow a page on file:// no fetch or XHR and no Web Worker, so a site that works served can
    still log errors on every page from disk (Material's search index); and with directory URLs its
    links name folders, which open as file listings. Every file:// link and asset must be a file in the
    site, and every #fragment an id on its page; links elsewhere are the server check's business.
    """
    site_dir = site_dir.resolve()
    word = search_word(site_dir)
    home = next((page for page in pages if page in ("", "index.html")), pages[0] if pages else None)
    refs: dict[str, list[dict]] = {}
    ids: dict[str, set[str]] = {}
    for page in pages:
        url = page_file(site_dir, page).as_uri()
        name = f"{page or 'index.html'} from disk"
        measured, console, events = load(driver, url)
        report.from_disk.append(page)
        if measured["url"].split("#")[0] != url:
            report.fail(name, f"does not load: the browser shows {measured['url']}")
            continue
        for entry in console:
            if entry.get("level") == "SEVERE":
                report.fail(name, f"console error: {entry.get('message', '')}")
        requested = {}
        for event in events:
            params = event["params"]
            if event["method"] == "Network.requestWillBeSent":
                requested[params["requestId"]] = params["request"]["url"]
                if urllib.parse.urlsplit(loaded := params["request"]["url"]).scheme in ("http", "https", "ws", "wss"):
                    report.fail(name, f"loads {loaded} from another host (the docs must work offline)")
            elif event["method"] == "Network.loadingFailed" and not params.get("canceled"):
                failed = requested.get(params["requestId"], params["requestId"])
                report.fail(name, f"{failed} failed to load: {params.get('errorText')}")
        refs[name] = measured["refs"]
        ids[url] = set(measured["ids"])
        if word and page == home:
            check_search(report, driver, name, word, search_seconds)
        errors = sum(entry.get("level") == "SEVERE" for entry in console)
        print(f"  {name:<34} {errors} console errors, {len(measured['refs'])} links and assets", flush=True)
    for name, page_refs in refs.items():
        seen = set()
        for ref in page_refs:
            if not ref["url"].startswith("file:") or ref["url"] in seen:
                continue
            seen.add(ref["url"])
            target, _, fragment = ref["url"].partition("#")
            path = Path(urllib.request.url2pathname(urllib.parse.urlsplit(target).path))
            if not path.is_relative_to(site_dir):
                report.fail(name, f"{ref['tag']} to {ref['url']} leaves the site's folder")
                continue
            shown = path.relative_to(site_dir).as_posix()
            if path.is_dir():
                report.fail(name, f"{ref['tag']} to {shown}/ opens a folder (a file listing, not its page)")
            elif not path.is_file():
                report.fail(name, f"broken {ref['tag']} to {shown}: no such file")
            elif fragment and target in ids and urllib.parse.unquote(fragment) not in ids[target]:
                report.fail(name, f"broken {ref['tag']} to {shown}#{fragment}: no such id there")


def check_markdown(report: Report, files: list[Path], max_columns: int) -> None:
    """Fenced code blocks in Markdown files that are not pages of the site (the README) fit `max_columns`."""
    for path in files:
        fence = None
        for number, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.lstrip()
            if fence is None and stripped.startswith(("```", "~~~")):
                fence = stripped[:3]
            elif fence is not None and stripped.startswith(fence):
                fence = None
            elif fence is not None and len(line) > max_columns:
                report.fail(f"{path.name}:{number}", f"code line of {len(line)} columns (at most {max_columns})")


def check_site(
    site_dir: Path,
    width: int = 1280,
    max_columns: int = 100,
    screenshots: Path | None = None,
    pages: list[str] | None = None,
    markdown: list[Path] = (),
    prefix: str | None = None,
) -> Report:
    report = Report()
    check_markdown(report, list(markdown), max_columns)
    pages = site_pages(site_dir) if pages is None else pages
    refs: dict[str, list[dict]] = {}
    ids: dict[str, set[str]] = {}
    with serve(site_dir, prefix) as base, chromium(width) as driver:
        # The 404 page where readers meet it: a deep path that does not exist.
        for page, expect in [*((p, 200) for p in pages), ("no/such/page/", 404)]:
            name = page or "index"
            measured, console, events = load(driver, base + page)
            check_page(report, name, measured, console, events, base, max_columns, expect)
            refs[name] = measured["refs"]
            ids[measured["url"].split("#")[0]] = set(measured["ids"])
            if screenshots is not None:
                screenshots.mkdir(parents=True, exist_ok=True)
                slug = name.strip("/").replace("/", "_") or "index"
                screenshot(driver, screenshots / f"{slug}.png", width, measured["height"])
            print(
                f"  {name:<24} column {measured['column']['width']} px, "
                f"{len(measured['overflows'])} too wide, {len(measured['refs'])} links and assets",
                flush=True,
            )
        check_links(report, base, refs, ids)
        check_from_disk(report, driver, site_dir, pages)
    return report


def check_site_from_disk(
    site_dir: Path, width: int = 1280, pages: list[str] | None = None, search_seconds: float = SEARCH_SECONDS
) -> Report:
    """Only the file:// half of `check_site`: for a site that a server need not show (the self-test's)."""
    report = Report()
    with chromium(width) as driver:
        check_from_disk(report, driver, site_dir, site_pages(site_dir) if pages is None else pages, search_seconds)
    return report


# --- proving that it can fail ------------------------------------------------------------------------------

DEFECTS = """

## Self-test defects

| {header} |
| {rule} |
| {cells} |

```text
{long_line}
```

<p style="width: 12em; overflow: hidden; white-space: nowrap">Self-test cut off: a line longer than its box</p>

<table class="self-test" style="table-layout: fixed; width: 18em"><tr>
<td style="width: 6em"><code style="white-space: nowrap">FSDPPrecision.convert_module</code></td>
<td>the next cell, which that name runs into</td></tr></table>

<p><span style="white-space: nowrap">Self-test past the column: {long_line}</span></p>

[a page that does not exist](no-such-page.md), [an anchor that does not exist](activation.md#no-such-anchor)

![an image that does not exist](no-such-image.png)

<script>console.error("docs self-test: a console error");</script>

<img alt="from another host" src="https://example.invalid/pixel.png">

<pre><code>CheckpointError: <a href="#self-test-defects">a link in output text</a></code></pre>
"""

SELF_TEST_MENU_ENTRY = "A menu entry unlike the heading"
"""The home page's menu entry in the self-test's first copy: its heading says something else."""

# Each injected defect, and the words of the failure that must report it (all of them, where a tuple).
EXPECTED: dict[str, str | tuple[str, ...]] = {
    "over-wide table": "table under 'Self-test defects' is wider than the content column",
    "over-wide code block": "code block under 'Self-test defects' is wider than the content column",
    "code line over 100 columns": "-column line (at most 100)",
    "text cut off by its box": "cut off by its box, unreadable: 'Self-test cut off",
    "text spilling out of its table cell": "spills out of its table cell, unreadable: 'FSDPPrecision.convert_module'",
    "text past the content column": "reaches past the content column, unreadable: 'Self-test past the column",
    "broken link": "no-such-page.md (HTTP 404)",
    "broken anchor": "no id 'no-such-anchor'",
    "broken asset": "no-such-image.png answered HTTP 404",
    "console error": "docs self-test: a console error",
    "request to another host": "example.invalid/pixel.png from another host",
    "link in a code block": "has a link on 'a link in output text'",
    "heading unlike its menu entry": ("does not start with its menu entry", SELF_TEST_MENU_ENTRY),
    "console error from disk": ("from disk: console error:", "docs self-test: a console error"),
    "broken link from disk": "from disk: broken a to no-such-page.md: no such file",
    "broken anchor from disk": "from disk: broken a to activation.html#no-such-anchor: no such id",
    "request to another host from disk": "from disk: loads https://example.invalid/pixel.png from another host",
}

WITHOUT_OFFLINE = "offline"
"""The plugin left out of the self-test's second copy: Material's, which makes the site work from disk."""

# What the site built without it must fail with, opened from disk, and one page that is not there.
EXPECTED_WITHOUT_OFFLINE: dict[str, str | tuple[str, ...]] = {
    "console error: no search index": ("from disk: console error:", "search_index.js"),
    "search that finds nothing": "from disk: search ",
    "link to a folder (directory URLs)": ("from disk: a to ", "opens a folder"),
    "page that does not load": "no-such-page.html from disk: does not load",
}
MISSING_PAGE = "no-such-page.html"


def build(config: Path, site_dir: Path, strict: bool) -> None:
    command = [sys.executable, "-m", "mkdocs", "build", "-q", "-f", str(config), "--site-dir", str(site_dir)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor, on every build
    subprocess.run([*command, *(["--strict"] if strict else [])], check=True, env=env)


def build_copy(
    tmp: Path, name: str, append_to_index: str = "", leave_out: str | None = None, home_entry: str | None = None
) -> Path:
    """Build a copy of the docs in `tmp`/`name`, `append_to_index` added to its home page, the plugin
    `leave_out` left out of mkdocs.yml and the home page's menu entry renamed `home_entry`; return the
    site. Not strict: the defects would stop a strict build."""
    import yaml  # mkdocs depends on PyYAML

    docs = tmp / name / "docs"
    shutil.copytree(ROOT / "docs", docs)
    with (docs / "index.md").open("a") as page:
        page.write(append_to_index)
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    if custom_dir := config.get("theme", {}).get("custom_dir"):
        config["theme"]["custom_dir"] = str(ROOT / custom_dir)
    if home_entry is not None:
        nav = config["nav"]  # one-key mappings, title: page
        config["nav"] = [{home_entry: "index.md"} if list(entry.values()) == ["index.md"] else entry for entry in nav]
    plugins = config.get("plugins", [])
    if leave_out is not None:
        if leave_out not in plugins:
            raise SystemExit(f"check_docs_in_browser: the self-test leaves out {leave_out!r}: not in mkdocs.yml")
        plugins.remove(leave_out)
    for plugin in plugins:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            handler = plugin["mkdocstrings"]["handlers"]["python"]
            handler["paths"] = [str(ROOT / p) for p in handler.get("paths", ["."])]
    config_path = tmp / name / "mkdocs.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    site = tmp / name / "site"
    build(config_path, site, strict=False)
    return site


def home_and_activation(site_dir: Path) -> list[str]:
    """The self-test's pages: the home page (the defects) and activation (the anchor's target), named as
    `site_pages` names them, which depends on use_directory_urls (``activation/`` or ``activation.html``)."""
    return [page for page in site_pages(site_dir) if page.rstrip("/").removesuffix(".html") in ("", "activation")]


def missed(expected: dict[str, str | tuple[str, ...]], report: Report) -> list[str]:
    """The names in `expected` whose words no failure in `report` has."""

    def reported(words: str | tuple[str, ...]) -> bool:
        words = (words,) if isinstance(words, str) else words
        return any(all(word in failure for word in words) for failure in report.failures)

    return [name for name, words in expected.items() if not reported(words)]


def self_test(width: int) -> int:
    """Build two copies of the docs; the check must report every defect of each.

    The first has one page full of defects, checked served and from disk. The second is the real docs
    built without Material's offline plugin, checked from disk only (with one page that is not there):
    it proves that the file:// check fails on what readers of a downloaded site hit without the plugin.
    """
    columns = 40
    defects = DEFECTS.format(
        header=" | ".join(f"column {i}" for i in range(columns)),
        rule=" | ".join("---" for _ in range(columns)),
        cells=" | ".join(f"`value_{i}`" for i in range(columns)),
        long_line="x" * 160,
    )
    with tempfile.TemporaryDirectory(prefix="docs-self-test-") as tmp:
        site = build_copy(Path(tmp), "defects", append_to_index=defects, home_entry=SELF_TEST_MENU_ENTRY)
        report = check_site(site, width=width, pages=home_and_activation(site))
        site = build_copy(Path(tmp), "without-offline", leave_out=WITHOUT_OFFLINE)
        # Its search never works: waiting the real check's SEARCH_SECONDS for that would prove nothing more.
        pages = [*home_and_activation(site), MISSING_PAGE]
        offline_report = check_site_from_disk(site, width=width, pages=pages, search_seconds=2)
    missing = missed(EXPECTED, report) + missed(EXPECTED_WITHOUT_OFFLINE, offline_report)
    print("self-test: the check reported")
    for failure in report.failures:
        print(f"  {failure}")
    print(f"self-test: from disk, the site built without the {WITHOUT_OFFLINE} plugin")
    for failure in offline_report.failures:
        print(f"  {failure}")
    if missing:
        print(f"self-test FAILED: the check did not report: {', '.join(missing)}")
        return 1
    total = len(EXPECTED) + len(EXPECTED_WITHOUT_OFFLINE)
    print(f"self-test passed: all {total} injected defects were reported")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", type=Path, help="the built site (mkdocs build --site-dir)")
    parser.add_argument("--width", type=int, default=1280, help="window width in px (default: 1280)")
    parser.add_argument("--max-columns", type=int, default=100, help="longest code line (default: 100)")
    parser.add_argument("--screenshots", type=Path, help="write a full-page PNG of every page here")
    parser.add_argument("--markdown", type=Path, nargs="*", default=[], help="Markdown files outside the site")
    parser.add_argument("--prefix", help="serve the site under this path (default: the path of site_url)")
    parser.add_argument("--json", type=Path, help="write every page's measurements here")
    parser.add_argument("--self-test", action="store_true", help="inject defects into a copy; they must fail")
    args = parser.parse_args(argv)
    if args.self_test:
        return self_test(args.width)
    if args.site is None:
        parser.error("name the built site, or --self-test")
    print(f"check_docs_in_browser: {args.site} in headless Chromium, {args.width} px wide")
    report = check_site(
        args.site, args.width, args.max_columns, args.screenshots, markdown=args.markdown, prefix=args.prefix
    )
    if args.json:
        args.json.write_text(json.dumps(report.pages, indent=1))
    for failure in report.failures:
        print(f"FAIL {failure}")
    pages = f"{len(report.pages)} pages served and {len(report.from_disk)} from disk"
    if report.failures:
        print(f"check_docs_in_browser: {len(report.failures)} problem(s) on {pages}")
        return 1
    fits = "every table, code block and line of text fits"
    print(f"check_docs_in_browser: {pages}: {fits}; no console errors or broken links")
    return 0


if __name__ == "__main__":
    sys.exit(main())
