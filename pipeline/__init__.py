"""aiogguf: load GGUF models into host and GPU memory at hardware speed, asynchronously.

The names below are imported when first used (PEP 562), so that importing one module of
the package (``aiogguf.io.files``, ``aiogguf.errors``) does not import the engine, every
stage and numpy's users with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiogguf.api import LoadHandle as LoadHandle
    from aiogguf.api import WarmUp as WarmUp
    from aiogguf.api import load as load
    from aiogguf.api import load_sync as load_sync
    from aiogguf.api import release_device_memory as release_device_memory
    from aiogguf.api import release_device_memory_sync as release_device_memory_sync
    from aiogguf.api import release_staging as release_staging
    from aiogguf.api import release_staging_sync as release_staging_sync
    from aiogguf.api import warm_up as warm_up
    from aiogguf.api import warm_up_sync as warm_up_sync
    from aiogguf.config import Config as Config
    from aiogguf.errors import BigEndianError as BigEndianError
    from aiogguf.errors import ClosedResourceError as ClosedResourceError
    from aiogguf.errors import ConfigError as ConfigError
    from aiogguf.errors import GGUFError as GGUFError
    from aiogguf.errors import GGUFFormatError as GGUFFormatError
    from aiogguf.errors import LoadError as LoadError
    from aiogguf.errors import LoadWarning as LoadWarning
    from aiogguf.errors import PathNotAllowedError as PathNotAllowedError
    from aiogguf.errors import PlacementError as PlacementError
    from aiogguf.errors import SplitError as SplitError
    from aiogguf.errors import TensorFailure as TensorFailure
    from aiogguf.errors import TensorValidationError as TensorValidationError
    from aiogguf.events import Progress as Progress
    from aiogguf.model import Model as Model
    from aiogguf.report import LoadReport as LoadReport
    from aiogguf.report import UploadReport as UploadReport

__version__ = "0.1.0"

# Public name → the module that defines it.
_EXPORTS: dict[str, str] = {
    "BigEndianError": "aiogguf.errors",
    "ClosedResourceError": "aiogguf.errors",
    "Config": "aiogguf.config",
    "ConfigError": "aiogguf.errors",
    "GGUFError": "aiogguf.errors",
    "GGUFFormatError": "aiogguf.errors",
    "LoadError": "aiogguf.errors",
    "LoadHandle": "aiogguf.api",
    "LoadReport": "aiogguf.report",
    "LoadWarning": "aiogguf.errors",
    "Model": "aiogguf.model",
    "PathNotAllowedError": "aiogguf.errors",
    "PlacementError": "aiogguf.errors",
    "Progress": "aiogguf.events",
    "SplitError": "aiogguf.errors",
    "TensorFailure": "aiogguf.errors",
    "TensorValidationError": "aiogguf.errors",
    "UploadReport": "aiogguf.report",
    "WarmUp": "aiogguf.api",
    "load": "aiogguf.api",
    "load_sync": "aiogguf.api",
    "release_device_memory": "aiogguf.api",
    "release_device_memory_sync": "aiogguf.api",
    "release_staging": "aiogguf.api",
    "release_staging_sync": "aiogguf.api",
    "warm_up": "aiogguf.api",
    "warm_up_sync": "aiogguf.api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiogguf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
