"""Screenshots of a real `make ui` in headless Chromium, for docs/reviewing-runs.md: the CVs' runs table on its
headline view (the address `make ui` prints), the comparisons' table with each pair's columns, the newest comparison's
Overview (its description: the pairs' table) and its Artifacts (the plots first, one of them open).

`make ui` asks for a password, and MLflow's UI breaks on credentials in the address (user:password@host), so a small
loopback proxy stands in front of it and adds the basic-auth header (the password from the file `make ui` names) to
every request. Chromium (`apt-get install -y chromium`) runs headless with a fresh profile, driven through its DevTools
protocol (websocket-client): each page loaded and waited for until its text shows, the MLflow Assistant panel closed
with its x as a user closes it, then captured as a PNG (PNGs with few colours stay small).

Run it after the three default CVs and `make compare` (README: "Three backbones on the twin"), from the checkout:
    .venv/bin/python scripts/ui_screenshots.py                  # -> docs/mlflow_ui_*.png
    .venv/bin/python scripts/ui_screenshots.py --out /tmp/shots --port 5077
"""

from __future__ import annotations

import argparse
import base64
import http.client
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import urlopen

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import websocket  # noqa: E402  (websocket-client, in the lock through MLflow's dependencies)
from PIL import Image  # noqa: E402

from pipeline.runs.store import tracking, ui_pages  # noqa: E402

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--remote-allow-origins=*")
CLOSE_ASSISTANT = """(() => {
  const button = document.querySelector('[data-component-id="mlflow.assistant.chat_panel.close"]')
    || [...document.querySelectorAll('button')].find(b => /close/i.test(b.getAttribute('aria-label') || '')
                                                          && b.closest('aside, [class*="ssistant"]'));
  if (button) { button.click(); return true; }
  return false;
})()"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class AuthProxy(ThreadingHTTPServer):
    """Loopback HTTP proxy to the UI at `target` (host, port) that adds `Authorization: Basic ...` to each request."""

    daemon_threads = True

    def __init__(self, target: tuple[str, int], user: str, password: str) -> None:
        self.target = target
        self.header = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        super().__init__(("127.0.0.1", 0), ProxyHandler)


class ProxyHandler(BaseHTTPRequestHandler):
    server: AuthProxy
    protocol_version = "HTTP/1.1"

    def forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "authorization", "connection")}
        upstream = http.client.HTTPConnection(*self.server.target, timeout=120)
        upstream.request(self.command, self.path, body=body or None,
                         headers={**headers, "Authorization": self.server.header, "Connection": "close"})
        response = upstream.getresponse()
        payload = response.read()
        self.send_response(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)
        upstream.close()

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = forward

    def log_message(self, format: str, *args) -> None:  # quiet
        pass


class Chromium:
    """Headless Chromium with a fresh profile, one page driven through the DevTools protocol."""

    def __init__(self, width: int, height: int) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        if binary is None:
            raise SystemExit("no chromium: apt-get install -y chromium")
        self.profile = tempfile.mkdtemp(prefix="ui-shots-profile-")
        port = free_port()
        self.process = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}",
                                         f"--remote-debugging-port={port}", f"--window-size={width},{height}",
                                         "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        targets = wait_for(lambda: json.loads(urlopen(f"http://127.0.0.1:{port}/json", timeout=5).read()), 60)
        page = next(target for target in targets if target["type"] == "page")
        self.socket = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=120, suppress_origin=True)
        self.ids = itertools.count(1)
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params) -> dict:
        message_id = next(self.ids)
        self.socket.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == message_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def show(self, url: str, text: str, timeout: float = 180) -> None:
        """Open `url` and wait until the page's text holds `text`; the Assistant panel closed."""
        self.call("Page.navigate", url=url)
        wait_for(lambda: self.evaluate(f"document.body && document.body.innerText.includes({json.dumps(text)})"),
                 timeout, what=f"{text!r} on {url}")
        time.sleep(2)  # the table's columns and the charts settle
        if self.evaluate(CLOSE_ASSISTANT):
            time.sleep(1)

    def texts(self) -> list[str]:
        """The page's text nodes, trimmed (names in the artifact tree sit beside an icon, in no element alone)."""
        return self.evaluate("""(() => { const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
          const found = []; while (walk.nextNode()) { const t = walk.currentNode.textContent.trim();
          if (t) found.push(t); } return found; })()""")

    def click_text(self, text: str) -> None:
        """Click the element around the first text node that reads `text` (a button, an artifact's name)."""
        found = self.evaluate(f"""(() => {{ const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
          while (walk.nextNode()) {{ if (walk.currentNode.textContent.trim() === {json.dumps(text)}) {{
            walk.currentNode.parentElement.click(); return true; }} }} return false; }})()""")
        if not found:
            raise SystemExit(f"nothing reads {text!r} on the page")
        time.sleep(3)

    def capture(self, path: Path) -> None:
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(suffix=".png") as raw:
            Path(raw.name).write_bytes(data)
            Image.open(raw.name).convert("RGB").quantize(colors=128).save(path, optimize=True)
        print(f"{path} ({path.stat().st_size // 1024} KB)", flush=True)

    def close(self) -> None:
        self.socket.close()
        self.process.terminate()
        self.process.wait(timeout=30)
        shutil.rmtree(self.profile, ignore_errors=True)


def wait_for(probe, timeout: float, what: str = "the browser"):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = probe()
            if value:
                return value
        except Exception:  # not up yet
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(1)


def start_ui(port: int) -> tuple[subprocess.Popen, list[str], str]:
    """`make ui MLFLOW_PORT=<port>`: the process, the addresses it printed and the password from its file."""
    process = subprocess.Popen(["make", "--no-print-directory", "ui", f"MLFLOW_PORT={port}"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")})
    assert process.stdout is not None
    urls: list[str] = []
    for line in process.stdout:
        print(f"make ui: {line.rstrip()}", flush=True)
        urls += re.findall(r"http://127\.0\.0\.1:\d+/\S+", line)
        found = re.search(r"password in (\S+) ", line)
        if found:
            threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()  # drain
            return process, urls, Path(found.group(1)).read_text().strip()
    raise SystemExit("make ui stopped before it named its password file")


def newest_comparison() -> tuple[str, str]:
    """The newest comparison run of the project's store: its experiment and run ids."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking.tracking_uri(ROOT))
    experiment = client.get_experiment_by_name(ui_pages.comparisons_experiment(tracking.DEFAULT_EXPERIMENT))
    if experiment is None:
        raise SystemExit("no comparison yet: run the three default CVs and make compare first")
    run = client.search_runs([experiment.experiment_id], order_by=["attribute.start_time DESC"], max_results=1)[0]
    return experiment.experiment_id, run.info.run_id


def capture_all(browser: Chromium, base: str, urls: list[str], out: Path) -> None:
    cv_url, comparisons_url = (f"{base}{urlsplit(url).path}#{urlsplit(url).fragment}" for url in urls[:2])
    browser.show(cv_url, "video_auroc")
    browser.capture(out / "mlflow_ui_runs.png")
    browser.show(comparisons_url, "p_holm")
    browser.capture(out / "mlflow_ui_comparisons.png")
    experiment_id, run_id = newest_comparison()
    run_page = f"{base}/#/experiments/{experiment_id}/runs/{run_id}"
    browser.show(f"{run_page}?workflowType={tracking.UI_WORKFLOW}", "Paired tests")
    browser.click_text("Show more")  # the description opens collapsed
    browser.capture(out / "mlflow_ui_comparison_overview.png")
    browser.show(f"{run_page}/artifacts?workflowType={tracking.UI_WORKFLOW}", "table_")
    texts = browser.texts()
    plots = [text for text in texts if text.endswith("_subjects.png")]
    if not plots:
        browser.capture(out / "mlflow_ui_comparison_artifacts.png")
        raise SystemExit(f"no *_subjects.png among the artifacts' names: {[t for t in texts if t][:60]}")
    browser.click_text(plots[0])
    browser.capture(out / "mlflow_ui_comparison_artifacts.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--port", type=int, default=None, help="make ui's port (default: a free one)")
    parser.add_argument("--size", default="1600x900", help="the browser window, WIDTHxHEIGHT")
    args = parser.parse_args()
    width, height = (int(part) for part in args.size.split("x"))
    port = args.port or free_port()
    ui, urls, password = start_ui(port)
    proxy = AuthProxy(("127.0.0.1", port), "admin", password)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{proxy.server_address[1]}"
    browser = None
    try:
        wait_for(lambda: urlopen(f"{base}/health", timeout=5).status == 200, 300, what="the UI to answer")
        if len(urls) < 2:
            raise SystemExit(f"make ui printed {urls}: no comparisons' address (run make compare first)")
        browser = Chromium(width, height)
        capture_all(browser, base, urls, args.out)
    finally:
        if browser is not None:
            browser.close()
        proxy.shutdown()
        os.killpg(ui.pid, signal.SIGINT)  # make ui's own group: Ctrl+C, as a user stops it
        ui.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
