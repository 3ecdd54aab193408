"""The plan stage against llama.cpp's placement rules (design §1.3), on hand-built indexes."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from synthetic_index import build_index, llama_index

from aiogguf._config import Config
from aiogguf._names import MAX_LAYERS
from aiogguf._records import Plan, WeightIndex
from aiogguf.errors import ConfigError, PlacementError
from aiogguf.io._devices import CpuDevice, Device, SimDevice
from aiogguf.stages.plan import (
    assign_layers,
    make_plan,
    resolve_mode,
    select_devices,
    split_fractions,
)

GiB = 1024**3


def cpu(free: int = 64 * GiB) -> Device:
    return CpuDevice(free=free, total=free)


def gpus(*free_gib: float, **kwargs: Any) -> list[Device]:
    return [SimDevice(f"g{i}", free=int(f * GiB), **kwargs) for i, f in enumerate(free_gib)]


def plan(index: WeightIndex, devices: Sequence[Device], **overrides: Any) -> Plan:
    return make_plan(index, devices, Config().with_overrides(**overrides))


def layer_map(p: Plan) -> list[str]:
    return [a.device for a in p.layers]


# --- devices ----------------------------------------------------------------------------


def test_seed_worked_example_24_and_12_gib() -> None:
    # Seed: splits [0.667, 1.0]; with 21 offloaded layers, offset 13 (13/21 = 0.619) goes
    # to the first card and offset 14 (14/21 = 0.667, not strictly below) to the second.
    splits = split_fractions([(24 * GiB, 24 * GiB), (12 * GiB, 12 * GiB)], (0, 0))
    assert splits == (float(np.float32(2 / 3)), 1.0)
    p = plan(llama_index(32), [cpu(), *gpus(24, 12)], n_gpu_layers=21)
    i_gpu_start = 33 - 21
    assert layer_map(p) == ["CPU"] * i_gpu_start + ["g0"] * 14 + ["g1"] * 7
    assert p.layers[i_gpu_start + 13].device == "g0"
    assert p.layers[i_gpu_start + 14].device == "g1"
    assert p.layers[-1].layer == 32  # the output layer
    assert p.placement("output.weight").device == "g1"
    assert p.placement("token_embd.weight").device == "CPU"  # input layer: always CPU


@pytest.mark.parametrize(
    ("ngl", "expected"),
    [
        (0, ["CPU"] * 5),
        (1, ["CPU"] * 4 + ["g0"]),  # only the output layer
        (4, ["CPU"] + ["g0"] * 4),
        (5, ["g0"] * 5),
        (99, ["g0"] * 5),  # more than n_layer + 1: everything
        (-1, ["g0"] * 5),  # -1: all
    ],
)
def test_n_gpu_layers(ngl: int, expected: list[str]) -> None:
    p = plan(llama_index(4), [cpu(), *gpus(8)], n_gpu_layers=ngl)
    assert layer_map(p) == expected
    assert p.placement("token_embd.weight").device == "CPU"
    for t in p.tensors:
        if t.layer is not None:
            want = expected[t.layer]
            # CPU-side tensors may sit in the GPU's pinned host type (mode none) or CPU.
            assert (t.device == "CPU") == (want == "CPU"), t


def test_assign_layers_formula() -> None:
    # i_gpu_start = max(n_layer + 1 - ngl, 0); act = min(ngl, n_layer + 1); no devices: 0.
    assert assign_layers(3, 2, (1.0,)) == (None, None, 0, 0)
    assert assign_layers(3, 10, (0.5, 1.0)) == (0, 0, 1, 1)
    assert assign_layers(3, -1, ()) == (None, None, None, None)


def test_split_mode_none_main_gpu() -> None:
    index = llama_index(4)
    devices = [cpu(), *gpus(8, 8)]
    none_gpu = plan(index, devices, split_mode="none", main_gpu=-1)
    assert set(layer_map(none_gpu)) == {"CPU"}
    assert [d.name for d in none_gpu.devices] == ["CPU"]
    assert all(t.device == "CPU" for t in none_gpu.tensors)
    assert set(layer_map(plan(index, devices, split_mode="none", main_gpu=0))[0:]) == {"g0"}
    only_g1 = plan(index, devices, split_mode="none", main_gpu=1)
    assert set(layer_map(only_g1)) == {"g1"}
    assert [d.name for d in only_g1.devices] == ["CPU", "g1"]
    with pytest.raises(PlacementError, match="invalid main_gpu 2: there are 2 devices"):
        plan(index, devices, split_mode="none", main_gpu=2)
    # Without any GPU there is nothing to choose from, and no error (as in llama.cpp).
    assert set(layer_map(plan(index, [cpu()], split_mode="none", main_gpu=5))) == {"CPU"}


def test_explicit_tensor_split() -> None:
    p = plan(llama_index(7), [cpu(), *gpus(24, 12)], tensor_split=(1.0, 3.0))
    # splits [0.25, 1.0] over 8 layers: ratios 0, .125 → g0; .25 … → g1.
    assert layer_map(p) == ["g0"] * 2 + ["g1"] * 6
    # All zeros means "not given": free memory decides (24:12 → 2/3).
    p = plan(llama_index(7), [cpu(), *gpus(24, 12)], tensor_split=(0.0, 0.0))
    assert layer_map(p) == ["g0"] * 6 + ["g1"] * 2
    # Extra values are ignored, with a warning.
    p = plan(llama_index(7), [cpu(), *gpus(24, 12)], tensor_split=(1.0, 1.0, 5.0))
    assert layer_map(p) == ["g0"] * 4 + ["g1"] * 4
    assert any("tensor_split has 3 values for 2 devices" in w for w in p.warnings)
    with pytest.raises(PlacementError, match="cannot be negative"):
        split_fractions([(1, 1)], (1, 1), (-1.0,))


def test_devices_reporting_zero_memory() -> None:
    # (0, 0) = "cannot tell": use host memory, so two such devices split evenly.
    assert split_fractions([(0, 0), (0, 0)], (10 * GiB, 16 * GiB)) == (0.5, 1.0)
    p = plan(llama_index(3), [cpu(), *gpus(0, 0)])
    assert layer_map(p) == ["g0", "g0", "g1", "g1"]
    # Free 0 but a total: a real zero. All zero → uniform (i+1)/n.
    assert split_fractions([(0, 8), (0, 8), (0, 8)], (GiB, GiB)) == tuple(
        float(np.float32(i) / np.float32(3)) for i in (1, 2, 3)
    )


def test_duplicate_device_ids() -> None:
    a, b, c = (
        SimDevice("g0", device_id="0000:01:00.0"),
        SimDevice("g1", device_id="0000:01:00.0"),
        SimDevice("g2", device_id="0000:02:00.0"),
    )
    placement = Config().placement
    assert [d.name for d in select_devices([cpu(), a, b, c], placement)] == ["g0", "g2"]
    # Devices without an id are never taken for one another.
    x, y = SimDevice("x"), SimDevice("y")
    assert [d.name for d in select_devices([cpu(), x, y], placement)] == ["x", "y"]
    p = plan(llama_index(3), [cpu(), a, b, c])
    assert "g1" not in layer_map(p)
    assert set(layer_map(p)) == {"g0", "g2"}


def test_igpu_only_without_discrete_gpu() -> None:
    igpu = SimDevice("ig", kind="igpu")
    gpu = SimDevice("g0")
    placement = Config().placement
    assert [d.name for d in select_devices([cpu(), igpu, gpu], placement)] == ["g0"]
    assert [d.name for d in select_devices([cpu(), igpu], placement)] == ["ig"]
    assert set(layer_map(plan(llama_index(2), [cpu(), igpu]))) == {"ig"}
    assert set(layer_map(plan(llama_index(2), [cpu(), igpu, gpu]))) == {"g0"}


def test_row_mode_needs_split_buffers() -> None:
    index = llama_index(2)
    devices = [cpu(), SimDevice("g0"), SimDevice("g1", split_buffer=False)]
    with pytest.raises(PlacementError, match="device g1 does not support split buffers"):
        plan(index, devices, split_mode="row")
    p = plan(index, [cpu(), *gpus(8, 8)], split_mode="row", mode="none")
    assert p.placement("blk.0.attn_q.weight").buffer_type == "g0_Split"
    # Split buffers hold matrices only: norms fall back to the device default (moved).
    norm = p.placement("blk.0.attn_norm.weight")
    assert (norm.buffer_type, norm.moved) == ("g0", True)
    assert p.moved is not None
    assert p.moved.count == 2 * 2 + 1


def test_mode_resolution() -> None:
    mappable = SimDevice("g0")
    unmappable = SimDevice("g1", mmap=False)
    assert resolve_mode("auto", [mappable]) == "mmap"
    assert resolve_mode("auto", [mappable, unmappable]) == "none"
    assert resolve_mode("direct", [unmappable]) == "direct"
    assert resolve_mode("mlock", [mappable]) == "mlock"
    with pytest.raises(PlacementError, match="g1 cannot use"):
        resolve_mode("mmap", [unmappable])
    assert plan(llama_index(1), [cpu(), unmappable]).mode == "none"
    # A device that holds no layer still counts (it is in the model's device list).
    assert plan(llama_index(1), [cpu(), mappable, unmappable], n_gpu_layers=0).mode == "none"


# --- buffer types -----------------------------------------------------------------------


def test_cpu_list_prefers_first_pinned_host_type() -> None:
    index = llama_index(2)
    devices = [cpu(), SimDevice("g0", pinned_host=False), SimDevice("g1")]
    p = plan(index, devices, mode="none", n_gpu_layers=0)
    assert {t.buffer_type for t in p.tensors} == {"g1_Host"}
    assert p.moved is None
    # With mmap the pinned choice becomes plain CPU, and that counts as moved (llama.cpp:
    # "cannot be used with preferred buffer type CUDA_Host, using CPU instead").
    p = plan(index, devices, mode="mmap", n_gpu_layers=0)
    assert {t.buffer_type for t in p.tensors} == {"CPU"}
    assert p.moved is not None
    assert (p.moved.first_from, p.moved.first_to) == ("g1_Host", "CPU")
    assert p.moved.count == len(index.tensors)
    # no_host: no pinned type in the CPU list, nothing moved.
    p = plan(index, devices, mode="none", n_gpu_layers=0, no_host=True)
    assert {t.buffer_type for t in p.tensors} == {"CPU"}
    assert p.moved is None


def test_accelerator_and_extra_types_lead_cpu_list() -> None:
    acc = SimDevice("acc", kind="accel")
    host = CpuDevice(free=GiB, extra_buffer_types=("REPACK",))
    p = plan(llama_index(1), [host, acc], mode="none")
    assert {t.buffer_type for t in p.tensors} == {"acc"}
    acc_q = SimDevice("acc", kind="accel", unsupported=("Q4_K",))
    p = plan(llama_index(1), [host, acc_q], mode="none")
    assert p.placement("blk.0.attn_q.weight").buffer_type == "CPU_REPACK"
    assert p.placement("blk.0.attn_norm.weight").buffer_type == "acc"
    assert [d.name for d in p.devices] == ["CPU", "acc"]


def test_layer_classes() -> None:
    index = llama_index(3, extra=[("rope_freqs.weight", "F32", (32,))])
    p = plan(index, [cpu(), *gpus(8, 8)], tensor_split=(1.0, 1.0))
    assert layer_map(p) == ["g0", "g0", "g1", "g1"]
    assert p.placement("token_embd.weight").device == "CPU"
    assert p.placement("token_embd.weight").layer is None
    assert p.placement("output.weight").device == "g1"
    assert p.placement("output_norm.weight").layer == 3
    # Global repeating tensors go with layer 0 (llama.cpp creates them with index 0).
    rope = p.placement("rope_freqs.weight")
    assert (rope.device, rope.layer) == ("g0", 0)
    assert p.placement("blk.2.ffn_up.weight").device == "g1"


def test_block_count_missing_or_too_small() -> None:
    p = plan(llama_index(3, block_count=None), [cpu(), *gpus(8)])
    assert len(p.layers) == 4
    assert any("no llama.block_count" in w for w in p.warnings)
    with pytest.raises(PlacementError, match=r"blk\.2\..* layer 2, but the model has 2 layers"):
        plan(llama_index(3, block_count=2), [cpu(), *gpus(8)])


def test_unsupported_type_moves_to_next_candidate() -> None:
    index = llama_index(2, types={r"attn_(q|k)\.": "IQ1_M"})
    devices = [cpu(), SimDevice("g0", unsupported=("IQ1_M",))]
    p = plan(index, devices, mode="none")
    iq1 = [t for t in p.tensors if t.name.endswith(("attn_q.weight", "attn_k.weight"))]
    assert len(iq1) == 4
    # g0 cannot hold it, nor can its pinned host type (same device): CPU.
    assert all((t.device, t.buffer_type, t.moved) == ("CPU", "CPU", True) for t in iq1)
    assert p.moved is not None
    assert (p.moved.count, p.moved.first_type) == (4, "IQ1_M")
    assert (p.moved.first_name, p.moved.first_from, p.moved.first_to) == (
        "blk.0.attn_k.weight",
        "g0",
        "CPU",
    )
    assert sum(t.moved for t in p.tensors) == 4


def test_no_buffer_type_can_hold_tensor() -> None:
    index = build_index([("blk.0.x.weight", "Q4_2", (0,))], block_count=1)
    with pytest.raises(PlacementError, match=r"'blk\.0\.x\.weight' \(Q4_2\): no buffer type"):
        plan(index, [cpu()])
    with pytest.raises(PlacementError, match="exactly one CPU device"):
        plan(llama_index(1), gpus(1))


# --- overrides --------------------------------------------------------------------------


def _override(*rules: tuple[str, str]) -> tuple[dict[str, str], ...]:
    return tuple({"pattern": p, "buffer_type": b} for p, b in rules)


def test_override_first_match_wins() -> None:
    index = llama_index(2)
    devices = [cpu(), *gpus(8, 8)]
    p = plan(index, devices, mode="none", override=_override(("ffn", "CPU"), ("ffn_down", "g1")))
    assert p.placement("blk.0.ffn_down.weight").device != "g1"
    # An override to CPU picks from the CPU list: the pinned host type comes first.
    assert p.placement("blk.0.ffn_down.weight").buffer_type == "g0_Host"
    p = plan(index, devices, mode="none", override=_override(("ffn_down", "g1"), ("ffn", "CPU")))
    down = p.placement("blk.0.ffn_down.weight")
    assert (down.device, down.buffer_type, down.moved) == ("g1", "g1", True)
    assert p.placement("blk.0.ffn_up.weight").buffer_type == "g0_Host"
    assert p.placement("blk.0.attn_q.weight").buffer_type == "g0"
    # Buffer type names work as targets too, and the search is unanchored.
    p = plan(index, devices, override=_override(("attn_q", "g1_Host")), mode="none")
    assert p.placement("blk.1.attn_q.weight").buffer_type == "g1_Host"


def test_override_to_cpu_under_mmap_warns() -> None:
    index = llama_index(2)
    devices = [cpu(), *gpus(8)]
    p = plan(index, devices, mode="mmap", override=_override(("exps|ffn_", "CPU")))
    assert p.placement("blk.1.ffn_gate.weight").buffer_type == "CPU"
    assert sum("overrides to CPU are used with mmap" in w for w in p.warnings) == 1
    assert any("mode = 'none'" in w for w in p.warnings)
    p = plan(index, devices, mode="none", override=_override(("ffn_", "CPU")))
    assert not any("overrides to CPU" in w for w in p.warnings)


def test_bad_overrides() -> None:
    with pytest.raises(PlacementError, match="unknown buffer type or device 'CUDA7'"):
        plan(llama_index(1), [cpu()], override=_override(("x", "CUDA7")))
    # A bad regex is caught by the config schema, which can name the file.
    with pytest.raises(ConfigError, match="expected a regular expression"):
        plan(llama_index(1), [cpu()], override=_override(("(", "CPU")))
    devices = [cpu(), SimDevice("g0", unsupported=("Q4_K",))]
    p = plan(llama_index(1), devices, override=_override(("attn_q", "g0")))
    assert p.placement("blk.0.attn_q.weight").buffer_type == "g0"
    assert any("which cannot hold it" in w for w in p.warnings)


# --- lazy -------------------------------------------------------------------------------


def test_lazy_auto_threshold() -> None:
    index = llama_index(2)
    biggest = max(t.nbytes for t in index.tensors)
    big = {t.name for t in index.tensors if t.nbytes == biggest}
    p = plan(index, [cpu(), *gpus(8)], lazy="auto", lazy_min_bytes=biggest - 1, mode="mmap")
    assert {t.name for t in p.tensors if t.lazy} == big
    out = p.placement("output.weight")
    assert out.name in big  # would be on g0 (output layer) without lazy
    assert (out.device, out.buffer_type, out.lazy, out.moved) == ("CPU", "CPU", True, False)
    lazy_buffers = [b for b in p.buffers if b.lazy]
    assert len(lazy_buffers) == 1
    assert lazy_buffers[0].host
    assert set(lazy_buffers[0].tensors) == big
    assert lazy_buffers[0].buffer_type == "CPU"
    # Only strictly larger tensors qualify.
    p = plan(index, [cpu(), *gpus(8)], lazy="auto", lazy_min_bytes=biggest)
    assert not any(t.lazy for t in p.tensors)
    # Default threshold 4 GiB: nothing in a small model.
    assert not any(t.lazy for t in plan(index, [cpu()], lazy="auto").tensors)


def test_lazy_needs_mmap() -> None:
    index = llama_index(2)
    p = plan(index, [cpu(), *gpus(8)], lazy="on", mode="none")
    assert not any(t.lazy for t in p.tensors)
    assert any("lazy = 'on' needs a mapped load mode" in w for w in p.warnings)
    # auto resolves to none when a device cannot map: lazy is off then too.
    p = plan(index, [cpu(), SimDevice("g0", mmap=False)], lazy="on")
    assert p.mode == "none"
    assert not any(t.lazy for t in p.tensors)
    p = plan(index, [cpu(), *gpus(8)], lazy="on", mode="mlock")
    assert all(t.lazy and t.device == "CPU" for t in p.tensors)
    assert [(b.device, b.lazy) for b in p.buffers] == [("CPU", True)]


# --- buffers and ranges -----------------------------------------------------------------


def _assert_ranges_sound(p: Plan, index: WeightIndex) -> None:
    group = {name: (b.device, b.buffer_type, b.lazy) for b in p.buffers for name in b.tensors}
    for b in p.buffers:
        covered = [name for r in b.ranges for name in r.tensors]
        assert sorted(covered) == sorted(b.tensors)
        assert b.nbytes == sum(index[name].nbytes for name in b.tensors)
        for r in b.ranges:
            for t in index.tensors:
                if t.file_index != r.file_index or t.nbytes == 0:
                    continue
                if group[t.name] != (b.device, b.buffer_type, b.lazy):
                    assert t.end <= r.start or t.offset >= r.end, (t.name, r)
                else:
                    assert (r.start <= t.offset and t.end <= r.end) == (t.name in r.tensors)
        starts = [(r.file_index, r.start) for r in b.ranges]
        assert starts == sorted(starts)


def test_coalescing_never_spans_another_group() -> None:
    index = llama_index(4)
    # attn_q on the CPU sits between every layer's other tensors.
    p = plan(index, [cpu(), *gpus(8)], mode="none", override=_override(("attn_q", "CPU")))
    _assert_ranges_sound(p, index)
    g0 = next(b for b in p.buffers if b.buffer_type == "g0")
    # File order per layer: attn_norm, attn_q, attn_k … ffn_down. Each attn_q cuts g0's
    # bytes: [blk.0.attn_norm] | q | [blk.0.attn_k … blk.1.attn_norm] | q | … | [… output].
    assert [len(r.tensors) for r in g0.ranges] == [1, 8, 8, 8, 9]
    cpu_buf = next(b for b in p.buffers if b.buffer_type == "g0_Host")
    assert len(cpu_buf.ranges) == 1 + 4  # token_embd, then each attn_q alone


def test_coalesce_gap_limit_and_multi_file() -> None:
    index = llama_index(2, gap=4096, n_files=3)
    p = plan(index, [cpu(), *gpus(8)], coalesce_gap=4096 + 31)
    _assert_ranges_sound(p, index)
    g0 = next(b for b in p.buffers if b.device == "g0")
    assert {r.file_index for r in g0.ranges} == {0, 1, 2}
    merged = len(g0.ranges)
    p = plan(index, [cpu(), *gpus(8)], coalesce_gap=4095)
    g0 = next(b for b in p.buffers if b.device == "g0")
    assert len(g0.ranges) == len(g0.tensors) > merged  # every gap too wide: one per tensor
    _assert_ranges_sound(p, index)


def test_buffers_summary_and_memory_warning() -> None:
    index = llama_index(4)
    p = plan(index, [cpu(), *gpus(8, 8)], mode="none")
    assert [(b.device, b.buffer_type, b.host) for b in p.buffers] == [
        ("g0", "g0", False),
        ("g0", "g0_Host", True),
        ("g1", "g1", False),
    ]
    assert sum(b.nbytes for b in p.buffers) == index.totals.nbytes
    assert [d.name for d in p.devices] == ["CPU", "g0", "g1"]
    assert not p.warnings
    tiny = plan(index, [cpu(), SimDevice("g0", free=1000, total=1000)])
    assert any(w.startswith("device g0 needs") and "free" in w for w in tiny.warnings)


def test_plan_is_deterministic() -> None:
    # The most layers a model may have (llama.cpp's cap).
    index = llama_index(MAX_LAYERS)
    devices = [cpu(), *gpus(24, 12, 12)]
    config = Config().with_overrides(override=_override(("ffn_down", "CPU")))
    first = make_plan(index, devices, config)
    assert make_plan(index, devices, config) == first
    assert len(first.tensors) == len(index.tensors) == 9 * MAX_LAYERS + 3
    assert len(first.layers) == MAX_LAYERS + 1


@pytest.mark.timing
def test_plan_is_fast() -> None:
    index = llama_index(MAX_LAYERS)
    devices = [cpu(), *gpus(24, 12, 12)]
    config = Config().with_overrides(override=_override(("ffn_down", "CPU")))
    started = time.perf_counter()
    make_plan(index, devices, config)
    elapsed = time.perf_counter() - started
    assert elapsed < 5.0, f"planning {MAX_LAYERS} layers took {elapsed:.2f} s"
