"""`aiogguf plan`: where every tensor would go, without allocating or reading anything
(of a URL or ``hf://`` name, only the ranges of its headers)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aiogguf._dry_run import plan_sync
from aiogguf._records import Plan, TensorClass
from aiogguf._units import counted, format_bytes
from aiogguf.cli import EXIT_WARNED
from aiogguf.cli.extras import say_missing_gpu_extra
from aiogguf.cli.options import add_placement_options, config_from_args
from aiogguf.errors import shown_path
from aiogguf.io._devices.base import DeviceKind
from aiogguf.remote._http_source import is_url, redact_url

__all__ = ["CPU_EXTRA_BUFFER_TYPES", "add_arguments", "plan_to_json", "run"]

# The CPU's extra buffer types in llama.cpp (ggml-cpu): with its defaults (--repack on),
# the weights of CPU layers that an AMX or a repacking kernel can take go there rather
# than in the plain CPU buffer. The plan does not model them: which kernels exist depends
# on the llama.cpp build and this CPU's features, and so does which tensors they take.
CPU_EXTRA_BUFFER_TYPES = ("AMX", "CPU_REPACK")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` command's flags."""
    parser.add_argument(
        "path",
        metavar="PATH",
        help="GGUF file, URL or hf:// name (the first split of a split model)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--strict", action="store_true", help="exit 3 if the plan has any warning (e.g. memory)"
    )
    add_placement_options(parser)


def run(args: argparse.Namespace) -> int:
    """Print where each tensor would go, without loading anything."""
    config = config_from_args(args)
    say_missing_gpu_extra(args, config)
    plan = plan_sync(args.path, config)
    if args.json:
        print(json.dumps(plan_to_json(plan), indent=2))
    else:
        shown = redact_url(args.path) if is_url(args.path) else args.path  # no credentials
        _print_plan(plan, shown)
    if args.strict and plan.warnings:
        return EXIT_WARNED
    return 0


def _cpu_weights(plan: Plan) -> int:
    """Tensors of the repeating and output layers planned in a CPU's plain buffer: those
    llama.cpp may put in its extra buffer types instead (the input layer's are read by
    row, which no extra type takes)."""
    cpus = {d.name for d in plan.devices if d.kind == DeviceKind.CPU}
    return sum(
        1
        for t in plan.tensors
        if t.device in cpus
        and t.buffer_type in cpus
        and not t.lazy
        and t.tensor_class is not TensorClass.INPUT
    )


def _cpu_extra_note(n_tensors: int) -> str:
    return (
        f"note: {counted(n_tensors, 'CPU weight')} planned in the plain CPU buffer; on a "
        "CPU with AMX or repacking kernels llama.cpp puts most such weights in its "
        f"{' / '.join(CPU_EXTRA_BUFFER_TYPES)} buffers, which this plan does not model"
    )


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The ``--json`` document: devices, input device, layers, tensors, buffers, moved,
    warnings, and what the plan leaves out (``cpu_extra_buffers``: llama.cpp's AMX and
    CPU_REPACK buffers, not modelled; ``tensors``: the CPU weights they may take)."""
    moved = plan.moved
    return {
        "devices": [
            {"name": d.name, "kind": d.kind, "free": d.free, "total": d.total} for d in plan.devices
        ],
        "input_device": plan.input_device,
        "layers": [{"layer": a.layer, "device": a.device} for a in plan.layers],
        "tensors": [
            {
                "name": t.name,
                "layer": t.layer,
                "class": t.tensor_class.value,
                "device": t.device,
                "buffer_type": t.buffer_type,
                "nbytes": t.nbytes,
                "lazy": t.lazy,
                "moved": t.moved,
            }
            for t in plan.tensors
        ],
        "buffers": [
            {
                "device": b.device,
                "buffer_type": b.buffer_type,
                "lazy": b.lazy,
                "nbytes": b.nbytes,
                "n_tensors": len(b.tensors),
            }
            for b in plan.buffers
        ],
        "moved": None
        if moved is None
        else {
            "count": moved.count,
            "first": {
                "name": moved.first_name,
                "type": moved.first_type,
                "from": moved.first_from,
                "to": moved.first_to,
            },
        },
        "warnings": list(plan.warnings),
        "cpu_extra_buffers": {
            "modelled": False,
            "types": list(CPU_EXTRA_BUFFER_TYPES),
            "tensors": _cpu_weights(plan),
        },
    }


def _layer_runs(plan: Plan) -> list[tuple[int, int, str]]:
    """Contiguous runs of layers on one device: ``(first, last, device)``."""
    runs: list[tuple[int, int, str]] = []
    for a in plan.layers:
        if runs and runs[-1][2] == a.device and runs[-1][1] == a.layer - 1:
            runs[-1] = (runs[-1][0], a.layer, a.device)
        else:
            runs.append((a.layer, a.layer, a.device))
    return runs


def _print_plan(plan: Plan, path: str) -> None:
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"[bold]{escape(shown_path(path))}[/bold]  load mode: {plan.mode}")
    devices = Table(title="devices", title_justify="left", show_edge=False)
    for column in ("device", "kind", "free", "total"):
        devices.add_column(column, justify="right" if column in ("free", "total") else "left")
    for d in plan.devices:
        devices.add_row(d.name, d.kind, format_bytes(d.free), format_bytes(d.total))
    console.print(devices)

    console.print(f"input layer (token embedding): {plan.input_device}")
    output_layer = plan.layers[-1].layer if plan.layers else 0
    for first, last, device in _layer_runs(plan):
        span = f"layer {first}" if first == last else f"layers {first}-{last}"
        note = f" ({output_layer} = output)" if last == output_layer else ""
        console.print(f"{span}{note}: {device}")

    buffers = Table(title="buffers", title_justify="left", show_edge=False)
    for column in ("device", "buffer type", "lazy", "size", "tensors", "ranges"):
        buffers.add_column(
            column, justify="right" if column in ("size", "tensors", "ranges") else "left"
        )
    for b in plan.buffers:
        buffers.add_row(
            b.device,
            b.buffer_type + (" (host)" if b.host else ""),
            "yes" if b.lazy else "",
            format_bytes(b.nbytes),
            str(len(b.tensors)),
            str(len(b.ranges)),
        )
    console.print(buffers)

    if plan.moved is not None:
        m = plan.moved
        others = f" (and {counted(m.count - 1, 'other')})" if m.count > 1 else ""
        console.print(
            f"moved: tensor '{escape(m.first_name)}' ({m.first_type}){others} "
            f"cannot use preferred buffer type {m.first_from}, using {m.first_to} instead"
        )
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    n_cpu_weights = _cpu_weights(plan)
    if n_cpu_weights:
        console.print(_cpu_extra_note(n_cpu_weights))
