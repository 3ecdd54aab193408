"""``handle.tensors_as_ready()``: each tensor once, as soon as it has landed and passed
its checks, while the load goes on; a bad tensor never, and the iteration then raises
the load's error; cancelling the consumer or the load leaves nothing behind.

Early delivery is made deterministic with a gate, not timing: the read (or slot fill)
of the job holding the file's last byte waits until the consumer has seen its first
tensors, so the load cannot end before then; and progress reports wake the loop at once
(``LAZY_S = 0``), since a report left for the loop's next wake-up would wait behind the
gate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from test_load_cancel import mappings_of, open_fds, our_threads, threads_in_our_code
from upload_helpers import cupy_stand_in_backend

import aiogguf
from aiogguf._events import Stage
from aiogguf._jobs import ReadJob
from aiogguf._model import ModelState
from aiogguf.errors import TensorValidationError
from aiogguf.integrity._manifest import manifest_json
from aiogguf.io import workers
from aiogguf.stages.read import Reader
from aiogguf.testing.synth import Corruption, SynthModel, write_synthetic_model

HOST_MODES = ["none", "mmap", "direct", "mlock"]
SIM = {"sim_gpus": ["name=g0,free=1GiB"], "n_gpu_layers": -1, "staging_buffer_size": "256KiB"}
BLOCK = 64 * 1024  # manifest blocks: several per tensor
GATE_S = 30.0  # a gate never opened fails the test instead of hanging it


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("stream") / "s.gguf"
    return write_synthetic_model(path, size_bytes="4MiB", seed=3, n_layer=4)


def file_bytes(model: SynthModel, name: str) -> bytes:
    t = next(t for t in model.tensors if t.name == name)
    with open(model.paths[t.shard], "rb") as f:
        f.seek(t.file_offset)
        return f.read(t.nbytes)


async def stream_all(path: Path, **overrides: Any) -> list[tuple[str, bytes]]:
    """Every ``(name, bytes)`` the stream hands out, in its order."""
    got: list[tuple[str, bytes]] = []
    async with aiogguf.load(path, **overrides).tensors_as_ready() as tensors:
        async for name, array in tensors:
            got.append((name, np.ascontiguousarray(array).tobytes()))
    return got


# --- every tensor once, each with its file's bytes -----------------------------------------


@pytest.mark.filterwarnings("ignore::aiogguf.errors.LoadWarning")  # low RLIMIT_MEMLOCK, tmpfs
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("where", [*HOST_MODES, "sim"])
def test_every_tensor_once_with_its_bytes(model: SynthModel, where: str, check: bool) -> None:
    overrides: dict[str, Any] = dict(SIM) if where == "sim" else {"mode": where}
    if where != "sim":
        overrides["n_gpu_layers"] = 0
    got = anyio.run(lambda: stream_all(model.path, check_tensors=check, **overrides))
    names = [name for name, _ in got]
    assert len(names) == len(set(names))
    assert set(names) == {t.name for t in model.tensors}
    for name, data in got:
        assert data == file_bytes(model, name), name


def test_device_tensors_come_as_device_arrays(model: SynthModel) -> None:
    """On the simulated GPU a device tensor is the array over its device buffer, the one
    ``model.tensors`` gives: written by the copies, not a host copy of them."""

    async def run() -> None:
        handle = aiogguf.load(model.path, **SIM)
        seen: dict[str, Any] = {}
        done = anyio.Event()

        async def consume() -> None:
            async for name, array in handle.tensors_as_ready():
                seen[name] = array
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            async with handle as loaded:
                await done.wait()
                on_device = [n for n in seen if loaded.plan.placement(n).buffer_type == "g0"]
                assert len(on_device) > len(seen) // 2
                for name in on_device:
                    # The same memory: a write through one shows in the other.
                    assert np.shares_memory(seen[name], loaded.tensors[name]), name

    anyio.run(run)


# --- early: before the load has ended --------------------------------------------------------


@pytest.fixture
def eager_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers, "LAZY_S", 0.0)


def gate_last_job(
    monkeypatch: pytest.MonkeyPatch, model: SynthModel, method: str
) -> tuple[threading.Event, list[ReadJob]]:
    """Hold ``Reader.<method>`` for the job that holds the file's last tensor byte until
    the returned event is set; the list gets each job held."""
    end = max(t.file_offset + t.nbytes for t in model.tensors)
    go = threading.Event()
    held: list[ReadJob] = []
    original: Callable[..., None] = getattr(Reader, method)

    def gated(self: Reader, job: ReadJob, *args: Any) -> None:
        if job.useful_end >= end:
            held.append(job)
            assert go.wait(GATE_S), "the consumer never saw a tensor while the load ran"
        original(self, job, *args)

    monkeypatch.setattr(Reader, method, gated)
    return go, held


async def first_while_loading(
    model: SynthModel, go: threading.Event, wanted: Callable[[str], bool], **overrides: Any
) -> tuple[str, Stage | None, bool]:
    """Stream the whole load; open ``go`` at the first wanted tensor. Returns its name,
    the last progress stage and the tensors loaded then, and checks the rest came too."""
    handle = aiogguf.load(model.path, readers=4, chunk_size="256KiB", **overrides)
    first: tuple[str, Stage | None, bool] | None = None
    names = []
    async with handle.tensors_as_ready() as tensors:
        async for name, _array in tensors:
            names.append(name)
            if first is None and wanted(name):
                last = handle.hub.last
                first = (name, last.stage if last else None, handle.model is not None)
                go.set()
    assert first is not None
    assert sorted(names) == sorted(t.name for t in model.tensors)
    return first


@pytest.mark.usefixtures("eager_reports")
@pytest.mark.filterwarnings("ignore::aiogguf.errors.LoadWarning")
@pytest.mark.parametrize("mode", HOST_MODES)
def test_a_host_tensor_comes_before_the_load_ends(
    model: SynthModel, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    go, held = gate_last_job(monkeypatch, model, "read")
    name, stage, loaded = anyio.run(
        lambda: first_while_loading(model, go, lambda n: True, mode=mode, n_gpu_layers=0)
    )
    assert len(held) == 1
    assert stage is not Stage.DONE, name
    assert not loaded, name


@pytest.mark.usefixtures("eager_reports")
def test_a_device_tensor_comes_before_the_load_ends(
    model: SynthModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device tensor is handed on once its copies have completed, not when the last
    copy of the load has (the job with the file's last byte waits at the gate)."""
    plan = aiogguf.plan_sync(model.path, **SIM)
    on_device = {t.name for t in plan.tensors if t.buffer_type == "g0"}
    go, held = gate_last_job(monkeypatch, model, "fill_slot")
    name, stage, loaded = anyio.run(
        lambda: first_while_loading(model, go, on_device.__contains__, **SIM)
    )
    assert len(held) == 1
    assert stage is not Stage.DONE, name
    assert not loaded, name


# --- bad tensors ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> tuple[SynthModel, set[str]]:
    d = tmp_path_factory.mktemp("bad")
    args: dict[str, Any] = {"size_bytes": "3MiB", "types": "all-types", "include_q2_0": False}
    clean = write_synthetic_model(d / "clean.gguf", seed=21, **args)
    q4k = clean.tensors_of_type("Q4_K")[0].name
    f16 = clean.tensors_of_type("F16")[-1].name
    corruptions = [Corruption(q4k, "nan_scale", 5), Corruption(f16, "inf_element", 1234)]
    bad = write_synthetic_model(d / "bad.gguf", corruptions=corruptions, seed=21, **args)
    return bad, {q4k, f16}


@pytest.mark.filterwarnings("ignore::aiogguf.errors.LoadWarning")
@pytest.mark.parametrize("where", [*HOST_MODES, "sim"])
def test_bad_tensors_never_come_and_the_iteration_raises(
    damaged: tuple[SynthModel, set[str]], where: str
) -> None:
    bad, wrong = damaged
    overrides: dict[str, Any] = dict(SIM) if where == "sim" else {"mode": where}
    names: list[str] = []

    async def run() -> None:
        async with aiogguf.load(bad.path, **overrides).tensors_as_ready() as tensors:
            async for name, _array in tensors:
                names.append(name)

    with pytest.raises(TensorValidationError) as info:
        anyio.run(run)
    assert {f.name for f in info.value.failures} == wrong
    assert not wrong & set(names)
    assert len(names) == len(set(names))


def test_a_manifest_holds_every_tensor_for_its_verdict(tmp_path: Path) -> None:
    """With a hash manifest a tensor's last blocks may be hashed only at the end: every
    tensor comes after the verdict, and none of a model that fails it."""
    clean = write_synthetic_model(tmp_path / "m.gguf", size_bytes="1MiB", seed=4, n_layer=2)
    sidecar = Path(f"{clean.path}.manifest.json")
    sidecar.write_text(manifest_json(aiogguf.hash_model_sync(clean.path, block_bytes=BLOCK)))
    got = anyio.run(lambda: stream_all(clean.path, manifest="auto", mode="none"))
    assert {n for n, _ in got} == {t.name for t in clean.tensors}
    # One bit of the biggest tensor flipped: a value still finite, which only the
    # manifest sees.
    big = max(clean.tensors, key=lambda t: t.nbytes)
    with open(clean.path, "r+b") as f:
        f.seek(big.file_offset + 64)
        byte = f.read(1)[0]
        f.seek(big.file_offset + 64)
        f.write(bytes([byte ^ 1]))
    names: list[str] = []

    async def run() -> None:
        async with aiogguf.load(clean.path, manifest="auto", mode="none").tensors_as_ready() as t:
            async for name, _array in t:
                names.append(name)

    with pytest.raises(aiogguf.IntegrityError) as info:
        anyio.run(run)
    assert [f.name for f in info.value.failures] == [big.name]
    assert names == []


def test_the_error_is_raised_at_the_block_when_the_loop_did_not_meet_it(
    damaged: tuple[SynthModel, set[str]],
) -> None:
    """A block that stops iterating once the load has failed still learns of it."""
    bad, _ = damaged

    async def run() -> None:
        handle = aiogguf.load(bad.path, mode="none")
        async with handle.tensors_as_ready():
            async for _event in handle.events():  # to the final one: the load failed
                pass

    with pytest.raises(TensorValidationError):
        anyio.run(run)


# --- the other shape: a consumer task beside ``async with handle`` -------------------------


def test_a_consumer_task_beside_the_load(model: SynthModel) -> None:
    async def run() -> None:
        handle = aiogguf.load(model.path, mode="none")
        names: list[str] = []
        done = anyio.Event()

        async def consume() -> None:
            async for name, _array in handle.tensors_as_ready():
                names.append(name)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            async with handle as loaded:
                await done.wait()  # the arrays are views: consume before leaving
                assert sorted(names) == sorted(loaded.tensors)

    anyio.run(run)


def test_a_cancelled_load_ends_a_consumer_task_with_an_error(model: SynthModel) -> None:
    async def run() -> None:
        handle = aiogguf.load(model.path, mode="none", chunk_size="256KiB")
        failure: list[BaseException] = []

        async def consume() -> None:
            try:
                async for _ in handle.tensors_as_ready():
                    pass
            except aiogguf.LoadError as exc:
                failure.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.CancelScope() as scope:
                scope.cancel()
                async with handle:
                    pytest.fail("a cancelled load returns no model")
        assert len(failure) == 1
        assert "cancelled" in str(failure[0])

    anyio.run(run)


def test_a_handle_loads_once(model: SynthModel) -> None:
    async def run() -> None:
        handle = aiogguf.load(model.path, mode="none")
        async with handle:
            with pytest.raises(RuntimeError, match="loads once"):
                async with handle.tensors_as_ready():
                    pass

    anyio.run(run)


# --- cancellation and leaving early leave nothing behind -----------------------------------


def _nothing_left(model: SynthModel, fds_before: dict[int, str]) -> Iterator[str]:
    if open_fds() != fds_before:
        yield "descriptors"
    if mappings_of(list(model.paths)):
        yield "mappings"
    if threads_in_our_code() or our_threads():
        yield "threads"


async def _settle() -> None:
    for _ in range(200):
        if not threads_in_our_code() and not our_threads():
            return
        await anyio.sleep(0.01)


@pytest.mark.filterwarnings("ignore::aiogguf.errors.LoadWarning")
@pytest.mark.parametrize("how", ["break", "raise", "cancel"])
@pytest.mark.parametrize("where", ["mmap", "none", "sim"])
def test_leaving_early_ends_the_load_cleanly(model: SynthModel, how: str, where: str) -> None:
    overrides: dict[str, Any] = dict(SIM) if where == "sim" else {"mode": where}

    async def consume(tensors: aiogguf.TensorStream, scope: anyio.CancelScope) -> None:
        # In a frame of its own: an array still referenced would keep its memory (and,
        # mapped, the file's mapping and descriptor), as one of ``Model.tensors`` does.
        async for _name, _array in tensors:
            if how == "break":
                break
            if how == "raise":
                raise KeyError("the consumer failed")
            scope.cancel()
            await anyio.sleep(1)  # cancelled here

    async def run() -> None:
        fds_before = open_fds()
        handle = aiogguf.load(model.path, chunk_size="256KiB", **overrides)
        with anyio.fail_after(GATE_S), anyio.CancelScope() as scope:
            try:
                async with handle.tensors_as_ready() as tensors:
                    await consume(tensors, scope)
            except KeyError:
                assert how == "raise"
        await _settle()
        assert list(_nothing_left(model, fds_before)) == []
        if handle.model is not None:
            assert handle.model.state is ModelState.CLOSED

    anyio.run(run)


def test_a_slow_consumer_does_not_hold_the_load(model: SynthModel) -> None:
    """The load ends while the consumer has taken one tensor: what waits for it is the
    list of names, and each array is made when it is taken."""

    async def run() -> None:
        handle = aiogguf.load(model.path, mode="none")
        async with handle.tensors_as_ready() as tensors:
            iterator = aiter(tensors)
            await anext(iterator)
            with anyio.fail_after(GATE_S):
                async for _event in handle.events():  # to the final one
                    pass
            last = handle.hub.last
            assert last is not None
            assert last.stage is Stage.DONE
            rest = [name async for name, _ in iterator]
            assert len(rest) == len(model.tensors) - 1

    anyio.run(run)


@pytest.mark.parametrize("where", ["none", "sim"])
def test_torch_tensors_as_ready(model: SynthModel, where: str) -> None:
    """``tensors.torch()``: each tensor as ``Model.torch`` gives it, over the same memory."""
    torch = pytest.importorskip("torch")
    overrides: dict[str, Any] = dict(SIM) if where == "sim" else {"mode": where}

    async def run() -> None:
        handle = aiogguf.load(model.path, **overrides)
        seen: dict[str, Any] = {}
        done = anyio.Event()

        async def consume() -> None:
            async for name, tensor in handle.tensors_as_ready().torch():
                seen[name] = tensor
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            async with handle as loaded:
                await done.wait()
                assert sorted(seen) == sorted(loaded.tensors)
                for name, tensor in seen.items():
                    want = loaded.torch(name)
                    assert isinstance(tensor, torch.Tensor)
                    assert (tensor.dtype, tensor.shape) == (want.dtype, want.shape), name
                    assert tensor.data_ptr() == want.data_ptr(), name

    anyio.run(run)


def test_keep_invalid_skips_the_bad_tensors_and_ends(damaged: tuple[SynthModel, set[str]]) -> None:
    bad, wrong = damaged
    got = anyio.run(lambda: stream_all(bad.path, mode="mmap", keep_invalid=True))
    names = {name for name, _ in got}
    assert names == {t.name for t in bad.tensors} - wrong


@pytest.mark.usefixtures("eager_reports")
def test_cupy_backend_device_tensors_stream_as_cupy_arrays(
    model: SynthModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CuPy backend (on its stand-in): a device tensor comes as a CuPy array holding
    its file's bytes, before the load ends (its copies' events are what say so)."""
    with cupy_stand_in_backend() as cupy:
        overrides: dict[str, Any] = {"n_gpu_layers": -1, "staging_buffer_size": "256KiB"}
        plan = aiogguf.plan_sync(model.path, **overrides)
        on_device = {t.name for t in plan.tensors if t.buffer_type == "CUDA0"}
        assert on_device
        go, held = gate_last_job(monkeypatch, model, "fill_slot")
        name, stage, loaded = anyio.run(
            lambda: first_while_loading(model, go, on_device.__contains__, **overrides)
        )
        assert len(held) == 1
        assert stage is not Stage.DONE, name
        assert not loaded, name
        got: dict[str, Any] = {}

        async def run() -> None:
            async with aiogguf.load(model.path, **overrides).tensors_as_ready() as tensors:
                async for n, array in tensors:
                    if n in on_device:
                        assert isinstance(array, cupy.ndarray), n
                        got[n] = cupy.asnumpy(array).tobytes()

        anyio.run(run)
        assert set(got) == on_device
        for n, data in got.items():
            assert data == file_bytes(model, n), n
