"""Each tensor's bytes still to come are counted once per load (``TensorCountdown``):
the progress, the transfers and the checks count down there, not in dicts of their own.
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from pathlib import Path

import pytest
from synthetic_index import llama_index

from aiogguf._config import Config
from aiogguf._jobs import ReadJob, TensorCountdown, TensorSpans, layout_buffers, split_jobs
from aiogguf.io._devices import CpuDevice, SimDevice
from aiogguf.stages.plan import make_plan

GiB, KiB = 1 << 30, 1 << 10
ROOT = Path(__file__).resolve().parents[1]  # pipeline/ is aiogguf, stages/ and io/ its own


def _sizes_calls(path: Path) -> list[int]:
    """Lines of ``path`` that call ``.sizes()`` (a per-tensor dict of bytes)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "sizes"
    ]


def test_only_the_countdown_builds_a_count_of_each_tensors_bytes() -> None:
    """``TensorSpans.sizes`` is where a per-tensor count starts: only ``_jobs`` (the
    countdown) calls it, and the modules that kept their own no longer have one."""
    callers = {
        str(path.relative_to(ROOT)): lines
        for folder in ("pipeline", "stages", "io")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (lines := _sizes_calls(path))
    }
    assert set(callers) == {"pipeline/_jobs.py"}, callers
    for module in ("pipeline/_core/progress.py", "stages/validate.py"):
        source = (ROOT / module).read_text(encoding="utf-8")
        for old in ("_remaining", "_uncopied", "_unchecked", ".overlapping("):
            if module == "stages/validate.py" and old == ".overlapping(":
                continue  # the piece checks find a piece's tensors (no count)
            assert old not in source, (module, old)


def _records() -> tuple[TensorSpans, list[ReadJob], list[ReadJob], set[str]]:
    """A two-layer model split between the host and a simulated GPU, cut in 64 KiB jobs:
    the host jobs, the device jobs and the device tensors' names."""
    index = llama_index(2)
    devices = [CpuDevice(free=64 * GiB, total=64 * GiB), SimDevice("g0", free=8 * GiB)]
    config = Config().with_overrides(mode="none", n_gpu_layers=1)
    layouts = layout_buffers(make_plan(index, devices, config), config.pipeline.alignment)
    host, device = split_jobs(
        index, layouts, 64 * KiB, host_bytes=64 * KiB, slot_bytes=64 * KiB, aligned=False
    )
    on_device = {n for lay in layouts if not lay.plan.host for n in lay.plan.tensors}
    return TensorSpans(index, layouts), [j for jobs in host for j in jobs], device, on_device


def _last_job(spans: TensorSpans, jobs: list[ReadJob]) -> dict[str, int]:
    """Each tensor's last job in ``jobs``' order (its position)."""
    last: dict[str, int] = {}
    for at, job in enumerate(jobs):
        for _, _, name in spans.overlapping(
            job.buffer_index, job.file_index, job.useful_start, job.useful_end
        ):
            last[name] = at
    return last


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("follow_copies", [False, True])
def test_each_tensor_completes_once_after_its_last_piece(seed: int, follow_copies: bool) -> None:
    """Jobs in any order: each tensor split over several jobs completes exactly once per
    count, at its last piece: a host tensor checked by pieces when its last job is
    checked, then when its last job landed; a device tensor when its last job landed, or
    (copies followed) only when its last copy completed."""
    spans, host, device, on_device = _records()
    sizes = spans.sizes()
    assert max(sizes.values()) > 64 * KiB, "some tensor spans several jobs"
    assert on_device, "tensors on the device"
    assert set(sizes) - on_device, "tensors on the host"
    random.Random(seed).shuffle(host)
    random.Random(seed + 100).shuffle(device)
    countdown = TensorCountdown(spans)
    host_names = set(sizes) - on_device
    countdown.count_checks(host_names)
    if follow_copies:
        countdown.follow_copies()

    checked = [countdown.checked(job) for job in host]
    landed = [countdown.landed(job, on_device=False) for job in host]
    device_landed = [countdown.landed(job, on_device=True) for job in device]
    copied = [countdown.copied([job]) for job in device] if follow_copies else []
    last_host, last_device = _last_job(spans, host), _last_job(spans, device)
    for counts in (checked, landed):
        assert Counter(n for names in counts for n in names) == Counter(host_names)
        assert {n: at for at, names in enumerate(counts) for n in names} == last_host
    ended = copied if follow_copies else device_landed
    assert Counter(n for names in ended for n in names) == Counter(on_device)
    assert {n: at for at, names in enumerate(ended) for n in names} == last_device
    if follow_copies:
        assert not any(device_landed), "a followed device tensor is in place once copied"


def test_the_checks_count_only_the_tensors_checked_on_the_readers() -> None:
    """A device job, or a host tensor checked whole, completes nothing in the checks'
    count; the host tensors it counts complete there as usual."""
    spans, host, device, on_device = _records()
    countdown = TensorCountdown(spans)
    counted = sorted(set(spans.sizes()) - on_device)[::2]  # the rest: checked whole
    countdown.count_checks(counted)
    assert not any(countdown.checked(job) for job in device)
    assert sorted(n for job in host for n in countdown.checked(job)) == counted
