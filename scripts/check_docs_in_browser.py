"""Open every page of the built docs in headless Chromium, 1280 px wide, and fail on what a reader would hit.

Usage (the nox session ``docs`` runs both, after ``mkdocs build --strict``)::

    check_docs_in_browser.py SITE_DIR [--screenshots DIR] [--width 1280] [--markdown FILE ...]
    check_docs_in_browser.py --self-test        # proves the check fails on a page with the defects below

A page fails when, at that window width:

* a table or a code block is wider than the page's content column (it scrolls or sticks out), or a
  table's column is so narrow that a name in code is broken mid-word;
* a code block has a line longer than 100 columns (``--max-columns``), also in ``--markdown`` files
  (the README, which is not part of the site);
* the browser console has an error (a script error, a resource that failed to load);
* an internal link, anchor or asset is broken (HTTP status other than 200, a ``#fragment`` that is not
  an ``id`` on its page);
* the page loads anything from another host: the docs must work offline and on air-gapped clusters.

The site is served on 127.0.0.1 under the path of ``site_url`` (as GitHub Pages serves it), and a missing
path gets ``404.html`` with status 404, so the 404 page is checked where readers meet it: at a deep URL.
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
// Readable, not only fitting: a table column so narrow that the theme breaks a name in code mid-word
// (`FSDPPrecision.conv` / `ert_module`) is as bad as a scrollbar.
const broken = [];
for (const code of column.querySelectorAll('table code')) {
  const text = code.innerText.trim();
  if (!/\s/.test(text) && code.getClientRects().length > 1) {
    broken.push({text, heading: heading(code.closest('table'))});
  }
}
const longest = [...column.querySelectorAll('pre')].map((el) => ({
  label: label(el), heading: heading(el),
  columns: Math.max(...el.innerText.replace(/\n$/, '').split('\n').map((l) => l.length))}));
const refs = [];
for (const [selector, attr] of [['a[href]', 'href'], ['link[href]', 'href'], ['script[src]', 'src'],
                                ['img[src]', 'src'], ['source[src]', 'src'], ['iframe[src]', 'src']]) {
  for (const el of document.querySelectorAll(selector)) refs.push({tag: el.tagName.toLowerCase(), url: el[attr]});
}
return {
  url: location.href, title: document.title, innerWidth: window.innerWidth,
  column: {selector: column.className || column.tagName, width: Math.round(colRight - colLeft)},
  height: document.documentElement.scrollHeight, overflows, broken, longest, refs,
  ids: [...document.querySelectorAll('[id], a[name]')].map((el) => el.id || el.getAttribute('name')),
};
"""


@dataclass
class Report:
    """What the check found, page by page; `failures` is what makes it exit 1."""

    failures: list[str] = field(default_factory=list)
    pages: list[dict] = field(default_factory=list)

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
    for item in measured["broken"]:
        where = f" under '{item['heading']}'" if item["heading"] else ""
        report.fail(page, f"table{where} breaks `{item['text']}` across lines: its column is too narrow")
    for block in measured["longest"]:
        if block["columns"] > max_columns:
            where = f" under '{block['heading']}'" if block["heading"] else ""
            report.fail(page, f"code block{where} has a {block['columns']}-column line (at most {max_columns})")
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

<table><tr><td style="width: 5em"><code style="word-break: break-all">FSDPPrecision.convert_module</code></td>
<td>a column squeezed so narrow that the name in code breaks mid-word</td></tr></table>

[a page that does not exist](no-such-page.md), [an anchor that does not exist](activation.md#no-such-anchor)

![an image that does not exist](no-such-image.png)

<script>console.error("docs self-test: a console error");</script>

<img alt="from another host" src="https://example.invalid/pixel.png">
"""

# Each injected defect, and the words of the failure that must report it.
EXPECTED = {
    "over-wide table": "table under 'Self-test defects' is wider than the content column",
    "over-wide code block": "code block under 'Self-test defects' is wider than the content column",
    "code line over 100 columns": "-column line (at most 100)",
    "name in code broken across lines": "breaks `FSDPPrecision.convert_module` across lines",
    "broken link": "no-such-page.md (HTTP 404)",
    "broken anchor": "no id 'no-such-anchor'",
    "broken asset": "no-such-image.png answered HTTP 404",
    "console error": "docs self-test: a console error",
    "request to another host": "example.invalid/pixel.png from another host",
}


def build(config: Path, site_dir: Path, strict: bool) -> None:
    command = [sys.executable, "-m", "mkdocs", "build", "-q", "-f", str(config), "--site-dir", str(site_dir)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor, on every build
    subprocess.run([*command, *(["--strict"] if strict else [])], check=True, env=env)


def home_and_activation(site_dir: Path) -> list[str]:
    """The self-test's pages: the home page (the defects) and activation (the anchor's target), named as
    `site_pages` names them, which depends on use_directory_urls (``activation/`` or ``activation.html``)."""
    return [page for page in site_pages(site_dir) if page.rstrip("/").removesuffix(".html") in ("", "activation")]


def self_test(width: int) -> int:
    """Build a copy of the docs with one page full of defects; the check must report every one of them."""
    import yaml  # mkdocs depends on PyYAML

    with tempfile.TemporaryDirectory(prefix="docs-self-test-") as tmp:
        docs = Path(tmp, "docs")
        shutil.copytree(ROOT / "docs", docs)
        columns = 40
        with (docs / "index.md").open("a") as page:
            page.write(
                DEFECTS.format(
                    header=" | ".join(f"column {i}" for i in range(columns)),
                    rule=" | ".join("---" for _ in range(columns)),
                    cells=" | ".join(f"`value_{i}`" for i in range(columns)),
                    long_line="x" * 160,
                )
            )
        config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
        config["docs_dir"] = str(docs)
        if custom_dir := config.get("theme", {}).get("custom_dir"):
            config["theme"]["custom_dir"] = str(ROOT / custom_dir)
        for plugin in config.get("plugins", []):
            if isinstance(plugin, dict) and "mkdocstrings" in plugin:
                handler = plugin["mkdocstrings"]["handlers"]["python"]
                handler["paths"] = [str(ROOT / p) for p in handler.get("paths", ["."])]
        config_path = Path(tmp, "mkdocs.yml")
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        site = Path(tmp, "site")
        build(config_path, site, strict=False)  # the broken link would stop a strict build
        report = check_site(site, width=width, pages=home_and_activation(site))
    missed = [name for name, words in EXPECTED.items() if not any(words in failure for failure in report.failures)]
    print("self-test: the check reported")
    for failure in report.failures:
        print(f"  {failure}")
    if missed:
        print(f"self-test FAILED: the check did not report: {', '.join(missed)}")
        return 1
    print(f"self-test passed: all {len(EXPECTED)} injected defects were reported")
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
    pages = len(report.pages)
    if report.failures:
        print(f"check_docs_in_browser: {len(report.failures)} problem(s) on {pages} pages")
        return 1
    print(f"check_docs_in_browser: {pages} pages, every table and code block fits, no console errors or broken links")
    return 0


if __name__ == "__main__":
    sys.exit(main())
