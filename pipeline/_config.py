"""The load configuration: one schema for TOML files, CLI flags and ``load()`` overrides.

Precedence, lowest first: the schema's defaults, the TOML file, then overrides (CLI flags
or keyword arguments to ``load()``). An override replaces the whole value of its key, lists
included (``-ot`` replaces the file's ``[[placement.override]]`` rules, ``--sim-gpu`` its
``[[device]]`` entries). Sizes accept ``"64MiB"``-style strings. Unknown keys, wrong types
and bad sizes are one-line ``ConfigError``s that name the key, the file and what was
expected. TOML gives values their types, so the schema is strict: ``readers = "4"`` or
``prefetch = 1`` is an error, not a guess.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Protocol

import re2
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from aiogguf._addresses import checked_network, checked_prefix
from aiogguf._records import LoadMode
from aiogguf._units import format_duration, format_size, parse_duration, parse_size
from aiogguf.errors import ConfigError
from aiogguf.io._devices.base import SIM_COPY_BYTES_PER_S, SIM_COPY_LATENCY_US, SIM_PIN_S_PER_GIB
from aiogguf.io.ggml_types import ggml_type_by_name

__all__ = [
    "FORMER_NAMES",
    "MANIFEST_SUFFIX",
    "Config",
    "HugePages",
    "LoadConfig",
    "LoadMode",
    "NamePattern",
    "OverrideRule",
    "PathLimit",
    "PipelineConfig",
    "PlacementConfig",
    "PreloadConfig",
    "ServerConfig",
    "SimDeviceConfig",
    "compile_pattern",
    "load_config",
    "manifest_beside",
]


LazyMode = Literal["off", "auto", "on"]
HugePages = Literal["auto", "on", "off"]
SplitMode = Literal["none", "layer", "row"]

# TOML already types its values: no "4" → 4 or 1 → True coercion.
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, Strict()]  # strict floats still take TOML integers (``3``)


class _SizeMark:
    """Marks a size field in ``Annotated`` so ``to_toml`` can write it as ``"64MiB"``."""


def _to_bytes(value: object) -> object:
    # Anything that is not an int or a str (a float, a table) is refused here with the
    # same message as a bad size string, so the user sees one kind of error for sizes.
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected a byte count or a size like '64MiB', got {_show(value)}")
    return parse_size(value)


# Caps on what one load may ask for. Each thread or queue slot costs memory and
# scheduling; past these a machine gains nothing and a bad value (``readers = 1000``)
# slows the load down instead of failing fast.
MAX_THREADS = 256  # readers (per disk) and validate_workers
MAX_QUEUE_DEPTH = 4096
MAX_STAGING_BUFFERS = 256
MAX_CHUNK_BYTES = 4 * 1024**3  # one read job, one staging slot


def _readers(value: object) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise ValueError(f"expected an integer in 1..{MAX_THREADS} or 'auto', got {_show(value)}")
    return value


Readers = Annotated[int | Literal["auto"], PlainValidator(_readers)]
Size = Annotated[int, BeforeValidator(_to_bytes), Field(ge=0), _SizeMark]
PositiveSize = Annotated[int, BeforeValidator(_to_bytes), Field(gt=0), _SizeMark]


def _manifest_setting(value: object) -> object:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if value == "":
        raise ValueError("expected a path or 'auto', got an empty string")
    return value


ManifestSetting = Annotated[str | None, BeforeValidator(_manifest_setting)]


class _Section(BaseModel):
    """A section of the configuration: frozen, unknown keys refused."""

    model_config: ClassVar[ConfigDict] = ConfigDict(extra="forbid", frozen=True)


class LoadConfig(_Section):
    """The ``[load]`` section: how a load reads, checks and keeps its tensors."""

    mode: LoadMode = LoadMode.AUTO
    check_tensors: Bool = True
    # Return the model even when validation found bad tensors (they are still reported).
    keep_invalid: Bool = False
    lazy: LazyMode = "off"
    lazy_min_bytes: Size = 4 * 1024**3
    prefetch: Bool = True
    # A hash manifest the load's bytes are checked against as they land: a path, or
    # "auto" for MODEL.gguf.manifest.json beside the model when it exists.
    manifest: ManifestSetting = None
    # hf:// files: read from the hub's cache when there, written to it as they stream.
    cache: Bool = True
    # Host images in memory another process can map (memfds; mapped modes keep each
    # file's descriptor) and device images exportable: what ``aiogguf.resident`` shares.
    shareable: Bool = False


class OverrideRule(_Section):
    """``pattern`` is a regex searched in tensor names; the first matching rule wins.
    ``buffer_type`` names a buffer type or a device (``CPU``, ``g0``, ``CUDA0``), which
    stands for that device's default buffer type."""

    pattern: str = Field(min_length=1)
    buffer_type: str = Field(min_length=1)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        # Caught here, the error names the file; the plan would only name the pattern.
        compile_pattern(pattern)
        return pattern


class NamePattern(Protocol):
    """A compiled override pattern: ``search`` a tensor name, None when it does not match."""

    @property
    def pattern(self) -> str: ...

    def search(self, text: str) -> object | None: ...


def compile_pattern(pattern: str) -> NamePattern:
    """``pattern`` compiled by RE2, the engine every tensor-name match uses.

    RE2 matches in time linear in the name, so no pattern (``(.|.)*Z``, from a server's
    client) can stall a load or the thread it runs on; it has no backreferences or
    lookaround, and such patterns are refused rather than matched some other way.

    Raises ``ValueError`` saying why RE2 refuses ``pattern``.
    """
    try:
        compiled: NamePattern = re2.compile(pattern, options=_RE2_OPTIONS)
        return compiled
    except re2.error as exc:
        why = exc.args[0] if exc.args else exc
        why = why.decode(errors="replace") if isinstance(why, bytes) else str(why)
        raise ValueError(
            f"expected a regular expression RE2 accepts, got {pattern!r}: {why}"
        ) from None


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # refusals are raised, not also printed by RE2


class PlacementConfig(_Section):
    """The ``[placement]`` section: where tensors go, as llama.cpp's options say."""

    n_gpu_layers: Int = Field(default=-1, ge=-1)
    split_mode: SplitMode = "layer"
    # -1 with split_mode = "none": no GPU at all (llama.cpp's meaning).
    main_gpu: Int = Field(default=0, ge=-1)
    # Finite: ``1e999`` is infinity, and every share divided by it put all on one device.
    tensor_split: tuple[Annotated[Float, Field(ge=0, allow_inf_nan=False)], ...] = ()
    no_host: Bool = False
    override: tuple[OverrideRule, ...] = ()


class PathLimit(_Section):
    """Reader concurrency for files under ``prefix`` (one entry per disk of an array)."""

    prefix: str = Field(min_length=1)
    readers: Int = Field(ge=1, le=MAX_THREADS)


class PipelineConfig(_Section):
    """The ``[pipeline]`` section: how the reads and copies are cut and queued."""

    # No longer used: every host job is handed to the readers at once, and what lands
    # is bounded by the model's own buffers. Kept so that configurations that set it
    # still load.
    queue_depth: Int = Field(default=8, ge=1, le=MAX_QUEUE_DEPTH)
    # "auto": one per core (up to 16) for page-cache reads, up to 4 for O_DIRECT.
    readers: Readers = "auto"
    # One read job; in modes mmap and mlock with checks off at least 256 MiB (one populate
    # call).
    chunk_size: PositiveSize = Field(default=64 * 1024**2, le=MAX_CHUNK_BYTES)
    coalesce_gap: Size = 1024**2
    # Staging slots per transfer thread and device; a slot's size is independent of the
    # size of the read calls that fill it.
    staging_buffers: Int = Field(default=2, ge=1, le=MAX_STAGING_BUFFERS)
    staging_buffer_size: PositiveSize = Field(default=32 * 1024**2, le=MAX_CHUNK_BYTES)
    # Cap of each device's process-wide pool of pinned slots, shared by every load.
    staging_pool_size: PositiveSize = 1024**3
    validate_workers: Int = Field(default=2, ge=1, le=MAX_THREADS)
    alignment: PositiveSize = 4096
    # Host images of the copying modes (none, direct) in transparent huge pages: "on"
    # asks for them, "off" keeps 4 KiB pages, "auto" asks where they fill faster on this
    # machine (aiogguf.io.buffers.huge_pages_pay). Only large images; where the kernel
    # has them off (THP "never") every setting gives 4 KiB pages, silently.
    huge_pages: HugePages = "auto"
    path: tuple[PathLimit, ...] = ()
    # Remote files (http:// and https://): ranged requests in flight, each on a reader
    # thread and a keep-alive connection of its own (``remote_readers``, its former
    # name, is still read); the most bytes one request asks for; tries of a range after
    # a reset, a timeout, a short body or a 5xx, in a row, before the load fails;
    # seconds without a byte before a request counts as timed out; the bytes a second a
    # connection must bring, averaged over remote_timeout, or it counts as timed out too
    # (0: no floor).
    remote_in_flight: Int = Field(default=16, ge=1, le=MAX_THREADS)
    remote_request_size: PositiveSize = Field(default=16 * 1024**2, le=MAX_CHUNK_BYTES)
    remote_retries: Int = Field(default=4, ge=0, le=100)
    remote_timeout: Float = Field(default=30.0, gt=0.0, le=3600.0)
    remote_min_rate: Size = Field(default=1024, le=1024**3)

    @model_validator(mode="before")
    @classmethod
    def _former_names(cls, data: Any) -> Any:
        return _renamed(data, "[pipeline] ")

    @field_validator("alignment")
    @classmethod
    def _power_of_two(cls, alignment: int) -> int:
        # O_DIRECT offsets and buffer addresses are aligned by masking, and no block
        # device has a logical block smaller than 512 bytes.
        if alignment & (alignment - 1) or alignment < 512:
            raise ValueError(f"expected a power of two of at least 512, got {alignment}")
        return alignment

    @model_validator(mode="after")
    def _chunks_hold_a_block(self) -> PipelineConfig:
        # Jobs and staging slots are cut in multiples of the alignment: a smaller size
        # would round down to nothing.
        for key in ("chunk_size", "staging_buffer_size"):
            value = getattr(self, key)
            if value < self.alignment:
                raise ValueError(
                    f"{key}: expected at least the alignment ({format_size(self.alignment)}),"
                    f" got {format_size(value)}"
                )
        return self

    @field_validator("path")
    @classmethod
    def _distinct_prefixes(cls, path: tuple[PathLimit, ...]) -> tuple[PathLimit, ...]:
        seen: set[str] = set()
        for limit in path:
            prefix = _resolve(limit.prefix)
            if prefix in seen:
                raise ValueError(f"prefix {limit.prefix!r} is listed twice")
            seen.add(prefix)
        return path

    def staging_bytes(self) -> int:
        """Bytes per staging slot: ``staging_buffer_size`` rounded down to the
        alignment (O_DIRECT reads land in slots)."""
        return self.staging_buffer_size - self.staging_buffer_size % self.alignment

    def staging_slots(self, transfer_threads: int) -> int:
        """Staging slots that a load with ``transfer_threads`` transfer threads leases
        from each device's pool: ``staging_buffers`` per thread."""
        return transfer_threads * self.staging_buffers

    def staging_pool_bytes(self, transfer_threads: int) -> int:
        """Bytes of staging slots such a load holds on each device, at most: its slots,
        capped by the size of the device's pool (which never grows past it)."""
        return min(
            self.staging_slots(transfer_threads) * self.staging_bytes(), self.staging_pool_size
        )

    def reader_count(self, *, direct: bool = False) -> int:
        """``readers``, with ``"auto"`` resolved for this machine: a page-cache read is
        bound by the core that copies it, an O_DIRECT read by the disk's queue."""
        if self.readers != "auto":
            return self.readers
        return min(usable_cores(), 4 if direct else 16)

    def readers_for(self, path: str | os.PathLike[str], *, direct: bool = False) -> int:
        """Reader limit for ``path``: that of the longest ``[[pipeline.path]]`` prefix that
        holds it (symlinks resolved, so a link into another disk counts for that disk),
        else ``reader_count(direct=direct)``."""
        limit = self.path_limit(path)
        return limit.readers if limit is not None else self.reader_count(direct=direct)

    def path_limit(self, path: str | os.PathLike[str]) -> PathLimit | None:
        """The ``[[pipeline.path]]`` entry with the longest prefix holding ``path``."""
        if not self.path:
            return None  # nothing to resolve the path for
        p = _resolve(path)
        best: PathLimit | None = None
        best_len = -1
        for limit in self.path:
            prefix = _resolve(limit.prefix)
            inside = p == prefix or p.startswith(prefix.rstrip(os.sep) + os.sep)
            if inside and len(prefix) > best_len:
                best, best_len = limit, len(prefix)
        return best


# Keys read under a former name: what they are called now.
FORMER_NAMES: dict[str, str] = {"remote_readers": "remote_in_flight"}


def _renamed(data: Any, where: str = "") -> Any:
    """``data`` (a section's keys, or overrides) with former names as today's; both
    names of one key is an error."""
    if not isinstance(data, Mapping) or not any(k in data for k in FORMER_NAMES):
        return data
    data = dict(data)
    for old, new in FORMER_NAMES.items():
        if old in data:
            if data.get(new) is not None and data[old] is not None:
                raise ValueError(f"{where}{old} is the former name of {new}: give one of them")
            value = data.pop(old)
            if value is not None:
                data[new] = value
    return data


def _duration_text(value: object) -> str:
    # Kept as text in parse_duration's own form ("5m", "-1"): TOML and JSON both write
    # it back, where forever as a float (inf) would not survive JSON.
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected a duration like '5m' or -1 (forever), got {_show(value)}")
    return format_duration(parse_duration(value))


Duration = Annotated[str, BeforeValidator(_duration_text)]


class PreloadConfig(_Section):
    """``[[server.preload]]``: a model the server loads as it starts, with the keys of a
    ``POST /models`` body: ``path``, ``config`` (overrides), ``keep_alive``, ``pin``."""

    path: Annotated[str, Field(min_length=1)]
    config: dict[str, Any] = {}
    keep_alive: Duration | None = None
    pin: Bool = False


class ServerConfig(_Section):
    """``[server]``: settings of ``aiogguf serve``, not of a load (no override sets them).

    ``roots``: the directories whose files clients may load (``--root`` adds to them).
    ``allow_remote`` (``["hf"]``), ``allow_url_prefixes``: the remote names they may
    load; ``allow_private_addresses``, ``allow_networks``: the addresses such loads may
    connect to beyond public ones (docs/server.md; each has the flag of its name).
    ``keep_alive``: how long a model stays once idle, unless its load says otherwise
    (``"5m"``, ``0``, ``-1`` for forever, the default; ``--keep-alive``).
    ``preload``: the models loaded as the server starts (``[[server.preload]]``).
    ``socket``: a Unix socket to listen on for ``aiogguf.attach`` beside HTTP;
    ``attach_users``/``attach_groups``: who may attach besides the server's own user
    (names or numbers; ``--socket``, ``--attach-user``, ``--attach-group``)."""

    roots: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    socket: str | None = Field(default=None, min_length=1)
    attach_users: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    attach_groups: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    allow_remote: tuple[Literal["hf"], ...] = ()
    allow_url_prefixes: tuple[Annotated[str, AfterValidator(checked_prefix)], ...] = ()
    allow_private_addresses: Bool = False
    allow_networks: tuple[Annotated[str, AfterValidator(checked_network)], ...] = ()
    keep_alive: Duration = "-1"
    preload: tuple[PreloadConfig, ...] = ()


# What a load server lets its clients hold by default (``aiogguf.server._policy``'s
# ``ServerPolicy`` and ``aiogguf serve``'s flags): enough for any real use of one machine,
# and no more. Here, not in the server's modules, so the CLI's help needs no aiohttp.
SERVER_MAX_MODELS = 64
SERVER_MAX_SHARDS = 256  # gguf-split sets are tens of shards; each is a descriptor
SERVER_REQUEST_TIMEOUT_S = 10.0
# Remote loads whose files are being opened at once: each holds a thread while it waits
# on another server, which may be slow on purpose.
SERVER_MAX_REMOTE_ADMISSIONS = 8


def server_max_loaded_bytes() -> int:
    """80% of this machine's physical memory: the file bytes the models a server holds
    may total by default. Copies take that much RAM; mapped models (``mmap``) count the
    same, since their pages are resident once loaded."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 64 * 1024**3
    return max(ram * 4 // 5, 1)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, not the machine's count)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _resolve(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.path.expanduser(os.fspath(path)))


class SimDeviceConfig(_Section):
    """A simulated GPU (``[[device]]``): for dry runs and for testing the upload path."""

    name: str | None = Field(default=None, min_length=1)
    kind: Literal["gpu", "igpu", "accel"] = "gpu"
    free: Size = 24 * 1024**3
    total: Size | None = None
    id: str | None = None  # PCI bus id; devices sharing one are the same device
    unsupported: tuple[str, ...] = ()  # ggml type names this device cannot hold
    host_pointer: Bool = False
    async_copies: Bool = True
    events: Bool = True
    pinned_host: Bool = True
    split_buffer: Bool = True
    mmap: Bool = True
    # The modelled GPU's costs (defaults: an H200 on PCIe Gen5): copy bytes per second
    # (None: as fast as the host copies), seconds to queue one copy, to pin a GiB.
    bandwidth: PositiveSize | None = SIM_COPY_BYTES_PER_S
    copy_latency_us: Float = Field(default=SIM_COPY_LATENCY_US, ge=0.0)
    pin_s_per_gib: Float = Field(default=SIM_PIN_S_PER_GIB, ge=0.0)
    max_delay_ms: Float = Field(default=0.0, ge=0.0)
    # False: copies take their modelled time but move no byte and device memory is never
    # backed (the host pays nothing a GPU does not); reads give zeros. For benchmarks.
    keep_bytes: Bool = True

    @field_validator("total")
    @classmethod
    def _holds_free(cls, total: int | None, info: ValidationInfo) -> int | None:
        free = info.data.get("free")
        if total is not None and free is not None and total < free:
            raise ValueError(
                f"expected at least free ({format_size(free)}), got {format_size(total)}"
            )
        return total

    @field_validator("unsupported")
    @classmethod
    def _ggml_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            try:
                ggml_type_by_name(name)
            except KeyError:
                raise ValueError(f"expected ggml type names, got {name!r}") from None
        return names

    @classmethod
    def from_spec(cls, spec: str) -> SimDeviceConfig:
        """Parse ``--sim-gpu`` text: ``"24GiB"`` or ``"name=g0,free=24GiB,unsupported=IQ1_M"``
        (several unsupported types are joined with ``+``).

        Raises ``ConfigError`` naming the spec and the bad key.
        """
        # A spec of 400 digits is named by its start, not echoed whole.
        where = f"--sim-gpu {spec!r}" if len(spec) <= 80 else f"--sim-gpu '{spec[:40]}...'"
        fields: dict[str, Any] = {}
        if "=" not in spec:
            fields["free"] = spec.strip()
        else:
            for part in spec.split(","):
                key, sep, value = part.partition("=")
                key = key.strip()
                if not sep or not key:
                    raise ConfigError("--sim-gpu", None, f"expected key=value, got {part!r}")
                if key in fields:
                    raise ConfigError(key, where, "given twice")
                value = value.strip()
                if key == "unsupported":
                    fields[key] = tuple(v for v in value.split("+") if v)
                elif key in _SIM_FLAGS:
                    fields[key] = _SIM_FLAGS[key].get(value.lower(), value)
                elif key in ("max_delay_ms", "copy_latency_us", "pin_s_per_gib"):
                    fields[key] = _number(value)
                else:
                    fields[key] = value
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise _config_error(exc, where, root=cls) from exc


# ``--sim-gpu`` text is untyped: these words mean a boolean there (not in TOML).
_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}
_SIM_FLAGS = {
    name: _BOOL_WORDS
    for name in (
        "host_pointer",
        "async_copies",
        "events",
        "pinned_host",
        "split_buffer",
        "mmap",
        "keep_bytes",
    )
}


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text  # left for the schema to reject with its message


class Config(_Section):
    """A whole load: ``[load]``, ``[placement]``, ``[pipeline]`` and ``[[device]]``; and
    ``[server]`` for ``aiogguf serve``.

    ``source`` is the file it was read from (for error messages), never a TOML key.
    """

    load: LoadConfig = LoadConfig()
    placement: PlacementConfig = PlacementConfig()
    pipeline: PipelineConfig = PipelineConfig()
    device: tuple[SimDeviceConfig, ...] = ()
    server: ServerConfig = ServerConfig()
    source: str | None = Field(default=None, exclude=True)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Config:
        """Read a TOML file.

        Raises ``ConfigError`` naming the file and the bad key, or why the file could not
        be read or parsed.
        """
        source = os.fspath(path)
        try:
            data = tomllib.loads(Path(source).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError("(file)", source, f"cannot read: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError("(file)", source, f"not UTF-8 text: {exc.reason}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("(file)", source, f"not valid TOML: {exc}") from exc
        except RecursionError as exc:
            # tomllib parses arrays and inline tables recursively: 5,000 ``[`` deep ends
            # the interpreter's stack, which is the file's fault, not the program's.
            raise ConfigError("(file)", source, "not valid TOML: nested too deeply") from exc
        return cls.from_mapping(data, source=source)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str | None = None) -> Config:
        """Validate a parsed TOML document (or ``--json`` output of ``config show``).

        Raises ``ConfigError`` naming ``source`` and the bad key.
        """
        if "source" in data:
            raise ConfigError("source", source, f"unknown key; expected one of: {_SECTIONS}")
        try:
            return cls.model_validate({**data, "source": source})
        except ValidationError as exc:
            raise _config_error(exc, source) from exc

    def with_overrides(self, **overrides: Any) -> Config:
        """A copy with keys replaced by their plain names (``mode="direct"``,
        ``n_gpu_layers=0``, ``chunk_size="16MiB"``, ``sim_gpus=["24GiB"]``); ``None``
        values are skipped. Raises ``ConfigError`` naming the key."""
        return self.with_settings(overrides)

    def with_settings(self, overrides: Mapping[str, Any], *, origin: str = "overrides") -> Config:
        """``with_overrides`` with the overrides in a mapping; errors name ``origin``
        (e.g. ``"command line"``) as where the bad value came from."""
        data = self.model_dump(exclude={"source"})
        try:
            overrides = _renamed(overrides)
        except ValueError as exc:
            raise ConfigError("remote_in_flight", origin, str(exc)) from None
        for key, value in overrides.items():
            if value is None:
                continue
            if key in ("sim_gpus", "device"):
                data["device"] = [_sim_device(v) for v in value]
                continue
            section = _SECTION_OF.get(key)
            if section is None:
                raise ConfigError(key, origin, f"unknown setting{_did_you_mean(key, _KNOWN)}")
            data[section][key] = value
        try:
            config = Config.model_validate(data)
        except ValidationError as exc:
            raise _config_error(exc, origin) from exc
        return config.model_copy(update={"source": self.source})

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain JSON types (sizes in bytes); ``from_mapping`` takes
        it back."""
        data: dict[str, Any] = self.model_dump(mode="json", exclude={"source"})
        return data

    def to_toml(self) -> str:
        """The configuration as a TOML document that ``from_toml`` reads back to an equal
        ``Config``; sizes are written as ``"64MiB"`` where that is exact."""
        lines: list[str] = []
        for name in ("load", "placement", "pipeline"):
            section: _Section = getattr(self, name)
            lines.append(f"[{name}]")
            tables: list[tuple[str, tuple[_Section, ...]]] = []
            for key, value in _fields(section):
                if isinstance(value, tuple) and value and isinstance(value[0], _Section):
                    tables.append((f"{name}.{key}", value))
                elif value is None:
                    lines.append(f"# {key}: unset ({_UNSET_NOTES.get(key, 'default')})")
                else:
                    lines.append(f"{key} = {_toml_value(section, key, value)}")
            for table, items in tables:
                for item in items:
                    lines.extend(["", f"[[{table}]]", *_toml_pairs(item)])
            lines.append("")
        for device in self.device:
            lines.extend(["[[device]]", *_toml_pairs(device), ""])
        if self.server != ServerConfig():
            lines.extend(["[server]", *_toml_pairs(self.server), ""])
            for preload in self.server.preload:
                lines.extend(["[[server.preload]]", *_toml_pairs(preload), ""])
        return "\n".join(lines)


_SECTIONS = "load, placement, pipeline, device, server"
_UNSET_NOTES = {"bandwidth": "as fast as the host copies", "manifest": "none checked"}

_SECTION_OF: dict[str, str] = {
    **{k: "load" for k in LoadConfig.model_fields},
    **{k: "placement" for k in PlacementConfig.model_fields},
    **{k: "pipeline" for k in PipelineConfig.model_fields},
}
# Overrides use bare key names, so no two sections may share one.
assert len(_SECTION_OF) == sum(
    len(m.model_fields) for m in (LoadConfig, PlacementConfig, PipelineConfig)
)
_KNOWN: tuple[str, ...] = (*_SECTION_OF, "sim_gpus", "device")


def _sim_device(value: Any) -> Any:
    if isinstance(value, str):
        return SimDeviceConfig.from_spec(value).model_dump()
    if isinstance(value, SimDeviceConfig):
        return value.model_dump()
    return value


# --- writing TOML -----------------------------------------------------------------------


def _fields(section: _Section) -> list[tuple[str, Any]]:
    return [(key, getattr(section, key)) for key in type(section).model_fields]


def _is_size(model: type[BaseModel], key: str) -> bool:
    field = model.model_fields[key]
    if _SizeMark in field.metadata:
        return True
    return any(_SizeMark in typing.get_args(arg) for arg in typing.get_args(field.annotation))


def _toml_value(section: _Section, key: str, value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and _is_size(type(section), key):
        text = format_size(value)
        return json.dumps(text) if not text.isdigit() else text
    return _toml_scalar(value)


def _toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_scalar(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table, its keys quoted
        pairs = (f"{json.dumps(str(k))} = {_toml_scalar(v)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    raise TypeError(f"no TOML form for {value!r}")


def _toml_pairs(section: _Section) -> list[str]:
    return [
        f"{key} = {_toml_value(section, key, value)}"
        for key, value in _fields(section)
        if value is not None and not (key == "preload" and isinstance(section, ServerConfig))
    ]


# --- errors -----------------------------------------------------------------------------

# pydantic error type → what the key expected, in TOML words.
_EXPECTED: dict[str, str] = {
    "bool_type": "true or false",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "string_type": "a string",
    "dict_type": "a table",
    "model_type": "a table",
    "model_attributes_type": "a table",
    "tuple_type": "an array",
    "list_type": "an array",
}
_BOUNDS: dict[str, tuple[str, str]] = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def _show(value: object) -> str:
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list | tuple):
        return "an array"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            model = _model_of(arg)
            if model is not None:
                return model
    return None


def _model_at(root: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int):
            continue  # an index into an array of tables
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        model = _model_of(field.annotation)
    return model


def _did_you_mean(key: str, known: typing.Iterable[str]) -> str:
    known = [k for k in known if k != "source"]
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; expected one of: {', '.join(known)}"


def _problem(err: ErrorDetails, root: type[BaseModel]) -> str:
    kind, got, ctx = err["type"], err.get("input"), err.get("ctx", {})
    if kind == "extra_forbidden":
        parent = _model_at(root, err["loc"][:-1])
        known = parent.model_fields if parent is not None else ()
        return "unknown key" + _did_you_mean(str(err["loc"][-1]), known)
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "missing":
        return "required key is missing"
    if kind in ("literal_error", "enum"):
        return f"expected one of {ctx['expected']}, got {_show(got)}"
    if kind in _BOUNDS:
        name, op = _BOUNDS[kind]
        return f"expected a value {op} {ctx[name]}, got {_show(got)}"
    if kind == "string_too_short":
        return "expected a non-empty string"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {_show(got)}"
    return f"{err['msg']}, got {_show(got)}"


def _key_of(loc: tuple[int | str, ...]) -> str:
    key = ""
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else part)
    return key or "(top level)"


def _config_error(
    exc: ValidationError, source: str | None, root: type[BaseModel] = Config
) -> ConfigError:
    # One line: the first problem in full, the count of the others. A misspelt key comes
    # first, as it often explains a "missing" one.
    errors = sorted(exc.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    err = errors[0]
    problem = _problem(err, root)
    if len(errors) > 1:
        problem += f" (and {len(errors) - 1} more problem(s))"
    return ConfigError(_key_of(err["loc"]), source, problem)


def load_config(config: Config | str | os.PathLike[str] | None = None, **overrides: Any) -> Config:
    """Resolve the ``config`` argument of the public API (object, TOML path or None) and
    apply ``overrides`` on top (see ``Config.with_overrides``).

    Raises ``ConfigError`` naming the key and the file (or ``overrides``).
    """
    if config is None:
        base = Config()
    elif isinstance(config, Config):
        base = config
    else:
        base = Config.from_toml(config)
    return base.with_overrides(**overrides) if overrides else base


# The manifest ``load.manifest = "auto"`` looks for beside a model's first file (and
# ``aiogguf hash`` writes there by default).
MANIFEST_SUFFIX = ".manifest.json"


def manifest_beside(model_path: str | os.PathLike[str]) -> str:
    """Where a model's manifest is looked for and written by default: beside its
    (first) file, ``MODEL.gguf.manifest.json``."""
    return os.fspath(model_path) + MANIFEST_SUFFIX
