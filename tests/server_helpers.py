"""Helpers shared by the server tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from aiogguf.server._transport import ConnectionGuard, GuardedSite


@contextlib.asynccontextmanager
async def running(app: web.Application, *, guarded: bool = False) -> AsyncIterator[str]:
    """Serve ``app`` on an ephemeral port of 127.0.0.1; yields its base URL.
    ``guarded``: through the connection handler ``aiogguf.server._app.serve`` uses (a
    connection cap, aiohttp's own rejections in JSON)."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site: web.BaseSite
        if guarded:
            site = GuardedSite(runner, "127.0.0.1", 0, ConnectionGuard(64), keepalive_timeout=10)
        else:
            site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def post(
    http: aiohttp.ClientSession, url: str, path: Path | str, **config: Any
) -> tuple[int, dict[str, Any]]:
    """``POST /models`` of ``path`` with ``config``: the status and the JSON reply."""
    async with http.post(f"{url}/models", json={"path": str(path), "config": config}) as r:
        assert r.content_type == "application/json", await r.text()
        body: dict[str, Any] = await r.json()
        return r.status, body
