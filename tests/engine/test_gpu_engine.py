"""The proxy preset on a CUDA device (run on an H200 by scripts/gpu-check): boots, registers the layout
through CUDA IPC with the peer process, generates, reloads in place. Records boot time and tokens/s."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from qualify.run.geometry import GEOMETRY

pytestmark = pytest.mark.gpu
GEOMETRY_PROXY_GPU = GEOMETRY["proxy"].for_peer(0, "gpu")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


@pytest.fixture(scope="module")
def proxy_engine(_engine_home):
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine

    t0 = time.perf_counter()
    e = Engine(EngineConfig(preset="proxy", device="cuda"))
    e.first_boot_wall = time.perf_counter() - t0
    yield e
    e.close()


def _tokens_per_second(engine, batch: int, new_tokens: int) -> float:
    prompts = [[256, *f"request {i}: the hybrid engine decodes".encode()] for i in range(batch)]
    engine.generate(prompts, 4)  # warm-up (Triton compiles, allocator settles)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gens, _ = engine.generate(prompts, new_tokens)
    torch.cuda.synchronize()
    return sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0)


def test_proxy_boots_registers_layout_over_cuda_ipc_generates_and_reloads(proxy_engine, record_property):
    from qualify.engine import kv_export
    from qualify.engine.config import EngineConfig
    from qualify.engine.engine import Engine
    from tests.engine.test_peer import peer_process

    e = proxy_engine
    assert e.resolution.name == "triton", e.resolution
    d = e.describe()
    assert d["layout"]["spans"] == [2304, 2304, 2304, 9216] and d["layout"]["ratios"] == [4, 4, 4, 1]
    assert {g["handle_kind"] for g in d["layout"]["groups"]} == {"cuda-ipc"}

    t_peer = time.perf_counter()
    report = peer_process(e, GEOMETRY_PROXY_GPU)  # CUDA IPC into a process of its own
    peer = {"seconds": time.perf_counter() - t_peer}
    assert report["error"] is None and report["spans"] == [2304, 2304, 2304, 9216], report
    for g in report["groups"]:
        assert g["size_ok"] and g["views_differ"] is None and g["engine_pattern_ok"], g
        assert g["device_ok"] and g["out_of_bounds_refused"], g
        w = g["written"]
        assert kv_export.kv_echo(e, g["name"], w["offset"], w["length"])["sha256"] == w["sha256"]

    probe = e.probe()
    assert "kda::triton" in probe["kernel_names"]
    assert any("kda_decode" in n for n in probe["kernel_names"]), probe["kernel_names"]

    prompts = [[256, *b"The quick brown fox"], [256, *b"hybrid attention"]]
    first = [g.token_ids for g in e.generate(prompts, 16)[0]]
    assert [g.token_ids for g in e.generate(prompts, 16)[0]] == first

    tps1 = _tokens_per_second(e, 1, 64)
    tps8 = _tokens_per_second(e, 8, 64)

    params = {n: p.data_ptr() for n, p in e.model.named_parameters()}
    same = e.reload()
    assert same["census"]["addresses_unchanged"] and same["census"]["changed"] == []
    assert [g.token_ids for g in e.generate(prompts, 16)[0]] == first
    original = e.weights_path
    new = e.reload(seed=99)
    assert new["census"]["addresses_unchanged"] and new["census"]["arena_addresses_unchanged"]
    assert [g.token_ids for g in e.generate(prompts, 16)[0]] != first
    back = e.reload(path=str(original))
    assert {n: p.data_ptr() for n, p in e.model.named_parameters()} == params
    assert [g.token_ids for g in e.generate(prompts, 16)[0]] == first

    t0 = time.perf_counter()
    warm = Engine(EngineConfig(preset="proxy", device="cuda"))  # weights already on disk: a warm boot
    warm_boot = time.perf_counter() - t0
    warm.close()
    del warm

    result = {
        "device": torch.cuda.get_device_name(),
        "first_boot_s": round(e.first_boot_wall, 3),
        "warm_boot_s": round(warm_boot, 3),
        "peer_verify_s": round(peer["seconds"], 3),
        "tokens_per_s_batch1": round(tps1, 1),
        "tokens_per_s_batch8": round(tps8, 1),
        "reload_same_s": round(same["seconds"], 3),
        "reload_new_s": round(new["seconds"], 3),
        "reload_back_s": round(back["seconds"], 3),
        "params": same["census"]["params"],
    }
    for k, v in result.items():
        record_property(k, v)
    print("QUALIFY_GPU_ENGINE " + json.dumps(result))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_engine.json"), "w") as f:
            json.dump(result, f, indent=2)


def test_the_proxys_batched_prefill_gives_a_prompt_the_bits_it_has_alone(proxy_engine):
    """On the GPU (bf16, the real kernels): a prompt's logits and last hidden state from the batched,
    row-invariant prefill equal its prefill alone bit for bit, wherever it sits among fillers of other
    lengths; one plain varlen forward over the same batch (cuBLAS's products) is what moved them."""
    from tests.engine.conftest import prefill_row

    r = proxy_engine.runner
    prompt = [256, *b"a prompt the harness compares across batches"]
    fillers = [[256, *f"filler {i}: {'words ' * (3 * i + 1)}".encode()] for i in range(7)]

    alone, h_alone = prefill_row(r, [prompt], 0)
    moved = 0.0
    for at, n in ((0, 1), (1, 3), (3, 7), (7, 7)):
        batch = [*fillers[:at], prompt, *fillers[at:n]]
        got, h_got = prefill_row(r, batch, at)
        assert torch.equal(got, alone) and torch.equal(h_got, h_alone), (at, n)
        plain, _ = prefill_row(r, batch, at, one_forward=True)
        moved = max(moved, float((plain - alone).abs().max()))
    print(f"plain batched prefill moved the logits by up to {moved:.4f}")
