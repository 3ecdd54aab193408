"""A load over a Ray cluster against the same load by one node: the cluster's own cost.

Starts a loopback Ray cluster of three nodes on this machine (``aiogguf.testing.cluster``:
three raylets, two simulated GPUs each), writes a synthetic model (1 GiB by default),
and loads it, alternating, with fresh loaders each time (new actor processes):

* one node alone: ``tensor_split`` gives every layer to n0's two GPUs (the other nodes
  start a loader, describe themselves and stop, as in any cluster load);
* split over three nodes: every GPU of every node an equal share.

The nodes share this machine's cores, page cache and disk, so the ratio of the medians
(split / alone) is the cluster's overhead, not its gain. The simulated GPUs keep no bytes
(``keep_bytes=false``: copies take an H200's modelled time and move nothing), so a load
is the reads from the page cache (the file is read once first). It prints each
load's seconds and per-node rates, and the arithmetic for N real nodes: since no tensor
byte crosses the network, the aggregate is the sum of the nodes' own read rates, next to
llama.cpp RPC's published per-node figure (0.4-0.7 GB/s, issue 38), where the head
reads every tensor and pushes it to each node.

    python bench/cluster.py [--size 1GiB] [--pairs 3] [--dir DIR] [--json] [--attach]

The loads are plain (``attach=False``): a simulated GPU's shareable memory is backed
(``keep_bytes=false`` does not apply to it), which would time the simulator's page
faults, not the cluster. ``--attach`` loads as ``aiogguf.cluster.load`` does by default:
shareable, each node serving its part.
"""

from __future__ import annotations

import os

# Read when Ray is imported: off, Ray takes loopback for this machine's address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import anyio

import aiogguf.cluster
from aiogguf.testing.cluster import NodeSpec, loopback_cluster
from aiogguf.testing.synth import write_synthetic_model

# llama.cpp's RPC backend, as published (issue 38): 15.7 GiB over a 111 Gb/s RoCE link
# in 23.5-41.5 s, about 0.4-0.7 GB/s per node, every byte read and sent by the head.
RPC_GBPS = (0.4, 0.7)
GPU = "free=64GiB,total=64GiB,keep_bytes=false"
NODES = ("n0", "n1", "n2")


async def _load(path: Path, split: list[int], attach: bool) -> dict[str, Any]:
    async with aiogguf.cluster.load(
        path, mode="none", check_tensors=False, tensor_split=split, attach=attach
    ) as model:
        report = model.report
    return {
        "total_s": report.total_s,
        "load_s": report.load_s,
        "nbytes": report.nbytes,
        "rows": [
            {"node": r.node, "nbytes": r.nbytes, "seconds": r.seconds, "gbps": r.gbps}
            for r in report.rows
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="model size (default 1GiB)")
    parser.add_argument("--pairs", type=int, default=3, help="alternated pairs (default 3)")
    parser.add_argument("--dir", type=Path, help="where the model is written (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--attach",
        action="store_true",
        help="nodes load shareable and serve attach, as cluster.load does by default",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        model = write_synthetic_model(Path(folder) / "m.gguf", size_bytes=args.size, seed=38)
        model.path.read_bytes()  # into the page cache: both ways read it from there
        specs = [
            NodeSpec(name, [f"name=g{2 * i + k},{GPU}" for k in range(2)])
            for i, name in enumerate(NODES)
        ]
        runs: dict[str, list[dict[str, Any]]] = {"alone": [], "split": []}
        splits = {"alone": [1, 1, 0, 0, 0, 0], "split": [1, 1, 1, 1, 1, 1]}
        with loopback_cluster(specs):
            attach = args.attach
            anyio.run(_load, model.path, splits["split"], attach)  # warm: Ray's first workers
            for _ in range(args.pairs):
                for way in ("alone", "split"):
                    runs[way].append(anyio.run(_load, model.path, splits[way], attach))
    _report(runs, model.tensor_bytes, args.json)


def _report(runs: dict[str, list[dict[str, Any]]], nbytes: int, as_json: bool) -> None:
    med = {
        way: {k: statistics.median(r[k] for r in rs) for k in ("total_s", "load_s")}
        for way, rs in runs.items()
    }
    ratio_load = med["split"]["load_s"] / med["alone"]["load_s"]
    ratio_total = med["split"]["total_s"] / med["alone"]["total_s"]
    alone_rate = nbytes / med["alone"]["load_s"] / 1e9
    last = runs["split"][-1]
    adds_up = all(
        sum(row["nbytes"] for row in r["rows"]) == r["nbytes"] == nbytes
        for rs in runs.values()
        for r in rs
    )
    result = {
        "tensor_bytes": nbytes,
        "medians": med,
        "ratio_load": ratio_load,
        "ratio_total": ratio_total,
        "rows_add_up": adds_up,
        "runs": runs,
    }
    if as_json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"model: {nbytes / 1e9:.2f} GB of tensors; "
        f"{len(runs['alone'])} alternated pairs, fresh loaders"
    )
    for way in ("alone", "split"):
        loads = ", ".join(f"{r['load_s']:.2f}" for r in runs[way])
        totals = ", ".join(f"{r['total_s']:.2f}" for r in runs[way])
        print(
            f"  {way:5}  load {loads} s (median {med[way]['load_s']:.2f});"
            f"  with loaders' start {totals} s (median {med[way]['total_s']:.2f})"
        )
    print(f"  ratio split/alone: load {ratio_load:.2f}x, with loaders' start {ratio_total:.2f}x")
    print("  per node, last split load:")
    for row in last["rows"]:
        print(
            f"    {row['node']}: {row['nbytes'] / 1e9:.3f} GB in {row['seconds']:.2f} s"
            f" = {row['gbps']:.2f} GB/s"
        )
    print(f"  rows add up to the model's bytes in every load: {adds_up}")
    print("N real nodes (each reads its own share; no tensor byte on the network), at this")
    print(f"machine's one-node rate of {alone_rate:.2f} GB/s per node; llama.cpp RPC's head reads")
    print(f"every byte and sends it on, at {RPC_GBPS[0]}-{RPC_GBPS[1]} GB/s per node (issue 38):")
    rpc = f"{nbytes / 1e9 / RPC_GBPS[1]:.2f}-{nbytes / 1e9 / RPC_GBPS[0]:.2f} s"
    for n in (1, 3, 8, 16):
        share = nbytes / n / 1e9
        print(
            f"  N={n:2}: aggregate {n * alone_rate:6.2f} GB/s, this model in "
            f"{share / alone_rate:5.2f} s; RPC {rpc} (its head's rate, whatever N)"
        )


if __name__ == "__main__":
    main()
