"""Seeded weights files: written once, byte-deterministic (canonical header) whatever order the metadata
map comes in, readable by safetensors; the census hashes every parameter (side by side) exactly as one
sha256 of its bytes; the harness's copy into its cache hashes what it writes, and the digest cache then
answers for that file without reading it again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from qualify.engine.weights import checksum, save, snapshot


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "b.weight": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "a.bias": torch.randn(3, generator=g),
        "c.w": torch.randn(2, 2, generator=g).to(torch.float16),
    }


def test_save_is_byte_deterministic_and_readable(tmp_path: Path) -> None:
    state = _state()
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    save(state, one, {"seed": "1", "preset": "tiny", "z": "last"})
    save(dict(reversed(state.items())), two, {"z": "last", "preset": "tiny", "seed": "1"})
    assert one.read_bytes() == two.read_bytes()
    data = one.read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert (8 + n) % 8 == 0
    header = data[8 : 8 + n].rstrip(b" ")
    assert header == json.dumps(json.loads(header), sort_keys=True, separators=(",", ":")).encode()
    back = load_file(str(one))
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())
    assert not list(tmp_path.glob("*.tmp*"))  # written in place by os.replace, nothing left behind


def test_the_census_hashes_each_parameter_as_its_bytes() -> None:
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(12)])
    snap = snapshot(model)
    params = dict(model.named_parameters())
    assert set(snap.checksums) == set(params)
    for name, p in params.items():
        assert snap.checksums[name] == hashlib.sha256(p.detach().numpy().tobytes()).hexdigest()
        assert snap.checksums[name] == checksum(p) and snap.pointers[name] == p.data_ptr()
    with torch.no_grad():
        params["3.weight"][0, 0] += 1.0
    changed = snapshot(model)
    assert [n for n in params if changed.checksums[n] != snap.checksums[n]] == ["3.weight"]
    assert changed.digest != snap.digest


@pytest.mark.parametrize("size", [0, 1, (1 << 24) + 5, 3 << 24])
def test_keep_seeded_hashes_what_it_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    from qualify.launch import local
    from qualify.launch.sandbox import DigestCache

    monkeypatch.setattr(local, "cache_dir", lambda: tmp_path / "cache")
    made, cached = tmp_path / "made.safetensors", tmp_path / "cache" / "weights" / "seeded.safetensors"
    made.write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    digest = local.keep_seeded(made, cached)
    assert digest == hashlib.sha256(made.read_bytes()).hexdigest()
    assert cached.read_bytes() == made.read_bytes() and cached.stat().st_mode & 0o777 == 0o444
    digests = DigestCache(tmp_path / "cache" / "weights-digests.json")
    assert digests.lookup(str(cached), cached.stat()) == digest  # hand_over reads nothing again
    handed = local.hand_over(cached, "/weights/seeded.safetensors", "test")
    assert handed.digest == "sha256:" + digest


def test_reload_state_copies_all_or_nothing() -> None:
    from qualify.engine.weights import WeightsError, reload_state

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    before = snapshot(model)
    state = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    with pytest.raises(WeightsError, match="1.bias"):
        reload_state(model, {k: v for k, v in state.items() if k != "1.bias"})
    with pytest.raises(WeightsError, match="the model wants"):
        reload_state(model, {**state, "0.weight": state["0.weight"].double()})
    assert snapshot(model).checksums == before.checksums  # nothing copied
    old, new = reload_state(model, state)
    assert old.checksums == before.checksums
    assert all(torch.equal(p, state[n]) for n, p in model.named_parameters())
    assert new.pointers == before.pointers
