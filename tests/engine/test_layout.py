"""Layout math (groups, spans, chunk, ratios) and views refused outside their allocation."""

from __future__ import annotations

import fcntl
import os

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


# ---------------------------------------------------------------- CPU shared-memory lifetime


def _shm_files(pid: int) -> set[str]:
    from qualify.engine.layout import SHM_PREFIX, _shm_dir

    return {n for n in os.listdir(_shm_dir()) if n.startswith(f"{SHM_PREFIX}{pid}-")}


def test_stale_shm_files_of_dead_engines_are_swept_and_live_ones_kept(tmp_path):
    from qualify.engine.layout import SHM_PREFIX, sweep_stale_shm

    dead = tmp_path / f"{SHM_PREFIX}999999-deadbeef0000"
    dead.write_bytes(b"\0" * 64)  # nobody holds its lock: its engine died
    live = tmp_path / f"{SHM_PREFIX}1-0123456789ab"
    live.write_bytes(b"\0" * 64)
    other = tmp_path / "PostgreSQL.12345"  # not ours: never touched
    other.write_bytes(b"x")
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # what a live engine holds for its whole life
        assert sweep_stale_shm(str(tmp_path)) == [dead.name]
        assert live.exists() and other.exists() and not dead.exists()
    finally:
        os.close(fd)
    assert sweep_stale_shm(str(tmp_path)) == [live.name]  # its owner is gone now


@pytest.mark.serial
def test_an_engine_leaves_no_shm_files_after_close_or_a_failed_boot(_engine_home, tmp_path):
    from qualify.engine.weights import WeightsError
    from tests.engine.conftest import make_engine

    before = _shm_files(os.getpid())
    e = make_engine(max_model_len=64)
    mine = _shm_files(os.getpid()) - before
    assert len(mine) == len(e.allocations) == 4
    e.close()
    e.close()  # idempotent
    assert _shm_files(os.getpid()) == before
    with pytest.raises(WeightsError, match="does not exist"):
        make_engine(max_model_len=64, weights=str(tmp_path / "missing.safetensors"))
    assert _shm_files(os.getpid()) == before  # the failed boot released what it had allocated


def test_spans_come_from_one_place():
    from qualify.engine.config import EngineConfig
    from qualify.engine.layout import group_span
    from qualify.engine.model.attention import DcpGeometry

    cfg = EngineConfig(device="cpu", block_size=48, dcp_size=3, interleave=4)
    spec = plan_layout(cfg.layer_pattern, cfg.group_size, cfg.block_size, cfg.dcp_size)
    geom = DcpGeometry(
        cfg.block_size, cfg.dcp_size, cfg.interleave, cfg.max_model_len, cfg.max_blocks_per_seq
    )
    assert cfg.attention_span == geom.span == spec.spans[-1] == group_span("attention", 48, 3) == 144
    assert spec.spans[0] == group_span("kda", 48, 3) == 48
    with pytest.raises(LayoutError, match="unknown group kind"):
        group_span("mamba", 48, 3)
