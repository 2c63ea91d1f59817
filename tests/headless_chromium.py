"""Load a page in real headless Chromium over the DevTools protocol; report console errors and images.

    with Chromium() as browser:                     # pytest.skip()s when chromium is not installed
        page = browser.load(Path("report.html"))
        page.errors       # console errors, uncaught exceptions, failed loads (Log/Runtime events)
        page.images       # [{"alt", "complete", "naturalWidth", "naturalHeight"}] after load
        page.svgs         # number of <svg> elements

Chromium (Debian package `chromium`) runs with --headless --no-sandbox --disable-gpu, no network
services and a fresh --user-data-dir, and `--remote-debugging-port=0`: the port it picked is read
from DevToolsActivePort in that directory, and one page target is driven through its websocket
(the `websockets` package). Errors are collected from `Runtime.exceptionThrown`,
`Runtime.consoleAPICalled` (error, assert) and `Log.entryAdded` (level error: e.g. a resource or
image that fails to load), from before the navigation until the load event and a settle round trip.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

INSTALL_HINT = (
    "chromium not found: install Debian's package (`sudo apt-get install -y chromium`; .ci/run does this "
    "in CI) or put a chromium/google-chrome binary on PATH"
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-dev-shm-usage",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
]
START_TIMEOUT_S = 60
LOAD_TIMEOUT_S = 60

_PROBE = """JSON.stringify({
  title: document.title,
  h1: (document.querySelector('h1') || {}).textContent || null,
  images: Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete,
                                                 naturalWidth: i.naturalWidth, naturalHeight: i.naturalHeight})),
  svgs: document.querySelectorAll('svg').length,
  tables: document.querySelectorAll('table').length,
  text: document.body ? document.body.innerText : ''
})"""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class Page:
    url: str
    errors: list[str] = field(default_factory=list)
    title: str = ""
    h1: str | None = None
    images: list[dict] = field(default_factory=list)
    svgs: int = 0
    tables: int = 0
    text: str = ""


class Chromium:
    def __init__(self) -> None:
        self.binary = find_chromium()
        if self.binary is None:
            pytest.skip(INSTALL_HINT)
        try:
            from websockets.sync.client import connect  # noqa: F401
        except ImportError:
            pytest.skip("the browser test drives Chromium through `websockets` (pip install websockets)")

    def __enter__(self) -> Chromium:
        self.profile = tempfile.mkdtemp(prefix="titan-audit-chromium-")
        self.proc = subprocess.Popen(
            [self.binary, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        active = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (active.is_file() and len(active.read_text().split()) >= 2):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"chromium exited {self.proc.returncode}: {self.proc.stderr.read().decode()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not open its DevTools port within {START_TIMEOUT_S} s")
            time.sleep(0.05)
        self.port = int(active.read_text().split()[0])
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def _page_ws(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=10) as response:
            targets = json.loads(response.read())
        pages = [t for t in targets if t.get("type") == "page"]
        if not pages:
            with urllib.request.urlopen(
                urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT"), timeout=10
            ) as response:
                pages = [json.loads(response.read())]
        return pages[0]["webSocketDebuggerUrl"]

    def load(self, path: Path) -> Page:
        from websockets.sync.client import connect

        url = Path(path).resolve().as_uri()
        page = Page(url)
        with connect(self._page_ws(), max_size=None, open_timeout=20) as ws:
            ids = iter(range(1, 1_000_000))
            pending: dict[int, dict] = {}

            def send(method: str, **params) -> int:
                n = next(ids)
                ws.send(json.dumps({"id": n, "method": method, "params": params}))
                return n

            def pump(until, timeout: float) -> None:
                deadline = time.monotonic() + timeout
                while not until():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"{url}: no answer from chromium within {timeout} s")
                    message = json.loads(ws.recv(timeout=left))
                    if "id" in message:
                        pending[message["id"]] = message
                        continue
                    method, params = message.get("method"), message.get("params", {})
                    if method == "Runtime.exceptionThrown":
                        details = params.get("exceptionDetails", {})
                        page.errors.append(
                            "exception: " + str(details.get("exception", {}).get("description") or details.get("text"))
                        )
                    elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                        args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                        page.errors.append(f"console.{params['type']}: {args}")
                    elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                        entry = params["entry"]
                        page.errors.append(
                            f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip()
                        )
                    elif method == "Page.loadEventFired":
                        pending["load"] = params

            def call(method: str, **params) -> dict:
                n = send(method, **params)
                pump(lambda: n in pending, LOAD_TIMEOUT_S)
                answer = pending.pop(n)
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})

            for domain in ("Page.enable", "Runtime.enable", "Log.enable"):
                call(domain)
            navigated = call("Page.navigate", url=url)
            if navigated.get("errorText"):
                page.errors.append(f"navigation: {navigated['errorText']}")
            pump(lambda: "load" in pending, LOAD_TIMEOUT_S)
            # images decode asynchronously after load in some builds: wait for every one to settle
            call(
                "Runtime.evaluate",
                expression="Promise.all(Array.from(document.images).map(i => i.decode().catch(() => null)))",
                awaitPromise=True,
            )
            result = call("Runtime.evaluate", expression=_PROBE, returnByValue=True)
            probe = json.loads(result["result"]["value"])
            call("Runtime.evaluate", expression="0")  # one more round trip: late console events arrive first
        page.title, page.h1, page.images = probe["title"], probe["h1"], probe["images"]
        page.svgs, page.tables, page.text = probe["svgs"], probe["tables"], probe["text"]
        return page
