"""Command-line flags shared by ``plan``, ``load``, ``validate`` and ``bench``, named as
in llama.cpp, and their translation into a ``Config`` (flags override the file)."""

from __future__ import annotations

import argparse
from typing import Any

from aiogguf._config import Config, load_config
from aiogguf._units import parse_size
from aiogguf.errors import ConfigError

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
    """The flags every loading command shares: ``--config`` and the settings
    that override it."""
    parser.add_argument("--config", metavar="FILE", help="TOML file (see configs/)")
    parser.add_argument(
        "--mode",
        choices=["auto", "mmap", "mlock", "none", "direct"],
        help="load mode (default: auto)",
    )
    # llama.cpp's own flags for two of the modes, so that its command lines work here.
    # Each is recorded on its own: what they mean together does not hang on their order.
    parser.add_argument("--no-mmap", action="store_true", default=None, help="= --mode none")
    parser.add_argument("--mlock", action="store_true", default=None, help="= --mode mlock")
    parser.add_argument(
        "--no-cache",
        dest="cache",
        action="store_const",
        const=False,
        help="hf:// names: neither read nor write the hub's cache",
    )


# llama.cpp's flags that set something aiogguf has no part in: each is refused in one
# line saying why (exit 2), not with the whole usage. (short, long) → why.
_WEIGHTS_ONLY = "aiogguf loads weights only"
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("-c", "--ctx-size"): f"sets llama.cpp's context; {_WEIGHTS_ONLY}",
    ("-dev", "--device"): "picks llama.cpp's devices; aiogguf uses the GPUs it finds: -ngl 0 "
    "keeps every weight on the CPU, -ts and -mg share the layers between GPUs",
    ("-b", "--batch-size"): f"sets llama.cpp's logical batch; {_WEIGHTS_ONLY}",
    ("-ub", "--ubatch-size"): f"sets llama.cpp's physical batch; {_WEIGHTS_ONLY}",
    ("-fa", "--flash-attn"): f"picks llama.cpp's attention kernels; {_WEIGHTS_ONLY}",
    ("-ctk", "--cache-type-k"): f"sets llama.cpp's KV cache type; {_WEIGHTS_ONLY}",
    ("-ctv", "--cache-type-v"): f"sets llama.cpp's KV cache type; {_WEIGHTS_ONLY}",
    ("-np", "--parallel"): f"sets llama.cpp's parallel sequences; {_WEIGHTS_ONLY}",
    ("-t", "--threads"): "sets llama.cpp's compute threads; aiogguf's read threads are "
    "readers = N in a --config file",
}


class _NotApplicable(argparse.Action):
    """A llama.cpp flag with no meaning here: the command ends at once, one line, exit 2."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        short, long = self.option_strings
        what = NOT_APPLICABLE[short, long]
        parser.exit(2, f"{parser.prog}: {short}/{long} {what}\n")


def _add_not_applicable(parser: argparse.ArgumentParser) -> None:
    for flags in NOT_APPLICABLE:
        # Out of --help and of the parsed arguments: they are there only to be refused
        # clearly. ``nargs="?"``: with or without the value llama.cpp takes, one line.
        parser.add_argument(
            *flags,
            action=_NotApplicable,
            nargs="?",
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


def add_placement_options(parser: argparse.ArgumentParser) -> None:
    """The configuration flags and llama.cpp's placement flags."""
    add_config_options(parser)
    _add_not_applicable(parser)
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


# llama.cpp's mode flags: the mode each stands for, and the modes it agrees with (mode
# direct reads without a mapping too).
_LLAMA_MODE_FLAGS: dict[str, tuple[str, frozenset[str]]] = {
    "--no-mmap": ("none", frozenset({"none", "direct"})),
    "--mlock": ("mlock", frozenset({"mlock"})),
}


def _mode(args: argparse.Namespace) -> str | None:
    """The load mode the flags ask for (None: the file's, or the default), whatever
    their order. llama.cpp's ``--no-mmap --mlock`` reads the model into memory and locks
    it; no mode here does both, so the pair is refused, as is a ``--mode`` that another
    flag contradicts."""
    given = [flag for flag in _LLAMA_MODE_FLAGS if getattr(args, flag[2:].replace("-", "_"), None)]
    if len(given) > 1:
        raise ConfigError(
            " ".join(given),
            "command line",
            "llama.cpp reads the model into memory and locks it; no aiogguf mode does "
            "both: --no-mmap (mode none) reads it into memory, --mlock (mode mlock) maps "
            "it and locks its pages",
        )
    mode: str | None = getattr(args, "mode", None)
    for flag in given:
        flag_mode, agrees = _LLAMA_MODE_FLAGS[flag]
        if mode is None:
            mode = flag_mode
        elif mode not in agrees:
            raise ConfigError(
                f"--mode {mode} {flag}", "command line", f"{flag} means mode {flag_mode}"
            )
    return mode


def config_from_args(args: argparse.Namespace, **extra: Any) -> Config:
    """The effective config: defaults < ``--config`` file < flags < ``extra``.

    Raises ``ConfigError`` naming the file, or ``command line``, and the bad key.
    """
    overrides: dict[str, Any] = {"mode": _mode(args)}
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
