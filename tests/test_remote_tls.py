"""``https://`` on loopback: a real aiohttp server with a self-signed certificate, trusted
through ``SSL_CERT_FILE`` (OpenSSL's own variable, which the load's TLS context reads)
and refused, at once and in one line, where it is not trusted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from http_server import FileServer, file_server, tls_context

import aiogguf
from aiogguf.errors import LoadError
from aiogguf.testing.synth import write_synthetic_model

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FileServer, Path]]:
    root = tmp_path_factory.mktemp("tls")
    context, cert = tls_context(root)
    write_synthetic_model(root / "m.gguf", size_bytes="2MiB", seed=5, n_layer=2)
    with file_server(root, tls=context) as server:
        yield server, cert


def test_https_with_a_trusted_certificate_has_the_file_bytes(
    tls_server: tuple[FileServer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, cert = tls_server
    server.faults.__init__()  # type: ignore[misc]
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    url = server.url("m.gguf")
    assert url.startswith("https://127.0.0.1:")
    with (
        aiogguf.load_sync(url, chunk_size="256KiB", remote_readers=4) as model,
        aiogguf.load_sync(server.root / "m.gguf", mode="none") as local,
    ):
        assert model.report.files[0].reads > 1
        names = [t.name for t in local.plan.tensors]
        assert names == [t.name for t in model.plan.tensors]
        for name in names:
            assert bytes(model.raw(name)) == bytes(local.raw(name)), name
    assert server.faults.headers  # it was read over TLS


def test_https_with_an_untrusted_certificate_fails_at_once_in_one_line(
    tls_server: tuple[FileServer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = tls_server
    server.faults.__init__()  # type: ignore[misc]
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # the system's authorities only
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with (
        pytest.raises(LoadError) as caught,
        aiogguf.load_sync(server.url("m.gguf"), remote_retries=4),
    ):
        pytest.fail("an untrusted certificate was accepted")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{server.url('m.gguf')}: at offset 0: ")
    assert "certificate is not trusted" in message
    assert "SSL_CERT_FILE" in message
    assert "tries" not in message  # not retried: another try cannot fix it
    assert not server.faults.headers  # no request was sent
