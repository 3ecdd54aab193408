"""`aiogguf cluster plan|load PATH`: a load over a Ray cluster (the ``cluster`` extra),
each node reading its own part (docs/cluster.md). Ray is imported when the command
runs, never to build the parser."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from aiogguf._run import run as run_loop
from aiogguf._units import format_bytes
from aiogguf.cli.options import add_placement_options, config_from_args
from aiogguf.cli.plan import _print_plan, plan_to_json
from aiogguf.errors import ConfigError

if TYPE_CHECKING:
    from aiogguf.cluster import ClusterPlan, ClusterReport

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``cluster`` command's subcommands and flags."""
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    plan = sub.add_parser("plan", help="show where every tensor would go over the cluster")
    load = sub.add_parser("load", help="load the model over the cluster and print the report")
    for p in (plan, load):
        p.add_argument("path", metavar="PATH", help="GGUF file, as the nodes name it")
        p.add_argument(
            "--address",
            default="auto",
            help="the Ray cluster to join (default: auto, the one this machine runs)",
        )
        p.add_argument("--cpu-node", metavar="NODE", help="the node of the CPU part")
        p.add_argument(
            "--path",
            dest="paths",
            action="append",
            default=[],
            metavar="NODE=PATH",
            help="the model's path on NODE, where it differs (repeatable)",
        )
        add_placement_options(p)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    load.add_argument(
        "--no-check", action="store_true", help="skip tensor validation (check_tensors=false)"
    )


def _paths(values: list[str]) -> dict[str, str]:
    paths: dict[str, str] = {}
    for value in values:
        node, sep, path = value.partition("=")
        if not sep or not node or not path:
            raise ConfigError("--path", "command line", f"expected NODE=PATH, got {value!r}")
        paths[node] = path
    return paths


def run(args: argparse.Namespace) -> int:
    """Plan or load over the cluster, and print it."""
    extra: dict[str, Any] = {}
    if args.action == "load" and args.no_check:
        extra["check_tensors"] = False
    config = config_from_args(args, **extra)
    paths = _paths(args.paths)
    # Imported here: Ray takes seconds to import, and only this command needs it.
    import aiogguf.cluster as cluster

    started = _ray_started()
    try:
        if args.action == "plan":
            made = cluster.plan_sync(
                args.path, config, address=args.address, cpu_node=args.cpu_node, paths=paths
            )
            if args.json:
                print(json.dumps({"nodes": _nodes_json(made), **plan_to_json(made.plan)}, indent=2))
            else:
                _print_nodes(made)
                _print_plan(made.plan, args.path)
            return 0

        async def load() -> ClusterReport:
            handle = cluster.load(
                args.path, config, address=args.address, cpu_node=args.cpu_node, paths=paths
            )
            async with handle as model:
                return model.report

        report: ClusterReport = run_loop(load, name="cluster load")
        _print_report(report)
        return 0
    finally:
        if not started:
            _ray_shutdown()


def _ray_started() -> bool:
    try:
        import ray  # pyright: ignore[reportMissingImports]  (optional: the cluster extra)
    except ImportError as exc:
        raise ConfigError("cluster", None, "needs Ray: pip install 'aiogguf[cluster]'") from exc
    return bool(ray.is_initialized())


def _ray_shutdown() -> None:
    import ray  # pyright: ignore[reportMissingImports]  (optional: the cluster extra)

    ray.shutdown()


def _nodes_json(made: ClusterPlan) -> list[dict[str, Any]]:
    return [
        {
            "node": n.name,
            "devices": [d.name for d in n.devices],
            "host_free": n.host_free,
            "path": n.path,
            "unreadable": n.unreadable,
            "nbytes": made.node_bytes(n.name),
        }
        for n in made.nodes
    ]


def _print_nodes(made: ClusterPlan) -> None:
    console = Console(highlight=False, soft_wrap=True)
    table = Table(title="nodes", title_justify="left", show_edge=False)
    for column in ("node", "devices", "host free", "loads", "path"):
        table.add_column(column, justify="right" if column in ("host free", "loads") else "left")
    for n in made.nodes:
        where = n.path if n.unreadable is None else f"{n.path} (cannot read: {n.unreadable})"
        cpu = " (CPU part)" if n.name == made.cpu_node else ""
        table.add_row(
            n.name + cpu,
            ", ".join(os.path.basename(d.name) for d in n.devices),
            format_bytes(n.host_free),
            format_bytes(made.node_bytes(n.name)),
            where,
        )
    console.print(table)


def _print_report(report: ClusterReport) -> None:
    console = Console(highlight=False, soft_wrap=True)
    table = Table(title=f"{report.path}", title_justify="left", show_edge=False)
    for column in ("node", "bytes", "read", "seconds", "GB/s"):
        table.add_column(column, justify="left" if column == "node" else "right")
    for r in report.rows:
        table.add_row(
            r.node,
            format_bytes(r.nbytes),
            format_bytes(r.read_bytes),
            f"{r.seconds:.2f}",
            f"{r.gbps:.2f}",
        )
    table.add_row(
        "total",
        format_bytes(report.nbytes),
        format_bytes(report.read_bytes),
        f"{report.total_s:.2f}",
        f"{report.gbps:.2f}",
    )
    console.print(table)
