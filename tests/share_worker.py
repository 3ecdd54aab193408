"""A client process of a shared model (tests/test_share.py): it receives shares over the
Unix socket named by its first argument (a descriptor number inherited from the test),
each as one message of ``struct <II`` (command length, description length) carrying the
descriptors (``SCM_RIGHTS``), then the command and the description. It answers each
with one JSON line on the same socket.

Commands: ``digest`` (open, sha256 of every tensor through ``raw`` and ``torch``, close),
``open`` (open and keep it, answer its digests), ``attach`` (open and keep it, answer
its tensor count: no torch imported, nothing copied), ``write NAME`` (fill the kept model's
tensor NAME through its torch tensor, answer the kept model's digests), ``touch`` (read
every byte of the kept model), ``pss`` (this process's Pss in KiB), ``close``, ``exit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import sys
from typing import Any

import numpy as np

from aiogguf.resident import open_shared_model

_HEADER = struct.Struct("<II")
MAX_FDS = 64


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < nbytes:
        part = sock.recv(min(nbytes - got, 1 << 20))
        if not part:
            raise EOFError("the test closed the socket")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def digests(model: Any) -> dict[str, list[str]]:
    """name → [sha256 of raw, sha256 of the torch tensor's bytes]."""
    import torch

    out: dict[str, list[str]] = {}
    for name in model.tensors:
        raw = hashlib.sha256(bytes(model.raw(name))).hexdigest()
        tensor = model.torch(name).contiguous().reshape(-1).view(torch.uint8)
        through_torch = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
        out[name] = [raw, through_torch]
    return out


def pss_kib() -> int:
    with open("/proc/self/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError("no Pss in smaps_rollup")


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    kept: Any = None
    while True:
        message, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
        if len(message) < _HEADER.size:
            message += _recv_exactly(sock, _HEADER.size - len(message))
        command_len, description_len = _HEADER.unpack(message)
        command = _recv_exactly(sock, command_len).decode()
        description = _recv_exactly(sock, description_len)
        reply: Any
        if command in ("digest", "open", "attach"):
            handed, fds = fds, []  # open_shared_model owns (and closes) them
        try:
            if command == "exit":
                break
            if command == "digest":
                model = open_shared_model(description, handed)
                try:
                    reply = digests(model)
                finally:
                    model.close()
            elif command == "open":
                kept = open_shared_model(description, handed)
                reply = digests(kept)
            elif command == "attach":
                kept = open_shared_model(description, handed)
                reply = len(kept.tensors)
            elif command.startswith("write "):
                import torch

                tensor = kept.torch(command[6:])
                tensor.view(torch.uint8).fill_(0x5A) if tensor.dim() else tensor.fill_(1)
                reply = digests(kept)
            elif command == "touch":
                total = 0
                for name in kept.tensors:
                    total += int(np.frombuffer(kept.raw(name), dtype=np.uint8)[::4096].sum())
                reply = total
            elif command == "pss":
                reply = pss_kib()
            elif command == "close":
                kept.close()
                kept = None
                reply = "closed"
            else:
                reply = {"error": f"unknown command {command!r}"}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd in fds:  # sent with a command that takes none
                try:
                    os.close(fd)
                except OSError:
                    continue
        sock.sendall(json.dumps(reply).encode() + b"\n")


if __name__ == "__main__":
    main()
