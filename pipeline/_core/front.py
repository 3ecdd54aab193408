"""The blocking front of one load, on the load's own thread: parse, index, plan, open,
lay out and allocate, cut the jobs and start the host reads, up to the first byte
read (a single-file model in one call: each call is a round trip through the loop).

It walks the load's steps; each step's work is elsewhere: the sources and watchers
are the assembler's (``aiogguf._core.assemble``), the plan, the layout and the read
side ``aiogguf._core.layout``'s. It hands the engine
two records: a ``Layout`` (nothing in it open or running) and a ``ReadSide`` (the
checks, the reader, and the host reads, started). What it opens, allocates, lends and
starts belongs to the load's ``LoadResources`` as soon as it exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiogguf._core.assemble import Assembly
from aiogguf._core.layout import Layout, Planner, ReadSide, lay_out, plan_load, start_reads
from aiogguf._core.load_resources import LoadResources
from aiogguf._events import ProgressHub
from aiogguf._jobs import Passed
from aiogguf._records import ParsedFile, WeightIndex
from aiogguf.io._devices.base import Device
from aiogguf.io.workers import raise_if_stopped

__all__ = ["Front", "Layout", "ReadSide"]


@dataclass(frozen=True, slots=True)
class Front:
    """The blocking front of one load, run on the load's thread, up to the first byte
    read: it plans with the ``assembly``'s config for ``devices`` (None: discover
    them), reads through the assembly's sources, times itself with ``clock`` and ends by
    starting the host reads, whose landed jobs go to a ``LoadProgress`` that reports to
    ``hub``. What it opens, allocates, lends and starts is ``resources``' as soon as
    each is made: its close frees them all."""

    resources: LoadResources
    assembly: Assembly
    devices: Sequence[Device] | None
    clock: Callable[[], float]
    hub: ProgressHub
    passed: Passed | None = None  # told each batch of tensors ready to hand on
    planner: Planner | None = None  # who makes the plan (None: ``make_plan``)

    def parse_and_plan(
        self, path: str
    ) -> tuple[ParsedFile, tuple[WeightIndex, float, Layout, ReadSide] | None]:
        """Blocking: a single-file model parsed, indexed and ``plan_and_open``-ed in one
        call: each call is a round trip through the loop, and in a fresh process the
        round trips cost as much as the work. Returns the header and (index, when it was
        indexed, the layout, the read side); for a split set only the first file's
        header, and nothing is opened."""
        first, index = self.assembly.read_model(path, self.resources)
        if index is None:
            return first, None
        indexed = self.clock()
        return first, (index, indexed, *self.plan_and_open(index))

    def plan_and_open(self, index: WeightIndex) -> tuple[Layout, ReadSide]:
        """Blocking: the load's devices and plan; then the files to read, opened in the
        plan's mode, its manifest, the layout and the host reads started."""
        assembly, resources, config = self.assembly, self.resources, self.assembly.config
        devices, plan = plan_load(index, self.devices, config, self.planner)
        raise_if_stopped()
        assembly.open_files(index, resources, direct=plan.traits.direct)
        assembly.open_manifest(index, resources)
        layout = lay_out(
            index,
            devices,
            plan,
            self.clock(),
            config=config,
            resources=resources,
            clock=self.clock,
            blocks=assembly.block_grid(),
        )
        # What no read lands, a hub file's digest fetches.
        assembly.expect_reads(resources, [*layout.jobs, layout.device_jobs])
        raise_if_stopped()  # a cancelled load starts no read
        reading = start_reads(
            index,
            layout,
            config=config,
            assembly=assembly,
            resources=resources,
            clock=self.clock,
            hub=self.hub,
            passed=self.passed,
        )
        return layout, reading
