"""Headless Chromium, driven over the DevTools protocol on a pipe: what the report's test and its screenshot use.

    with Browser() as b:
        b.open(Path("runs/evolve-sciworld/report.html"))
        b.wait_for("document.body.dataset.ready === '1'")
        print(b.evaluate("document.title"), b.errors, b.requests)
        b.screenshot(Path("report.png"))

No driver package and no network: Chromium (Debian's `chromium`) reads protocol messages on fd 3 and answers on
fd 4 (--remote-debugging-pipe), one JSON object per message, each ended by a NUL byte.
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


class Browser:
    """One headless page. `errors` collects console errors, uncaught exceptions and failed loads; `requests` every
    URL the page asked for."""

    def __init__(self, width: int = 1400, height: int = 1000, timeout: float = 60):
        exe = find_chromium()
        if exe is None:
            raise RuntimeError("no Chromium found: apt-get install chromium (docs/setup.md)")
        self.timeout, self.errors, self.requests = timeout, [], []
        self._profile = tempfile.mkdtemp(prefix="report-chromium-")
        to_child, self._write = os.pipe()   # we write commands, Chromium reads them on fd 3
        self._read, from_child = os.pipe()  # Chromium answers on fd 4
        # the child's ends moved above 4 first, so that placing them at 3 and 4 cannot overwrite one with the other
        child_in, child_out = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_child, from_child))
        os.close(to_child)
        os.close(from_child)
        self._proc = subprocess.Popen(
            [exe, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--disable-dev-shm-usage", "--disable-background-networking",
             f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank"],
            close_fds=False, preexec_fn=lambda: (os.dup2(child_in, 3), os.dup2(child_out, 4)),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(child_in)
        os.close(child_out)
        self._buffer, self._next_id, self._events = b"", 0, []
        page = next(t for t in self._call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self._session = self._call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    # ------------------------------------------------------------------ protocol
    def _send(self, message: dict) -> None:
        os.write(self._write, json.dumps(message).encode() + b"\0")

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            if time.time() > deadline:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed its pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _call(self, method: str, session: str | None = None, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        self._send(message)
        deadline = time.time() + self.timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._event(reply)

    def _event(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append("exception: " + details.get("exception", {}).get("description", details["text"]))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append("log: " + params["entry"]["text"])
        elif method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"][:200])
        self._events.append(method)

    def call(self, method: str, **params) -> dict:
        """One protocol command on the page."""
        return self._call(method, self._session, **params)

    # ------------------------------------------------------------------ what a test does
    def open(self, path: Path) -> None:
        """Load the file and wait for its load event."""
        self._events.clear()
        self.call("Page.navigate", url=Path(path).resolve().as_uri())
        deadline = time.time() + self.timeout
        while "Page.loadEventFired" not in self._events:
            self._event(self._receive(deadline))

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails'].get('exception', {}).get('description')}")
        return result["result"].get("value")

    def wait_for(self, expression: str) -> None:
        """Poll until the expression is true."""
        deadline = time.time() + self.timeout
        while not self.evaluate(expression):
            if time.time() > deadline:
                raise TimeoutError(f"never true: {expression}")
            time.sleep(0.05)

    def screenshot(self, path: Path, full_page: bool = False) -> None:
        params = {"format": "png", "captureBeyondViewport": full_page}
        if full_page:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        data = base64.b64decode(self.call("Page.captureScreenshot", **params)["data"])
        Path(path).write_bytes(data)

    def close(self) -> None:
        try:
            self._call("Browser.close")
        except (RuntimeError, OSError, TimeoutError):
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        for fd in (self._read, self._write):
            os.close(fd)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
