"""A loaded model handed to another process without a copy: the server's side
(``share_model``) and the client's (``open_shared_model``).

A model loaded with ``[load] shareable = true`` keeps its memory where another process
can map it: host images of modes ``none``/``direct`` in memfds, mapped images (modes
``mmap``/``mlock``) over the files themselves (each mapping kept its file's descriptor),
device images in memfds (the simulated GPU) or behind CUDA IPC handles. ``share_model``
gathers those descriptors and writes what a client needs beside them as JSON (no
pickle): each file's header bytes (in one memfd: the client parses and indexes them with
the load's own stages), where each buffer's ranges lie in it, the plan, the report and
the bad tensors a ``keep_invalid`` load kept.

What a client gets can only be read, or written copy-on-write: host memfds and files are
mapped ``MAP_PRIVATE``, and every memfd is sealed before it leaves (no new write to it
but through the server's own mappings, no change of size: ``seal_writes``), so a
client's write stays in that client and a server cannot cut a page from under it. CUDA
IPC memory is the exception CUDA makes: there is no copy-on-write device memory, and a
client's write to a device tensor reaches the server and every other client.

The description and the descriptors are hostile to the client (a server can lie):
``open_shared_model`` checks every count, size, offset, type and encoding before it maps
anything, and what is wrong raises ``LoadError`` naming it.
"""

from __future__ import annotations

import json
import os
import stat
import weakref
from collections.abc import Sequence
from typing import Any, Final

from aiogguf._images import DeviceImage, HostImage, Image, MappedImage
from aiogguf._jobs import BufferLayout, RangeSlot, tensor_slots
from aiogguf._model import Model, ModelState
from aiogguf._records import BufferPlan, ParsedFile, Plan, WeightIndex
from aiogguf._report import LoadReport
from aiogguf.errors import GGUFError, LoadError, TensorFailure, from_os_error
from aiogguf.io._devices.base import ExportableBuffer, SharedDeviceMemory
from aiogguf.io._devices.sim import SimDevice
from aiogguf.io.buffers import (
    Closeable,
    HostBuffer,
    ResourceState,
    seal_writes,
    sealed_memfd,
    size_is_sealed,
)
from aiogguf.io.files import DataFile, open_readable
from aiogguf.io.mapping import FileMapping
from aiogguf.resident._records_json import RecordError, from_json, to_json
from aiogguf.stages.index import build_index
from aiogguf.stages.parse import NeedMoreBytes, parse_header

__all__ = ["ModelShare", "open_shared_model", "share_model"]

VERSION: Final = 1
# A description larger than this is refused unread: a plan of 10^5 tensors is a few MiB.
MAX_DESCRIPTION_BYTES: Final = 256 << 20
# A header larger than this is refused (the biggest vocabularies are tens of MiB).
MAX_HEADER_BYTES: Final = 1 << 30
MAX_PATH_CHARS: Final = 4096
CUDA_IPC_HANDLE_BYTES: Final = 64
_INT_LIMIT: Final = 1 << 63
_WHAT = "shared model"


class ModelShare(Closeable):
    """What a client needs to open a model another process holds: ``description``
    (JSON bytes) and ``fds``, the descriptors to pass with ``SCM_RIGHTS`` in the order
    the description names them. It owns the descriptors (duplicates): closing it (or
    leaving its ``with``) closes them, not the model's."""

    def __init__(self, description: bytes, fds: Sequence[int]) -> None:
        self.description = description
        self.fds: tuple[int, ...] = tuple(fds)
        self._state = ResourceState.OPEN

    def close(self) -> None:
        """Close the descriptors; idempotent."""
        if self._state is ResourceState.CLOSED:
            return
        self._state = ResourceState.CLOSED
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                continue  # the rest still close

    def __repr__(self) -> str:
        size = len(self.description)
        return f"<ModelShare {size} bytes, {len(self.fds)} fds {self._state.value}>"


# --- the server's side ---------------------------------------------------------------

# Each model's header memfd, made on its first share and sealed: later shares duplicate
# it. Closed when the model is collected (a model's close leaves it to the collector).
_HEADERS: weakref.WeakKeyDictionary[Model, tuple[int, list[tuple[int, int]]]] = (
    weakref.WeakKeyDictionary()
)


def share_model(model: Model) -> ModelShare:
    """What another process needs to open ``model`` (``open_shared_model``): the JSON
    description and duplicates of the descriptors of its memory, in a ``ModelShare``.

    Blocking (the first share of a model reads its files' headers again and checks them
    against the model's index). Raises ``LoadError`` naming the file if the model holds
    images that cannot be shared (it was not loaded with ``[load] shareable = true``, a
    file changed since the load, a device that exports nothing) or is closed.
    """
    path = model.index.files[0].path
    if model.state is ModelState.CLOSED:
        raise LoadError(path, None, "cannot share a closed model")
    fds: list[int] = []  # borrowed: the model's own, duplicated at the end

    def name(fd: int) -> int:
        fds.append(fd)
        return len(fds) - 1

    header_fd, header_spans = _headers(model)
    name(header_fd)
    data_fds: dict[int, int] = {}
    buffers: list[dict[str, Any]] = []
    for image in model._images:
        if image is None:
            raise LoadError(path, None, "cannot share a model with a buffer not allocated")
        buffers.append(_describe(image, path, name, data_fds))
    files = []
    for i, parsed in enumerate(model.index.files):
        offset, nbytes = header_spans[i]
        data = data_fds.get(i)
        files.append(
            {
                "path": parsed.path,
                "size": parsed.file_size,
                "header_offset": offset,
                "header_nbytes": nbytes,
                "fd": None if data is None else name(data),
            }
        )
    document = {
        "version": VERSION,
        "headers_fd": 0,
        "files": files,
        "buffers": buffers,
        "plan": to_json(model.plan),
        "report": to_json(model.report),
        "failures": to_json(model.failures),
    }
    description = json.dumps(document, separators=(",", ":")).encode()
    owned: list[int] = []
    try:
        for fd in fds:
            owned.append(os.dup(fd))
    except OSError as exc:
        for fd in owned:
            os.close(fd)
        raise from_os_error(exc, path, None, "cannot duplicate a descriptor to share") from exc
    return ModelShare(description, owned)


def _describe(image: Image, path: str, name: Any, data_fds: dict[int, int]) -> dict[str, Any]:
    """One buffer's entry in the description, its descriptors named through ``name``."""
    layout = {
        "nbytes": image.layout.nbytes,
        "slots": [[rs.file_start, rs.file_end, rs.buffer_offset] for rs in image.layout.slots],
    }
    if isinstance(image, HostImage):
        buffer = image.buffer
        if not buffer.shareable:
            raise _not_shareable(path)
        _seal(buffer.fileno(), path)
        return {
            "kind": "host",
            "fd": name(buffer.fileno()),
            "offset": buffer.descriptor_offset,
            "nbytes": buffer.nbytes,
            "layout": layout,
        }
    if isinstance(image, MappedImage):
        for rs, mapping in zip(image.layout.slots, image.mappings, strict=True):
            try:
                data_fds.setdefault(rs.range.file_index, mapping.fileno())
            except ValueError:
                raise _not_shareable(path) from None
        return {"kind": "mapped", "layout": layout}
    device = image.buffer
    if not isinstance(device, ExportableBuffer):
        raise LoadError(path, None, f"device {device.device}: its buffers cannot be shared")
    shared = device.export()
    if shared.fd is not None:
        _seal(shared.fd, path)
        return {
            "kind": "sim",
            "device": shared.device,
            "fd": name(shared.fd),
            "offset": shared.offset,
            "nbytes": shared.nbytes,
            "layout": layout,
        }
    assert shared.ipc_handle is not None
    return {
        "kind": "cuda",
        "device": shared.device,
        "device_id": shared.device_id,
        "handle": shared.ipc_handle.hex(),
        "offset": shared.offset,
        "nbytes": shared.nbytes,
        "layout": layout,
    }


def _not_shareable(path: str) -> LoadError:
    return LoadError(
        path,
        None,
        "the model's memory cannot be shared: load it with [load] shareable = true "
        "(shareable=True)",
    )


def _seal(fd: int, path: str) -> None:
    try:
        seal_writes(fd)
    except OSError as exc:
        raise from_os_error(exc, path, None, "cannot seal shared memory (Linux 5.1+)") from exc


def _headers(model: Model) -> tuple[int, list[tuple[int, int]]]:
    """The model's header memfd (made and sealed on its first share) and where each
    file's header lies in it."""
    found = _HEADERS.get(model)
    if found is not None:
        return found
    parts = [_header_bytes(i, parsed, model) for i, parsed in enumerate(model.index.files)]
    total = sum(len(p) for p in parts)
    path = model.index.files[0].path
    try:
        fd = sealed_memfd("aiogguf-headers", max(total, 1))
    except MemoryError as exc:
        raise LoadError(path, None, str(exc)) from exc
    spans: list[tuple[int, int]] = []
    try:
        at = 0
        for part in parts:
            view = memoryview(part)
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], at + done)
            spans.append((at, len(part)))
            at += len(part)
        seal_writes(fd)
    except OSError as exc:
        os.close(fd)
        raise from_os_error(exc, path, None, "cannot write the shared headers") from exc
    _HEADERS[model] = (fd, spans)
    weakref.finalize(model, os.close, fd).atexit = False
    return fd, spans


def _header_bytes(file_index: int, parsed: ParsedFile, model: Model) -> bytes:
    """Blocking: the header of one of the model's files, read again (through a mapping's
    descriptor where the model maps the file, else by its path) and checked against
    what the load parsed: a file changed since is refused."""
    path = parsed.path
    fd = _mapped_descriptor(model, file_index)
    own = fd is None
    if fd is None:
        fd = open_readable(path)
    try:
        size = os.fstat(fd).st_size
        # A file with no tensors may end before its data section's alignment.
        data = _pread_all(fd, min(parsed.data_offset, size), path)
    except OSError as exc:
        raise from_os_error(exc, path, None, "cannot read the header again to share it") from exc
    finally:
        if own:
            os.close(fd)
    try:
        again = parse_header(data, path, size)
    except (GGUFError, NeedMoreBytes):
        again = None
    if (
        again is None
        or size != parsed.file_size
        or again.data_offset != parsed.data_offset
        or again.tensors != parsed.tensors
        or list(again.metadata) != list(parsed.metadata)
    ):
        raise LoadError(path, None, "the file changed since the model was loaded: cannot share it")
    return data


def _mapped_descriptor(model: Model, file_index: int) -> int | None:
    """The descriptor a mapping of the model kept of file ``file_index``, if any."""
    for image in model._images:
        if isinstance(image, MappedImage):
            for rs, mapping in zip(image.layout.slots, image.mappings, strict=True):
                if rs.range.file_index == file_index:
                    try:
                        return mapping.fileno()
                    except ValueError:
                        return None
    return None


def _pread_all(fd: int, nbytes: int, path: str, offset: int = 0) -> bytes:
    parts: list[bytes] = []
    done = 0
    while done < nbytes:
        part = os.pread(fd, min(nbytes - done, 64 << 20), offset + done)
        if not part:
            raise LoadError(path, offset + done, f"short read: {nbytes} bytes expected")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


# --- the client's side ---------------------------------------------------------------


class _Bad(Exception):
    """Something in the description is wrong: the ``LoadError`` it becomes."""


def open_shared_model(description: bytes, fds: Sequence[int]) -> Model:
    """The model another process shares (``share_model``), over its memory, without a
    copy: host memfds and files mapped copy-on-write, simulated device memory likewise,
    CUDA memory through its IPC handles. The ``Model`` has ``load``'s interface; close it
    (or leave its ``async with``) to unmap.

    Takes ownership of ``fds``: they are closed before this returns, whatever happens
    (the mappings need none of them). Blocking: the headers are parsed and indexed here.
    Raises ``LoadError`` naming what is wrong when the description or the descriptors
    are not what a shared model is (wrong sizes, offsets past a descriptor's end, too
    few or too many descriptors, bad JSON, memory not sealed against shrinking).
    """
    owned = list(fds)
    try:
        try:
            return _open(description, owned)
        except _Bad as bad:
            raise LoadError(None, None, f"{_WHAT}: {bad}") from None
        except RecordError as bad:
            raise LoadError(None, None, f"{_WHAT}: {bad}") from None
    finally:
        for fd in owned:
            try:
                os.close(fd)
            except OSError:
                continue


def _open(description: bytes, fds: list[int]) -> Model:
    if not isinstance(description, bytes | bytearray | memoryview):
        raise _Bad(f"the description is {type(description).__name__}, not bytes")
    if len(description) > MAX_DESCRIPTION_BYTES:
        raise _Bad(f"the description has {len(description)} bytes, over the cap")
    try:
        document = json.loads(bytes(description).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _Bad(f"the description is not JSON: {exc}") from None
    doc = _Object(document, "description")
    doc.keys("version", "headers_fd", "files", "buffers", "plan", "report", "failures")
    if doc.integer("version") != VERSION:
        raise _Bad(f"description version {document['version']} (this client reads {VERSION})")
    named = _Descriptors(fds)
    index = _index(doc, named)
    plan: Plan = from_json(Plan, document["plan"], "plan")
    report: LoadReport = from_json(LoadReport, document["report"], "report")
    failures: tuple[TensorFailure, ...] = from_json(
        tuple[TensorFailure, ...], document["failures"], "failures"
    )
    buffers = doc.items("buffers")
    _check_plan(plan, index, len(buffers))
    files = doc.items("files")
    images: list[Image | None] = []
    data_files: dict[int, DataFile] = {}
    devices: dict[str, SimDevice] = {}
    try:
        layouts = []
        for k, entry in enumerate(buffers):
            where = f"buffers[{k}]"
            buffer = _Object(entry, where)
            layout = _layout(buffer, k, plan.buffers[k], where)
            layouts.append(layout)
            images.append(_image(buffer, layout, named, files, index, data_files, devices, where))
        named.all_used()
        slots = tensor_slots(index, layouts)
    except BaseException:
        for image in images:
            if image is not None:
                image.close()
        raise
    finally:
        for data_file in data_files.values():
            data_file.close()
    return Model(index, plan, images, slots, report, failures=failures)


class _Object:
    """A JSON object of the description, read one checked field at a time."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise _Bad(f"{where} is not an object")
        self.data: dict[str, Any] = data
        self.where = where

    def keys(self, *names: str) -> None:
        if set(self.data) != set(names):
            extra = sorted(set(self.data) - set(names))
            missing = sorted(set(names) - set(self.data))
            raise _Bad(f"{self.where}: fields {missing} missing, {extra} unknown")

    def integer(self, key: str, hi: int = _INT_LIMIT) -> int:
        value = self.data.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < hi:
            raise _Bad(f"{self.where}.{key} is {value!r}, not an integer in [0, {hi})")
        return value

    def string(self, key: str) -> str:
        value = self.data.get(key)
        if not isinstance(value, str) or len(value) > MAX_PATH_CHARS:
            raise _Bad(f"{self.where}.{key} is not a string of at most {MAX_PATH_CHARS}")
        return value

    def items(self, key: str) -> list[Any]:
        value = self.data.get(key)
        if not isinstance(value, list):
            raise _Bad(f"{self.where}.{key} is not a list")
        return value


class _Descriptors:
    """The descriptors sent, by the index the description gives them: each checked to
    be a regular file (a memfd is one) when first named."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = fds
        self._sizes: dict[int, int] = {}

    def get(self, number: int, where: str) -> tuple[int, int]:
        """The descriptor ``number`` and its size."""
        if not 0 <= number < len(self._fds):
            raise _Bad(f"{where} names descriptor {number}, but {len(self._fds)} were sent")
        fd = self._fds[number]
        size = self._sizes.get(number)
        if size is None:
            try:
                st = os.fstat(fd)
            except OSError as exc:
                raise _Bad(f"{where}: descriptor {number}: {exc.strerror}") from None
            if not stat.S_ISREG(st.st_mode):
                raise _Bad(f"{where}: descriptor {number} is not a file or memfd")
            size = self._sizes[number] = st.st_size
        return fd, size

    def sealed(self, number: int, where: str) -> tuple[int, int]:
        """``get``, for memory that will be mapped: its size must be sealed, or a
        server could cut a page from under the mapping."""
        fd, size = self.get(number, where)
        if not size_is_sealed(fd):
            raise _Bad(f"{where}: descriptor {number} is not a memfd sealed against shrinking")
        return fd, size

    def all_used(self) -> None:
        if len(self._sizes) != len(self._fds):
            unused = sorted(set(range(len(self._fds))) - set(self._sizes))
            raise _Bad(f"{len(self._fds)} descriptors were sent; {unused} are named by nothing")


def _index(doc: _Object, named: _Descriptors) -> WeightIndex:
    """Each file's header from the header memfd, parsed and indexed by the load's own
    (hardened) stages."""
    headers_fd, headers_size = named.get(doc.integer("headers_fd"), "description.headers_fd")
    parsed: list[ParsedFile] = []
    entries = doc.items("files")
    if not entries:
        raise _Bad("description.files is empty")
    for i, entry in enumerate(entries):
        where = f"files[{i}]"
        file = _Object(entry, where)
        file.keys("path", "size", "header_offset", "header_nbytes", "fd")
        path = file.string("path")
        size = file.integer("size")
        offset = file.integer("header_offset")
        nbytes = file.integer("header_nbytes", MAX_HEADER_BYTES)
        if offset + nbytes > headers_size or nbytes > size:
            raise _Bad(
                f"{where}: header [{offset}, {offset + nbytes}) is past the header memfd's "
                f"{headers_size} bytes or the file's {size}"
            )
        try:
            data = _pread_all(headers_fd, nbytes, path, offset)
        except OSError as exc:
            raise _Bad(f"{where}: cannot read the header: {exc.strerror}") from None
        try:
            parsed.append(parse_header(data, path, size))
        except NeedMoreBytes:
            raise _Bad(f"{where}: the header sent ends inside the header") from None
        except GGUFError as exc:
            raise _Bad(f"{where}: the header sent is not valid: {exc}") from None
    try:
        return build_index(parsed)
    except GGUFError as exc:
        raise _Bad(f"the headers sent do not index: {exc}") from None


def _check_plan(plan: Plan, index: WeightIndex, buffers: int) -> None:
    """The plan's buffers hold exactly the index's tensors, each inside its range, or
    (one node's part of a cluster's model) exactly the tensors the plan places."""
    if len(plan.buffers) != buffers:
        raise _Bad(f"the plan has {len(plan.buffers)} buffers, the description {buffers}")
    seen: set[str] = set()
    for k, buffer in enumerate(plan.buffers):
        for j, r in enumerate(buffer.ranges):
            where = f"plan.buffers[{k}].ranges[{j}]"
            if not 0 <= r.file_index < len(index.files) or not 0 <= r.start <= r.end:
                raise _Bad(f"{where}: file {r.file_index}, [{r.start}, {r.end}) is no range")
            for name in r.tensors:
                if name not in index or name in seen:
                    raise _Bad(f"{where}: tensor {name!r} is unknown or placed twice")
                entry = index[name]
                if (
                    entry.file_index != r.file_index
                    or entry.offset < r.start
                    or entry.offset + entry.nbytes > r.end
                ):
                    raise _Bad(f"{where}: tensor {name!r} lies outside the range")
                seen.add(name)
    if len(seen) != len(index.tensors) and seen != {t.name for t in plan.tensors}:
        raise _Bad(f"the plan places {len(seen)} of the {len(index.tensors)} tensors")


def _layout(buffer: _Object, k: int, plan: BufferPlan, where: str) -> BufferLayout:
    layout = _Object(buffer.data.get("layout"), f"{where}.layout")
    layout.keys("nbytes", "slots")
    nbytes = layout.integer("nbytes")
    slots = layout.items("slots")
    if len(slots) != len(plan.ranges):
        raise _Bad(f"{where}.layout has {len(slots)} slots for {len(plan.ranges)} ranges")
    made: list[RangeSlot] = []
    for j, (slot, r) in enumerate(zip(slots, plan.ranges, strict=True)):
        if (
            not isinstance(slot, list)
            or len(slot) != 3
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in slot)
        ):
            raise _Bad(f"{where}.layout.slots[{j}] is not three offsets")
        start, end, offset = slot
        if not start <= r.start <= r.end <= end or offset + (end - start) > nbytes:
            raise _Bad(f"{where}.layout.slots[{j}] does not hold its range inside the buffer")
        made.append(RangeSlot(r, start, end, offset))
    return BufferLayout(k, plan, tuple(made), nbytes)


def _image(
    buffer: _Object,
    layout: BufferLayout,
    named: _Descriptors,
    files: list[Any],
    index: WeightIndex,
    data_files: dict[int, DataFile],
    devices: dict[str, SimDevice],
    where: str,
) -> Image:
    """One buffer's image over the memory the description points at."""
    kind = buffer.data.get("kind")
    host = kind in ("host", "mapped")
    if kind not in ("host", "mapped", "sim", "cuda"):
        raise _Bad(f"{where}.kind is {kind!r}")
    if host != layout.plan.host:
        raise _Bad(f"{where}: a {kind} image for a buffer the plan puts on {layout.plan.device}")
    if kind == "mapped":
        buffer.keys("kind", "layout")
        return _mapped(layout, named, files, index, data_files, where)
    if kind == "cuda":
        buffer.keys("kind", "device", "device_id", "handle", "offset", "nbytes", "layout")
        return DeviceImage(layout, _cuda(buffer, layout, where))
    if kind == "host":
        buffer.keys("kind", "fd", "offset", "nbytes", "layout")
    else:
        buffer.keys("kind", "device", "fd", "offset", "nbytes", "layout")
    fd, size = named.sealed(buffer.integer("fd"), f"{where}.fd")
    offset, nbytes = buffer.integer("offset"), buffer.integer("nbytes")
    if nbytes < layout.nbytes or offset + nbytes > size:
        raise _Bad(
            f"{where}: [{offset}, {offset + nbytes}) is past the descriptor's {size} bytes "
            f"or smaller than the buffer's {layout.nbytes}"
        )
    if kind == "host":
        try:
            return HostImage(layout, HostBuffer.map_private(fd, offset, nbytes))
        except MemoryError as exc:
            raise _Bad(f"{where}: {exc}") from None
    device_name = buffer.string("device")
    if device_name != layout.plan.device:
        raise _Bad(f"{where}: device {device_name!r}, the plan says {layout.plan.device!r}")
    device = devices.get(device_name)
    if device is None:
        device = devices[device_name] = SimDevice(device_name, free=0, total=0)
    shared = SharedDeviceMemory(device_name, nbytes, offset, fd=fd)
    return DeviceImage(layout, device.map_shared(shared))


def _mapped(
    layout: BufferLayout,
    named: _Descriptors,
    files: list[Any],
    index: WeightIndex,
    data_files: dict[int, DataFile],
    where: str,
) -> MappedImage:
    mappings: list[FileMapping] = []
    try:
        for rs in layout.slots:
            i = rs.range.file_index
            data_file = data_files.get(i)
            if data_file is None:
                number = files[i].get("fd") if isinstance(files[i], dict) else None
                if number is None:
                    raise _Bad(f"{where}: a mapped buffer of file {i}, which has no descriptor")
                if isinstance(number, bool) or not isinstance(number, int):
                    raise _Bad(f"files[{i}].fd is {number!r}")
                fd, size = named.get(number, f"files[{i}].fd")
                if size != index.files[i].file_size:
                    raise _Bad(
                        f"files[{i}]: the descriptor has {size} bytes, the header says "
                        f"{index.files[i].file_size}"
                    )
                data_file = data_files[i] = DataFile(index.files[i].path, direct=False, fd=fd)
            mappings.append(FileMapping(data_file, rs.range.start, rs.range.end))
    except BaseException:
        for mapping in mappings:
            mapping.close()
        raise
    return MappedImage(layout, mappings)


def _cuda(buffer: _Object, layout: BufferLayout, where: str) -> Any:
    from aiogguf.io._devices.cupy_backend import open_ipc_buffer

    handle_hex = buffer.string("handle")
    try:
        handle = bytes.fromhex(handle_hex)
    except ValueError:
        raise _Bad(f"{where}.handle is not hex") from None
    if len(handle) != CUDA_IPC_HANDLE_BYTES:
        raise _Bad(f"{where}.handle has {len(handle)} bytes, not {CUDA_IPC_HANDLE_BYTES}")
    nbytes = buffer.integer("nbytes")
    if nbytes < layout.nbytes:
        raise _Bad(f"{where}: {nbytes} bytes, smaller than the buffer's {layout.nbytes}")
    shared = SharedDeviceMemory(
        buffer.string("device"),
        nbytes,
        buffer.integer("offset"),
        ipc_handle=handle,
        device_id=buffer.string("device_id"),
    )
    return open_ipc_buffer(shared)
