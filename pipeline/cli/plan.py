"""`aiogguf plan`: where every tensor would go, without allocating or reading anything
(of a URL or ``hf://`` name, only the ranges of its headers)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from aiogguf.cli import EXIT_WARNED
from aiogguf.cli.options import add_placement_options, config_from_args
from aiogguf.dry_run import plan_sync
from aiogguf.io.http_source import is_url, redact_url
from aiogguf.records import Plan
from aiogguf.units import format_bytes

__all__ = ["add_arguments", "plan_to_json", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    plan = plan_sync(args.path, config_from_args(args))
    if args.json:
        print(json.dumps(plan_to_json(plan), indent=2))
    else:
        shown = redact_url(args.path) if is_url(args.path) else args.path  # no credentials
        _print_plan(plan, shown)
    if args.strict and plan.warnings:
        return EXIT_WARNED
    return 0


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The ``--json`` document: devices, input device, layers, tensors, buffers, moved,
    warnings."""
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
    console.print(f"[bold]{path}[/bold]  load mode: {plan.mode}")
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
        console.print(
            f"moved: tensor '{m.first_name}' ({m.first_type}) (and {m.count - 1} others) "
            f"cannot use preferred buffer type {m.first_from}, using {m.first_to} instead"
        )
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")
