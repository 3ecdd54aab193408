"""``LoadResources`` owns what a load holds and frees it in one close, in order: the host
reads are stopped before the images they write into are freed, the images before the
files, and a step that fails does not keep the later ones from running."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aiogguf._core.load_resources import LoadResources
from aiogguf.io.files import open_file

pytestmark = pytest.mark.asyncio


class _Image:
    """Stands in for an image: records when it is closed."""

    def __init__(self, log: list[str], name: str) -> None:
        self._log = log
        self.name = name

    def close(self) -> None:
        self._log.append(f"free {self.name}")


class _Reads:
    """Stands in for ``HostReads``: records ``abandon``, and can fail it."""

    def __init__(self, log: list[str], error: Exception | None = None) -> None:
        self._log = log
        self._error = error

    async def abandon(self) -> None:
        self._log.append("stop reads")
        if self._error is not None:
            raise self._error


def _file(tmp_path: Path, log: list[str]) -> Any:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 4096)
    f = open_file(path)
    close = f.close

    def logged() -> None:
        log.append("close file")
        close()

    f.close = logged  # type: ignore[method-assign]
    return f


async def test_a_failed_load_is_freed_in_order(tmp_path: Path) -> None:
    log: list[str] = []
    async with LoadResources() as resources:
        resources.keep_file(_file(tmp_path, log))
        resources.make_room(3)
        resources.place(0, _Image(log, "a"))  # type: ignore[arg-type]
        resources.place(2, _Image(log, "c"))  # type: ignore[arg-type]
        resources.hold_reads(_Reads(log), lambda: log.append("close landing"))  # type: ignore[arg-type]
        threads = resources.lend(2, "aiogguf-test")
        assert await threads.run_sync(lambda: 7) == 7
        assert [i is not None for i in resources.images] == [True, False, True]
    assert log == ["stop reads", "close landing", "free a", "free c", "close file"]
    assert not any(resources.images)
    assert resources.files == []
    await resources.aclose()  # again: nothing left to free
    assert len(log) == 5


async def test_the_images_the_model_takes_are_not_freed(tmp_path: Path) -> None:
    log: list[str] = []
    async with LoadResources() as resources:
        resources.make_room(2)
        resources.place(1, _Image(log, "b"))  # type: ignore[arg-type]
        taken = resources.take_images()
    assert [image is not None for image in taken] == [False, True]
    assert log == []


async def test_a_failing_step_still_frees_the_rest(tmp_path: Path) -> None:
    log: list[str] = []
    resources = LoadResources()
    async with resources:
        resources.keep_file(_file(tmp_path, log))
        resources.make_room(1)
        resources.place(0, _Image(log, "a"))  # type: ignore[arg-type]
        resources.hold_reads(
            _Reads(log, RuntimeError("reads")),  # type: ignore[arg-type]
            lambda: log.append("close landing"),
        )
        with pytest.raises(RuntimeError, match="reads"):
            await resources.aclose(ValueError("the load failed"))
    assert log == ["stop reads", "close landing", "free a", "close file"]
