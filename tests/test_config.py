"""The config schema: one-line errors naming key and file, sizes, precedence, per-path
reader limits, ``--sim-gpu`` specs and ``aiogguf config show``."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiogguf._config import (
    Config,
    PathLimit,
    PipelineConfig,
    SimDeviceConfig,
    load_config,
)
from aiogguf._units import format_size, parse_size
from aiogguf.cli import main
from aiogguf.errors import ConfigError


def _write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# (TOML text, key named in the message, fragment of what was expected)
BAD_FILES = [
    pytest.param('[load]\nmdoe = "mmap"\n', "load.mdoe", "did you mean 'mode'", id="typo"),
    pytest.param('[lod]\nmode = "mmap"\n', "lod", "expected one of: load, placement", id="section"),
    pytest.param(
        '[pipeline]\nreaders = "four"\n',
        "pipeline.readers",
        "expected an integer in 1..256 or 'auto', got 'four'",
        id="wrong-type",
    ),
    pytest.param(
        '[pipeline]\nreaders = "4"\n',
        "pipeline.readers",
        "expected an integer in 1..256 or 'auto'",
        id="no-coercion",
    ),
    pytest.param(
        "[load]\nprefetch = 1\n", "load.prefetch", "expected true or false, got 1", id="bool"
    ),
    pytest.param(
        '[pipeline]\nchunk_size = "64MB/s"\n',
        "pipeline.chunk_size",
        "expected a size like '64MiB'",
        id="bad-size",
    ),
    pytest.param(
        "[pipeline]\nchunk_size = 1.5\n",
        "pipeline.chunk_size",
        "expected a byte count or a size",
        id="float-size",
    ),
    pytest.param(
        '[load]\nmode = "fast"\n', "load.mode", "expected one of 'auto', 'mmap'", id="literal"
    ),
    pytest.param("[placement]\nn_gpu_layers = -2\n", "placement.n_gpu_layers", ">= -1", id="range"),
    pytest.param("load = 3\n", "load", "expected a table, got 3", id="not-a-table"),
    pytest.param(
        '[placement]\ntensor_split = "3,1"\n', "placement.tensor_split", "an array", id="split"
    ),
    pytest.param(
        '[[placement.override]]\npattern = "exps"\nbuffertype = "CPU"\n',
        "placement.override[0].buffertype",
        "did you mean 'buffer_type'",
        id="override-typo-first",
    ),
    pytest.param(
        '[[placement.override]]\npattern = "exps("\nbuffer_type = "CPU"\n',
        "placement.override[0].pattern",
        "expected a regular expression",
        id="regex",
    ),
    pytest.param(
        '[[pipeline.path]]\nprefix = "/a"\nreaders = 0\n',
        "pipeline.path[0].readers",
        ">= 1",
        id="path-readers",
    ),
    pytest.param(
        '[[pipeline.path]]\nprefix = "/a"\nreaders = 1\n[[pipeline.path]]\nprefix = "/a/"\n'
        "readers = 2\n",
        "pipeline.path",
        "listed twice",
        id="path-twice",
    ),
    pytest.param(
        "[pipeline]\nalignment = 3000\n", "pipeline.alignment", "power of two", id="alignment"
    ),
    pytest.param(
        "[pipeline]\nalignment = 256\n", "pipeline.alignment", "at least 512", id="alignment-small"
    ),
    pytest.param(
        '[[device]]\nfree = "2GiB"\ntotal = "1GiB"\n',
        "device[0].total",
        "at least free (2GiB), got 1GiB",
        id="total",
    ),
    pytest.param(
        '[[device]]\nunsupported = ["IQ9_Z"]\n',
        "device[0].unsupported",
        "ggml type names, got 'IQ9_Z'",
        id="ggml-name",
    ),
    pytest.param('[device]\nfree = "1GiB"\n', "device", "expected an array", id="device-table"),
    pytest.param('source = "x"\n', "source", "unknown key", id="source"),
]


@pytest.mark.parametrize(("text", "key", "expected"), BAD_FILES)
def test_bad_file_is_one_line_naming_key_and_file(
    tmp_path: Path, text: str, key: str, expected: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        Config.from_toml(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: {key}: ")
    assert expected in message
    assert (info.value.key, info.value.source) == (key, str(path))


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [p for p in BAD_FILES if p.id in ("typo", "wrong-type", "bad-size")],
)
def test_cli_bad_file_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, key: str, expected: str
) -> None:
    path = _write(tmp_path, text)
    assert main(["config", "show", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert f"{path}: {key}: " in lines[0]
    assert expected in lines[0]


def test_unreadable_and_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.toml: \(file\): cannot read"):
        Config.from_toml(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match=r"bad\.toml: \(file\): not valid TOML: .*line 1"):
        Config.from_toml(_write(tmp_path, "[load\n", "bad.toml"))
    (tmp_path / "latin1.toml").write_bytes(b'[load]\nmode = "\xe9"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        Config.from_toml(tmp_path / "latin1.toml")


def test_many_problems_still_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path, '[load]\nmode = 1\nprefetch = "x"\n[pipeline]\nreaders = 0\n')
    with pytest.raises(ConfigError, match=r"\(and 2 more problem\(s\)\)$") as info:
        Config.from_toml(path)
    assert "\n" not in str(info.value)


def test_sizes_accept_strings_and_ints(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[load]\nlazy_min_bytes = "1.5GiB"\n'
        '[pipeline]\nchunk_size = "16MiB"\ncoalesce_gap = 0\nstaging_buffer_size = "1 MB"\n'
        '[[device]]\nfree = "8G"\nbandwidth = "12GB"\n',
    )
    config = Config.from_toml(path)
    assert config.load.lazy_min_bytes == 3 * 512 * 1024**2
    assert config.pipeline.chunk_size == 16 * 1024**2
    assert config.pipeline.coalesce_gap == 0
    assert config.pipeline.staging_buffer_size == 1_000_000
    assert (config.device[0].free, config.device[0].bandwidth) == (8 * 1024**3, 12 * 10**9)


def test_staging_bytes_are_aligned() -> None:
    assert PipelineConfig().staging_bytes() == 32 * 1024**2
    assert PipelineConfig(staging_buffer_size=4096).staging_bytes() == 4096
    assert PipelineConfig(staging_buffer_size=10_000).staging_bytes() == 8192
    assert PipelineConfig(staging_buffer_size=10_000, alignment=8192).staging_bytes() == 8192


def test_readers_auto_scales_with_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiogguf import _config as config_module

    for cores, buffered, direct in ((1, 1, 1), (2, 2, 2), (16, 16, 4), (128, 16, 4)):
        monkeypatch.setattr(config_module, "usable_cores", lambda n=cores: n)
        assert PipelineConfig().reader_count() == buffered
        assert PipelineConfig().reader_count(direct=True) == direct
        assert PipelineConfig(readers=3).reader_count(direct=True) == 3


# --- precedence -------------------------------------------------------------------------


def test_precedence_defaults_file_overrides(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[load]\nmode = "mmap"\n[pipeline]\nreaders = 3\nchunk_size = "8MiB"\n'
        '[[placement.override]]\npattern = "exps"\nbuffer_type = "CPU"\n'
        '[[device]]\nname = "a"\n',
    )
    from_file = load_config(path)
    assert (from_file.load.mode, from_file.pipeline.readers) == ("mmap", 3)
    assert from_file.pipeline.queue_depth == PipelineConfig().queue_depth  # default kept
    config = load_config(
        path,
        mode="direct",
        chunk_size="16MiB",
        lazy=None,  # None: not given, the file's (here the default) value stays
        override=[{"pattern": "attn", "buffer_type": "a"}],
        sim_gpus=["name=b,free=1GiB"],
    )
    assert config.load.mode == "direct"
    assert config.pipeline.chunk_size == 16 * 1024**2
    assert config.pipeline.readers == 3  # from the file, not overridden
    assert config.load.lazy == "off"
    # A list override replaces the file's list: the flags are the whole story.
    assert [r.pattern for r in config.placement.override] == ["attn"]
    assert [d.name for d in config.device] == ["b"]
    assert config.source == str(path)


def test_override_errors_blame_the_override(tmp_path: Path) -> None:
    path = _write(tmp_path, "[pipeline]\nreaders = 3\n")
    with pytest.raises(
        ConfigError, match=r"^overrides: pipeline\.readers: expected an integer in 1..256 or 'auto'"
    ):
        load_config(path, readers=0)
    with pytest.raises(ConfigError, match=r"^overrides: redaers: unknown setting \(did you"):
        load_config(path, redaers=4)


def test_cli_flags_override_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, '[load]\nmode = "mmap"\nlazy = "auto"\n[placement]\nn_gpu_layers = 5\n')
    argv = ["config", "show", "--config", str(path), "--json"]
    assert main([*argv, "--mode", "none", "-ngl", "2", "-ot", "exps=CPU,attn=g0"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["load"] == {**data["load"], "mode": "none", "lazy": "auto"}
    assert data["placement"]["n_gpu_layers"] == 2
    assert data["placement"]["override"] == [
        {"pattern": "exps", "buffer_type": "CPU"},
        {"pattern": "attn", "buffer_type": "g0"},
    ]
    assert Config.from_mapping(data) == load_config(
        path, mode="none", n_gpu_layers=2, override=data["placement"]["override"]
    ).model_copy(update={"source": None})
    assert main(["config", "show", "--config", str(path), "-ngl", "-3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "command line: placement.n_gpu_layers: expected a value >= -1" in err


def test_config_show_toml_reads_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--mode", "direct", "-ts", "3,1", "-ot", "exps=CPU", "--sim-gpu", "24GiB"]
    flags += ["--sim-gpu", "name=x,free=1000,unsupported=IQ1_M+Q4_0,events=false"]
    assert main(["config", "show", *flags]) == 0
    out = capsys.readouterr().out
    assert 'chunk_size = "64MiB"' in out
    assert 'free = "24GiB"' in out
    assert "free = 1000\n" in out  # not exact in any unit: bytes
    shown = Config.from_mapping(tomllib.loads(out))
    assert shown == Config().with_overrides(
        mode="direct",
        tensor_split=(3, 1),
        override=[{"pattern": "exps", "buffer_type": "CPU"}],
        sim_gpus=["24GiB", "name=x,free=1000,unsupported=IQ1_M+Q4_0,events=false"],
    )


def test_to_toml_round_trip_of_every_field(tmp_path: Path) -> None:
    config = Config().with_overrides(
        staging_buffer_size="3MiB",
        path=[{"prefix": 'we"ird\\dir', "readers": 3}],
        override=[{"pattern": r"blk\.\d+\.ffn", "buffer_type": "CPU"}],
        sim_gpus=["name=ü,free=1GiB,total=2GiB,bandwidth=1000000,max_delay_ms=2.5,id=0:1"],
    )
    assert Config.from_mapping(tomllib.loads(config.to_toml())) == config
    assert Config.from_mapping(tomllib.loads(Config().to_toml())) == Config()


@given(st.integers(min_value=0, max_value=2**50))
def test_format_size_round_trips(n: int) -> None:
    assert parse_size(format_size(n)) == n


# --- per-path reader limits -------------------------------------------------------------


def test_readers_for_longest_prefix(tmp_path: Path) -> None:
    pipeline = PipelineConfig(
        readers=2,
        path=(
            PathLimit(prefix="/mnt/nvme0", readers=4),
            PathLimit(prefix="/mnt/nvme0/slow/", readers=1),
            PathLimit(prefix="/mnt/nvme1/model.gguf", readers=8),
        ),
    )
    assert pipeline.readers_for("/mnt/nvme0/m-00001-of-00002.gguf") == 4
    assert pipeline.readers_for("/mnt/nvme0/slow/m.gguf") == 1
    assert pipeline.readers_for("/mnt/nvme0/slower/m.gguf") == 4  # not a path prefix
    assert pipeline.readers_for("/mnt/nvme0") == 4
    assert pipeline.readers_for("/mnt/nvme00/m.gguf") == 2
    assert pipeline.readers_for("/mnt/nvme1/model.gguf") == 8
    assert pipeline.readers_for(Path("/elsewhere/m.gguf")) == 2


def test_readers_for_follows_symlinks_and_relative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = tmp_path / "disk1"
    disk.mkdir()
    (disk / "shard.gguf").write_bytes(b"")
    (tmp_path / "model").mkdir()
    os.symlink(disk / "shard.gguf", tmp_path / "model" / "shard.gguf")
    monkeypatch.chdir(tmp_path)
    pipeline = PipelineConfig(path=(PathLimit(prefix="disk1", readers=6),))
    assert pipeline.readers_for(tmp_path / "model" / "shard.gguf") == 6
    assert pipeline.readers_for("model/shard.gguf") == 6


# --- --sim-gpu --------------------------------------------------------------------------


def test_sim_gpu_spec() -> None:
    assert SimDeviceConfig.from_spec("24GiB").free == 24 * 1024**3
    spec = "name=g7, free=1GiB, total=2GiB, unsupported=IQ1_M+TQ1_0, mmap=false, max_delay_ms=3"
    device = SimDeviceConfig.from_spec(spec)
    assert (device.name, device.free, device.total) == ("g7", 1024**3, 2 * 1024**3)
    assert (device.unsupported, device.mmap, device.max_delay_ms) == (("IQ1_M", "TQ1_0"), False, 3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("lots", "--sim-gpu 'lots': free: expected a size like '64MiB'"),
        ("", "--sim-gpu '': free: expected a size"),
        ("name=g0,free", "--sim-gpu: expected key=value, got 'free'"),
        ("name=g0,,free=1GiB", "--sim-gpu: expected key=value, got ''"),
        ("=3", "--sim-gpu: expected key=value, got '=3'"),
        ("free=1GiB,fere=2GiB", "fere: unknown key (did you mean 'free'?)"),
        ("free=1GiB,free=2GiB", "free: given twice"),
        ("free=1GiB,mmap=maybe", "mmap: expected true or false, got 'maybe'"),
        ("free=1GiB,kind=cpu", "kind: expected one of 'gpu', 'igpu' or 'accel'"),
        ("free=1GiB,unsupported=Q9", "unsupported: expected ggml type names, got 'Q9'"),
        ("free=1GiB,max_delay_ms=soon", "max_delay_ms: expected a number, got 'soon'"),
        ("free=2GiB,total=1GiB", "total: expected at least free (2GiB), got 1GiB"),
        ("name=,free=1GiB", "name: expected a non-empty string"),
    ],
)
def test_sim_gpu_spec_errors(spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        SimDeviceConfig.from_spec(spec)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_cli_sim_gpu_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--sim-gpu", "free=1GiB,colour=red"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "colour: unknown key" in err
