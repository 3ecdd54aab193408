"""The status page (``GET /``) in a real headless browser: Debian's chromium driven by
chromedriver over the W3C WebDriver protocol (plain JSON over HTTP on 127.0.0.1, so no
client library and nothing that fetches drivers), against a real server on 127.0.0.1
with a token. Skips where chromium or chromedriver is not installed (``.ci/run``
installs them on Debian)."""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from server_helpers import running

from aiogguf.server._app import LoadState, ServerPolicy, create_app, registry_of
from aiogguf.server._policy import REQUEST_KEYS
from aiogguf.server._status_page import CONTENT_SECURITY_POLICY
from aiogguf.testing.synth import write_synthetic_model

TOKEN = "s3cret-t0ken"
# A simulated GPU slow enough that a 32 MiB load takes about two seconds, through 1 MiB
# chunks and staging buffers, so that its progress moves a chunk at a time: the page sees
# it on its way before it is ready.
SLOW_GPU = "name=g0,free=1GiB,bandwidth=16MiB"
SLOW_LOAD = {
    "sim_gpus": [SLOW_GPU],
    "n_gpu_layers": -1,
    "chunk_size": "1MiB",
    "staging_buffer_size": "1MiB",
}
POLICY = ServerPolicy(
    token=TOKEN, request_keys=REQUEST_KEYS | {"sim_gpus", "chunk_size", "staging_buffer_size"}
)
# Generous: these tell "shows" from "never shows", not fast from slow.
WITHIN_S = 60
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("chromium and chromedriver are not installed (apt-get install chromium-driver)")
    return chromium, driver


@contextlib.contextmanager
def chromedriver(driver: str) -> Iterator[str]:
    """chromedriver on an ephemeral port of 127.0.0.1; yields its base URL."""
    proc = subprocess.Popen([driver, "--port=0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + WITHIN_S
        said = b""
        # Read the raw descriptor, not the buffered file: a line already in the file's
        # buffer would not make ``select`` say so.
        while (found := re.search(rb"started successfully on port (\d+)", said)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"chromedriver did not say its port within {WITHIN_S} s: {said!r}")
            readable, _, _ = select.select([fd], [], [], left)
            if readable:
                chunk = os.read(fd, 4096)
                if not chunk:
                    pytest.fail(f"chromedriver ended ({proc.wait()}) before listening: {said!r}")
                said += chunk
        yield f"http://127.0.0.1:{int(found.group(1))}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


class Browser:
    """One WebDriver session: the few commands the test needs."""

    def __init__(self, http: aiohttp.ClientSession, session_url: str) -> None:
        self.http = http
        self.url = session_url

    async def command(self, method: str, path: str, body: Any = None) -> Any:
        async with self.http.request(method, f"{self.url}{path}", json=body) as r:
            reply = await r.json()
            assert r.status == 200, reply
            return reply["value"]

    async def go(self, url: str) -> None:
        await self.command("POST", "/url", {"url": url})

    async def run(self, script: str, *args: Any) -> Any:
        return await self.command("POST", "/execute/sync", {"script": script, "args": list(args)})

    async def type_into(self, selector: str, text: str) -> None:
        element = await self.command(
            "POST", "/element", {"using": "css selector", "value": selector}
        )
        element_id = next(iter(element.values()))
        await self.command("POST", f"/element/{element_id}/value", {"text": text})

    async def click(self, selector: str) -> None:
        element = await self.command(
            "POST", "/element", {"using": "css selector", "value": selector}
        )
        await self.command("POST", f"/element/{next(iter(element.values()))}/click", {})

    async def until(self, script: str, done: Callable[[Any], bool], *args: Any) -> list[Any]:
        """Run ``script`` until ``done`` holds of its value (bounded); every value seen."""
        seen: list[Any] = []
        with anyio.fail_after(WITHIN_S):
            while True:
                value = await self.run(script, *args)
                if not seen or seen[-1] != value:
                    seen.append(value)
                if done(value):
                    return seen
                await anyio.sleep(0.05)


@contextlib.asynccontextmanager
async def browser(chromium: str, driver_url: str, profile: Path) -> AsyncIterator[Browser]:
    capabilities = {
        "capabilities": {
            "alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {
                    "binary": chromium,
                    "args": [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"],
                },
            }
        }
    }
    timeout = aiohttp.ClientTimeout(total=WITHIN_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.post(f"{driver_url}/session", json=capabilities) as r:
            reply = await r.json()
            assert r.status == 200, reply
        session_url = f"{driver_url}/session/{reply['value']['sessionId']}"
        try:
            yield Browser(http, session_url)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(WITHIN_S):
                async with http.delete(session_url):
                    pass


ROW = """
const row = document.querySelector(`tr[data-id="${arguments[0]}"]`);
if (!row) return null;
const text = (name) => row.querySelector("td." + name).textContent;
return {state: text("state"), progress: text("progress"), leases: text("leases")};
"""
NOTE_AND_ROWS = """
return {note: document.getElementById("note").textContent,
        rows: document.querySelectorAll("#models tr").length};
"""


@pytest.mark.asyncio
async def test_the_page_shows_a_load_reach_100_percent_and_its_leases(tmp_path: Path) -> None:
    chromium, driver = browser_paths()
    path = tmp_path / "m.gguf"
    write_synthetic_model(path, size_bytes="32MiB", seed=1, n_layer=2)
    app = create_app(roots=[tmp_path], policy=POLICY)
    registry = registry_of(app)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with chromedriver(driver) as driver_url:
        async with (
            running(app) as url,
            aiohttp.ClientSession(headers=auth) as http,
            browser(chromium, driver_url, tmp_path / "profile") as page,
        ):
            await page.go(f"{url}/")
            # Without the token the page shows no data, only why.
            seen = await page.until(NOTE_AND_ROWS, lambda v: "token" in v["note"])
            assert seen[-1]["rows"] == 0
            await page.type_into("#token", TOKEN)
            await page.click("#auth button")
            await page.until(NOTE_AND_ROWS, lambda v: v["note"] == "")

            body = {"path": str(path), "config": SLOW_LOAD}
            async with http.post(f"{url}/models", json=body) as r:
                assert r.status == 201, await r.text()
                load_id = (await r.json())["id"]
            states = await page.until(
                ROW, lambda v: v is not None and v["state"] == "ready", load_id
            )
            entry = registry.entries[load_id]
            assert entry.state is LoadState.READY
            progress = [v["progress"] for v in states if v is not None]
            assert progress[-1] == "100%"
            # Live progress from the event stream: somewhere on the way.
            assert any(0 < int(p.rstrip("%")) < 100 for p in progress if p), progress
            assert any(v["state"].startswith("loading") for v in states if v is not None), states
            assert states[-1]["leases"] == "0"

            with registry.lease(entry):
                await page.until(ROW, lambda v: v["leases"] == "1", load_id)
                with registry.lease(entry):
                    await page.until(ROW, lambda v: v["leases"] == "2", load_id)
            await page.until(ROW, lambda v: v["leases"] == "0", load_id)
            print(f"progress the page showed: {progress}")


@pytest.mark.asyncio
async def test_the_page_is_served_with_a_strict_policy_and_no_data(tmp_path: Path) -> None:
    app = create_app(roots=[tmp_path], policy=ServerPolicy(token=TOKEN))
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/") as r:
            assert r.status == 200
            assert r.content_type == "text/html"
            page = await r.text()
            assert r.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
            assert r.headers["X-Content-Type-Options"] == "nosniff"
        async with http.get(f"{url}/models") as r:
            assert r.status == 401
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY
    assert "'unsafe-inline'" not in CONTENT_SECURITY_POLICY
    assert str(tmp_path) not in page
    # No third-party asset: nothing is fetched from anywhere but this server.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
