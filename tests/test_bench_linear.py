"""bench/linear.py's choice of launch shape per weight shape, on synthetic timings: the least time at
1 row among the shapes no slower than the module's at 32, and whether linear_small should serve the shape
(the folded launch against the unfused kernels plus cuBLAS where the step folds some); and its wrong-result
guard."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
lb = pytest.importorskip("bench.linear")

NAME, N, K, _ = lb.SHAPES[2]  # mlp down: the step folds the residual add and the next norm into it
A, B = lb.SWEEP[0], lb.SWEEP[1]


def _case(M: int, us: dict[str, float], cublas: float) -> dict:
    timings = {k: {"us": v, "us_streamed": v} for k, v in us.items()}
    timings["cublas"] = {"us": cublas, "us_streamed": cublas}
    best = min(us, key=us.get)
    return {"case": NAME, "N": N, "K": K, "M": M, "timings": timings, "best_vs_cublas": cublas / us[best]}


def _fold(M: int, folded: float, two: float) -> dict:
    us = {"unfused_cublas": two, "unfused_ours": two + 1, "folded_module": folded, "folded_best": folded}
    return {"case": NAME, "M": M, "us_streamed": us, "folded_vs_unfused": two / folded}


def test_the_fastest_shape_at_one_row_that_does_not_lose_at_32_rows_is_picked() -> None:
    # B is faster at 1 row but slower than the module's launch at 32 rows: A is picked
    one = _case(1, {"ours": 20.0, lb.label(A): 19.0, lb.label(B): 18.0}, cublas=22.0)
    wide = _case(32, {"ours": 21.0, lb.label(A): 20.5, lb.label(B): 23.0}, cublas=22.0)
    got = lb.suggest([one, wide], [_fold(1, 18.5, 21.0), _fold(32, 20.0, 23.0)])[f"{N}x{K}"]
    assert got["launch_shape"] == list(A) and got["us_at_1"] == 19.0 and got["us_at_32"] == 20.5
    assert got["serve"] is True


def test_a_shape_is_not_served_where_the_fold_loses_to_the_two_launch_path_at_either_row_count() -> None:
    one = _case(1, {"ours": 20.0}, cublas=22.0)
    wide = _case(32, {"ours": 21.0}, cublas=19.0)
    got = lb.suggest([one, wide], [_fold(1, 19.0, 22.0), _fold(32, 24.0, 21.0)])[f"{N}x{K}"]
    assert got["launch_shape"] == list(lb.fused.launch_shape(N, K))  # "ours" is the module's own
    assert got["serve"] is False and got["faster_than_cublas_path_at"] == {"1": True, "32": False}


def test_a_wrong_or_failing_contender_is_reported_not_timed() -> None:
    want = torch.ones(2, 3)

    def fails():
        raise RuntimeError("no such launch shape\nmore")

    errors = lb._checked({"right": lambda: want + 0.01, "wrong": lambda: want * 2, "fails": fails}, want)
    assert set(errors) == {"wrong", "fails"}
    assert errors["fails"] == "RuntimeError: no such launch shape"
    # a contender with an output of its own (linear_add_norm's (s, u, sq): s is checked) is held to it
    own = {"s": lambda: (want + 1, want, want), "t": lambda: (want, want + 1)}
    assert set(lb._checked(own, want, {"s": want + 1, "t": want + 1})) == {"t"}


def test_a_fold_sweep_times_each_shape_once_and_names_the_fastest() -> None:
    module, best = lb.SWEEP[3], lb.SWEEP[5]
    shapes = lb.fold_shapes(module, best, lb.SWEEP)
    assert shapes["module"] == tuple(module) and shapes["best"] == tuple(best)
    assert len(shapes) == len(lb.SWEEP)  # the module's and the best shape are not timed twice
    assert sorted(map(tuple, shapes.values())) == sorted(map(tuple, lb.SWEEP))
    assert lb.fold_shapes(module, best) == {"module": tuple(module), "best": tuple(best)}
    name = lb.label(lb.SWEEP[7]).removeprefix("ours_")
    us = {"unfused_cublas": 9.0, "folded_module": 10.0, "folded_best": 9.5, f"folded_{name}": 8.25}
    assert lb.fastest_folded(us, shapes) == {
        "name": name, "launch_shape": list(lb.SWEEP[7]), "us_streamed": 8.25,
    }  # fmt: skip
    assert lb.fastest_folded({"unfused_cublas": 9.0}, shapes) is None


def test_fold_kinds_select_the_cases_whose_launch_folds_them() -> None:
    assert [c[0] for c in lb.cases_to_run(None, ["add_norm"])] == ["mlp down", "out_proj / o_proj"]
    assert [c[0] for c in lb.cases_to_run(["mlp down"], ["norm"])] == []
    assert lb.cases_to_run(None, None) == list(lb.SHAPES)


def _swept(M: int, us: dict[tuple, float]) -> dict:
    """A fold record of the add_norm fold at mlp down, timed at the module's shape (A) and others."""
    shapes = {"module": A, **{lb.label(c).removeprefix("ours_"): c for c in us if c != A}}
    timed = {f"folded_{k}": us[tuple(c)] for k, c in shapes.items()}
    return {"case": NAME, "M": M, "fold": "add_norm", "launch_shapes": shapes, "us_streamed": timed}


def test_a_kind_shape_is_suggested_where_the_fold_is_faster_at_one_row_and_no_slower_at_32() -> None:
    C = lb.SWEEP[9]
    # B wins at 1 row but loses to the module's shape at 32; C is faster at 1 and no slower at 32
    one = _swept(1, {A: 20.0, B: 16.0, C: 17.0})
    wide = _swept(32, {A: 22.0, B: 23.0, C: 22.0})
    got = lb.suggest_kinds([one, wide])[f"add_norm {N}x{K}"]
    assert got["launch_shape"] == list(C) and got["differs"] is True
    assert got["us_at_1"] == 17.0 and got["module_us_at_1"] == 20.0 and got["gain_at_1"] == round(20 / 17, 3)
    # where the module's shape is as fast as any, it stays (no table entry to add)
    tie = lb.suggest_kinds([_swept(1, {A: 17.0, C: 17.0}), _swept(32, {A: 22.0, C: 22.0})])
    assert tie[f"add_norm {N}x{K}"]["differs"] is False
    assert lb.suggest_kinds([wide]) == {}  # nothing timed at 1 row: nothing suggested
