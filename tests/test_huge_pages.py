"""Host images in transparent huge pages: the buffer, the ``auto`` decision, the
``huge_pages`` key, and loads that land the same bytes with each setting."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from test_load_bytes import assert_same_bytes

import aiogguf
from aiogguf._config import Config
from aiogguf._images import HostImage
from aiogguf.errors import ConfigError
from aiogguf.io import buffers as buffers_module
from aiogguf.io.buffers import (
    HUGE_PAGE_BYTES,
    PAGE_BYTES,
    HostBuffer,
    reports_free_pages,
    transparent_huge_pages,
)
from aiogguf.stages import allocate as allocate_module
from aiogguf.stages.allocate import HUGE_IMAGE_MIN_BYTES, wants_huge_pages
from aiogguf.testing.synth import SynthModel, write_synthetic_model

THP = transparent_huge_pages()
needs_thp = pytest.mark.skipif(
    THP == "never", reason="transparent huge pages are off on this kernel (THP 'never')"
)


def _smaps_field(address: int, field: str) -> int:
    """``field`` (in bytes) of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == f"{field}:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}, or it has no {field}")


def _vmstat(key: str) -> int:
    with open("/proc/vmstat", encoding="ascii") as f:
        for line in f:
            name, value = line.split()
            if name == key:
                return int(value)
    return 0


# --- the buffer --------------------------------------------------------------------------


@needs_thp
def test_huge_page_buffer_is_aligned_and_backed_by_huge_pages() -> None:
    nbytes = 8 * HUGE_PAGE_BYTES + 5
    with HostBuffer(nbytes, huge_pages=True) as buf:
        assert buf.huge_pages
        assert buf.address % HUGE_PAGE_BYTES == 0
        assert buf.nbytes == nbytes
        refused = _vmstat("thp_fault_fallback")
        buf.as_array()[:] = 3  # the first touch
        granted = _smaps_field(buf.address, "AnonHugePages")
        if granted == 0 and _vmstat("thp_fault_fallback") > refused:
            pytest.skip("the kernel had no free huge page to give (thp_fault_fallback)")
        assert granted >= HUGE_PAGE_BYTES
        assert int(buf.as_array()[-1]) == 3
        assert bytes(buf.memoryview[:2]) == b"\x03\x03"


@pytest.mark.skipif(THP != "madvise", reason="only under THP 'madvise' are plain pages sure")
def test_plain_buffer_gets_no_huge_pages_under_madvise() -> None:
    with HostBuffer(8 * HUGE_PAGE_BYTES) as buf:
        assert not buf.huge_pages
        buf.as_array()[:] = 1
        assert _smaps_field(buf.address, "AnonHugePages") == 0


@pytest.mark.parametrize("alignment", [PAGE_BYTES, 1 << 20, 4 << 20])
def test_huge_page_alignment_is_the_larger_of_the_two(alignment: int) -> None:
    with HostBuffer(3 * PAGE_BYTES, alignment=alignment, huge_pages=True) as buf:
        wanted = max(alignment, HUGE_PAGE_BYTES) if buf.huge_pages else alignment
        assert buf.address % wanted == 0
        buf.as_array()[:] = 1


def test_thp_never_gives_plain_pages_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buffers_module, "transparent_huge_pages", lambda: "never")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with HostBuffer(4 * HUGE_PAGE_BYTES, huge_pages=True) as buf:
            assert not buf.huge_pages
            buf.as_array()[:] = 2
            assert int(buf.as_array()[-1]) == 2


def test_refused_advice_gives_plain_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel built without THP refuses ``MADV_HUGEPAGE`` (EINVAL): plain pages."""
    from aiogguf.io import _libc

    def refuse(address: int, length: int, advice: int) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(buffers_module, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setattr(_libc, "madvise", refuse)
    with HostBuffer(4 * HUGE_PAGE_BYTES, huge_pages=True) as buf:
        assert not buf.huge_pages


def test_thp_setting_is_the_bracketed_word(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    monkeypatch.setattr(buffers_module, "_THP", str(tmp_path))
    assert buffers_module.transparent_huge_pages() == "madvise"
    (tmp_path / "enabled").write_text("[always] madvise never\n")
    assert buffers_module.transparent_huge_pages() == "always"
    (tmp_path / "enabled").unlink()
    assert buffers_module.transparent_huge_pages() == "never"


# --- auto: free page reporting -------------------------------------------------------------


def _virtio(root: Path, name: str, device: int, features: str, driver: bool) -> None:
    d = root / "bus/virtio/devices" / name
    d.mkdir(parents=True)
    (d / "device").write_text(f"0x{device:04x}\n")
    (d / "features").write_text(features + "0" * (64 - len(features)) + "\n")
    if driver:
        (d / "driver").mkdir()


def test_free_page_reporting_is_a_balloon_with_bit_5(tmp_path: Path) -> None:
    assert not reports_free_pages(str(tmp_path))  # no virtio at all
    _virtio(tmp_path, "virtio0", 2, "001001", driver=True)  # a block device, bit 5 set
    assert not reports_free_pages(str(tmp_path))
    _virtio(tmp_path, "virtio1", 5, "011001", driver=False)  # a balloon without driver
    assert not reports_free_pages(str(tmp_path))
    _virtio(tmp_path, "virtio2", 5, "011000", driver=True)  # a balloon, no reporting
    assert not reports_free_pages(str(tmp_path))
    _virtio(tmp_path, "virtio3", 5, "011001", driver=True)
    assert reports_free_pages(str(tmp_path))


def test_which_images_ask_for_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    big, small = HUGE_IMAGE_MIN_BYTES, HUGE_IMAGE_MIN_BYTES - 1
    assert wants_huge_pages("on", big)
    assert not wants_huge_pages("on", small)
    assert not wants_huge_pages("off", big)
    for pays in (True, False):
        monkeypatch.setattr(allocate_module, "huge_pages_pay", lambda p=pays: p)
        assert wants_huge_pages("auto", big) is pays
        assert not wants_huge_pages("auto", small)


# --- the key -------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", ["auto", "on", "off"])
def test_huge_pages_key_round_trips(tmp_path: Path, setting: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f'[pipeline]\nhuge_pages = "{setting}"\n')
    config = Config.from_toml(path)
    assert config.pipeline.huge_pages == setting
    again = tmp_path / "again.toml"
    again.write_text(config.to_toml())
    assert Config.from_toml(again).pipeline.huge_pages == setting
    assert Config().with_overrides(huge_pages=setting).pipeline.huge_pages == setting


def test_huge_pages_defaults_to_auto() -> None:
    assert Config().pipeline.huge_pages == "auto"


@pytest.mark.parametrize("bad", ['"yes"', "true", '"ON"', "2"])
def test_bad_huge_pages_is_one_line_naming_the_key(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[pipeline]\nhuge_pages = {bad}\n")
    with pytest.raises(ConfigError) as info:
        Config.from_toml(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: pipeline.huge_pages: expected one of 'auto', 'on'")
    with pytest.raises(ConfigError, match="huge_pages: expected one of"):
        Config().with_overrides(huge_pages="always")


# --- loads -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("huge") / "m.gguf"
    return write_synthetic_model(path, size_bytes="6MiB", types="all-types", include_q2_0=False)


@pytest.mark.parametrize("mode", ["none", "direct"])
@pytest.mark.parametrize("setting", ["auto", "on", "off"])
def test_loads_are_byte_identical_with_each_setting(
    monkeypatch: pytest.MonkeyPatch, model: SynthModel, mode: str, setting: str
) -> None:
    # The test model is small: let every image count as large.
    monkeypatch.setattr(allocate_module, "HUGE_IMAGE_MIN_BYTES", 0)
    with aiogguf.load_sync(model.path, mode=mode, n_gpu_layers=0, huge_pages=setting) as loaded:
        assert_same_bytes(loaded, [model.path])
        images = [i for i in loaded._images if isinstance(i, HostImage)]
        assert images
        for image in images:
            asked = wants_huge_pages(setting, image.buffer.nbytes) and THP != "never"
            assert image.buffer.huge_pages is asked
            if asked:
                assert image.buffer.address % HUGE_PAGE_BYTES == 0
