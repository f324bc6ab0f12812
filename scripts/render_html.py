"""Open an HTML file in headless Chromium through the DevTools protocol: its console errors, uncaught exceptions
and failed loads, and a full-page PNG screenshot. The tests use it on the what-if report; by hand:

    python scripts/render_html.py docs/report-example/report.html -o /tmp/report.png

The protocol runs over a pipe (--remote-debugging-pipe: commands on fd 3, replies on fd 4, NUL-separated JSON),
so nothing beyond the standard library and a `chromium` (or chrome) binary is needed.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_browser() -> str | None:
    return next((p for b in BROWSERS if (p := shutil.which(b))), None)


@dataclass
class Rendered:
    """What the page did: console errors and exceptions (text), the loaded page's size, the screenshot's path."""

    errors: list[str] = field(default_factory=list)
    width: int = 0
    height: int = 0
    screenshot: Path | None = None


class _Pipe:
    def __init__(self, binary: str, profile_dir: str) -> None:
        r_cmd, w_cmd = os.pipe()  # we write commands, chromium reads fd 3
        r_out, w_out = os.pipe()  # chromium writes fd 4, we read
        flags = [
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile_dir}",
            "about:blank",
        ]

        def onto_3_and_4() -> None:  # in the child: the pipe ends where the browser expects them
            a, b = os.dup(r_cmd), os.dup(w_out)  # first out of the way, in case either end already is 3 or 4
            os.dup2(a, 3)
            os.dup2(b, 4)

        # close_fds=False: the close-fds pass runs after preexec_fn and would close 3 and 4 again
        self.proc = subprocess.Popen(
            [binary, *flags],
            preexec_fn=onto_3_and_4,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(r_cmd)
        os.close(w_out)
        self.w, self.r = w_cmd, r_out
        self.buf = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None, timeout: float = 30.0
    ) -> dict[str, Any]:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        while True:
            m = self.read(timeout)
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def read(self, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while b"\0" not in self.buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.r], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self.r, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the pipe")
            self.buf += chunk
        msg, _, self.buf = self.buf.partition(b"\0")
        return json.loads(msg)

    def wait_for(self, method: str, timeout: float) -> None:
        if any(e.get("method") == method for e in self.events):
            return
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = self.read(end - time.monotonic())
            self.events.append(m)
            if m.get("method") == method:
                return
        raise TimeoutError(f"no {method} within {timeout} s")

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.w)
        os.close(self.r)


def _errors(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        p = e.get("params", {})
        if e.get("method") == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
        elif e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
        elif e.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            entry = p["entry"]
            out.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())
    return out


def render(
    path: str | Path, png: str | Path | None = None, width: int = 1280, binary: str | None = None, timeout: float = 60.0
) -> Rendered:
    """Load file `path` in headless Chromium; its errors, and with `png` a full-page screenshot there."""
    binary = binary or find_browser()
    if binary is None:
        raise FileNotFoundError("no chromium or chrome binary on PATH")
    url = Path(path).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="xsched-chromium-") as profile_dir:
        pipe = _Pipe(binary, profile_dir)
        try:
            target = next(
                t for t in pipe.send("Target.getTargets", timeout=timeout)["targetInfos"] if t["type"] == "page"
            )
            session = pipe.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                pipe.send(f"{domain}.enable", session=session)
            pipe.send(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
                session,
            )
            pipe.events.clear()
            pipe.send("Page.navigate", {"url": url}, session)
            pipe.wait_for("Page.loadEventFired", timeout)
            size = pipe.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
            out = Rendered(_errors(pipe.events), int(size["width"]), int(size["height"]))
            if png is not None:
                clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
                shot = pipe.send(
                    "Page.captureScreenshot",
                    {"format": "png", "clip": clip, "captureBeyondViewport": True},
                    session,
                    timeout,
                )
                Path(png).write_bytes(base64.b64decode(shot["data"]))
                out.screenshot = Path(png)
            out.errors = _errors(pipe.events)  # with anything logged while painting the screenshot
            return out
        finally:
            pipe.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("html")
    ap.add_argument("-o", "--output", help="PNG screenshot of the whole page")
    ap.add_argument("--width", type=int, default=1280)
    a = ap.parse_args()
    r = render(a.html, a.output, a.width)
    print(
        f"{a.html}: {r.width}x{r.height} px, {len(r.errors)} errors" + (f" -> {r.screenshot}" if r.screenshot else "")
    )
    for e in r.errors:
        print("  " + e)
    return 1 if r.errors else 0


if __name__ == "__main__":
    sys.exit(main())
