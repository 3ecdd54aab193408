"""Loading from a URL, against a real HTTP server on loopback (aiohttp's file responses:
Range, ETag, If-Match), with faults injected by the server (``http_server.Faults``).

The oracle is a load of the same file from disk (mode ``none``), itself checked against
gguf-py elsewhere: every tensor's bytes must be equal.
"""

from __future__ import annotations

import itertools
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from http_server import (
    COMMIT,
    FileServer,
    HubServer,
    canned_server,
    client_sockets,
    file_server,
)

import aiogguf
from aiogguf._model import Model
from aiogguf.errors import LoadError, PathNotAllowedError, SplitError
from aiogguf.remote._http_source import HttpSource, RemoteOptions, is_url, redact_url
from aiogguf.testing.synth import write_synthetic_model

pytestmark = pytest.mark.timeout(60)

# Small jobs: a model of a few MiB then makes many ranged requests, so faults land
# mid-load.
SMALL = {"chunk_size": "256KiB", "remote_in_flight": 4}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FileServer]:
    root = tmp_path_factory.mktemp("served")
    write_synthetic_model(root / "m.gguf", size_bytes="4MiB", seed=11, n_layer=4)
    with file_server(root) as server:
        yield server


@pytest.fixture
def server(served: FileServer) -> FileServer:
    served.faults.__init__()  # type: ignore[misc]
    return served


def _load(url: str, **overrides: object) -> None:
    with aiogguf.load_sync(url, **overrides):
        pass


def _same_bytes(model: Model, path: Path) -> None:
    with aiogguf.load_sync(path, mode="none") as local:
        names = [t.name for t in local.plan.tensors]
        assert names == [t.name for t in model.plan.tensors]
        for name in names:
            assert bytes(model.raw(name)) == bytes(local.raw(name)), name


def test_urls_are_told_apart_and_shown_without_credentials() -> None:
    assert is_url("https://h/m.gguf")
    assert is_url("HTTP://h/m.gguf")
    assert not is_url("m.gguf")
    assert not is_url("/x/https://h")
    assert not is_url("hf://o/r/f")
    shown = redact_url("https://user:secret@Host.example:8443/a/m.gguf?X-Amz-Signature=s#f")
    assert shown == "https://host.example:8443/a/m.gguf"


def test_host_load_from_a_url_has_the_file_bytes(server: FileServer) -> None:
    with aiogguf.load_sync(server.url("m.gguf"), **SMALL) as model:
        assert model.plan.mode == "none"  # auto, for a URL
        assert model.report.files[0].reads > 4
        _same_bytes(model, server.root / "m.gguf")
    etags = {h.get("If-Match") for h in server.faults.headers[1:]}
    assert len(etags) == 1
    assert None not in etags


def test_simulated_gpu_load_from_a_url_has_the_file_bytes(server: FileServer) -> None:
    url = server.url("m.gguf")
    with aiogguf.load_sync(url, sim_gpus=["24GiB"], n_gpu_layers=-1, **SMALL) as model:
        assert {t.device for t in model.plan.tensors if t.nbytes} == {"g0"}
        _same_bytes(model, server.root / "m.gguf")


def test_each_request_is_checked_before_the_next_is_sent(
    server: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote job's bytes are checked request by request as they land, while the other
    connections wait on the network, not all at once after the job's last request."""
    from aiogguf.stages.validate import Validation

    requests_at_check: list[int] = []
    check_piece = Validation.check_piece

    def check(*args: object, **kwargs: object) -> None:
        requests_at_check.append(len(server.faults.headers))
        check_piece(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Validation, "check_piece", check)
    overrides = {"chunk_size": "1MiB", "remote_request_size": "256KiB", "remote_in_flight": 1}
    with aiogguf.load_sync(server.url("m.gguf"), **overrides) as model:
        assert model.report.validated > 0
    steps = [b - a for a, b in itertools.pairwise(requests_at_check)]
    assert len(requests_at_check) > 8
    assert set(steps) <= {0, 1}, steps  # never two requests between two checks
    assert requests_at_check[-1] == len(server.faults.headers)


def test_local_jobs_are_backed_before_their_read_and_remote_ones_are_not(
    server: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local read lands in pages backed first (each job asks); a remote request is
    not held back for it."""
    from aiogguf._images import HostImage

    backed: list[int] = []
    back = HostImage.back

    def counted(image: HostImage, job: object) -> None:
        backed.append(1)
        back(image, job)  # type: ignore[arg-type]

    monkeypatch.setattr(HostImage, "back", counted)
    with aiogguf.load_sync(server.root / "m.gguf", mode="none", chunk_size="1MiB") as model:
        assert len(backed) == model.report.files[0].reads > 1
    backed.clear()
    with aiogguf.load_sync(server.url("m.gguf"), **SMALL) as model:
        assert model.report.files[0].reads > 1
    assert backed == []


def test_a_url_load_has_a_thread_per_connection_started_before_its_header_is_read(
    server: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool starts a new thread at a time, each start waiting for the GIL: threads
    started only once the reads began would join them one by one."""
    from aiogguf._core import engine

    reserved: list[tuple[int, int]] = []
    reserve = engine.reserve_threads

    def counted(count: int) -> None:
        reserved.append((count, len(server.faults.headers)))
        reserve(count)

    monkeypatch.setattr(engine, "reserve_threads", counted)
    _load(server.url("m.gguf"), remote_in_flight=12, check_tensors=False)
    assert reserved == [(1 + 12, 0)]  # its own thread and one per connection, first
    reserved.clear()
    _load(server.root / "m.gguf", readers=3, check_tensors=False)  # type: ignore[arg-type]
    assert [count for count, _ in reserved] == [1 + 3]


@pytest.mark.parametrize("mode", ["mmap", "mlock", "direct"])
def test_modes_that_need_a_local_file_are_refused(server: FileServer, mode: str) -> None:
    with pytest.raises(LoadError, match=f"mode '{mode}' needs a local file"):
        _load(server.url("m.gguf"), mode=mode)
    assert not server.faults.headers  # refused before any request


def test_a_rooted_opener_refuses_urls(server: FileServer, tmp_path: Path) -> None:
    with aiogguf.RootedOpener([tmp_path]) as opener, pytest.raises(PathNotAllowedError):
        _load(server.url("m.gguf"), opener=opener)
    assert not server.faults.headers


def test_a_reset_mid_body_resumes_from_the_byte_it_stopped_at(server: FileServer) -> None:
    server.faults.reset_left = 3
    with aiogguf.load_sync(server.url("m.gguf"), **SMALL) as model:
        _same_bytes(model, server.root / "m.gguf")
    assert server.faults.reset_left == 0
    # The resumed requests start half way into a job (the server sent half the body).
    starts = [int(h["Range"][6:].split("-")[0]) for h in server.faults.headers if "Range" in h]
    assert any(s % (256 << 10) for s in starts if s)


def test_a_stall_beyond_the_timeout_is_retried(server: FileServer) -> None:
    server.faults.stall_left, server.faults.stall_s = 1, 20.0
    began = time.monotonic()
    with aiogguf.load_sync(server.url("m.gguf"), remote_timeout=0.5, **SMALL) as model:
        _same_bytes(model, server.root / "m.gguf")
    assert server.faults.stall_left == 0
    assert time.monotonic() - began < 10


def test_503_then_success(server: FileServer) -> None:
    server.faults.status_left = 2
    with aiogguf.load_sync(server.url("m.gguf"), **SMALL) as model:
        _same_bytes(model, server.root / "m.gguf")
    assert server.faults.status_left == 0


def test_a_server_that_keeps_failing_fails_the_load_naming_url_and_offset(
    server: FileServer,
) -> None:
    server.faults.status_left, server.faults.after = 10**6, 1  # the header arrives
    url = server.url("m.gguf").replace("http://", "http://user:secret@") + "?token=hush"
    with pytest.raises(LoadError) as caught:
        _load(url, remote_retries=2, **SMALL)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{server.url('m.gguf')}: at offset ")
    assert "after 3 tries" in message
    assert "503" in message
    assert "secret" not in message
    assert "hush" not in message
    assert caught.value.offset is not None
    assert caught.value.offset > 0


def test_a_file_replaced_during_the_load_fails_it(server: FileServer) -> None:
    server.faults.replace_after = 3
    with pytest.raises(LoadError, match="changed during the load") as caught:
        _load(server.url("m.gguf"), **SMALL)
    assert caught.value.offset is not None


def test_a_short_body_is_detected(server: FileServer) -> None:
    server.faults.short, server.faults.after = True, 1
    with pytest.raises(LoadError, match="after 2 tries") as caught:
        _load(server.url("m.gguf"), remote_retries=1, **SMALL)
    assert caught.value.offset is not None
    assert caught.value.offset > 0


def test_a_redirect_to_another_host_gets_no_authorization(served: FileServer) -> None:
    served.faults.__init__()  # type: ignore[misc]
    try:
        other = FileServer(served.root, host="127.0.0.2").start()
    except OSError as exc:  # pragma: no cover - a loopback without 127.0.0.2
        pytest.skip(f"no second loopback address: {exc}")
    try:
        other.faults.redirect_to = None
        served.faults.redirect_to = f"http://127.0.0.2:{other.port}"
        options = RemoteOptions(headers={"Authorization": "Bearer hush", "X-Trace": "t"})
        source = HttpSource(served.url("m.gguf"), options)
        try:
            data = bytearray(100_000)
            source.read_into(data, 12_345)
        finally:
            source.close()
        assert bytes(data) == (served.root / "m.gguf").read_bytes()[12_345:112_345]
        assert served.faults.headers[0]["Authorization"] == "Bearer hush"
        assert other.faults.headers
        for seen in other.faults.headers:
            assert "Authorization" not in seen
            assert seen["X-Trace"] == "t"
    finally:
        other.stop()


@pytest.mark.anyio
async def test_a_cancelled_load_closes_every_connection_promptly(server: FileServer) -> None:
    server.faults.stall_left, server.faults.stall_s = 10**6, 30.0
    before = client_sockets(server.port)
    began = time.monotonic()
    with anyio.move_on_after(1.0) as scope:
        async with aiogguf.load(server.url("m.gguf"), **SMALL):
            pytest.fail("the load cannot finish: every body stalls")
    assert scope.cancelled_caught
    assert time.monotonic() - began < 3.5  # stopped within about a second
    assert server.faults.headers  # it was reading
    assert client_sockets(server.port) == before == 0


@pytest.mark.anyio
async def test_a_cancelled_load_stops_waiting_for_a_connect_no_one_answers() -> None:
    """A listener whose accept queue is full drops new handshakes: the load's connect
    waits, and a cancel ends it within about a second, not after the connect timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    address = listener.getsockname()
    queued: list[socket.socket] = []
    try:
        while True:  # fill the queue: the connect that does not complete shows it full
            probe = socket.socket()
            queued.append(probe)
            probe.setblocking(False)
            probe.connect_ex(address)
            await anyio.sleep(0.05)
            if probe.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0 or len(queued) > 8:
                break
            try:
                probe.getpeername()
            except OSError:
                break  # still connecting: the queue is full
        began = time.monotonic()
        with anyio.move_on_after(0.5) as scope:
            async with aiogguf.load(f"http://127.0.0.1:{address[1]}/m.gguf", remote_timeout=30):
                pytest.fail("no connection can be made")
        assert scope.cancelled_caught
        assert time.monotonic() - began < 2.0  # not the 10 s connect timeout
    finally:
        for probe in queued:
            probe.close()
        listener.close()


def _partial(content_range: str, body: bytes, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 206 Partial Content\r\nContent-Range: {content_range}\r\n"
        f'Content-Length: {len(body)}\r\nETag: "v1"\r\nConnection: close\r\n{extra}\r\n'
    )
    return head.encode() + body


# The answer to the first request, which asks for the first MiB: the whole small file.
_FIRST = _partial("bytes 0-999/1000", b"G" * 1000)


@pytest.mark.parametrize(
    ("second", "problem"),
    [
        (_partial("bytes 0-9/1000", b"x" * 10), "asked for bytes 100-109, got 0-9"),
        (_partial("bytes 100-109/99999999999", b"x" * 10), "changed during the load"),
        (_partial("bytes 100-109/1000", b"x" * 10, 'ETag: "v2"\r\n'), "changed during"),
        (_partial("bytes x-y/z", b"x" * 10), "no usable Content-Range"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n" + b"x" * 10, "expected a partial"),
        (_partial("bytes 100-109/1000", b"x" * 10, "X: " + "a" * 70000 + "\r\n"), "tries"),
    ],
)
def test_hostile_answers_are_load_errors(second: bytes, problem: str) -> None:
    with canned_server([_FIRST, second]) as url:
        source = HttpSource(url, RemoteOptions(retries=0))
        try:
            assert (source.size_bytes, source.etag) == (1000, '"v1"')
            with pytest.raises(LoadError, match=problem) as caught:
                source.read_into(bytearray(10), 100)
            assert caught.value.offset == 100
        finally:
            source.close()


def test_a_range_past_the_end_is_refused_before_any_request() -> None:
    with canned_server([_FIRST]) as url:
        source = HttpSource(url)
        try:
            source.read_into(bytearray(0), 1000)  # nothing to read: no request
            with pytest.raises(LoadError, match="past the end"):
                source.read_into(bytearray(10), 995)
        finally:
            source.close()


# --- hf:// names, through a stand-in for the hub's resolve endpoint --------------------


@pytest.fixture
def hub(server: FileServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    pytest.importorskip("huggingface_hub")
    with HubServer(server, {"own/repo/m.gguf": "m.gguf"}) as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{stand_in.port}")
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        yield stand_in


@pytest.mark.parametrize("revision", ["", "@main", f"@{COMMIT}"])
def test_hf_name_loads_the_file_at_its_commit(
    hub: HubServer, server: FileServer, revision: str
) -> None:
    with aiogguf.load_sync(f"hf://own/repo/m.gguf{revision}", **SMALL) as model:
        _same_bytes(model, server.root / "m.gguf")
    head, *gets = hub.faults.headers
    assert head["path"] == f"/own/repo/resolve/{revision[1:] or 'main'}/m.gguf"
    # The data is read at the commit the revision pointed to, with the token; the CDN
    # never sees the token.
    assert gets
    for seen in [head, *gets]:
        assert seen["Authorization"] == "Bearer hf_secret"
    assert {g["path"] for g in gets} == {f"/own/repo/resolve/{COMMIT}/m.gguf"}
    assert server.faults.headers
    assert all("Authorization" not in seen for seen in server.faults.headers)


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("hf://own/repo/m.gguf@v9", "the hub cannot resolve it"),
        ("hf://own/repo/other.gguf", "the hub cannot resolve it"),
        ("hf://own/repo", "expected hf://OWNER/REPO/FILE.gguf"),
        ("hf://own/repo/../m.gguf", "expected hf://OWNER/REPO/FILE.gguf"),
    ],
)
def test_hf_names_the_hub_does_not_know_fail_in_one_line(
    hub: HubServer, name: str, problem: str
) -> None:
    with pytest.raises(LoadError, match=problem) as caught:
        _load(name)
    assert str(caught.value).startswith(f"{name}: ")
    assert "\n" not in str(caught.value)
    assert "hf_secret" not in str(caught.value)


def test_hf_without_the_hub_library_says_which_extra(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(LoadError, match=r"pip install 'aiogguf\[remote\]'"):
        _load("hf://own/repo/m.gguf")
    assert not hub.faults.headers


# --- split sets, named by their first split -----------------------------------------


@pytest.fixture(scope="module")
def split_root(served: FileServer) -> Path:
    write_synthetic_model(served.root / "s.gguf", size_bytes="3MiB", seed=5, split_count=3)
    return served.root


def test_a_split_set_loads_from_the_url_of_its_first_split(
    server: FileServer, split_root: Path
) -> None:
    first = "s-00001-of-00003.gguf"
    with aiogguf.load_sync(server.url(first), **SMALL) as model:
        assert len(model.report.files) == 3
        _same_bytes(model, split_root / first)
    with pytest.raises(SplitError, match="this is split 2 of 3"):
        _load(server.url("s-00002-of-00003.gguf"))


def test_a_split_set_by_hf_name_reads_every_split_at_one_commit(
    hub: HubServer, server: FileServer, split_root: Path
) -> None:
    names = [f"s-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    hub.files.update({f"own/repo/{n}": n for n in names})
    with aiogguf.load_sync(f"hf://own/repo/{names[0]}@main", **SMALL) as model:
        _same_bytes(model, split_root / names[0])
    heads = [h["path"] for h in hub.faults.headers if "Range" not in h]
    # The first split first; the others at once, in any order.
    assert heads[0] == f"/own/repo/resolve/main/{names[0]}"
    assert sorted(heads[1:]) == [
        f"/own/repo/resolve/{COMMIT}/{names[1]}",
        f"/own/repo/resolve/{COMMIT}/{names[2]}",
    ]
