"""Issue 24, finding 1, as a server sees it: the 1.7 MB file whose block_count is 2^31
kept a load "loading" while RSS climbed to GBs, and a DELETE waited 30 s and answered 202
while the load went on. Now the file fails at once, naming the key, and a load held in
a long stage on its thread (the plan) is cancelled by a DELETE within a second."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.to_thread
import pytest
from gguf_fields import metadata_value_field, set_field
from server_helpers import running
from test_cancel_stages import N_TENSORS, _many_tensors

from aiogguf.server._app import create_app
from aiogguf.stages import plan


async def _post(http: aiohttp.ClientSession, url: str, path: Path) -> str:
    async with http.post(f"{url}/models", json={"path": str(path)}) as reply:
        body: dict[str, Any] = await reply.json()
        assert reply.status == 201, body
        return str(body["id"])


async def _state(http: aiohttp.ClientSession, url: str, load_id: str) -> dict[str, Any]:
    async with http.get(f"{url}/models/{load_id}") as reply:
        body: dict[str, Any] = await reply.json()
        return body


@pytest.mark.asyncio
async def test_finding_1_the_file_fails_at_once_in_the_server(
    reference_dir: Path, tmp_path: Path
) -> None:
    buf = (reference_dir / "tiny-llama-Q4_0.gguf").read_bytes()
    path = tmp_path / "huge-layers.gguf"
    path.write_bytes(set_field(buf, metadata_value_field(buf, "llama.block_count"), 2**31))
    async with running(create_app(roots=[tmp_path])) as url, aiohttp.ClientSession() as http:
        load_id = await _post(http, url, path)
        with anyio.fail_after(10):  # it ran for ever
            # Polled over HTTP: there is no event to wait on.
            while (state := await _state(http, url, load_id))["state"] == "loading":  # noqa: ASYNC110
                await anyio.sleep(0.02)
    assert state["state"] == "failed", state
    assert "llama.block_count" in state["error"]


@pytest.mark.asyncio
async def test_finding_1_delete_of_a_load_held_in_its_plan_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan of 20,000 tensors, slowed to 0.5 ms a tensor (10 s): a DELETE during it
    waited for the whole plan; now the plan stops within 256 tensors."""
    path = _many_tensors(tmp_path / "many.gguf", N_TENSORS)
    entered = threading.Event()
    choose = plan._choose

    @functools.wraps(choose)
    def slow_choose(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        time.sleep(0.0005)
        return choose(*args, **kwargs)

    monkeypatch.setattr(plan, "_choose", slow_choose)
    async with running(create_app(roots=[tmp_path])) as url, aiohttp.ClientSession() as http:
        load_id = await _post(http, url, path)
        assert await anyio.to_thread.run_sync(entered.wait, 60.0)
        began = time.perf_counter()
        async with http.delete(f"{url}/models/{load_id}") as reply:
            body: dict[str, Any] = await reply.json()
        took = time.perf_counter() - began
    assert reply.status == 200, body
    assert body["state"] == "cancelled"
    assert took < 5.0, f"DELETE took {took:.2f} s"
