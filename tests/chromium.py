"""Headless Chromium for the report and UI tests: screenshots, DOM dumps and image checks.

Chromium is the Debian package (``make browser`` installs it); when it is missing the test is skipped
locally and fails under ``CI=true`` (tests/prereq.py). Each call starts a fresh browser with a fresh profile
and the flags that keep it from reaching the network on its own.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from prereq import missing

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--force-device-scale-factor=1", "--disable-dev-shm-usage",
]

# Appended to a copy of a page: after load, runs a JavaScript expression and writes its JSON value into the DOM.
PROBE = """<script>
window.addEventListener('load', () => {
  const out = (() => { %s })();
  const pre = document.createElement('pre'); pre.id = 'qk-probe';
  pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
});
</script>"""

# Every <img>'s state and box (page coordinates), the page's height and title.
IMG_PROBE = """
  const imgs = [...document.images].map(i => {
    const b = i.getBoundingClientRect();
    return {src: i.getAttribute('src'), naturalWidth: i.naturalWidth, naturalHeight: i.naturalHeight,
            complete: i.complete, x: b.left + scrollX, y: b.top + scrollY, w: b.width, h: b.height};
  });
  return {images: imgs, height: document.documentElement.scrollHeight, title: document.title};
"""


def chromium() -> str:
    """The Chromium binary; when it is not installed: skip locally, fail under ``CI=true``."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        missing("chromium", "make browser")
    return exe


@contextlib.contextmanager
def _profile() -> Iterator[str]:
    """A fresh Chromium profile folder, removed once nothing writes into it any more: a helper process of the
    browser that outlives it for a moment once made the removal fail ("Directory not empty: 'Default'")."""
    folder = tempfile.mkdtemp(prefix="qk-chromium-")
    try:
        yield folder
    finally:
        deadline = time.monotonic() + 30
        while True:
            try:
                shutil.rmtree(folder)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)


def _end(proc: subprocess.Popen) -> None:
    """Stop a browser started in its own session and every process it started."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    with _profile() as profile:
        return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=timeout)


def screenshot(url: str, out: Path, width: int = 1280, height: int = 1600, timeout: float = 120,
               budget_ms: int = 8000) -> Path:
    """A PNG of the page's first ``height`` pixels at ``width`` (waits up to ``budget_ms`` of page time)."""
    out.unlink(missing_ok=True)
    proc = _run([f"--screenshot={out}", f"--window-size={width},{height}",
                 f"--virtual-time-budget={budget_ms}", url], timeout)
    assert out.exists(), f"chromium wrote no screenshot of {url}: {proc.stderr[-2000:]}"
    return out


def dump_dom(url: str, timeout: float = 120, budget_ms: int = 8000, width: int = 1280,
             height: int = 1600) -> str:
    """The DOM after load (and up to ``budget_ms`` of page time), serialised."""
    proc = _run(["--dump-dom", f"--window-size={width},{height}", f"--virtual-time-budget={budget_ms}", url],
                timeout)
    assert proc.returncode == 0 and proc.stdout, f"chromium --dump-dom failed for {url}: {proc.stderr[-2000:]}"
    return proc.stdout


def probe_page(page: Path, script: str, width: int = 1280, height: int = 1600) -> object:
    """Load a copy of ``page`` (same folder, so relative links resolve) at ``width`` x ``height``, run the
    JavaScript function body ``script`` after load and return the JSON value it returns."""
    page = page.resolve()
    probe = page.with_name(".probe-" + page.name)
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE % script + "</body>"),
                     encoding="utf-8")
    try:
        dom = dump_dom(probe.as_uri(), width=width, height=height)
    finally:
        probe.unlink(missing_ok=True)
    m = re.search(r'<pre id="qk-probe">(.*?)</pre>', dom, re.S)
    assert m, "the probe script did not run"
    import html

    return json.loads(html.unescape(m.group(1)))


def probe_images(page: Path, width: int = 1280) -> dict:
    """Every image of ``page`` as drawn: ``{"images": [{src, naturalWidth, x, y, w, h, ...}], "height": ...}``."""
    return probe_page(page, IMG_PROBE, width=width)  # type: ignore[return-value]


def load_png(path: Path) -> np.ndarray:
    """The PNG as an (h, w, 3) float array in [0, 1]."""
    from matplotlib.image import imread

    img = imread(str(path))
    return np.asarray(img[..., :3], dtype=float)


def region_std(img: np.ndarray, x: float, y: float, w: float, h: float) -> float:
    """Standard deviation of the pixels inside a box (0 for a blank or empty box)."""
    x0, y0 = max(int(x), 0), max(int(y), 0)
    x1, y1 = min(int(x + w), img.shape[1]), min(int(y + h), img.shape[0])
    if x1 <= x0 or y1 <= y0:
        return 0.0
    return float(img[y0:y1, x0:x1].std())


def click_and_probe(url: str, click: str, probe: str, width: int = 1440, height: int = 900, settle_s: float = 15,
                    after_s: float = 3, shot: Path | None = None, timeout: float = 120) -> object:
    """Load ``url`` in headless Chromium driven over its DevTools protocol (what a click needs), wait ``settle_s``,
    run the JavaScript expression ``click`` (e.g. one that clicks a button), wait ``after_s``, and return the JSON
    value of the expression ``probe``; with ``shot``, a screenshot of the window is written there."""
    from websockets.sync.client import connect

    with _profile() as profile:
        proc = subprocess.Popen([chromium(), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                                 f"--window-size={width},{height}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            port_file, deadline = Path(profile) / "DevToolsActivePort", time.monotonic() + 30
            while not (port_file.exists() and port_file.read_text().strip()):
                assert time.monotonic() < deadline and proc.poll() is None, "chromium did not open its DevTools port"
                time.sleep(0.2)
            port, path = port_file.read_text().split()[:2]
            with connect(f"ws://127.0.0.1:{port}{path}", max_size=2**27, open_timeout=30) as ws:
                ids = iter(range(1, 1_000_000))

                def call(method: str, session: str | None = None, **params: object) -> dict:
                    n = next(ids)
                    ws.send(json.dumps({"id": n, "method": method, "params": params,
                                        **({"sessionId": session} if session else {})}))
                    while True:
                        msg = json.loads(ws.recv(timeout=timeout))
                        if msg.get("id") == n:
                            assert "error" not in msg, f"{method}: {msg['error']}"
                            return msg["result"]

                target = call("Target.createTarget", url="about:blank")["targetId"]
                session = call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
                call("Emulation.setDeviceMetricsOverride", session, width=width, height=height, deviceScaleFactor=1,
                     mobile=False)

                def evaluate(expr: str) -> object:
                    res = call("Runtime.evaluate", session, expression=expr, returnByValue=True, awaitPromise=True)
                    assert "exceptionDetails" not in res, res["exceptionDetails"]
                    return res["result"].get("value")

                call("Page.navigate", session, url=url)
                time.sleep(settle_s)
                evaluate(click)
                time.sleep(after_s)
                value = evaluate(probe)
                if shot is not None:
                    shot.write_bytes(base64.b64decode(call("Page.captureScreenshot", session, format="png")["data"]))
                return value
        finally:
            _end(proc)
