"""Headless Chromium driven over the DevTools protocol (CDP) with a tiny websocket client.

Debian's `chromium` package (`.ci/install-debian-package.sh chromium chromium`); `CHROMIUM` is None where it is absent,
and tests that need it skip. Every console error and uncaught exception of the page is kept in
`Browser.errors`, so a test can assert that a page ran without a JavaScript error.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",  # chromium picks a free port and prints it
)
_DEVTOOLS_URL = re.compile(r"DevTools listening on (ws://\S+)")


class Browser:
    """One headless Chromium with a fresh profile and one page, closed by `close()`."""

    def __init__(self, width: int = 1440, height: int = 1100, timeout_s: float = 60.0) -> None:
        assert CHROMIUM is not None, "chromium is not installed"
        self.profile = tempfile.mkdtemp(prefix="pagedserve-chromium-")
        self.errors: list[str] = []
        self._ids = itertools.count(1)
        self._stack = contextlib.ExitStack()
        self.process = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}"]
            + ["about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            browser_url = self._read_devtools_url(timeout_s)
            self._socket = self._stack.enter_context(
                connect(browser_url, max_size=64 * 2**20, open_timeout=timeout_s)
            )
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            session = self.call("Target.attachToTarget", targetId=target, flatten=True)
            self._session = session["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                self.call(f"{domain}.enable", session=True)
            self.call(
                "Emulation.setDeviceMetricsOverride",
                session=True,
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self.close()
            raise

    def _read_devtools_url(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        assert self.process.stderr is not None
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line and self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.process.returncode}")
            match = _DEVTOOLS_URL.search(line)
            if match:
                return match.group(1)
        raise RuntimeError("chromium did not print its DevTools URL in time")

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        """Send one CDP command and return its result, recording page errors seen meanwhile."""
        message_id = next(self._ids)
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        self._socket.send(json.dumps(message))
        while True:
            reply = json.loads(self._socket.recv(timeout=60))
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._record(reply)

    def _record(self, event: dict[str, Any]) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            description = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"uncaught: {description}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            texts = [str(arg.get("value", arg.get("description", ""))) for arg in params["args"]]
            self.errors.append("console.error: " + " ".join(texts))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(
                f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}"
            )

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate", session=True, expression=expression, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll `expression` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.2)

    def screenshot(self, path: Path) -> Path:
        data = self.call(
            "Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True
        )
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stack.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)
