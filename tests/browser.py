"""A real browser for tests: headless Chromium driven over the Chrome DevTools Protocol.

The protocol travels over two pipes (``--remote-debugging-pipe``: fd 3 carries commands to the
browser, fd 4 its answers and events, each a JSON message ending in a NUL byte), as Playwright
and Puppeteer drive it, so nothing listens on a port and no websocket library is needed.
``find_chromium()`` names the browser (Debian's ``chromium``; None: the test skips). Console
messages of level error, uncaught exceptions and log entries of level error (a failed request, a
Content-Security-Policy violation) are collected in ``errors``.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["Browser", "BrowserError", "find_chromium"]

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


class BrowserError(RuntimeError):
    """The browser answered a command with an error, or did not answer in time."""


def find_chromium() -> str | None:
    """The path of a Chromium this machine has (PARAMSERVE_CHROMIUM first), or None."""
    named = os.environ.get("PARAMSERVE_CHROMIUM")
    if named:
        return shutil.which(named) or (named if os.access(named, os.X_OK) else None)
    return next((path for path in map(shutil.which, CANDIDATES) if path), None)


class Browser:
    """One headless Chromium with one page (a tab); ``close()`` ends the process."""

    def __init__(self, executable: str, *, width: int = 1400, height: int = 1000, timeout: float = 30.0):
        self._timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="paramserve-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # Above 4, so that putting them at 3 and 4 in the browser never closes one of them.
        to_browser_r, from_browser_w = _above_four(to_browser_r), _above_four(from_browser_w)
        flags = [
            "--headless=new",
            "--remote-debugging-pipe",
            f"--user-data-dir={self._profile}",
            "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--hide-scrollbars",
            "--mute-audio",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        # The pipes must be fds 3 and 4 in the browser: a small Python puts them there, then execs it.
        place = (
            "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
            "os.execv(sys.argv[3], sys.argv[3:])"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", place, str(to_browser_r), str(from_browser_w), executable, *flags],
            pass_fds=(to_browser_r, from_browser_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._lock = threading.Condition()
        self._next_id = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self._events: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._reader = threading.Thread(target=self._read, name="test-chromium-reader", daemon=True)
        self._reader.start()
        self._session = ""
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self._session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    # ---------------------------------------------------------------- the protocol

    def send(self, method: str, params: Mapping[str, Any] | None = None, *, session: bool = True) -> dict[str, Any]:
        """Sends one command and returns its result; raises BrowserError for an error or no answer."""
        with self._lock:
            self._next_id += 1
            ident = self._next_id
        message: dict[str, Any] = {"id": ident, "method": method, "params": dict(params or {})}
        if session and self._session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        with self._lock:
            if not self._lock.wait_for(lambda: ident in self._answers or not self._reader.is_alive(), self._timeout):
                raise BrowserError(f"{method}: no answer within {self._timeout:g}s")
            answer = self._answers.pop(ident, None)
        if answer is None:
            raise BrowserError(f"{method}: the browser exited")
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error']}")
        return dict(answer.get("result", {}))

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._from_browser, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._lock:
                    self._lock.notify_all()
                return
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                self._receive(json.loads(raw))

    def _receive(self, message: dict[str, Any]) -> None:
        with self._lock:
            if "id" in message:
                self._answers[message["id"]] = message
            else:
                self._events.append(message)
                error = _error_of(message)
                if error is not None:
                    self.errors.append(error)
            self._lock.notify_all()

    # ---------------------------------------------------------------- what a test does

    def open(self, url: str) -> None:
        """Navigates to ``url`` and waits for its load event."""
        with self._lock:
            seen = len(self._events)
        result = self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise BrowserError(f"could not open {url}: {result['errorText']}")

        def loaded() -> bool:
            return any(e.get("method") == "Page.loadEventFired" for e in self._events[seen:])

        with self._lock:
            if not self._lock.wait_for(loaded, self._timeout):
                raise BrowserError(f"{url} did not load within {self._timeout:g}s")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, interval: float = 0.05) -> Any:
        """Evaluates ``expression`` until it is truthy; returns that value. Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{expression!r} was still falsy after {timeout:g}s")
            time.sleep(interval)  # polling the page: the browser has no callback into the test

    def screenshot(self, path: str | os.PathLike[str], *, full_page: bool = True) -> None:
        """Writes a PNG of the page (the whole page by default)."""
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": full_page})["data"]
        with open(path, "wb") as handle:
            handle.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False)
        except (BrowserError, OSError):
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        os.close(self._to_browser)
        self._reader.join(10)
        os.close(self._from_browser)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _above_four(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


def _error_of(event: Mapping[str, Any]) -> str | None:
    """What a protocol event says went wrong in the page, or None."""
    method, params = event.get("method"), event.get("params", {})
    if method == "Runtime.exceptionThrown":
        details = params.get("exceptionDetails", {})
        return f"exception: {details.get('exception', {}).get('description') or details.get('text')}"
    if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
        return (
            "console."
            + params["type"]
            + ": "
            + " ".join(str(a.get("value", a.get("description"))) for a in params.get("args", []))
        )
    if method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
        entry = params["entry"]
        return f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip()
    return None
