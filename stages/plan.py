"""The plan stage: which device holds each layer, which buffer type each tensor, and which
file ranges feed which buffer (design §1.3, §2.1).

Pure, synchronous and deterministic: the only thing it asks the devices is their memory,
once each. The rules are llama.cpp's (``llama_prepare_model_devices``, ``load_tensors``,
``make_cpu_buft_list``/``make_gpu_buft_list``, ``create_tensor``), so that a user of
llama.cpp gets the same placement for the same flags.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aiogguf._config import Config, LoadMode, NamePattern, PlacementConfig, compile_pattern
from aiogguf._names import MAX_LAYERS, layer_number
from aiogguf._records import (
    BufferPlan,
    DeviceSummary,
    FileRange,
    LayerAssignment,
    ModeTraits,
    MovedSummary,
    Plan,
    TensorClass,
    TensorEntry,
    TensorPlacement,
    WeightIndex,
)
from aiogguf._units import counted, format_bytes
from aiogguf.errors import PlacementError
from aiogguf.io._devices.base import BufferRole, BufferType, Device, DeviceKind, all_buffer_types
from aiogguf.io.mapping import may_lock_past_limit, memlock_limit
from aiogguf.io.workers import raise_if_stopped

__all__ = [
    "assign_layers",
    "coalesce_ranges",
    "make_plan",
    "resolve_mode",
    "select_devices",
    "split_fractions",
]

_ROLE_ORDER = {BufferRole.SPLIT: 0, BufferRole.DEFAULT: 1, BufferRole.EXTRA: 2, BufferRole.HOST: 3}


@dataclass(frozen=True, slots=True)
class _Candidate:
    device: Device
    buffer_type: BufferType


# --- devices ----------------------------------------------------------------------------


def select_devices(devices: Sequence[Device], placement: PlacementConfig) -> tuple[Device, ...]:
    """The model's offload devices, in order (``llama_prepare_model_devices``).

    GPUs are de-duplicated by ``device_id`` (one card seen by two backends); integrated
    GPUs are used only when there is no discrete GPU, and only those of the first iGPU's
    backend; ``split_mode = "none"`` keeps ``devices[main_gpu]`` only, or none at all
    when ``main_gpu < 0``. CPU and accelerator devices are never offload devices.

    Raises ``PlacementError`` when ``main_gpu`` is out of range.
    """
    gpus: list[Device] = []
    igpus: list[Device] = []
    for device in devices:
        if device.kind == "gpu":
            same = device.device_id is not None and any(
                g.device_id == device.device_id for g in gpus
            )
            if not same:
                gpus.append(device)
        elif device.kind == "igpu" and (not igpus or device.backend == igpus[-1].backend):
            igpus.append(device)
    chosen = gpus if gpus else igpus
    if placement.split_mode == "none" and chosen:
        if placement.main_gpu < 0:
            return ()
        if placement.main_gpu >= len(chosen):
            names = ", ".join(d.name for d in chosen)
            raise PlacementError(
                f"invalid main_gpu {placement.main_gpu}: there are "
                f"{counted(len(chosen), 'device')} ({names}); use 0 … {len(chosen) - 1}, "
                "or -1 for none"
            )
        return (chosen[placement.main_gpu],)
    return tuple(chosen)


def resolve_mode(mode: LoadMode | str, devices: Sequence[Device]) -> LoadMode:
    """The load mode to use: ``auto`` is ``mmap`` unless one of ``devices`` cannot load
    from mapped memory, then ``none``.

    Raises ``PlacementError`` when ``mmap``/``mlock`` is asked for explicitly and a
    device cannot use mapped memory.
    """
    mode = LoadMode(mode)
    unmappable = [d.name for d in devices if not d.caps.mmap]
    if mode is LoadMode.AUTO:
        return LoadMode.NONE if unmappable else LoadMode.MMAP
    if ModeTraits.of(mode).mapped and unmappable:
        raise PlacementError(
            f"mode = '{mode}' needs mapped memory, which device(s) {', '.join(unmappable)} "
            "cannot use; use mode = 'auto' or 'none'"
        )
    return mode


def split_fractions(
    memory: Sequence[tuple[int, int]],
    host_memory: tuple[int, int],
    tensor_split: Sequence[float] = (),
) -> tuple[float, ...]:
    """Cumulative, normalised share of each device (the last is 1.0), in float32 like
    llama.cpp, so that a layer on a boundary lands where it lands there.

    ``memory`` is ``(free, total)`` per device; a device reporting ``(0, 0)`` counts with
    ``host_memory``'s free bytes. ``tensor_split`` (padded with zeros, cut to the device
    count) replaces free memory unless it is all zeros. A zero sum gives ``(i+1)/n``.

    Raises ``PlacementError`` for a negative ``tensor_split`` value.
    """
    n = len(memory)
    if any(x < 0 for x in tensor_split):
        raise PlacementError(f"tensor_split values cannot be negative: {list(tensor_split)}")
    given = [np.float32(x) for x in tensor_split[:n]]
    given += [np.float32(0.0)] * (n - len(given))
    if all(x == 0 for x in given):
        values = [
            np.float32(host_memory[0] if free == 0 and total == 0 else free)
            for free, total in memory
        ]
    else:
        values = given
    cumulative: list[np.float32] = []
    total_share = np.float32(0.0)
    for value in values:
        total_share = np.float32(total_share + value)
        cumulative.append(total_share)
    if total_share != 0:
        return tuple(float(np.float32(c / total_share)) for c in cumulative)
    return tuple(float(np.float32(i + 1) / np.float32(n)) for i in range(n))


def assign_layers(
    n_layer: int, n_gpu_layers: int, splits: Sequence[float]
) -> tuple[int | None, ...]:
    """Device index (into ``splits``) of each layer ``0 … n_layer`` (``n_layer`` is the
    output layer), or None for the CPU.

    ``i_gpu_start = max(n_layer + 1 - ngl, 0)`` and ``act = min(ngl, n_layer + 1)`` (0
    without devices); layer ``il`` is offloaded when ``i_gpu_start <= il < i_gpu_start +
    act``, to ``upper_bound(splits, float32(il - i_gpu_start) / act)``. ``-1`` = all.
    """
    n_all = n_layer + 1
    ngl = n_all if n_gpu_layers < 0 else n_gpu_layers
    i_gpu_start = max(n_all - ngl, 0)
    act = 0 if not splits else min(ngl, n_all)
    out: list[int | None] = []
    for il in range(n_all):
        if il < i_gpu_start or il - i_gpu_start >= act:
            out.append(None)
            continue
        ratio = float(np.float32(il - i_gpu_start) / np.float32(act))
        out.append(min(bisect_right(splits, ratio), len(splits) - 1))
    return tuple(out)


# --- buffer type candidates -------------------------------------------------------------


def _cpu_candidates(
    cpu: Device, accels: Sequence[Device], offload: Sequence[Device], no_host: bool
) -> tuple[_Candidate, ...]:
    # make_cpu_buft_list: accelerators, the first offload device's pinned host type,
    # the CPU's extra types, plain CPU.
    out = [_Candidate(a, a.buffer_type) for a in accels if a.buffer_type != cpu.buffer_type]
    if not no_host:
        for device in offload:
            if device.host_buffer_type is not None:
                out.append(_Candidate(device, device.host_buffer_type))
                break
    out.extend(_Candidate(cpu, b) for b in cpu.extra_buffer_types)
    out.append(_Candidate(cpu, cpu.buffer_type))
    return tuple(out)


def _gpu_candidates(
    device: Device, split_mode: str, cpu_list: tuple[_Candidate, ...]
) -> tuple[_Candidate, ...]:
    # make_gpu_buft_list, then the CPU list as the fallback chain.
    out: list[_Candidate] = []
    if split_mode == "row":
        if device.split_buffer_type is None:
            raise PlacementError(
                f"device {device.name} does not support split buffers (split_mode = 'row'); "
                "use split_mode = 'layer'"
            )
        out.append(_Candidate(device, device.split_buffer_type))
    out.append(_Candidate(device, device.buffer_type))
    out.extend(_Candidate(device, b) for b in device.extra_buffer_types)
    return (*out, *cpu_list)


def _holds(candidate: _Candidate, tensor: TensorEntry) -> bool:
    if not candidate.device.supports(tensor.type):
        return False
    if candidate.buffer_type.matrices_only:
        return len(tensor.shape) >= 2 and all(d == 1 for d in tensor.shape[2:])
    return True


def _select(candidates: tuple[_Candidate, ...], tensor: TensorEntry) -> _Candidate:
    for candidate in candidates:
        if _holds(candidate, tensor):
            return candidate
    names = ", ".join(c.buffer_type.name for c in candidates)
    raise PlacementError(
        f"tensor '{tensor.name}' ({tensor.type.name}): no buffer type can hold it (tried {names})"
    )


# --- the plan ---------------------------------------------------------------------------


class _Warnings:
    """Warnings in order, each said once."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, text: str) -> None:
        if text not in self.items:
            self.items.append(text)


def _n_layer(index: WeightIndex, warnings: _Warnings) -> int:
    n_layer = index.n_layer
    if n_layer is not None:
        # ``build_index`` refused these; an index made otherwise must not make the plan
        # loop over 2^31 layers either.
        if not 0 <= n_layer <= MAX_LAYERS:
            raise PlacementError(
                f"{index.architecture}.block_count is {n_layer}; expected 0 … {MAX_LAYERS}"
            )
        return n_layer
    numbers = [m for t in index.tensors if (m := layer_number(t.name)) is not None]
    derived = max(numbers) + 1 if numbers else 0
    warnings.add(
        f"no {index.architecture or '<arch>'}.block_count in the metadata; "
        f"assuming {counted(derived, 'layer')} from the tensor names"
    )
    return derived


def _placement_layer(tensor: TensorEntry, n_layer: int) -> int | None:
    """The layer whose candidate list a tensor uses; None for the input layer."""
    if tensor.tensor_class is TensorClass.INPUT:
        return None
    if tensor.tensor_class is TensorClass.OUTPUT:
        return n_layer
    number = tensor.layer if tensor.layer is not None else layer_number(tensor.name)
    if number is None:
        # Global repeating tensors (rope_freqs, ...): llama.cpp creates them with layer 0.
        return 0
    if not 0 <= number < max(n_layer, 1):
        raise PlacementError(
            f"tensor '{tensor.name}' belongs to layer {number}, but the model has "
            f"{counted(n_layer, 'layer')} (block_count)"
        )
    return number


def _override_targets(
    devices: Sequence[Device],
) -> dict[str, _Candidate]:
    targets: dict[str, _Candidate] = {}
    for device in devices:
        targets.setdefault(device.name, _Candidate(device, device.buffer_type))
        for buffer_type in all_buffer_types(device):
            targets.setdefault(buffer_type.name, _Candidate(device, buffer_type))
    return targets


def _compile_overrides(
    placement: PlacementConfig, targets: dict[str, _Candidate]
) -> list[tuple[NamePattern, _Candidate]]:
    rules: list[tuple[NamePattern, _Candidate]] = []
    for rule in placement.override:
        try:
            pattern = compile_pattern(rule.pattern)
        except ValueError as exc:
            raise PlacementError(f"override pattern: {exc}") from exc
        target = targets.get(rule.buffer_type)
        if target is None:
            known = ", ".join(sorted(targets))
            raise PlacementError(
                f"override {rule.pattern!r}: unknown buffer type or device "
                f"{rule.buffer_type!r} (known: {known})"
            )
        rules.append((pattern, target))
    return rules


def make_plan(index: WeightIndex, devices: Sequence[Device], config: Config) -> Plan:
    """Place every tensor of ``index`` on ``devices`` as llama.cpp would, and lay out the
    file ranges that feed each buffer.

    ``devices`` is the full list (``enumerate_devices``): exactly one CPU device, plus
    any GPUs, iGPUs and accelerators. No I/O is done; each device's memory is asked once.

    Raises ``PlacementError`` for: no CPU device, ``main_gpu`` out of range, a device
    without split buffers in ``split_mode = "row"``, an unknown or invalid override, a
    tensor no buffer type can hold, a layer number beyond ``block_count``.
    """
    placement = config.placement
    warnings = _Warnings()
    cpus = [d for d in devices if d.kind == "cpu"]
    if len(cpus) != 1:
        raise PlacementError(f"expected exactly one CPU device, got {len(cpus)}")
    cpu = cpus[0]
    accels = [d for d in devices if d.kind == "accel"]
    offload = select_devices(devices, placement)
    traits = ModeTraits.of(resolve_mode(config.load.mode, offload))
    use_mmap = traits.mapped

    memory: dict[str, tuple[int, int]] = {cpu.name: cpu.memory()}
    for device in (*accels, *offload):
        memory[device.name] = device.memory()

    n_layer = _n_layer(index, warnings)
    if len(placement.tensor_split) > len(offload) and offload:
        warnings.add(
            f"tensor_split has {len(placement.tensor_split)} values for "
            f"{counted(len(offload), 'device')}; the extra values are ignored"
        )
    splits = split_fractions(
        [memory[d.name] for d in offload], memory[cpu.name], placement.tensor_split
    )
    layer_devices = assign_layers(n_layer, placement.n_gpu_layers, splits)

    cpu_list = _cpu_candidates(cpu, accels, offload, placement.no_host)
    gpu_lists = [_gpu_candidates(d, placement.split_mode, cpu_list) for d in offload]
    layer_lists = [cpu_list if i is None else gpu_lists[i] for i in layer_devices]
    overrides = _compile_overrides(placement, _override_targets(devices))
    cpu_default = _Candidate(cpu, cpu.buffer_type)

    lazy_mode = config.load.lazy
    lazy_refused: list[str] = []
    placements: list[TensorPlacement] = []
    moved_first: tuple[TensorEntry, str, str] | None = None
    n_moved = 0
    for k, tensor in enumerate(index.tensors):
        if not k & 255:
            raise_if_stopped()  # the load was cancelled: stop within 256 tensors
        layer = _placement_layer(tensor, n_layer)
        candidates = cpu_list if layer is None else layer_lists[layer]
        lazy_wanted = lazy_mode == "on" or (
            lazy_mode == "auto" and tensor.nbytes > config.load.lazy_min_bytes
        )
        if lazy_wanted and use_mmap:
            # Lazy tensors stay mapped on the CPU whatever -ngl says, and are not "moved".
            placements.append(
                TensorPlacement(
                    name=tensor.name,
                    layer=layer,
                    tensor_class=tensor.tensor_class,
                    device=cpu.name,
                    buffer_type=cpu.buffer_type.name,
                    nbytes=tensor.nbytes,
                    lazy=True,
                    moved=False,
                )
            )
            continue
        if lazy_wanted:
            lazy_refused.append(tensor.name)
        choice = _choose(tensor, candidates, cpu_list, overrides, cpu_default, use_mmap, warnings)
        # Pinned host memory would be a second copy of pages already in the page cache.
        if use_mmap and choice.buffer_type.role is BufferRole.HOST:
            choice = cpu_default
        is_moved = choice.buffer_type != candidates[0].buffer_type
        if is_moved:
            if moved_first is None:
                moved_first = (tensor, candidates[0].buffer_type.name, choice.buffer_type.name)
            n_moved += 1
        placements.append(
            TensorPlacement(
                name=tensor.name,
                layer=layer,
                tensor_class=tensor.tensor_class,
                device=choice.device.name,
                buffer_type=choice.buffer_type.name,
                nbytes=tensor.nbytes,
                lazy=False,
                moved=is_moved,
            )
        )
    moved: MovedSummary | None = None
    if moved_first is not None:
        first, from_name, to_name = moved_first
        moved = MovedSummary(n_moved, first.name, first.type.name, from_name, to_name)
    if lazy_refused:
        warnings.add(
            f"lazy = '{lazy_mode}' needs a mapped load mode (mode = '{traits.name}'); "
            f"{counted(len(lazy_refused), 'tensor is', 'tensors are')} loaded in full, "
            f"first '{lazy_refused[0]}'"
        )

    by_name = {d.name: d for d in devices}
    summary_devices: list[Device] = [cpu, *accels, *offload]
    buffers = _buffers(index, placements, by_name, summary_devices, config.pipeline.coalesce_gap)
    for name in dict.fromkeys(b.device for b in buffers):
        if name not in memory:
            summary_devices.append(by_name[name])
            memory[name] = by_name[name].memory()
    _memory_warnings(buffers, cpu, memory, traits, warnings)

    return Plan(
        devices=tuple(
            DeviceSummary(d.name, DeviceKind(d.kind), memory[d.name][0], memory[d.name][1])
            for d in summary_devices
        ),
        input_device=cpu.name,
        layers=tuple(
            LayerAssignment(il, cpu.name if i is None else offload[i].name)
            for il, i in enumerate(layer_devices)
        ),
        tensors=tuple(placements),
        buffers=buffers,
        moved=moved,
        warnings=tuple(warnings.items),
        traits=traits,
    )


def _choose(
    tensor: TensorEntry,
    candidates: tuple[_Candidate, ...],
    cpu_list: tuple[_Candidate, ...],
    overrides: list[tuple[NamePattern, _Candidate]],
    cpu_default: _Candidate,
    use_mmap: bool,
    warnings: _Warnings,
) -> _Candidate:
    for pattern, target in overrides:
        if pattern.search(tensor.name) is None:
            continue
        if target.buffer_type == cpu_default.buffer_type:
            # An override to CPU still gets the CPU side's best choice (accelerator,
            # pinned host, extra types).
            if use_mmap:
                warnings.add(
                    "tensor overrides to CPU are used with mmap: the data is copied out of "
                    "the mapping; consider --no-mmap (mode = 'none') for better performance"
                )
            return _select(cpu_list, tensor)
        if not _holds(target, tensor):
            warnings.add(
                f"override {pattern.pattern!r} puts tensor '{tensor.name}' "
                f"({tensor.type.name}) on {target.buffer_type.name}, which cannot hold it"
            )
        return target
    return _select(candidates, tensor)


# --- buffers and file ranges ------------------------------------------------------------

_GroupKey = tuple[str, str, bool]


def _buffers(
    index: WeightIndex,
    placements: Sequence[TensorPlacement],
    devices: dict[str, Device],
    order: Sequence[Device],
    coalesce_gap: int,
) -> tuple[BufferPlan, ...]:
    groups: dict[_GroupKey, list[TensorEntry]] = {}
    group_of: dict[str, _GroupKey] = {}
    for entry, p in zip(index.tensors, placements, strict=True):
        key = (p.device, p.buffer_type, p.lazy)
        groups.setdefault(key, []).append(entry)
        group_of[entry.name] = key
    ranges = coalesce_ranges(index.tensors, group_of, coalesce_gap)

    position = {d.name: i for i, d in enumerate(order)}
    buffer_types = {b.name: b for d in devices.values() for b in all_buffer_types(d)}

    def sort_key(key: _GroupKey) -> tuple[int, int, str, bool]:
        device, buffer_type, lazy = key
        role = buffer_types[buffer_type].role
        return (position.get(device, len(position)), _ROLE_ORDER[role], buffer_type, lazy)

    out: list[BufferPlan] = []
    for key in sorted(groups, key=sort_key):
        device, buffer_type, lazy = key
        entries = groups[key]
        out.append(
            BufferPlan(
                device=device,
                buffer_type=buffer_type,
                lazy=lazy,
                host=buffer_types[buffer_type].host,
                nbytes=sum(e.nbytes for e in entries),
                tensors=tuple(e.name for e in entries),
                ranges=tuple(ranges.get(key, ())),
            )
        )
    return tuple(out)


def coalesce_ranges(
    tensors: Sequence[TensorEntry], group_of: dict[str, _GroupKey], gap_bytes: int
) -> dict[_GroupKey, list[FileRange]]:
    """Each group's tensors as file ranges, in (file, offset) order: neighbours of a group
    merge when the gap between them is at most ``gap_bytes`` and holds no byte of another
    group's tensor, so that reading a range never writes over another buffer's data."""
    by_file: dict[int, list[TensorEntry]] = {}
    for t in tensors:
        by_file.setdefault(t.file_index, []).append(t)
    out: dict[_GroupKey, list[FileRange]] = {}
    for file_index in sorted(by_file):
        entries = sorted(by_file[file_index], key=lambda t: (t.offset, t.end, t.name))
        # nonzero[k]: how many of the first k entries own at least one byte.
        nonzero = [0]
        for t in entries:
            nonzero.append(nonzero[-1] + (t.nbytes > 0))
        open_ranges: dict[_GroupKey, tuple[int, int, list[str], int]] = {}
        for pos, t in enumerate(entries):
            if not pos & 1023:
                raise_if_stopped()
            key = group_of[t.name]
            current = open_ranges.get(key)
            if current is not None:
                start, end, names, last = current
                foreign = nonzero[pos] - nonzero[last + 1] > 0
                if t.offset - end <= gap_bytes and not foreign:
                    names.append(t.name)
                    open_ranges[key] = (start, max(end, t.end), names, pos)
                    continue
                out.setdefault(key, []).append(FileRange(file_index, start, end, tuple(names)))
            open_ranges[key] = (t.offset, t.end, [t.name], pos)
        for key, (start, end, names, _) in open_ranges.items():
            out.setdefault(key, []).append(FileRange(file_index, start, end, tuple(names)))
    for ranges in out.values():
        ranges.sort(key=lambda r: (r.file_index, r.start))
    return out


def _memory_warnings(
    buffers: Sequence[BufferPlan],
    cpu: Device,
    memory: dict[str, tuple[int, int]],
    mode: ModeTraits,
    warnings: _Warnings,
) -> None:
    """A shortfall of memory, in every mode. Copied host buffers (and device buffers)
    need free memory; mapped ones live in the page cache, which can be evicted, but a
    load makes every page resident: they must fit in the host's RAM with the copies,
    and in mode ``mlock`` also in ``RLIMIT_MEMLOCK`` and in free memory (locked pages
    cannot be evicted)."""
    need: dict[str, int] = {}
    mapped_bytes = 0
    for b in buffers:
        if b.host:
            if b.lazy:
                continue  # read on demand: nothing has to be resident
            if mode.mapped and b.buffer_type == cpu.buffer_type.name:
                mapped_bytes += b.nbytes
            else:
                need[cpu.name] = need.get(cpu.name, 0) + b.nbytes
        else:
            need[b.device] = need.get(b.device, 0) + b.nbytes
    for name, nbytes in need.items():
        free = memory[name][0]
        if nbytes > free and memory[name] != (0, 0):
            warnings.add(
                f"device {name} needs {format_bytes(nbytes)} but has {format_bytes(free)} free"
            )
    if not mapped_bytes or memory[cpu.name] == (0, 0):
        return
    free, total = memory[cpu.name]
    resident = mapped_bytes + need.get(cpu.name, 0)
    if resident > total:
        warnings.add(
            f"mode {mode.name}: {format_bytes(resident)} must be resident in memory "
            f"({format_bytes(mapped_bytes)} mapped) but the host has {format_bytes(total)} "
            "of RAM: pages will be read again and again"
        )
    if not mode.locked:
        return
    limit = memlock_limit()
    if limit is not None and mapped_bytes > limit and not may_lock_past_limit():
        warnings.add(
            f"mode mlock: {format_bytes(mapped_bytes)} would be locked but RLIMIT_MEMLOCK "
            f"is {format_bytes(limit)}: the rest stays unlocked (raise it with `ulimit -l`)"
        )
    if resident <= total and resident > free:
        warnings.add(
            f"mode mlock: {format_bytes(resident)} must be locked or copied but the host "
            f"has {format_bytes(free)} free"
        )
