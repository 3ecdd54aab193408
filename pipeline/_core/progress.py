"""What a load has landed: bytes and tensors counted, reported as progress events, and
the names of the tensors whose bytes have all landed, handed on to the checks.

The read side hands every landed host job to ``LoadProgress.host_landed`` (a callback
on the loop's thread, attached before the first read) and the transfer side every
landed device job to ``LoadProgress.landed``; the engine reads ``ready_receive``. Which
tensors a job completed is the load's one ``TensorCountdown``'s to say.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from aiogguf._events import ProgressHub, Stage
from aiogguf._jobs import BufferLayout, Passed, ReadJob, TensorCountdown
from aiogguf._records import Plan

__all__ = ["LoadProgress", "Names"]

# Not ``create_memory_object_stream[list[str]]``: a subscript is built at run time, and
# the first one in a process costs as much as the rest of a small load's setup.
Names = tuple[MemoryObjectSendStream[list[str]], MemoryObjectReceiveStream[list[str]]]


class LoadProgress:
    """Counts landed bytes and finished tensors, reports them as progress events, and
    puts the names of the tensors whose bytes have all landed on ``ready`` for the checks
    (on the loop's thread only; made before the reads start, silent until ``go_live``).

    Tensor names travel in lists, one per landed host job and at most one per device job
    whose copy has completed (a send per tensor would be a loop iteration per tensor),
    with room for all (``jobs``: host and device jobs): both come from loop callbacks
    (``host_landed``, ``device_copied``), which cannot wait."""

    def __init__(
        self,
        hub: ProgressHub,
        plan: Plan,
        layouts: Sequence[BufferLayout],
        countdown: TensorCountdown,
        *,
        jobs: int,
        checked: bool,
        passed: Passed | None = None,
    ) -> None:
        self._hub = hub
        self._layouts = layouts
        self._countdown = countdown
        self._checked = checked
        self._passed = passed  # told the host tensors that need no check, as they land
        self._live = False
        ready: Names = anyio.create_memory_object_stream(jobs + 1)
        self.ready_send, self.ready_receive = ready
        loaded = [t for t in plan.tensors if not t.lazy]
        self.bytes_total = sum(t.nbytes for t in loaded)
        self.tensors_total = len(loaded)
        self.bytes_done = 0
        self.tensors_done = 0
        # Device tensors whose bytes all landed (copies not followed): ready once every
        # copy has completed, which it has when the transfers return.
        self.device_landed: list[str] = []

    def landed(self, job: ReadJob) -> list[str]:
        """Count a landed job; the host tensors it completed. A device tensor is ready
        once its copies have completed (``device_copied``)."""
        self.bytes_done += job.useful_end - job.useful_start
        on_device = not self._layouts[job.buffer_index].plan.host
        done = self._countdown.landed(job, on_device=on_device)
        self.emit(Stage.READ)
        if on_device:
            self.device_landed += done
            return []
        return done

    def device_copied(
        self, jobs: Sequence[ReadJob], ready: MemoryObjectSendStream[list[str]]
    ) -> None:
        """Where the transfers hand the device jobs whose copies have completed (on the
        loop's thread): the tensors they completed go on ``ready``, to the checks."""
        done = self._countdown.copied(jobs)
        if done:
            # Broken only once the load is failing anyway.
            with contextlib.suppress(anyio.BrokenResourceError):
                ready.send_nowait(done)

    def host_landed(self, job: ReadJob) -> None:
        """Where the host reads hand each landed job (on the loop's thread)."""
        names = self.landed(job)
        if not names:
            return
        if not self._checked:
            self.tensors_checked(len(names))
            if self._passed is not None:
                self._passed(names)
            return
        # Broken only once the load is failing anyway.
        with contextlib.suppress(anyio.BrokenResourceError):
            self.ready_send.send_nowait(names)

    def tensors_checked(self, count: int) -> None:
        self.tensors_done += count
        self.emit(Stage.READ)

    def go_live(self) -> None:
        """Report from now on: the plan's event is out (jobs that landed before it were
        counted in silence)."""
        self._live = True
        self.emit(Stage.READ)

    def close(self) -> None:
        """Close both ends of ``ready`` (harmless when the load has)."""
        self.ready_send.close()
        self.ready_receive.close()

    def emit(self, stage: Stage) -> None:
        """Report the counts so far (throttled, except the final event)."""
        if not self._live:
            return
        self._hub.emit(
            stage,
            self.bytes_done,
            self.bytes_total,
            self.tensors_done,
            self.tensors_total,
            force=stage is Stage.DONE,
        )
