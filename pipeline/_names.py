"""What a tensor's name says about its layer (format §3.2), and the most layers a model
may have (§1.10): rules the index and the plan stages share."""

from __future__ import annotations

import re
from typing import Final

__all__ = ["MAX_LAYERS", "layer_number", "layer_of"]

# llama.cpp's LLAMA_MAX_LAYERS (format §1.10): it refuses a model with more. The plan
# makes a record per layer, so a larger ``block_count`` (or ``blk.N``) is refused here,
# before anything loops over the layers: a 2 KB header must not ask for 2^31 of them.
MAX_LAYERS: Final = 512

# The one pattern for a layer number at the start of a tensor's name. Group 1: ``blk.N``
# read like C's sscanf("blk.%d"), so whitespace and a sign may precede the digits (§3.2).
# Group 2: the ``N.`` of the other per-layer prefixes, tensors that llama.cpp creates in
# its layer loop with that index, so they follow layer N's device.
_LAYER = re.compile(r"blk\.\s*([+-]?\d+)|(?:enc\.blk|dec\.blk|posnet|convnext)\.(\d+)\.")


def layer_number(name: str) -> int | None:
    """The layer whose loop iteration creates a tensor: the N of ``blk.N`` (as
    ``layer_of`` reads it), ``enc.blk.N.``, ``dec.blk.N.``, ``posnet.N.`` or
    ``convnext.N.``; else None."""
    match = _LAYER.match(name)
    if match is None:
        return None
    blk, other = match.groups()
    return int(blk if blk is not None else other)


def layer_of(name: str) -> int | None:
    """The N of a leading ``blk.N``, or None when the name does not start with ``blk.``."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match is not None and match.group(1) is not None else None
