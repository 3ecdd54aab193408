"""Command-line flags shared by ``plan``, ``load``, ``validate`` and ``bench``, named as
in llama.cpp, and their translation into a ``Config`` (flags override the file)."""

from __future__ import annotations

import argparse
from typing import Any

from aiogguf.config import Config, load_config
from aiogguf.errors import ConfigError
from aiogguf.units import parse_size

__all__ = [
    "add_config_options",
    "add_placement_options",
    "config_from_args",
    "positive_int",
    "positive_size",
]


def positive_size(text: str, flag: str) -> int:
    """Bytes in ``text`` (``64MiB``, ``1GiB``, ``4096``), which must be more than 0.

    Raises ``ConfigError`` naming ``flag`` (the CLI prints one line and exits 2).
    """
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise ConfigError(flag, "command line", str(exc)) from exc
    if size <= 0:
        raise ConfigError(flag, "command line", f"must be more than 0 bytes, got {text!r}")
    return size


def positive_int(value: int, flag: str) -> int:
    """``value`` if it is at least 1; else ``ConfigError`` naming ``flag``."""
    if value < 1:
        raise ConfigError(flag, "command line", f"must be at least 1, got {value}")
    return value


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file (see configs/)")
    parser.add_argument(
        "--mode",
        choices=["auto", "mmap", "mlock", "none", "direct"],
        help="load mode (default: auto)",
    )
    # llama.cpp's own flags for two of the modes, so that its command lines work here.
    parser.add_argument(
        "--no-mmap", dest="mode", action="store_const", const="none", help="= --mode none"
    )
    parser.add_argument(
        "--mlock", dest="mode", action="store_const", const="mlock", help="= --mode mlock"
    )
    parser.add_argument(
        "--no-cache",
        dest="cache",
        action="store_const",
        const=False,
        help="hf:// names: neither read nor write the hub's cache",
    )


def add_placement_options(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser)
    g = parser.add_argument_group("placement (as in llama.cpp)")
    g.add_argument("-ngl", "--n-gpu-layers", type=int, metavar="N", help="-1 = all")
    g.add_argument("-sm", "--split-mode", choices=["none", "layer", "row"])
    g.add_argument("-mg", "--main-gpu", type=int, metavar="I")
    g.add_argument("-ts", "--tensor-split", metavar="A,B,...", help="e.g. 3,1")
    g.add_argument(
        "-ot",
        "--override-tensor",
        action="append",
        metavar="PATTERN=BUFTYPE",
        help="repeatable; also comma-separated",
    )
    g.add_argument("--no-host", action="store_true", default=None, help="no pinned host buffers")
    g.add_argument("--lazy", choices=["off", "auto", "on"])
    g.add_argument(
        "--sim-gpu",
        action="append",
        metavar="SPEC",
        help="add a simulated GPU: 24GiB or name=g0,free=24GiB,total=24GiB,unsupported=IQ1_M",
    )


def add_manifest_option(parser: argparse.ArgumentParser) -> None:
    """``--manifest [PATH]``: check the bytes against a hash manifest as they land."""
    parser.add_argument(
        "--manifest",
        nargs="?",
        const="auto",
        metavar="PATH",
        help="check every byte against a hash manifest (aiogguf hash) as it lands; "
        "without PATH, or 'auto': MODEL.gguf.manifest.json beside the model, if any",
    )


def _parse_overrides(values: list[str]) -> list[dict[str, str]]:
    rules: list[dict[str, str]] = []
    for value in values:
        for item in value.split(","):
            pattern, sep, buffer_type = item.rpartition("=")
            if not sep or not pattern or not buffer_type:
                raise ConfigError(
                    "--override-tensor", None, f"expected PATTERN=BUFTYPE, got {item!r}"
                )
            rules.append({"pattern": pattern, "buffer_type": buffer_type})
    return rules


def _parse_split(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.replace("/", ",").split(",") if part)
    except ValueError as exc:
        raise ConfigError(
            "--tensor-split", None, f"expected numbers like 3,1, got {text!r}"
        ) from exc


def config_from_args(args: argparse.Namespace, **extra: Any) -> Config:
    """The effective config: defaults < ``--config`` file < flags < ``extra``.

    Raises ``ConfigError`` naming the file, or ``command line``, and the bad key.
    """
    overrides: dict[str, Any] = {"mode": getattr(args, "mode", None)}
    flag_keys = {
        "n_gpu_layers": "n_gpu_layers",
        "split_mode": "split_mode",
        "main_gpu": "main_gpu",
        "no_host": "no_host",
        "lazy": "lazy",
        "manifest": "manifest",
        "cache": "cache",
    }
    for attr, key in flag_keys.items():
        overrides[key] = getattr(args, attr, None)
    if getattr(args, "tensor_split", None):
        overrides["tensor_split"] = _parse_split(args.tensor_split)
    if getattr(args, "override_tensor", None):
        overrides["override"] = _parse_overrides(args.override_tensor)
    if getattr(args, "sim_gpu", None):
        overrides["sim_gpus"] = args.sim_gpu
    overrides.update(extra)
    # Errors in flag values name the command line, not the file they override.
    return load_config(getattr(args, "config", None)).with_settings(
        overrides, origin="command line"
    )
