"""An HTTP load server (the ``server`` extra: aiohttp): ``create_app`` to mount in an
aiohttp application, ``serve`` to run one alone (``aiogguf serve``). docs/server.md."""

from aiogguf.server._app import LimiterStats as LimiterStats
from aiogguf.server._app import LoaderRegistry as LoaderRegistry
from aiogguf.server._app import LoadLimiter as LoadLimiter
from aiogguf.server._app import LoadState as LoadState
from aiogguf.server._app import RemoteAccess as RemoteAccess
from aiogguf.server._app import ServerPolicy as ServerPolicy
from aiogguf.server._app import create_app as create_app
from aiogguf.server._app import registry_of as registry_of
from aiogguf.server._app import serve as serve

__all__ = [
    "LimiterStats",
    "LoadLimiter",
    "LoadState",
    "LoaderRegistry",
    "RemoteAccess",
    "ServerPolicy",
    "create_app",
    "registry_of",
    "serve",
]
