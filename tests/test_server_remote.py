"""Remote sources in the load server (issue #28, item 5): real HTTP requests to a real
``create_app`` on loopback, which loads from real file servers on loopback.

Nothing remote without the operator's word: a URL or an ``hf://`` name is 403 unless
``--allow-url-prefix`` admits it (matched on the parsed URL: no credentials, other ports,
look-alike hosts, ``..`` or encodings slip through) or ``--allow-remote hf``; and even
then no connection goes to a loopback, private or link-local address, after a redirect
too, unless the operator allowed that network. The budget counts a remote model's bytes
before its load reads them.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from http_server import COMMIT, FileServer, HubServer
from server_helpers import post, running

from aiogguf._addresses import AddressPolicy, UrlPrefix, blocked_reason, parse_network
from aiogguf._config import Config
from aiogguf.errors import ConfigError, PathNotAllowedError
from aiogguf.remote._http_source import HttpSource, RemoteOptions
from aiogguf.server._app import RemoteAccess, ServerPolicy, create_app
from aiogguf.testing.synth import write_synthetic_model

pytestmark = pytest.mark.timeout(60)

LOOPBACK = "127.0.0.1/32"


class DirServer(FileServer):
    """A ``FileServer`` that also serves its files at ``/models/NAME``."""

    def _routes(self, app: Any) -> None:
        app.router.add_get("/models/{name}", self._handle)
        super()._routes(app)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("remote-files")
    write_synthetic_model(root / "m.gguf", size_bytes="1MiB", seed=3)
    return root


@pytest.fixture
def origin(files: Path) -> Iterator[DirServer]:
    with DirServer(files) as server:
        yield server


def _app(*, networks: tuple[str, ...] = (LOOPBACK,), **settings: Any) -> Any:
    access = RemoteAccess.from_settings(networks=networks, **settings)
    return create_app(policy=ServerPolicy(remote=access))


async def settled(http: aiohttp.ClientSession, base: str, load_id: str) -> dict[str, Any]:
    with anyio.fail_after(30):
        while True:
            async with http.get(f"{base}/models/{load_id}") as r:
                state: dict[str, Any] = await r.json()
            if state["state"] != "loading":
                return state
            await anyio.sleep(0.02)


# --- matching prefixes and addresses, as functions ---------------------------------------

PREFIX = "https://models.example/org/"


@pytest.mark.parametrize(
    "url",
    [
        "https://models.example/org/m.gguf",
        "HTTPS://Models.Example/org/m.gguf",
        "https://models.example:443/org/m.gguf",
        "https://models.example./org/sub/m.gguf",
        "https://models.example/org/m.gguf?X-Amz-Signature=s",
        "https://models.example/org/m%20q.gguf",
    ],
)
def test_a_prefix_admits_urls_beneath_it(url: str) -> None:
    assert UrlPrefix.parse(PREFIX).admits(url)


@pytest.mark.parametrize(
    "url",
    [
        "https://models.example@evil.example/org/m.gguf",  # userinfo: the host is evil
        "https://models.example:x@evil.example/org/m.gguf",
        "https://models.example.evil/org/m.gguf",  # a look-alike host
        "https://evil.example/models.example/org/m.gguf",
        "https://models.example:8443/org/m.gguf",  # another port
        "http://models.example/org/m.gguf",  # another scheme
        "https://models.example/organic/m.gguf",  # not on a segment boundary
        "https://models.example/org",  # the prefix's parent
        "https://models.example/org/../secret/m.gguf",
        "https://models.example/org/%2e%2e/secret/m.gguf",
        "https://models.example/org/%2E%2e/secret/m.gguf",
        "https://models.example/org/./m.gguf",
        "https://models.example/org%2fm.gguf",
        "https://models.example/org/..%2fsecret/m.gguf",
        "https://models.example/org/%252e%252e/m.gguf",  # encoded twice
        "https://models.example/org\\..\\m.gguf",
        "https://models.example/org/m.gguf\r\nHost: evil",
        "https://models.exämple/org/m.gguf",
        "https://0x7f.1/org/m.gguf",
    ],
)
def test_a_prefix_refuses_look_alikes(url: str) -> None:
    assert not UrlPrefix.parse(PREFIX).admits(url)


@pytest.mark.parametrize(
    "text", ["ftp://h/", "https://u@h/", "https:///x", "https://h/a?b", "https://h:99999/"]
)
def test_bad_prefixes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="'"):
        UrlPrefix.parse(text)


@pytest.mark.parametrize(
    ("address", "what"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("10.1.2.3", "private"),
        ("172.31.255.255", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),  # the cloud metadata service
        ("100.64.0.1", "CGNAT"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("255.255.255.255", "reserved"),
        ("::1", "loopback"),
        ("::", "unspecified"),
        ("fd00::1", "private"),
        ("fc00::1", "private"),
        ("fe80::1", "link-local"),
        ("fe80::1%1", "link-local"),
        ("ff02::1", "multicast"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("::ffff:169.254.169.254", "link-local"),
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 of 169.254.169.254
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
    ],
)
def test_internal_addresses_are_blocked(address: str, what: str) -> None:
    reason = blocked_reason(ipaddress.ip_address(address))
    assert reason is not None
    assert what in reason


@pytest.mark.parametrize("address", ["93.184.215.14", "2606:4700::1", "::ffff:8.8.8.8"])
def test_public_addresses_pass(address: str) -> None:
    assert blocked_reason(ipaddress.ip_address(address)) is None
    assert AddressPolicy()("h", ipaddress.ip_address(address)) is None


def test_an_allowed_network_opens_only_itself() -> None:
    policy = AddressPolicy((parse_network("10.1.0.0/16"),))
    assert policy("h", ipaddress.ip_address("10.1.2.3")) is None
    refused = policy("h", ipaddress.ip_address("10.2.0.1"))
    assert refused is not None
    assert "10.2.0.1" in refused


# --- the server ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_without_flags_a_server_loads_nothing_remote(
    origin: DirServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a server that may read any path: 403, and no request leaves it."""
    monkeypatch.setenv("HF_ENDPOINT", origin.url("").rstrip("/"))
    app = create_app(allow_any_path=True)
    async with running(app) as base, aiohttp.ClientSession() as http:
        for path, words in [
            (origin.url("m.gguf"), "not beneath a URL prefix this server allows"),
            ("hf://own/repo/m.gguf", "hf:// names are not allowed by this server"),
        ]:
            status, body = await post(http, base, path)
            assert (status, body) == (403, {"error": f"{path}: {words}"})
    assert not origin.faults.headers


@pytest.mark.anyio
async def test_a_url_beneath_an_allowed_prefix_loads(origin: DirServer, files: Path) -> None:
    app = _app(url_prefixes=[origin.url("models/")])
    async with running(app) as base, aiohttp.ClientSession() as http:
        status, body = await post(http, base, origin.url("models/m.gguf"))
        assert status == 201, body
        state = await settled(http, base, body["id"])
        assert state["state"] == "ready", state
        assert state["report"]["nbytes"] > 0
        assert state["bytes_done"] == state["bytes_total"] > 0
        # Not beneath the prefix: the same file at its other address.
        status, body = await post(http, base, origin.url("m.gguf"))
        assert status == 403, body
    ranged = [h for h in origin.faults.headers if "Range" in h]
    assert ranged
    assert all(h["If-Match"] for h in ranged[1:])


@pytest.mark.anyio
async def test_prefix_tricks_are_refused_before_any_request(origin: DirServer) -> None:
    base_url = origin.url("models/")  # http://127.0.0.1:PORT/models/
    host_port = base_url.split("/")[2]
    other_port = int(host_port.rsplit(":", 1)[1]) % 60000 + 1024
    tricks = [
        f"http://{host_port}@127.0.0.2:{other_port}/models/m.gguf",  # userinfo
        f"http://127.0.0.1:{other_port}/models/m.gguf",  # another port
        f"http://localhost:{host_port.rsplit(':', 1)[1]}/models/m.gguf",  # another name
        f"http://{host_port}/models-evil/m.gguf",  # not on a segment boundary
        f"http://{host_port}/models/../m.gguf",
        f"http://{host_port}/models/%2e%2e/m.gguf",
        f"http://{host_port}/models%2fm.gguf",
    ]
    app = _app(url_prefixes=[base_url, "https://models.example/"])
    async with running(app) as base, aiohttp.ClientSession() as http:
        for url in [*tricks, "https://models.example.evil/m.gguf"]:
            status, body = await post(http, base, url)
            assert status == 403, (url, body)
            assert "\n" not in body["error"]
    assert not origin.faults.headers


@pytest.mark.anyio
async def test_a_loopback_target_is_refused_unless_its_network_is_allowed(
    origin: DirServer,
) -> None:
    url = origin.url("models/m.gguf")
    async with (
        running(_app(url_prefixes=[url], networks=())) as base,
        aiohttp.ClientSession() as http,
    ):
        status, body = await post(http, base, url)
    assert status == 403, body
    assert "127.0.0.1" in body["error"]
    assert "loopback" in body["error"]
    assert not origin.faults.headers  # refused before connecting
    # ``--allow-private-addresses``: any address.
    app = _app(url_prefixes=[url], networks=(), private_addresses=True)
    async with running(app) as base, aiohttp.ClientSession() as http:
        status, body = await post(http, base, url)
        assert status == 201, body
        assert (await settled(http, base, body["id"]))["state"] == "ready"


@pytest.mark.anyio
async def test_a_redirect_to_an_internal_address_is_refused(origin: DirServer, files: Path) -> None:
    """The origin (whose network is allowed) redirects to another loopback address,
    whose network is not: the server never connects there."""
    with FileServer(files, host="127.0.0.2") as inside:
        origin.faults.redirect_to = f"http://127.0.0.2:{inside.port}"
        url = origin.url("models/m.gguf")
        async with running(_app(url_prefixes=[url])) as base, aiohttp.ClientSession() as http:
            status, body = await post(http, base, url)
        assert status == 403, body
        assert "127.0.0.2" in body["error"]
        assert "loopback" in body["error"]
        assert origin.faults.headers
        assert not inside.faults.headers


@pytest.mark.anyio
async def test_the_budget_counts_a_remote_models_bytes(origin: DirServer, files: Path) -> None:
    size = (files / "m.gguf").stat().st_size
    url = origin.url("models/m.gguf")
    access = RemoteAccess.from_settings(url_prefixes=[url], networks=[LOOPBACK])
    app = create_app(policy=ServerPolicy(remote=access, max_loaded_bytes=size * 3 // 2))
    async with running(app) as base, aiohttp.ClientSession() as http:
        # Pinned: never evicted to make room.
        async with http.post(f"{base}/models", json={"path": url, "pin": True}) as r:
            status, first = r.status, await r.json()
        assert status == 201, first
        # Another placement (the same one would share the first load).
        status, body = await post(http, base, url, check_tensors=False)
        assert status == 507, body
        assert f"{size} bytes would take the models held to {2 * size} bytes" in body["error"]
        assert (await settled(http, base, first["id"]))["state"] == "ready"
    small = create_app(policy=ServerPolicy(remote=access, max_loaded_bytes=size - 1))
    async with running(small) as base, aiohttp.ClientSession() as http:
        status, body = await post(http, base, url)
        assert status == 507, body
    # Refused on the size learnt from one ranged request of one byte; no data was read.
    assert all(h.get("Range") == "bytes=0-0" for h in origin.faults.headers[-1:])


@pytest.fixture
def hub(origin: DirServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    pytest.importorskip("huggingface_hub")
    with HubServer(origin, {"own/repo/m.gguf": "m.gguf"}) as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{stand_in.port}")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield stand_in


@pytest.mark.anyio
async def test_hf_names_need_allow_remote_hf_and_an_allowed_endpoint(
    hub: HubServer, origin: DirServer
) -> None:
    name = f"hf://own/repo/m.gguf@{COMMIT}"
    async with (
        running(_app(url_prefixes=["https://models.example/"])) as base,
        aiohttp.ClientSession() as http,
    ):
        status, body = await post(http, base, name)
    assert status == 403, body
    # The hub's endpoint is on loopback: refused before huggingface_hub connects.
    async with (
        running(_app(allow_remote=["hf"], networks=())) as base,
        aiohttp.ClientSession() as http,
    ):
        status, body = await post(http, base, name)
    assert status == 403, body
    assert "the hub's endpoint" in body["error"]
    assert "loopback" in body["error"]
    assert not hub.faults.headers
    assert not origin.faults.headers
    async with running(_app(allow_remote=["hf"])) as base, aiohttp.ClientSession() as http:
        status, body = await post(http, base, name)
        assert status == 201, body
        assert (await settled(http, base, body["id"]))["state"] == "ready"
        status, body = await post(http, base, "hf://own/repo/other.gguf")
        assert status == 502, body
        assert "the hub cannot resolve it" in body["error"]


@pytest.mark.anyio
async def test_a_split_set_is_counted_whole_and_opened_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every split's size counts before the load; the load reads the sources opened for
    the count (the hub resolves each split once), at the first split's commit."""
    pytest.importorskip("huggingface_hub")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    root = tmp_path / "split"
    root.mkdir()
    write_synthetic_model(root / "s.gguf", size_bytes="2MiB", seed=5, split_count=3)
    names = [f"s-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    total = sum((root / n).stat().st_size for n in names)
    with DirServer(root) as cdn, HubServer(cdn, {f"own/repo/{n}": n for n in names}) as split_hub:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{split_hub.port}")
        access = RemoteAccess.from_settings(allow_remote=["hf"], networks=[LOOPBACK])
        name = f"hf://own/repo/{names[0]}@main"
        tight = create_app(policy=ServerPolicy(remote=access, max_loaded_bytes=total - 1))
        async with running(tight) as base, aiohttp.ClientSession() as http:
            status, body = await post(http, base, name)
            assert status == 507, body
            assert f"{total} bytes would take" in body["error"]
        split_hub.faults.headers.clear()
        roomy = create_app(policy=ServerPolicy(remote=access, max_loaded_bytes=total))
        async with running(roomy) as base, aiohttp.ClientSession() as http:
            status, body = await post(http, base, name)
            assert status == 201, body
            state = await settled(http, base, body["id"])
            assert state["state"] == "ready", state
        resolved = [h["path"] for h in split_hub.faults.headers if "Range" not in h]
        assert resolved == [
            f"/own/repo/resolve/main/{names[0]}",
            f"/own/repo/resolve/{COMMIT}/{names[1]}",
            f"/own/repo/resolve/{COMMIT}/{names[2]}",
        ]
        probes = [h for h in cdn.faults.headers if h.get("Range") == "bytes=0-0"]
        assert len(probes) == 2 * 3  # one per split, per server: none by the load itself


def test_http_source_connects_only_where_the_policy_allows(origin: DirServer) -> None:
    """The library's own check: what was resolved and checked is what is connected to."""
    url = origin.url("m.gguf")
    with pytest.raises(PathNotAllowedError, match="loopback"):
        HttpSource(url, RemoteOptions(address_policy=AddressPolicy()))
    assert not origin.faults.headers
    allowed = AddressPolicy((parse_network(LOOPBACK),))
    source = HttpSource(url, RemoteOptions(address_policy=allowed, request_bytes=64 << 10))
    try:
        buf = bytearray(200 << 10)
        source.read_into(buf, 0)
        assert bytes(buf) == (origin.root / "m.gguf").read_bytes()[: len(buf)]
    finally:
        source.close()
    # ``request_bytes``: one read of 200 KiB is four requests of at most 64 KiB.
    ranges = [h["Range"] for h in origin.faults.headers[1:]]
    assert ranges == [
        f"bytes={a}-{min(a + (64 << 10), 200 << 10) - 1}" for a in range(0, 200 << 10, 64 << 10)
    ]


# --- config -------------------------------------------------------------------------------


def test_remote_keys_and_the_former_name() -> None:
    config = Config()
    assert config.pipeline.remote_in_flight == 16
    assert config.pipeline.remote_request_size == 16 << 20
    assert config.with_overrides(remote_readers=3).pipeline.remote_in_flight == 3
    assert Config.from_mapping({"pipeline": {"remote_readers": 5}}).pipeline.remote_in_flight == 5
    with pytest.raises(ConfigError, match="former name of remote_in_flight"):
        config.with_overrides(remote_readers=3, remote_in_flight=4)
    with pytest.raises(ConfigError, match="remote_request_size"):
        config.with_overrides(remote_request_size=0)


def test_server_section_keys_are_checked(tmp_path: Path) -> None:
    toml = tmp_path / "s.toml"
    toml.write_text('[server]\nallow_url_prefixes = ["https://a@b/"]\n')
    with pytest.raises(ConfigError, match=r"allow_url_prefixes\[0\].*credentials"):
        Config.from_toml(toml)
    toml.write_text('[server]\nallow_networks = ["10.0.0.0/33"]\n')
    with pytest.raises(ConfigError, match="allow_networks"):
        Config.from_toml(toml)


@pytest.mark.anyio
async def test_the_server_section_opens_remote_sources(origin: DirServer, tmp_path: Path) -> None:
    url = origin.url("models/m.gguf")
    toml = tmp_path / "s.toml"
    toml.write_text(f'[server]\nallow_url_prefixes = ["{url}"]\nallow_networks = ["{LOOPBACK}"]\n')
    async with running(create_app(config=toml)) as base, aiohttp.ClientSession() as http:
        status, body = await post(http, base, url)
        assert status == 201, body
        assert (await settled(http, base, body["id"]))["state"] == "ready"
        status, body = await post(http, base, str(tmp_path / "local.gguf"))
        assert status == 403, body  # no root: no local file


def test_a_request_cannot_set_in_flight_by_its_former_name(origin: DirServer) -> None:
    async def main() -> None:
        url = origin.url("models/m.gguf")
        async with running(_app(url_prefixes=[url])) as base, aiohttp.ClientSession() as http:
            status, body = await post(http, base, url, remote_readers=1)
            assert status == 403, body
            assert "'remote_readers' is not a key a request may set" in body["error"]

    anyio.run(main)


# --- aiogguf serve --------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_serve_refuses_bad_remote_flags(tmp_path: Path) -> None:
    for args, words in [
        (("--allow-url-prefix", "https://u@h/"), "credentials"),
        (("--allow-url-prefix", "https://h/", "--allow-network", "10.0.0.0/33"), "--allow-network"),
        (("--allow-remote", "s3"), "invalid choice"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "aiogguf", "serve", "--port", "0", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 2, result
        assert words in result.stderr, result.stderr


@pytest.mark.slow
@pytest.mark.anyio
async def test_cli_serve_with_remote_flags_warns_and_loads(
    origin: DirServer, tmp_path: Path
) -> None:
    url = origin.url("models/m.gguf")
    command = [
        *(sys.executable, "-m", "aiogguf", "serve", "--port", "0"),
        *("--allow-url-prefix", url, "--allow-remote", "hf", "--allow-private-addresses"),
    ]
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9"}
    async with await anyio.open_process(command, cwd=tmp_path, env=env) as proc:
        assert proc.stderr is not None
        assert proc.stdout is not None
        stderr = BufferedByteReceiveStream(proc.stderr)
        stdout = BufferedByteReceiveStream(proc.stdout)
        with anyio.fail_after(30):
            warnings = [(await stderr.receive_until(b"\n", 4096)).decode() for _ in range(3)]
            listening = (await stdout.receive_until(b"\n", 4096)).decode()
        base = listening.rsplit(" ", 1)[1].strip()
        async with aiohttp.ClientSession() as http:
            status, body = await post(http, base, url)
            assert status == 201, body
            assert (await settled(http, base, body["id"]))["state"] == "ready"
        proc.terminate()
        await proc.wait()
    assert "warning: --allow-remote hf" in warnings[0]
    assert (
        f"warning: --allow-url-prefix: clients may have this server fetch URLs beneath {url}"
        in warnings[1]
    )
    assert "warning: --allow-private-addresses: remote loads may connect to any" in warnings[2]
