"""Layout math (groups, spans, chunk, ratios) and views refused outside their allocation."""

from __future__ import annotations

import pytest
import torch

from qualify.engine.layout import ALIGNMENT, LayoutError, carve, plan_layout


def test_default_layout_is_the_registered_glm_layout():
    spec = plan_layout("KKKAKKKA", 2, 2304, 4)
    assert spec.spans == [2304, 2304, 2304, 9216]
    assert spec.chunk == 9216 and spec.ratios == [4, 4, 4, 1]
    assert [g.layers for g in spec.groups] == [(0, 1), (2, 4), (5, 6), (3, 7)]
    assert [g.kind for g in spec.groups] == ["kda", "kda", "kda", "attention"]


@pytest.mark.parametrize(
    "pattern,group,block,dcp,spans,chunk,ratios",
    [
        ("KKKAKKKA", 2, 2304, 1, [2304] * 4, 2304, [1, 1, 1, 1]),
        ("KKKAKKKA", 2, 2304, 2, [2304, 2304, 2304, 4608], 4608, [2, 2, 2, 1]),
        ("KKKAKKKA", 1, 16, 8, [16] * 6 + [128] * 2, 128, [8] * 6 + [1] * 2),
        ("KKKKKKAAA", 3, 64, 4, [64, 64, 256], 256, [4, 4, 1]),
        ("KAKA", 2, 1000, 3, [1000, 3000], 3000, [3, 1]),
        ("KKKK", 2, 48, 4, [48, 48], 48, [1, 1]),
        ("AA", 1, 8, 6, [48, 48], 48, [1, 1]),
    ],
)
def test_layout_math_across_patterns_blocks_and_dcp(pattern, group, block, dcp, spans, chunk, ratios):
    spec = plan_layout(pattern, group, block, dcp)
    assert spec.spans == spans and spec.chunk == chunk and spec.ratios == ratios
    assert all(r * s == spec.chunk for r, s in zip(spec.ratios, spec.spans, strict=True))


def test_ungroupable_pattern_is_refused():
    with pytest.raises(LayoutError):
        plan_layout("KKKA", 2, 16, 1)


def test_views_inside_an_allocation_alias_it_and_views_outside_are_refused():
    buf = torch.zeros(4 * ALIGNMENT, dtype=torch.uint8)
    v = carve(buf, ALIGNMENT, (ALIGNMENT // 4,), torch.float32)
    v.fill_(1.0)
    assert buf[ALIGNMENT : 2 * ALIGNMENT].any() and not buf[:ALIGNMENT].any()
    for offset, shape in [(3 * ALIGNMENT, (2 * ALIGNMENT,)), (-ALIGNMENT, (4,)), (ALIGNMENT + 4, (4,))]:
        with pytest.raises(LayoutError):
            carve(buf, offset, shape, torch.uint8)


def test_engine_allocations_hold_every_layer_view_inside_one_buffer(tiny_engine):
    for alloc in tiny_engine.allocations:
        lo, hi = alloc.buffer.data_ptr(), alloc.buffer.data_ptr() + alloc.nbytes
        assert len(alloc.views) == 2 * len(alloc.group.layers)
        for view in alloc.views.values():
            start = view.data_ptr()
            assert lo <= start and start + view.numel() * view.element_size() <= hi
            assert (start - lo) % ALIGNMENT == 0
