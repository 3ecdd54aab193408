"""aiogguf: load GGUF models into host and GPU memory at hardware speed, asynchronously.

``import aiogguf`` imports the loader and every record a load hands back, so that the
first ``aiogguf.load(...)`` inside a running event loop imports nothing on the loop's
thread (an import there stalls every task of the loop for its whole length). What a load
imports on first use (CuPy, a simulated device's backing) it imports on its own threads.
The optional parts stay out until used: ``aiogguf.server._app`` (aiohttp), ``aiogguf.cli``,
``aiogguf.compat._reader`` (gguf-py), ``aiogguf.testing`` (the benchmark harness), CuPy and torch.

The public API is this module's ``__all__``, ``aiogguf.server._app``, ``aiogguf.compat._reader`` and
``aiogguf.testing``; every other module is internal (its ``__all__`` names what the rest
of the package uses) and may change.
"""

from __future__ import annotations

import gc
import importlib
import sys
from typing import TYPE_CHECKING, Any

if __name__ != "aiogguf":
    # The folder pipeline/ is the package aiogguf; imported by its folder's name (from the
    # repository root, or by an IDE's auto-import) it would be a second copy of every
    # module, whose classes are not the package's (an ``isinstance`` or ``except`` fails).
    raise ImportError(
        f"{__name__!r} is the folder pipeline/ of aiogguf: import it as 'aiogguf' "
        "(install with: pip install -e . --config-settings editable_mode=strict)"
    )

if TYPE_CHECKING:
    from aiogguf._api import LoadHandle as LoadHandle
    from aiogguf._api import WarmUp as WarmUp
    from aiogguf._api import load as load
    from aiogguf._api import load_sync as load_sync
    from aiogguf._api import open_model as open_model
    from aiogguf._api import release_device_memory as release_device_memory
    from aiogguf._api import release_device_memory_sync as release_device_memory_sync
    from aiogguf._api import release_staging as release_staging
    from aiogguf._api import release_staging_sync as release_staging_sync
    from aiogguf._api import warm_up as warm_up
    from aiogguf._api import warm_up_sync as warm_up_sync
    from aiogguf._config import Config as Config
    from aiogguf._core.ready import TensorStream as TensorStream
    from aiogguf._dry_run import inspect as inspect
    from aiogguf._dry_run import inspect_sync as inspect_sync
    from aiogguf._dry_run import plan as plan
    from aiogguf._dry_run import plan_sync as plan_sync
    from aiogguf._events import Progress as Progress
    from aiogguf._model import Model as Model
    from aiogguf._records import LoadMode as LoadMode
    from aiogguf._records import Plan as Plan
    from aiogguf._records import TensorClass as TensorClass
    from aiogguf._records import TensorEntry as TensorEntry
    from aiogguf._records import TensorPlacement as TensorPlacement
    from aiogguf._records import WeightIndex as WeightIndex
    from aiogguf._report import LoadReport as LoadReport
    from aiogguf._report import UploadReport as UploadReport
    from aiogguf.errors import AttachError as AttachError
    from aiogguf.errors import BigEndianError as BigEndianError
    from aiogguf.errors import ClosedResourceError as ClosedResourceError
    from aiogguf.errors import ConfigError as ConfigError
    from aiogguf.errors import GGUFError as GGUFError
    from aiogguf.errors import GGUFFormatError as GGUFFormatError
    from aiogguf.errors import IntegrityError as IntegrityError
    from aiogguf.errors import LoadError as LoadError
    from aiogguf.errors import LoadWarning as LoadWarning
    from aiogguf.errors import ManifestError as ManifestError
    from aiogguf.errors import ManifestMismatchError as ManifestMismatchError
    from aiogguf.errors import PathNotAllowedError as PathNotAllowedError
    from aiogguf.errors import PlacementError as PlacementError
    from aiogguf.errors import SplitError as SplitError
    from aiogguf.errors import TensorFailure as TensorFailure
    from aiogguf.errors import TensorValidationError as TensorValidationError
    from aiogguf.integrity import Manifest as Manifest
    from aiogguf.integrity import VerifyReport as VerifyReport
    from aiogguf.integrity import hash_model as hash_model
    from aiogguf.integrity import hash_model_sync as hash_model_sync
    from aiogguf.integrity import verify_model as verify_model
    from aiogguf.integrity import verify_model_sync as verify_model_sync
    from aiogguf.integrity import verify_sha256 as verify_sha256
    from aiogguf.integrity import verify_sha256_sync as verify_sha256_sync
    from aiogguf.io._devices.base import DeviceKind as DeviceKind
    from aiogguf.io.opener import FileOpener as FileOpener
    from aiogguf.io.opener import RootedOpener as RootedOpener
    from aiogguf.resident import attach as attach
    from aiogguf.resident import attach_sync as attach_sync

# Each public name → the module that defines it (tests/test_exports.py checks that this
# table and the imports above agree).
_EXPORTS: dict[str, str] = {
    "AttachError": "aiogguf.errors",
    "BigEndianError": "aiogguf.errors",
    "ClosedResourceError": "aiogguf.errors",
    "Config": "aiogguf._config",
    "ConfigError": "aiogguf.errors",
    "DeviceKind": "aiogguf.io._devices.base",
    "FileOpener": "aiogguf.io.opener",
    "GGUFError": "aiogguf.errors",
    "GGUFFormatError": "aiogguf.errors",
    "IntegrityError": "aiogguf.errors",
    "LoadError": "aiogguf.errors",
    "LoadHandle": "aiogguf._api",
    "LoadMode": "aiogguf._records",
    "LoadReport": "aiogguf._report",
    "LoadWarning": "aiogguf.errors",
    "ManifestError": "aiogguf.errors",
    "ManifestMismatchError": "aiogguf.errors",
    "Model": "aiogguf._model",
    "PathNotAllowedError": "aiogguf.errors",
    "PlacementError": "aiogguf.errors",
    "Plan": "aiogguf._records",
    "Progress": "aiogguf._events",
    "RootedOpener": "aiogguf.io.opener",
    "SplitError": "aiogguf.errors",
    "TensorClass": "aiogguf._records",
    "TensorEntry": "aiogguf._records",
    "TensorFailure": "aiogguf.errors",
    "TensorPlacement": "aiogguf._records",
    "TensorStream": "aiogguf._core.ready",
    "TensorValidationError": "aiogguf.errors",
    "UploadReport": "aiogguf._report",
    "WarmUp": "aiogguf._api",
    "WeightIndex": "aiogguf._records",
    "inspect": "aiogguf._dry_run",
    "inspect_sync": "aiogguf._dry_run",
    "load": "aiogguf._api",
    "load_sync": "aiogguf._api",
    "open_model": "aiogguf._api",
    "plan": "aiogguf._dry_run",
    "plan_sync": "aiogguf._dry_run",
    "release_device_memory": "aiogguf._api",
    "release_device_memory_sync": "aiogguf._api",
    "release_staging": "aiogguf._api",
    "release_staging_sync": "aiogguf._api",
    "warm_up": "aiogguf._api",
    "warm_up_sync": "aiogguf._api",
    "Manifest": "aiogguf.integrity",
    "VerifyReport": "aiogguf.integrity",
    "hash_model": "aiogguf.integrity",
    "hash_model_sync": "aiogguf.integrity",
    "verify_model": "aiogguf.integrity",
    "verify_model_sync": "aiogguf.integrity",
    "verify_sha256": "aiogguf.integrity",
    "verify_sha256_sync": "aiogguf.integrity",
    "attach": "aiogguf.resident",
    "attach_sync": "aiogguf.resident",
}
# The wings' names are resolved on first use even in a library's process: a load
# without a manifest never needs the integrity wing (``aiogguf._core.assemble`` imports
# it for one that has), and a load never needs the resident wing's attach.
_WINGS = frozenset({"aiogguf.integrity", "aiogguf.resident"})


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiogguf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def _exports_on_demand() -> bool:
    """Whether this process's command line asked for the re-exports on first use.

    The console script's entry (``aiogguf_entry``, beside the package: the one module
    that runs before this one) asks, before ``import aiogguf``: each command imports
    what it needs at its own import, before any loop starts, and ``aiogguf inspect``
    then never waits for the loader's import (0.3 s)."""
    entry = sys.modules.get("aiogguf_entry")
    return bool(getattr(entry, "exports_on_demand", False))


__version__ = "0.1.0"


__all__ = [
    "AttachError",
    "BigEndianError",
    "ClosedResourceError",
    "Config",
    "ConfigError",
    "DeviceKind",
    "FileOpener",
    "GGUFError",
    "GGUFFormatError",
    "IntegrityError",
    "LoadError",
    "LoadHandle",
    "LoadMode",
    "LoadReport",
    "LoadWarning",
    "Manifest",
    "ManifestError",
    "ManifestMismatchError",
    "Model",
    "PathNotAllowedError",
    "PlacementError",
    "Plan",
    "Progress",
    "RootedOpener",
    "SplitError",
    "TensorClass",
    "TensorEntry",
    "TensorFailure",
    "TensorPlacement",
    "TensorStream",
    "TensorValidationError",
    "UploadReport",
    "VerifyReport",
    "WarmUp",
    "WeightIndex",
    "attach",
    "attach_sync",
    "hash_model",
    "hash_model_sync",
    "inspect",
    "inspect_sync",
    "load",
    "load_sync",
    "open_model",
    "plan",
    "plan_sync",
    "release_device_memory",
    "release_device_memory_sync",
    "release_staging",
    "release_staging_sync",
    "verify_model",
    "verify_model_sync",
    "verify_sha256",
    "verify_sha256_sync",
    "warm_up",
    "warm_up_sync",
]

if not _exports_on_demand():
    # A library's process: the loader and every record a load hands back are imported
    # now, so that nothing is imported on a running loop's thread at first use.
    for _name, _module in _EXPORTS.items():
        if _module not in _WINGS:
            globals()[_name] = getattr(importlib.import_module(_module), _name)
    del _name, _module
    # The imports leave the collector a debt (a full collection is due once enough
    # objects have survived): paid here, at import, rather than by a first load's
    # thread while the loop waits for the GIL it holds.
    gc.collect()
