"""Tensors handed on while their load goes on: ``handle.tensors_as_ready()``.

A tensor is *ready* once every byte of it has landed in its final buffer (for a device
tensor: every copy to the device has completed) and every check it gets has passed.
Where that is known, the load says so on the loop's thread, by name, in one call per
batch: the host reads' landed callback (checks off), and the validate stage once it
has finished a batch of tensors or a whole-tensor check (checks on). Nothing here runs
on a reader or transfer thread, and nothing wakes the loop that was not woken already.

What a slow consumer makes the load keep is one list of names (at most one per tensor):
the tensors are already in their final buffers, so a step of the iteration only makes a
view of one (``Model.tensors`` makes the same). The load never waits for a consumer.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.abc import TaskGroup

from aiogguf._model import Model
from aiogguf._records import TensorEntry
from aiogguf.errors import ClosedResourceError

if TYPE_CHECKING:
    from torch import Tensor as TorchTensor
else:
    TorchTensor = Any  # torch is imported on first use (``to_torch``)

__all__ = ["ReadyTensors", "TensorStream"]


class ArrayOf(Protocol):
    """A ready tensor's array by name; ``private``: writable, over the process's own
    copy-on-write pages where the tensor is mapped (what torch needs)."""

    def __call__(self, name: str, *, private: bool = False) -> Any: ...


"""A ready tensor's array, by name (a view where its bytes lie)."""


class ReadyTensors:
    """The names of one load's ready tensors, in the order they became ready; fed on the
    loop's thread by the load (``add``; ``open`` once the tensors can be addressed;
    ``finish`` or ``fail`` at the end) and read by any number of iterations, each from
    the first name."""

    def __init__(self) -> None:
        self.names: list[str] = []  # what iterations may hand out, in order
        self._pending: list[str] = []  # ready before ``open``, or held for the verdict
        self._array: ArrayOf | None = None
        self._entry: Callable[[str], TensorEntry] | None = None
        self._hold = False
        self.ended: bool = False
        # A stream was asked for (``tensors_as_ready``): the load then follows each
        # device copy as it completes, which costs a loop callback per job.
        self.wanted: bool = False
        self.error: BaseException | None = None
        self.error_delivered: bool = False
        self._wake: anyio.Event | None = None

    def open(self, array: ArrayOf, entry: Callable[[str], TensorEntry], *, hold: bool) -> None:
        """Ready tensors can be addressed by ``array(name)`` from now on, and their index
        entries by ``entry(name)`` (for ``torch``). ``hold``: keep
        every name back until ``finish`` (a hash manifest's verdict comes at the end:
        some of a tensor's blocks are hashed only then)."""
        self._array = array
        self._entry = entry
        self._hold = hold
        if not hold:
            self._release(self._pending)
            self._pending = []

    def add(self, names: Iterable[str]) -> None:
        """These tensors are ready (on the loop's thread)."""
        if self._array is None or self._hold:
            self._pending.extend(names)
        else:
            self._release(names)

    def finish(self, model: Model, *, failed: Collection[str], last: Iterable[str]) -> None:
        """The load succeeded: names are addressed through ``model`` from now on, which
        this record does not keep alive (the handle or its caller does); the names held
        back but those in ``failed`` (a load that keeps invalid tensors) come now, then
        ``last`` (lazy tensors: mapped, never read), then the end."""
        held = weakref.ref(model)

        def array(name: str, *, private: bool = False) -> Any:
            alive = held()
            if alive is None:
                raise ClosedResourceError(f"model of tensor {name!r} (collected)")
            return alive._array(name, private=private)

        self._array = array
        self._release([n for n in self._pending if n not in failed])
        self._pending = []
        self._release(last)
        self.ended = True
        self._notify()

    def fail(self, error: BaseException) -> None:
        """The load failed with ``error``: every iteration raises it at its next step
        (names not yet handed out are not: their memory goes with the failed load)."""
        if self.ended:
            return
        self.error = error
        self.ended = True
        self._array = None
        self._pending = []
        self._notify()

    async def iterate(self, *, torch: bool = False) -> AsyncIterator[tuple[str, Any]]:
        """``(name, array)`` for each ready tensor, once each, as it becomes ready; ends
        after the last, or raises the load's error. ``torch``: the array as a
        ``torch.Tensor`` over the same memory, as ``Model.torch`` gives it."""
        at = 0
        while True:
            if self.error is not None:
                self.error_delivered = True
                raise self.error
            array = self._array
            if array is not None and at < len(self.names):
                name = self.names[at]
                at += 1
                # A consumer that never awaits would otherwise not see its cancellation
                # until the load has ended.
                await anyio.lowlevel.checkpoint_if_cancelled()
                if torch:
                    assert self._entry is not None
                    # With torch, which a stream of torch tensors imports anyway.
                    from aiogguf._torch import to_torch

                    yield name, to_torch(array(name, private=True), self._entry(name))
                else:
                    yield name, array(name)
                continue
            if self.ended:
                return
            if self._wake is None:
                self._wake = anyio.Event()
            await self._wake.wait()

    def _release(self, names: Iterable[str]) -> None:
        before = len(self.names)
        self.names.extend(names)
        if len(self.names) > before:
            self._notify()

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()
            self._wake = None


class TensorStream:
    """``handle.tensors_as_ready()``: ``(name, array)`` for each tensor of a load once it
    is ready, in the order they become ready.

    ``async with handle.tensors_as_ready() as tensors: async for name, array in
    tensors: ...`` runs the load in a task of its own while the block consumes; leaving
    the block ends it (a load still running is cancelled, a loaded model closed).
    ``async for`` over it without the ``async with`` reads a load that another task
    runs (``async with handle as model``), as ``handle.events()`` does.
    """

    def __init__(
        self,
        ready: ReadyTensors,
        claim: Callable[[], None],
        enter: Callable[[], Awaitable[object]],
        leave: Callable[[], Awaitable[None]],
    ) -> None:
        self._ready = ready
        self._claim = claim  # raises when the load has been started already
        self._enter = enter
        self._leave = leave
        self._task_group: TaskGroup | None = None

    def __aiter__(self) -> AsyncIterator[tuple[str, Any]]:
        return self._ready.iterate()

    def torch(self) -> AsyncIterator[tuple[str, TorchTensor]]:
        """The same iteration with each tensor as a ``torch.Tensor`` sharing its memory,
        as ``Model.torch`` gives it (dtype, gguf-py's shape; ``cpu`` or ``cuda:N``)."""
        return self._ready.iterate(torch=True)

    async def __aenter__(self) -> TensorStream:
        self._claim()
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        task_group.start_soon(self._load)
        return self

    async def _load(self) -> None:
        with contextlib.suppress(Exception):  # the iteration raises it (``ReadyTensors.fail``)
            await self._enter()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task_group, self._task_group = self._task_group, None
        assert task_group is not None, "left a TensorStream that was not entered"
        ready = self._ready
        cut_short = not ready.ended
        if cut_short or exc is not None:
            task_group.cancel_scope.cancel()  # the block was left before the load ended
        try:
            # Not told of the block's exception, which would come out wrapped in an
            # exception group: the load's task was cancelled above, and the exception
            # goes on as it is.
            await task_group.__aexit__(None, None, None)
        finally:
            await self._leave()
        if exc is None and not cut_short and not ready.error_delivered and ready.error:
            # The block ended without meeting the load's error: it is not lost.
            raise ready.error
