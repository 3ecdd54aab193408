"""One record per decision: the load mode's traits (``ModeTraits``), made once by the plan,
and the thread plan (``ThreadPlan``), made once with the layout; nothing downstream
re-derives either from the mode's name or from ``readers``."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from synthetic_index import llama_index

import aiogguf
from aiogguf._config import Config, LoadMode
from aiogguf._jobs import MIN_MAPPED_JOB_BYTES, MIN_SPREAD_BYTES, BufferLayout, layout_buffers
from aiogguf._records import ModeTraits
from aiogguf.errors import PlacementError
from aiogguf.io._devices import CpuDevice, SimDevice
from aiogguf.stages.plan import make_plan, resolve_mode
from aiogguf.stages.read import Disks, ThreadPlan, most_readers, plan_threads
from aiogguf.testing.synth import write_synthetic_model

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
MiB = 1 << 20

# --- the mode ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "mapped", "locked", "direct", "copies"),
    [
        ("none", False, False, False, True),
        ("direct", False, False, True, True),
        ("mmap", True, False, False, False),
        ("mlock", True, True, False, False),
    ],
)
def test_each_mode_has_its_traits(
    mode: str, mapped: bool, locked: bool, direct: bool, copies: bool
) -> None:
    traits = ModeTraits.of(mode)
    assert traits.name is LoadMode(mode)
    assert (traits.mapped, traits.locked, traits.direct, traits.copies) == (
        mapped,
        locked,
        direct,
        copies,
    )
    assert ModeTraits.of(LoadMode(mode)) is traits  # one record per mode, made once
    assert traits.copies is not traits.mapped  # a host tensor is a mapping or a copy


def test_auto_has_no_traits_until_the_plan_resolves_it() -> None:
    with pytest.raises(ValueError, match="resolved by the plan"):
        ModeTraits.of("auto")
    with pytest.raises(ValueError, match="not a valid"):
        ModeTraits.of("mapped")


@pytest.mark.parametrize("mode", ["auto", "none", "direct", "mmap", "mlock"])
def test_the_plan_carries_the_resolved_modes_traits(mode: str) -> None:
    plan = make_plan(llama_index(2), [CpuDevice()], Config().with_overrides(mode=mode))
    resolved = LoadMode.MMAP if mode == "auto" else LoadMode(mode)
    assert plan.mode is resolved
    assert plan.traits is ModeTraits.of(resolved)


@pytest.mark.parametrize("mode", ["auto", "direct"])
def test_the_dry_run_plans_the_traits_a_load_would(tmp_path: Path, mode: str) -> None:
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="2MiB", seed=1, n_layer=2)
    planned = aiogguf.plan_sync(model.path, mode=mode, n_gpu_layers=0)
    assert planned.traits is ModeTraits.of("mmap" if mode == "auto" else mode)


def test_a_device_without_mapped_memory_resolves_auto_to_copies() -> None:
    unmappable = SimDevice("g0", free=GiB, mmap=False)
    plan = make_plan(llama_index(2), [CpuDevice(), unmappable], Config())
    assert plan.traits is ModeTraits.of("none")
    assert resolve_mode("auto", [unmappable]) is LoadMode.NONE
    for mode in ("mmap", "mlock"):  # the traits say which modes map
        with pytest.raises(PlacementError, match="mapped memory"):
            resolve_mode(mode, [unmappable])


# --- the thread plan --------------------------------------------------------------------


def _layouts(mode: str, config: Config) -> tuple[BufferLayout, ...]:
    # One 4 GiB tensor (an index only: nothing is read), all of it on the host.
    index = llama_index(1, extra=[("big.weight", "F32", (16384, 65536))])
    plan = make_plan(index, [CpuDevice(free=64 * GiB, total=64 * GiB)], config)
    assert plan.mode == mode
    return layout_buffers(plan, config.pipeline.alignment)


def _thread_plan(disks: Disks, *, cores: int, mode: str = "none", **overrides: Any) -> ThreadPlan:
    config = Config().with_overrides(mode=mode, **overrides)
    return plan_threads(disks, _layouts(mode, config), config, ModeTraits.of(mode), cores=cores)


def test_one_reader_on_a_machine_with_cores_to_spare_checks_apart() -> None:
    # As tests/test_read_threads.py: 1 reader, 4 cores, 2 check workers (the default).
    disks = Disks(("dev 8:0",), (1,))
    threads = _thread_plan(disks, cores=4)
    assert threads.disks is disks
    assert (threads.readers, threads.transfer_threads, threads.check_threads) == (1, 1, 2)
    assert threads.checks_apart
    assert threads.job_bytes == 64 * MiB  # the chunk size: 4 GiB spreads wider


@pytest.mark.parametrize(("readers", "cores"), [(2, 2), (4, 64)])
def test_readers_on_every_core_or_outnumbering_the_checks_check_inline(
    readers: int, cores: int
) -> None:
    threads = _thread_plan(Disks(("dev 8:0",), (readers,)), cores=cores)
    assert threads.readers == readers
    assert not threads.checks_apart


def test_the_disks_add_up_to_the_readers_and_the_busiest_sets_the_transfer_threads() -> None:
    # Two files on one disk of 3 readers, one on a disk of 1: 4 reader threads, not 7.
    disks = Disks(("a", "a", "b"), (3, 3, 1))
    threads = _thread_plan(disks, cores=64, validate_workers=8)
    assert (threads.readers, threads.transfer_threads) == (4, 3)
    assert threads.checks_apart  # 4 readers < min(64 cores, 8 check workers)
    assert _thread_plan(disks, cores=4, validate_workers=8).checks_apart is False


def test_checks_off_lend_no_check_threads_and_let_mapped_jobs_grow() -> None:
    disks = Disks(("dev 8:0",), (2,))
    mapped_unchecked = _thread_plan(disks, cores=8, mode="mmap", check_tensors=False)
    assert mapped_unchecked.check_threads == 0
    assert mapped_unchecked.job_bytes == MIN_MAPPED_JOB_BYTES  # a populate call per 256 MiB
    # Checked, a mapped tensor's check starts once its job has landed: the chunk size.
    assert _thread_plan(disks, cores=8, mode="mmap").job_bytes == 64 * MiB
    # Copies keep the chunk size whether checked or not.
    assert _thread_plan(disks, cores=8, check_tensors=False).job_bytes == 64 * MiB


def test_many_readers_share_a_model_too_small_for_a_chunk_each() -> None:
    # 4 GiB over 256 readers: 16 MiB jobs, each reader one of them at least.
    threads = _thread_plan(Disks(("dev 8:0",), (256,)), cores=8)
    assert threads.job_bytes == 16 * MiB + 4096  # the tensors' bytes and the rest, aligned
    assert MIN_SPREAD_BYTES < threads.job_bytes < 64 * MiB


def test_the_reader_bound_before_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiogguf import _config as config_module

    monkeypatch.setattr(config_module, "usable_cores", lambda: 32)
    assert most_readers(Config()) == 16  # auto never resolves to direct
    assert most_readers(Config().with_overrides(mode="none")) == 16
    assert most_readers(Config().with_overrides(mode="direct")) == 4
    assert most_readers(Config().with_overrides(mode="direct", readers=7)) == 7


# --- nothing downstream reads the mode's name -------------------------------------------

# The load's modules: the core, the stages, the wings it plugs in, the API and records.
# The CLI, the server, the harness and the compat reader compare what a user or another
# format typed, before any plan.
_SKIPPED = ("cli", "server", "testing", "compat")
_MODE_NAMES = {m.value for m in LoadMode}


def _load_modules(root: Path) -> list[Path]:
    found = sorted((root / "stages").rglob("*.py"))
    for path in sorted((root / "pipeline").rglob("*.py")):
        if path.relative_to(root / "pipeline").parts[0] not in _SKIPPED:
            found.append(path)
    return found


def _is_a_mode(node: ast.expr) -> bool:
    """A load mode: ``mode``, ``plan.mode``, ``str(config.load.mode)``."""
    if isinstance(node, ast.Name):
        return node.id == "mode"
    if isinstance(node, ast.Attribute):
        return node.attr == "mode"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str":
        return any(_is_a_mode(a) for a in node.args)
    return False


def _is_the_plans_mode(node: ast.expr) -> bool:
    """``plan.mode`` (``layout.plan.mode``) or ``traits.name``: read for its traits, never
    compared (an ``is LoadMode.MLOCK`` re-derives ``locked``)."""
    if not isinstance(node, ast.Attribute):
        return False
    owner = node.value
    owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
    return (node.attr, owner_name) in {("mode", "plan"), ("name", "traits")}


def _mode_names(node: ast.expr) -> bool:
    """A mode's name, a collection of them (``("mmap", "mlock")``), or one kept by name
    (``MAPPED_MODES``)."""
    if isinstance(node, ast.Constant):
        return node.value in _MODE_NAMES
    if isinstance(node, ast.Name | ast.Attribute):
        return (node.id if isinstance(node, ast.Name) else node.attr).endswith("_MODES")
    if isinstance(node, ast.Call) and node.args:  # frozenset({...}), set((...))
        return isinstance(node.func, ast.Name) and _mode_names(node.args[0])
    if isinstance(node, ast.Tuple | ast.List | ast.Set) and node.elts:
        return all(isinstance(e, ast.Constant) and e.value in _MODE_NAMES for e in node.elts)
    return False


def mode_by_name(root: Path) -> list[str]:
    """Where a load module under ``root`` compares a mode with a mode's name, or keeps
    a collection of modes' names (a ``MAPPED_MODES``) outside the records' module."""
    found: list[str] = []
    for path in _load_modules(root):
        where = path.relative_to(root).as_posix()
        records = where == "pipeline/_records.py"
        hits: list[tuple[int, str]] = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_is_a_mode(s) for s in sides) and any(_mode_names(s) for s in sides):
                    hits.append((node.lineno, "compares a mode by its name"))
                elif any(_is_the_plans_mode(s) for s in sides):
                    hits.append((node.lineno, "compares the plan's mode"))
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                kept = not isinstance(node.value, ast.Constant) and _mode_names(node.value)
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                named = any(isinstance(t, ast.Name) and t.id.endswith("_MODES") for t in targets)
                if (kept or named) and not records:
                    hits.append((node.lineno, "a copy of the modes' names"))
        found.extend(f"{where}:{line}: {what}" for line, what in sorted(hits))
    return found


def test_no_module_of_the_load_reads_the_mode_by_its_name() -> None:
    modules = _load_modules(ROOT)
    assert len(modules) > 50  # the walk found the package
    assert mode_by_name(ROOT) == []


def test_the_scan_finds_what_the_old_code_did(tmp_path: Path) -> None:
    """The scan is not blind: it finds each way the mode was re-derived."""
    (tmp_path / "stages").mkdir()
    (tmp_path / "pipeline" / "cli").mkdir(parents=True)
    (tmp_path / "stages" / "plan.py").write_text(
        'MAPPED_MODES: frozenset[str] = frozenset({"mmap", "mlock"})\n'
        "use_mmap = mode in MAPPED_MODES\n",
        encoding="utf-8",
    )
    (tmp_path / "pipeline" / "front.py").write_text(
        'lock = plan.mode == "mlock"\n'
        'host_read = mode in ("none", "direct")\n'
        'mapped = isinstance(c, C) and mode in ("mmap", "mlock")\n'
        'other = str(config.load.mode) != "none"\n'
        "locked = layout.plan.mode is LoadMode.MLOCK\n"
        'fine = split_mode == "none" and plan.traits.mapped\n'
        "asked = config.load.mode is LoadMode.DIRECT\n",
        encoding="utf-8",
    )
    (tmp_path / "pipeline" / "cli" / "options.py").write_text(
        'typed = mode == "direct"\n', encoding="utf-8"
    )
    found = mode_by_name(tmp_path)
    assert [f.split(": ")[0] for f in found] == [
        "stages/plan.py:1",
        "stages/plan.py:2",
        "pipeline/front.py:1",
        "pipeline/front.py:2",
        "pipeline/front.py:3",
        "pipeline/front.py:4",
        "pipeline/front.py:5",
    ], found
