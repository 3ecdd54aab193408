"""The load configuration: one schema for TOML files, CLI flags and ``load()`` overrides.

Precedence, lowest first: the schema's defaults, the TOML file, then overrides (CLI flags
or keyword arguments to ``load()``). Sizes accept ``"64MiB"``-style strings. Unknown keys
and wrong types are ``ConfigError``s that name the key and the file.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from aiogguf.errors import ConfigError
from aiogguf.units import parse_size

__all__ = [
    "Config",
    "LoadConfig",
    "LoadMode",
    "OverrideRule",
    "PathLimit",
    "PipelineConfig",
    "PlacementConfig",
    "SimDeviceConfig",
    "load_config",
]

LoadMode = Literal["auto", "mmap", "mlock", "none", "direct"]
LazyMode = Literal["off", "auto", "on"]
SplitMode = Literal["none", "layer", "row"]

Size = Annotated[int, BeforeValidator(parse_size), Field(ge=0)]
PositiveSize = Annotated[int, BeforeValidator(parse_size), Field(gt=0)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class LoadConfig(_Section):
    mode: LoadMode = "auto"
    check_tensors: bool = True
    # Return the model even when validation found bad tensors (they are still reported).
    keep_invalid: bool = False
    lazy: LazyMode = "off"
    lazy_min_bytes: Size = 4 * 1024**3
    prefetch: bool = True


class OverrideRule(_Section):
    """``pattern`` is a regex searched in tensor names; the first matching rule wins.
    ``buffer_type`` names a buffer type or a device (``CPU``, ``g0``, ``CUDA0``), which
    stands for that device's default buffer type."""

    pattern: str
    buffer_type: str


class PlacementConfig(_Section):
    n_gpu_layers: int = Field(default=-1, ge=-1)
    split_mode: SplitMode = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()
    no_host: bool = False
    override: tuple[OverrideRule, ...] = ()


class PathLimit(_Section):
    """Reader concurrency for files under ``prefix`` (one entry per disk of an array)."""

    prefix: str
    readers: int = Field(ge=1)


class PipelineConfig(_Section):
    queue_depth: int = Field(default=8, ge=1)
    readers: int = Field(default=2, ge=1)
    chunk_size: PositiveSize = 64 * 1024**2
    coalesce_gap: Size = 1024**2
    staging_buffers: int = Field(default=4, ge=1)
    # None: 64 MiB in direct mode, 1 MiB otherwise.
    staging_buffer_size: PositiveSize | None = None
    validate_workers: int = Field(default=2, ge=1)
    alignment: PositiveSize = 4096
    path: tuple[PathLimit, ...] = ()

    def staging_bytes(self, mode: str) -> int:
        if self.staging_buffer_size is not None:
            return self.staging_buffer_size
        return 64 * 1024**2 if mode == "direct" else 1024**2

    def readers_for(self, path: str | os.PathLike[str]) -> int:
        """Reader limit for ``path``: the longest matching ``[[pipeline.path]]`` prefix."""
        p = os.path.abspath(os.fspath(path))
        best: PathLimit | None = None
        for limit in self.path:
            prefix = os.path.abspath(limit.prefix)
            inside = p == prefix or p.startswith(prefix.rstrip(os.sep) + os.sep)
            if inside and (best is None or len(prefix) > len(best.prefix)):
                best = limit
        return best.readers if best is not None else self.readers


class SimDeviceConfig(_Section):
    """A simulated GPU (``[[device]]``): for dry runs and for testing the upload path."""

    name: str | None = None
    kind: Literal["gpu", "igpu", "accel"] = "gpu"
    free: Size = 24 * 1024**3
    total: Size | None = None
    id: str | None = None  # PCI bus id; devices sharing one are the same device
    unsupported: tuple[str, ...] = ()  # ggml type names this device cannot hold
    host_pointer: bool = False
    async_copies: bool = True
    events: bool = True
    pinned_host: bool = True
    split_buffer: bool = True
    mmap: bool = True
    bandwidth: Size | None = None  # bytes per second of the simulated copy engine
    max_delay_ms: float = Field(default=0.0, ge=0.0)

    @classmethod
    def from_spec(cls, spec: str) -> SimDeviceConfig:
        """Parse ``--sim-gpu`` text: ``"24GiB"`` or ``"name=g0,free=24GiB,unsupported=IQ1_M"``
        (several unsupported types are joined with ``+``)."""
        if "=" not in spec:
            return cls(free=spec)  # type: ignore[arg-type]
        fields: dict[str, Any] = {}
        for part in spec.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ConfigError("--sim-gpu", None, f"expected key=value, got {part!r}")
            fields[key] = tuple(v for v in value.split("+") if v) if key == "unsupported" else value
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise _config_error(exc, f"--sim-gpu {spec!r}") from exc


class Config(_Section):
    """A whole load: ``[load]``, ``[placement]``, ``[pipeline]`` and ``[[device]]``."""

    load: LoadConfig = LoadConfig()
    placement: PlacementConfig = PlacementConfig()
    pipeline: PipelineConfig = PipelineConfig()
    device: tuple[SimDeviceConfig, ...] = ()
    source: str | None = Field(default=None, exclude=True)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Config:
        """Read a TOML file. Raises ``ConfigError`` naming the file and the bad key."""
        source = os.fspath(path)
        try:
            data = tomllib.loads(Path(source).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError("(file)", source, f"cannot read: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("(file)", source, f"not valid TOML: {exc}") from exc
        return cls.from_mapping(data, source=source)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str | None = None) -> Config:
        try:
            return cls.model_validate({**data, "source": source})
        except ValidationError as exc:
            raise _config_error(exc, source) from exc

    def with_overrides(self, **overrides: Any) -> Config:
        """A copy with keys replaced by their plain names (``mode="direct"``,
        ``n_gpu_layers=0``, ``chunk_size="16MiB"``, ``sim_gpus=["24GiB"]``)."""
        data = self.model_dump(exclude={"source"})
        for key, value in overrides.items():
            if value is None:
                continue
            if key == "sim_gpus":
                data["device"] = [
                    SimDeviceConfig.from_spec(v).model_dump() if isinstance(v, str) else v
                    for v in value
                ]
                continue
            section = _SECTION_OF.get(key)
            if section is None:
                raise ConfigError(key, "overrides", f"unknown setting; known: {_known_keys()}")
            data[section][key] = value
        return Config.from_mapping(data, source=self.source)


_SECTION_OF: dict[str, str] = {
    **{k: "load" for k in LoadConfig.model_fields},
    **{k: "placement" for k in PlacementConfig.model_fields},
    **{k: "pipeline" for k in PipelineConfig.model_fields},
}


def _known_keys() -> str:
    return ", ".join(sorted([*_SECTION_OF, "sim_gpus"]))


def _config_error(exc: ValidationError, source: str | None) -> ConfigError:
    err = exc.errors()[0]
    key = ".".join(str(part) for part in err["loc"]) or "(root)"
    if err["type"] == "extra_forbidden":
        problem = "unknown key"
    else:
        got = err.get("input")
        problem = f"{err['msg']} (got {got!r})" if not isinstance(got, dict) else err["msg"]
    return ConfigError(key, source, problem)


def load_config(config: Config | str | os.PathLike[str] | None = None, **overrides: Any) -> Config:
    """Resolve the ``config`` argument of the public API (object, TOML path or None)."""
    if config is None:
        base = Config()
    elif isinstance(config, Config):
        base = config
    else:
        base = Config.from_toml(config)
    return base.with_overrides(**overrides) if overrides else base
