"""The benchmarks' shared timing schedule (every contender once per round, the order rotating) and the
provenance every committed result carries."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import _common
from bench._common import interleaved_medians, write_result


def test_contenders_take_turns_first_and_each_measure_is_the_median_of_all_rounds() -> None:
    order: list[str] = []

    def contender(name: str, value: float):
        def measure() -> dict[str, list[float]]:
            order.append(name)
            return {"single": [value, value + 2 * len(order)], "streamed": [value]}

        return measure

    result = interleaved_medians({"a": contender("a", 1.0), "b": contender("b", 10.0)}, rounds=4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    # a's single samples: 1, 3 | 1, 9 | 1, 11 | 1, 17 -> median of eight is (1 + 3) / 2.
    assert result["a"] == {"single": 2.0, "streamed": 1.0}
    assert result["b"] == {"single": 12.0, "streamed": 10.0}  # 10 x4, 14, 16, 22, 24


RESULTS = sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*.json"))


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_each_result_names_the_commit_and_the_committed_script_that_wrote_it(path: Path) -> None:
    root = path.parents[2]
    prov = json.loads(path.read_text())["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}", prov["commit"] or ""), prov.get("commit")
    assert prov.get("modified") is not True  # written by committed code, not a working copy's edits
    assert prov["script"].startswith("bench/") and (root / prov["script"]).is_file()
    assert prov["command"].startswith(f"python {prov['script']}")
    assert {"date", "device", "versions"} <= set(prov)


def test_a_written_result_is_headed_by_its_provenance(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BENCH_COMMAND", "scripts/gpu-check kda")
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    out = tmp_path / "r.json"
    write_result({"x": 1}, str(out))
    data = json.loads(out.read_text())
    assert list(data) == ["provenance", "x"]
    prov = data["provenance"]
    assert prov["invoked_by"] == "scripts/gpu-check kda"
    assert prov["commit_source"] in ("git", "BENCH_COMMIT")
    assert set(prov["versions"]) == {"python", "torch", "triton", "fla", "b12x"}


def test_a_partial_result_is_written_without_being_printed(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    write_result({"x": 1, "complete": False}, str(out), echo=False)
    assert capsys.readouterr().out == ""
    assert json.loads(out.read_text())["complete"] is False
    write_result({"x": 1, "complete": True}, str(out))
    assert json.loads(capsys.readouterr().out)["complete"] is True


def test_provenance_takes_the_commit_from_bench_commit_before_any_enclosing_checkout(monkeypatch) -> None:
    # On the GPU machine the tree is a copy inside another checkout, whose HEAD is not this code's.
    monkeypatch.setattr(
        _common, "_git", lambda *args: "/elsewhere" if "--show-toplevel" in args else "b" * 40
    )
    monkeypatch.setenv("BENCH_COMMIT", "a" * 40)
    prov = _common.provenance(["bench/kda.py", "--quick"])
    assert prov["commit"] == "a" * 40 and prov["commit_source"] == "BENCH_COMMIT"
    assert prov["script"] == "bench/kda.py" and prov["command"] == "python bench/kda.py --quick"


def test_provenance_names_no_commit_from_a_checkout_rooted_elsewhere(monkeypatch) -> None:
    monkeypatch.setattr(
        _common, "_git", lambda *args: "/elsewhere" if "--show-toplevel" in args else "b" * 40
    )
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    assert _common.commit()["commit"] is None


def test_a_decode_step_must_read_every_used_weight_once_one_embedding_row_the_states_and_the_kv() -> None:
    from bench.graphs import step_bytes
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine

    e = Engine(EngineConfig(preset="tiny", device="cpu"))
    try:
        s, m = e.cfg.shape, e.model
        need = step_bytes(e, context_tokens=10)
        params = {id(p) for p in m.mtp.parameters()} | {id(p) for p in m.embed.parameters()}
        used = sum(p.numel() * p.element_size() for p in m.parameters() if id(p) not in params)
        assert need["weights"] == used + s.hidden * m.embed.weight.element_size()
        assert need["kda_state"] == e.cfg.layer_pattern.count("K") * s.kda_heads * s.kda_head_dim**2 * 4
        kv_row = 2 * s.attn_kv_heads * s.attn_head_dim * m.embed.weight.element_size()  # K and V, model dtype
        assert need["kv"] == e.cfg.layer_pattern.count("A") * 10 * kv_row
        assert need["total"] == need["weights"] + need["kda_state"] + need["kv"]
        # A step of 32 requests reads the weights once, but 32 embedding rows, states and KV histories.
        wide = step_bytes(e, context_tokens=10, batch=32)
        assert wide["weights"] == used + 32 * s.hidden * m.embed.weight.element_size()
        assert wide["kda_state"] == 32 * need["kda_state"] and wide["kv"] == 32 * need["kv"]
        assert wide["total"] == wide["weights"] + wide["kda_state"] + wide["kv"]
    finally:
        e.close()


def test_a_steps_launches_are_told_apart_in_order_and_summed_by_name() -> None:
    gpu = pytest.importorskip("bench._gpu")
    # two replays of a three-launch step, the profiler's events out of order: launch 1 and 2 share a name
    step = [("norm", 2.0), ("linear", 10.0), ("linear", 20.0)]
    events = [(name, 100.0 * c + i, us + c) for c in range(2) for i, (name, us) in enumerate(step)]
    events.reverse()
    assert gpu.launch_sequence(events, 2) == [
        {"i": 0, "kernel": "norm", "us": 2.5},
        {"i": 1, "kernel": "linear", "us": 10.5},
        {"i": 2, "kernel": "linear", "us": 20.5},
    ]
    assert gpu.breakdown(events, 2) == [
        {"kernel": "linear", "us_per_call": 31.0, "launches_per_call": 2.0},
        {"kernel": "norm", "us_per_call": 2.5, "launches_per_call": 1.0},
    ]
    with pytest.raises(ValueError, match="do not split into 2 equal calls"):
        gpu.launch_sequence(events[1:], 2)
    swapped = [
        (("norm" if n == "linear" else "linear") if t >= 100 and t < 102 else n, t, us) for n, t, us in events
    ]
    with pytest.raises(ValueError, match="launch 0 differs between calls"):
        gpu.launch_sequence(swapped, 2)


def test_a_variant_runs_with_its_settings_and_leaves_the_module_as_it_was() -> None:
    import types

    mod = types.SimpleNamespace(A=1, B="x")
    seen = []
    call = _common.with_settings(mod, {"A": 2, "B": "y"}, lambda: seen.append((mod.A, mod.B)) or "out")
    assert call() == "out" and seen == [(2, "y")] and (mod.A, mod.B) == (1, "x")

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _common.with_settings(mod, {"A": 3}, fails)()
    assert mod.A == 1
