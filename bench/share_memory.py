"""What clients of a shared model cost the machine's memory (issue 37).

A server process loads a synthetic model of ``--size`` (default 1 GiB) with ``[load]
shareable = true``; ``--clients`` processes (default 3) each open it
(``aiogguf.resident.open_shared_model``, the descriptors over a socketpair) and read a
byte of every page. Printed: the sum of ``Pss`` (``/proc/PID/smaps_rollup``) over the
server and the clients before they open the model (imports done) and after, and the
difference against the model's size. Run it once:

    python bench/share_memory.py [--size 1GiB] [--clients 3] [--mode none] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

_HEADER = struct.Struct("<I")
_CLIENT = r"""
import socket, struct, sys
import numpy as np
from aiogguf.resident import open_shared_model

sock = socket.socket(fileno=int(sys.argv[1]))
sock.sendall(b"r")  # imported: the baseline may be taken
message, fds, _, _ = socket.recv_fds(sock, 4, 64)
(length,) = struct.unpack("<I", message)
description = b""
while len(description) < length:
    description += sock.recv(length - len(description))
model = open_shared_model(description, fds)
total = 0
for name in model.tensors:
    total += int(np.frombuffer(model.raw(name), dtype=np.uint8)[::4096].sum())
sock.sendall(b"t")  # every page read: the second measure may be taken
sock.recv(1)  # until the bench is done
model.close()
"""


def pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss for process {pid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--mode", default="none", choices=["none", "direct", "mmap"])
    parser.add_argument("--dir", default="/var/tmp")
    args = parser.parse_args()

    import aiogguf
    from aiogguf.resident import share_model
    from aiogguf.testing.synth import write_synthetic_model

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = Path(folder) / "model.gguf"
        write_synthetic_model(path, size_bytes=args.size, seed=37, include_q2_0=False)
        clients = []
        for _ in range(args.clients):
            ours, theirs = socket.socketpair()
            process = subprocess.Popen(
                [sys.executable, "-c", _CLIENT, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
            )
            theirs.close()
            clients.append((ours, process))
        try:
            with aiogguf.load_sync(path, mode=args.mode, shareable=True) as model:
                nbytes = model.report.nbytes
                for sock, _ in clients:
                    assert sock.recv(1) == b"r"
                pids = [os.getpid(), *(p.pid for _, p in clients)]
                before = [pss_kib(pid) for pid in pids]
                for sock, _ in clients:
                    with share_model(model) as share:
                        socket.send_fds(sock, [_HEADER.pack(len(share.description))], share.fds)
                        sock.sendall(share.description)
                    assert sock.recv(1) == b"t"
                after = [pss_kib(pid) for pid in pids]
                for sock, _ in clients:
                    sock.sendall(b"x")
        finally:
            for sock, process in clients:
                process.wait(timeout=60)
                sock.close()
    added = (sum(after) - sum(before)) * 1024
    print(f"model: {args.size} synthetic, {nbytes} tensor bytes, mode {args.mode}, shareable")
    print(f"Pss KiB before (server, clients): {before}  sum {sum(before)}")
    print(f"Pss KiB after  (server, clients): {after}  sum {sum(after)}")
    print(
        f"{args.clients} clients added {added / 2**20:.1f} MiB = "
        f"{100 * added / nbytes:.2f}% of the model"
    )


if __name__ == "__main__":
    main()
