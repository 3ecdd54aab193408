"""Property: for any layer count, -ngl, device count and split, layers land in contiguous
blocks in device order, the CPU holds exactly the first ``i_gpu_start`` layers, and each
device's share of the offloaded layers matches its fraction to within one layer."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic_index import build_index

from aiogguf._config import Config
from aiogguf.io._devices import CpuDevice, SimDevice
from aiogguf.stages.plan import make_plan

GiB = 1024**3
HOST_FREE = 64 * GiB

memory_st = st.one_of(
    st.just((0, 0)),  # a device that cannot tell: host memory stands in
    st.integers(min_value=0, max_value=200 * GiB).map(lambda f: (f, max(f, 1))),
)


@st.composite
def setups(draw: st.DrawFn) -> tuple[int, int, list[tuple[int, int]], tuple[float, ...]]:
    n_layer = draw(st.integers(min_value=0, max_value=160))
    ngl = draw(st.integers(min_value=-1, max_value=n_layer + 4))
    memory = draw(st.lists(memory_st, min_size=0, max_size=6))
    tensor_split = draw(
        st.one_of(
            st.just(()),
            st.lists(
                st.floats(min_value=0.0, max_value=100.0, allow_nan=False),
                min_size=len(memory),
                max_size=len(memory),
            ).map(tuple),
        )
    )
    return n_layer, ngl, memory, tensor_split


@settings(max_examples=200, deadline=None)
@given(setups())
def test_layers_form_blocks_in_device_order(
    setup: tuple[int, int, list[tuple[int, int]], tuple[float, ...]],
) -> None:
    n_layer, ngl, memory, tensor_split = setup
    devices = [CpuDevice(free=HOST_FREE, total=HOST_FREE)] + [
        SimDevice(f"g{i}", free=free, total=total) for i, (free, total) in enumerate(memory)
    ]
    config = Config().with_overrides(n_gpu_layers=ngl, tensor_split=tensor_split)
    plan = make_plan(build_index([], block_count=n_layer), devices, config)

    n_all = n_layer + 1
    assert [a.layer for a in plan.layers] == list(range(n_all))
    names = [a.device for a in plan.layers]
    effective = n_all if ngl < 0 else ngl
    i_gpu_start = max(n_all - effective, 0) if memory else n_all
    assert names[:i_gpu_start] == ["CPU"] * i_gpu_start
    assert "CPU" not in names[i_gpu_start:]

    # Contiguous blocks, in device order.
    order = [int(name[1:]) for name in names[i_gpu_start:]]
    assert order == sorted(order)

    act = n_all - i_gpu_start
    if not act:
        return
    if any(np.float32(x) != 0 for x in tensor_split):  # the reference compares floats
        weights = [float(np.float32(x)) for x in tensor_split]
    else:
        weights = [float(HOST_FREE if m == (0, 0) else m[0]) for m in memory]
    total = sum(weights)
    shares = [w / total for w in weights] if total else [1 / len(memory)] * len(memory)
    for d, share in enumerate(shares):
        count = order.count(d)
        # upper_bound over cumulative fractions gives each device ceil(act*c_d) -
        # ceil(act*c_{d-1}) layers: within one layer of its share (float32 aside).
        assert math.fabs(count - act * share) <= 1.0 + 1e-4 * act, (d, count, act, share)
