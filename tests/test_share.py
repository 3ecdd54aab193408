"""Shareable images and the model share (issue 37): a model loaded with ``[load]
shareable = true`` reaches another process through ``share_model`` and
``open_shared_model``, over the server's memory, without a copy.

Oracle: ``gguf.GGUFReader`` on the reference files and a synthetic model, compared with
what a real second process (tests/share_worker.py, the descriptors sent over a
``socket.socketpair`` with ``SCM_RIGHTS``) reads through ``raw`` and ``torch``. Also: a
client's write stays in that client; three clients add little to the machine's Pss; a
lying description raises ``LoadError``; a plain load keeps private anonymous memory.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
import random
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from conftest import reference_files

import aiogguf
from aiogguf._images import DeviceImage, HostImage, MappedImage
from aiogguf.errors import LoadError, TensorValidationError
from aiogguf.io._devices.arena import device_arenas
from aiogguf.io._devices.cpu import CpuDevice
from aiogguf.io._devices.sim import SimDevice
from aiogguf.io.buffers import HostBuffer, sealed_memfd
from aiogguf.resident import ModelShare, open_shared_model, share_model
from aiogguf.resident._records_json import RecordError, from_json, to_json
from aiogguf.testing.synth import Corruption, write_synthetic_model

WORKER = Path(__file__).with_name("share_worker.py")
_HEADER = struct.Struct("<II")
GiB = 1024**3
SPLIT_FIRST = "tiny-llama-Q4_K_M-split-00001-of-00003.gguf"
SIM = {"sim_gpus": ["4GiB"], "n_gpu_layers": 99}
PLACEMENTS: dict[str, dict[str, Any]] = {
    "none": {"mode": "none"},
    "mmap": {"mode": "mmap"},
    "sim-gpu": {"mode": "none", **SIM},
}


class Client:
    """A second process that opens what this one shares (tests/share_worker.py)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = ours
        self.sock.settimeout(60)
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._pending = b""

    def ask(self, command: str, share: ModelShare | None = None) -> Any:
        description = share.description if share is not None else b""
        fds = list(share.fds) if share is not None else []
        socket.send_fds(self.sock, [_HEADER.pack(len(command), len(description))], fds)
        self.sock.sendall(command.encode() + description)
        while b"\n" not in self._pending:
            part = self.sock.recv(1 << 20)
            assert part, "the client process ended"
            self._pending += part
        line, self._pending = self._pending.split(b"\n", 1)
        reply = json.loads(line)
        assert not (isinstance(reply, dict) and "error" in reply), reply.get("error")
        return reply

    def close(self) -> None:
        try:
            socket.send_fds(self.sock, [_HEADER.pack(4, 0)], [])
            self.sock.sendall(b"exit")
            self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.sock.close()


@pytest.fixture
def client() -> Iterator[Client]:
    c = Client()
    try:
        yield c
    finally:
        c.close()


@functools.cache
def reader_digests(paths: tuple[Path, ...]) -> dict[str, str]:
    """name → sha256 of the tensor's bytes as ``gguf.GGUFReader`` reads them."""
    out: dict[str, str] = {}
    for path in paths:
        for t in gguf.GGUFReader(path).tensors:
            data = np.ascontiguousarray(t.data).view(np.uint8).tobytes()
            out[t.name] = hashlib.sha256(data).hexdigest()
    return out


def server_digests(model: aiogguf.Model) -> dict[str, str]:
    return {name: hashlib.sha256(bytes(model.raw(name))).hexdigest() for name in model.tensors}


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("share") / "synth.gguf"
    write_synthetic_model(path, size_bytes="4MiB", seed=37, include_q2_0=False)
    return path


# --- through a second process: the oracle --------------------------------------------


@pytest.mark.parametrize("placement", ["none", "mmap"])
def test_reference_files_through_a_second_process(
    client: Client, placement: str, reference_dir: Path
) -> None:
    """Every reference file (and the split set), shared and opened in another process,
    reads as GGUFReader reads it, through ``raw`` and ``torch``."""
    names = [n for n in reference_files() if "-split-" not in n or n == SPLIT_FIRST]
    for name in names:
        path = reference_dir / name
        paths = (
            tuple(sorted(reference_dir.glob("tiny-llama-Q4_K_M-split-*.gguf")))
            if name == SPLIT_FIRST
            else (path,)
        )
        expected = reader_digests(paths)
        with (
            aiogguf.load_sync(path, shareable=True, **PLACEMENTS[placement]) as model,
            share_model(model) as share,
        ):
            got = client.ask("digest", share)
        assert set(got) == set(expected), name
        for tensor, (raw, through_torch) in got.items():
            assert raw == expected[tensor], f"{name}: {tensor}"
            assert through_torch == expected[tensor], f"{name}: {tensor} (torch)"


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_synthetic_model_through_a_second_process(
    client: Client, synth: Path, placement: str
) -> None:
    expected = reader_digests((synth,))
    with (
        aiogguf.load_sync(synth, shareable=True, **PLACEMENTS[placement]) as model,
        share_model(model) as share,
    ):
        if placement == "sim-gpu":
            kinds = {type(image) for image in model._images}
            assert DeviceImage in kinds
            assert HostImage in kinds
        got = client.ask("digest", share)
    assert {name: pair[0] for name, pair in got.items()} == expected
    assert {name: pair[1] for name, pair in got.items()} == expected


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_a_client_write_stays_in_that_client(synth: Path, placement: str) -> None:
    """A write through one client's torch tensor changes the tensor there, and nothing
    the server or a second client sees (the server's memory is mapped copy-on-write)."""
    with aiogguf.load_sync(synth, shareable=True, **PLACEMENTS[placement]) as model:
        before = server_digests(model)
        # A tensor on the simulated GPU where there is one: its memory is shared too.
        images = model._images

        def on_device(n: str) -> bool:
            return isinstance(images[model._slots[n].buffer_index], DeviceImage)

        name = next(n for n in model.tensors if placement != "sim-gpu" or on_device(n))
        writer, reader = Client(), Client()
        try:
            with share_model(model) as share:
                writer.ask("open", share)
            written = writer.ask(f"write {name}")
            assert written[name][0] != before[name], "the write did not land in the writer"
            assert {n: d[0] for n, d in written.items() if n != name} == {
                n: d for n, d in before.items() if n != name
            }
            assert server_digests(model) == before
            with share_model(model) as share:
                seen = reader.ask("digest", share)
            assert {n: d[0] for n, d in seen.items()} == before
            assert {n: d[1] for n, d in seen.items()} == before
        finally:
            writer.close()
            reader.close()
        assert server_digests(model) == before


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise AssertionError("no Pss")


def test_three_clients_add_little_to_the_machines_pss(tmp_path: Path) -> None:
    """Three processes attached to one resident model (64 MiB), each having read every
    page of it, add less than 10% of the model to the sum of Pss, server included: the
    pages are the server's, not copies."""
    path = tmp_path / "m.gguf"
    write_synthetic_model(path, size_bytes="64MiB", seed=3, include_q2_0=False)
    clients = [Client() for _ in range(3)]
    try:
        with aiogguf.load_sync(path, shareable=True, mode="none") as model:
            nbytes = model.report.nbytes
            for c in clients:
                c.ask("pss")  # imported and running: the baseline counts that
            pids = [os.getpid(), *(c.process.pid for c in clients)]
            before = sum(_pss_kib(pid) for pid in pids)
            for c in clients:
                with share_model(model) as share:
                    c.ask("attach", share)
                c.ask("touch")
            after = sum(_pss_kib(pid) for pid in pids)
            added = (after - before) * 1024
            assert added < 0.10 * nbytes, f"{added} bytes added for a model of {nbytes}"
    finally:
        for c in clients:
            c.close()


# --- the load side ---------------------------------------------------------------------


def _memfd_maps() -> int:
    with open("/proc/self/maps", encoding="ascii") as f:
        return sum("memfd:aiogguf-image" in line for line in f)


@pytest.mark.parametrize("mode", ["none", "mmap"])
def test_a_plain_load_keeps_private_memory_and_cannot_be_shared(synth: Path, mode: str) -> None:
    """Without ``shareable`` a load's host images are private anonymous memory (no memfd
    mapped), its mappings keep no descriptor, and sharing it names the file."""
    before = _memfd_maps()
    with aiogguf.load_sync(synth, mode=mode) as model:
        assert _memfd_maps() == before
        for image in model._images:
            if isinstance(image, HostImage):
                assert not image.buffer.shareable
                with pytest.raises(ValueError, match="private memory"):
                    image.buffer.fileno()
            elif isinstance(image, MappedImage):
                for mapping in image.mappings:
                    with pytest.raises(ValueError, match="no descriptor"):
                        mapping.fileno()
        with pytest.raises(LoadError, match="shareable") as caught:
            share_model(model)
        assert caught.value.path == str(synth)


def test_a_shareable_load_maps_memfds(synth: Path) -> None:
    before = _memfd_maps()
    with aiogguf.load_sync(synth, mode="none", shareable=True) as model:
        assert _memfd_maps() > before
        assert all(i.buffer.shareable for i in model._images if isinstance(i, HostImage))


def test_a_plain_host_buffer_is_private_anonymous() -> None:
    buffer = HostBuffer(1 << 20)
    try:
        address = buffer.address
        with open("/proc/self/maps", encoding="ascii") as f:
            spans = [(ln, ln.split()[0].split("-")) for ln in f]
        line = next(ln for ln, (lo, hi) in spans if int(lo, 16) <= address < int(hi, 16))
        fields = line.split()
        assert fields[1].endswith("p"), line  # private
        assert len(fields) == 5 or fields[5] == "", line  # anonymous: no file
    finally:
        buffer.close()


def test_direct_reads_land_in_shareable_memory(disk_dir: Path, client: Client) -> None:
    """``O_DIRECT`` reads into memfd memory work (or the load falls back to buffered
    reads, as it does on a filesystem that refuses them): the bytes are the file's."""
    path = disk_dir / "direct.gguf"
    write_synthetic_model(path, size_bytes="4MiB", seed=5, include_q2_0=False)
    with aiogguf.load_sync(path, mode="direct") as plain:
        direct = [f.direct for f in plain.report.files]
    with (
        aiogguf.load_sync(path, mode="direct", shareable=True) as model,
        share_model(model) as share,
    ):
        assert model.report.mode == "direct"
        # O_DIRECT into memfd memory where it works into private memory.
        assert [f.direct for f in model.report.files] == direct
        got = client.ask("digest", share)
    assert {n: d[0] for n, d in got.items()} == reader_digests((path,))


@pytest.mark.parametrize("mode", ["none", "mmap"])
def test_arrays_are_writable_where_a_loads_are(synth: Path, mode: str) -> None:
    """The opened model's numpy arrays are read-only where the load's are (mapped modes)
    and writable copy-on-write where they are not; ``raw`` likewise; its torch tensors
    take writes either way, none of which reaches the server's model."""
    with aiogguf.load_sync(synth, mode=mode, shareable=True) as model:
        name = next(iter(model.tensors))
        before = bytes(model.raw(name))
        with share_model(model) as share:
            opened = open_shared_model(share.description, [os.dup(fd) for fd in share.fds])
        try:
            assert opened.writable(name) == model.writable(name) == (mode == "none")
            assert opened.tensors[name].flags.writeable == (mode == "none")
            assert opened.raw(name).readonly == model.raw(name).readonly
            tensor = opened.torch(name)
            tensor.view(-1)[0] = 1 if tensor.dtype.is_floating_point else 0
            if mode == "none":
                opened.tensors[name].reshape(-1).view(np.uint8)[:] = 0x5A
                assert bytes(opened.raw(name)) != before
            assert bytes(model.raw(name)) == before
        finally:
            opened.close()


def test_bad_tensors_a_load_kept_are_shared_too(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    write_synthetic_model(
        path,
        size_bytes="2MiB",
        seed=8,
        corruptions=[Corruption("output_norm.weight", "inf_element", 0)],
        include_q2_0=False,
    )
    with aiogguf.load_sync(path, mode="none", shareable=True, keep_invalid=True) as model:
        assert model.failures
        with share_model(model) as share:
            opened = open_shared_model(share.description, [os.dup(fd) for fd in share.fds])
        try:
            assert opened.failures == model.failures
        finally:
            opened.close()


@pytest.mark.parametrize("fails", [False, True])
def test_shareable_sim_memory_is_freed(tmp_path: Path, fails: bool) -> None:
    """A shareable load's simulated device memory lies outside the arena: closing the
    model (or a load that fails its checks) gives every byte of it back to the device,
    and none of it to the arena, which keeps memory for later loads."""
    path = tmp_path / "m.gguf"
    corruptions = [Corruption("output_norm.weight", "inf_element", 0)] if fails else []
    write_synthetic_model(path, size_bytes="2MiB", seed=9, corruptions=corruptions)
    sim = SimDevice("g0", free=GiB)
    devices = [CpuDevice(), sim]
    if fails:
        with (
            pytest.raises(TensorValidationError),
            aiogguf.load_sync(path, devices=devices, shareable=True, n_gpu_layers=99),
        ):
            pass
    else:
        with aiogguf.load_sync(path, devices=devices, shareable=True, n_gpu_layers=99) as model:
            assert sim.live.buffer_bytes > 0
            assert any(isinstance(i, DeviceImage) for i in model._images)
    gc.collect()
    assert sim.live.buffers == 0
    assert sim.live.buffer_bytes == 0
    assert all(a.stats().blocks == 0 for a in device_arenas() if a.target is sim)


def test_a_share_owns_duplicates(synth: Path) -> None:
    with aiogguf.load_sync(synth, mode="mmap", shareable=True) as model:
        share = share_model(model)
        fds = share.fds
        share.close()
        for fd in fds:
            with pytest.raises(OSError, match="Bad file descriptor"):
                os.fstat(fd)
        # The model's own descriptors are untouched: it shares again.
        with share_model(model) as again:
            opened = open_shared_model(again.description, [os.dup(fd) for fd in again.fds])
            opened.close()


# --- hostile descriptions ----------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_none(synth: Path) -> Iterator[tuple[aiogguf.Model, dict[str, Any], tuple[int, ...]]]:
    with aiogguf.load_sync(synth, mode="none", shareable=True, **SIM) as model:
        share = share_model(model)
        try:
            yield model, json.loads(share.description), share.fds
        finally:
            share.close()


def _open(document: Any, fds: tuple[int, ...] | list[int]) -> aiogguf.Model:
    data = document if isinstance(document, bytes) else json.dumps(document).encode()
    return open_shared_model(data, [os.dup(fd) for fd in fds])


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _lie(document: dict[str, Any], change: Any) -> dict[str, Any]:
    lie: dict[str, Any] = json.loads(json.dumps(document))
    change(lie)
    return lie


def _host(document: dict[str, Any]) -> dict[str, Any]:
    return next(b for b in document["buffers"] if b["kind"] == "host")


def _sim(document: dict[str, Any]) -> dict[str, Any]:
    return next(b for b in document["buffers"] if b["kind"] == "sim")


LIES: dict[str, Any] = {
    "bigger than the memfd": lambda d: _host(d).update(nbytes=_host(d)["nbytes"] + (1 << 30)),
    "offset past the memfd": lambda d: _host(d).update(offset=1 << 40),
    "sim offset past the memfd": lambda d: _sim(d).update(offset=1 << 40),
    "smaller than the layout": lambda d: _host(d).update(nbytes=1),
    "negative offset": lambda d: _host(d).update(offset=-4096),
    "a bool for an int": lambda d: _host(d).update(offset=True),
    "descriptor past those sent": lambda d: _host(d).update(fd=99),
    "unknown kind": lambda d: _host(d).update(kind="shm"),
    "device kind on a host buffer": lambda d: _host(d).update(kind="sim", device="g0"),
    "wrong version": lambda d: d.update(version=2),
    "extra field": lambda d: d.update(extra=1),
    "missing plan": lambda d: d.pop("plan"),
    "header past the memfd": lambda d: d["files"][0].update(header_offset=1 << 40),
    "header cut short": lambda d: d["files"][0].update(header_nbytes=100),
    "file smaller than its tensors": lambda d: d["files"][0].update(size=1000),
    "range outside its tensors": lambda d: d["plan"]["buffers"][0]["ranges"][0].update(end=0),
    "a tensor placed twice": lambda d: d["plan"]["buffers"][-1]["ranges"][0]["tensors"].append(
        d["plan"]["buffers"][0]["ranges"][0]["tensors"][0]
    ),
    # A part (a cluster node's) places exactly the tensors its plan lists; this does not.
    "a tensor dropped from its range": lambda d: d["plan"]["buffers"][0]["ranges"][0][
        "tensors"
    ].pop(),
    "slot outside the buffer": lambda d: _host(d)["layout"]["slots"][0].__setitem__(2, 1 << 40),
    "a buffer missing": lambda d: d["buffers"].pop(),
    "bad enum in the plan": lambda d: d["plan"]["traits"].update(name="turbo"),
    "a string for a float": lambda d: d["report"].update(total_s="fast"),
    "bad hex handle": lambda d: _sim(d).update(kind="cuda", handle="zz", device_id="0"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_lying_description_raises_load_error(
    shared_none: tuple[aiogguf.Model, dict[str, Any], tuple[int, ...]], lie: str
) -> None:
    _model, document, fds = shared_none
    before = _open_fds()
    with pytest.raises(LoadError, match="shared model"):
        _open(_lie(document, LIES[lie]), fds)
    assert _open_fds() == before, "descriptors leaked"


def test_too_few_too_many_and_wrong_descriptors(
    shared_none: tuple[aiogguf.Model, dict[str, Any], tuple[int, ...]], tmp_path: Path
) -> None:
    _model, document, fds = shared_none
    with pytest.raises(LoadError, match="were sent"):
        _open(document, fds[:-1])
    with pytest.raises(LoadError, match="named by nothing"):
        _open(document, [*fds, fds[0]])
    # A plain file where a memfd should be: it could be cut under the mapping.
    plain = tmp_path / "plain"
    plain.write_bytes(b"\0" * (1 << 24))
    with open(plain, "rb") as f:
        swapped = list(fds)
        swapped[_host(document)["fd"]] = f.fileno()
        with pytest.raises(LoadError, match="sealed"):
            _open(document, swapped)
    # A memfd whose size is sealed but which is too small.
    small = sealed_memfd("small", 4096)
    try:
        swapped = list(fds)
        swapped[_sim(document)["fd"]] = small
        with pytest.raises(LoadError, match="past the descriptor"):
            _open(document, swapped)
    finally:
        os.close(small)
    # A socket where a file should be.
    a, b = socket.socketpair()
    with a, b:
        swapped = list(fds)
        swapped[0] = a.fileno()
        with pytest.raises(LoadError, match="not a file"):
            _open(document, swapped)


@pytest.mark.parametrize(
    "data", [b"", b"\xff\xfe", b"[" * 100_000, b"null", b"{}", b'{"version": 1}', b"1e999"]
)
def test_bad_json_raises_load_error(
    shared_none: tuple[aiogguf.Model, dict[str, Any], tuple[int, ...]], data: bytes
) -> None:
    _model, _document, fds = shared_none
    with pytest.raises(LoadError, match="shared model"):
        _open(data, fds)


def test_random_damage_never_crashes(
    shared_none: tuple[aiogguf.Model, dict[str, Any], tuple[int, ...]],
) -> None:
    """Bytes of the description changed at random: a ``LoadError``, or a model whose
    every tensor can be read (a change that kept it consistent), never anything else."""
    _model, document, fds = shared_none
    text = json.dumps(document).encode()
    rng = random.Random(37)
    for _ in range(150):
        damaged = bytearray(text)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.choice(b'0123456789"{}[],:-ae ')
        try:
            opened = _open(bytes(damaged), fds)
        except LoadError:
            continue
        try:
            for name in opened.tensors:
                opened.raw(name)
        finally:
            opened.close()


# --- the record codec ----------------------------------------------------------------------


def test_plan_and_report_round_trip(synth: Path) -> None:
    with aiogguf.load_sync(synth, mode="none", **SIM) as model:
        plan, report = model.plan, model.report
    assert from_json(type(plan), json.loads(json.dumps(to_json(plan))), "plan") == plan
    assert from_json(type(report), json.loads(json.dumps(to_json(report))), "report") == report
    lie = to_json(plan)
    lie["buffers"][0]["nbytes"] = "many"
    with pytest.raises(RecordError, match=r"plan\.buffers\[0\]\.nbytes"):
        from_json(type(plan), lie, "plan")


# --- real CUDA ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_buffers_reach_another_process(synth: Path, client: Client) -> None:
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception:
        pytest.skip("no CUDA device")
    with (
        aiogguf.load_sync(synth, mode="none", shareable=True, n_gpu_layers=99) as model,
        share_model(model) as share,
    ):
        assert any(b["kind"] == "cuda" for b in json.loads(share.description)["buffers"])
        got = client.ask("digest", share)
    assert {n: d[0] for n, d in got.items()} == reader_digests((synth,))


def test_cuda_glue_on_the_stand_in(synth: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path end to end in this process, on the CuPy stand-in (its IPC handles
    open in the process that made them only): the description carries each device
    buffer's handle and offset, and the opened model reads the file's bytes."""
    from stand_ins import cupy_stand_in

    from aiogguf.io._devices import cupy_backend

    monkeypatch.setattr(cupy_backend, "import_cupy", cupy_stand_in)
    cupy_backend.forget_cupy_devices()
    try:
        with (
            aiogguf.load_sync(synth, mode="none", shareable=True, n_gpu_layers=99) as model,
            share_model(model) as share,
        ):
            cuda = [b for b in json.loads(share.description)["buffers"] if b["kind"] == "cuda"]
            assert cuda
            assert all(len(bytes.fromhex(b["handle"])) == 64 for b in cuda)
            assert all(b["offset"] == 0 for b in cuda)  # a buffer starts its arena block
            opened = open_shared_model(share.description, [os.dup(fd) for fd in share.fds])
            try:
                assert server_digests(opened) == reader_digests((synth,))
                assert any(isinstance(i, DeviceImage) for i in opened._images)
            finally:
                opened.close()
            lie = json.loads(share.description)
            next(b for b in lie["buffers"] if b["kind"] == "cuda")["handle"] = "00" * 63
            with pytest.raises(LoadError, match="not 64"):
                _open(lie, share.fds)
    finally:
        aiogguf.release_device_memory_sync()
        cupy_backend.forget_cupy_devices()
