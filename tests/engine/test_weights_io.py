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


def test_the_seeded_file_streamed_as_it_is_generated_is_the_file_save_writes(tmp_path: Path) -> None:
    import io

    from safetensors.torch import load

    from qualify.engine.config import EngineConfig
    from qualify.engine.model import HybridModel
    from qualify.engine.weights import generate, write_seeded

    cfg = EngineConfig(preset="tiny", device="cpu", dtype="bfloat16")
    meta = {"seed": "5", "preset": "tiny"}
    model = HybridModel(cfg, torch.device("cpu"))
    save(generate(model, 5), tmp_path / "w.safetensors", meta)
    want = (tmp_path / "w.safetensors").read_bytes()
    out = io.BytesIO()
    n = write_seeded(HybridModel(cfg, torch.device("meta")), 5, out, torch.device("cpu"), meta)
    assert (
        len({p.dtype for p in model.parameters()}) > 1
    )  # bf16 beside fp32: the library's order across dtypes
    assert out.getvalue() == want and n == len(want)
    assert set(load(out.getvalue())) == {name for name, _ in model.named_parameters()}


def test_the_background_save_writes_the_bytes_save_writes(tmp_path: Path) -> None:
    from qualify.engine.config import EngineConfig
    from qualify.engine.model import HybridModel
    from qualify.engine.weights import generate, save_streamed

    cfg = EngineConfig(preset="tiny", device="cpu", dtype="bfloat16")
    meta = {"seed": "9", "preset": "tiny"}
    state = generate(HybridModel(cfg, torch.device("cpu")), 9)
    save(state, tmp_path / "a.safetensors", meta)
    save_streamed(state, tmp_path / "b.safetensors", meta)
    assert (tmp_path / "b.safetensors").read_bytes() == (tmp_path / "a.safetensors").read_bytes()
    assert not list(tmp_path.glob("*.tmp*"))
    state[next(iter(state))].view(-1)[0] += 1  # a changed tensor: other bytes
    save_streamed(state, tmp_path / "b.safetensors", meta)
    assert (tmp_path / "b.safetensors").read_bytes() != (tmp_path / "a.safetensors").read_bytes()


def _stream(tmp_path: Path, data: bytes) -> tuple[str, int]:
    import io

    from qualify.launch.local import receive_weights

    tmp = tmp_path / "w.tmp"
    tmp.unlink(missing_ok=True)
    return receive_weights(io.BufferedReader(io.BytesIO(data)), tmp)


def test_the_harness_keeps_exactly_the_file_the_stream_declares(tmp_path: Path) -> None:
    import io

    from qualify.launch.local import receive_weights

    state = _state()
    save(state, tmp_path / "w.safetensors", {"seed": "1"})
    data = (tmp_path / "w.safetensors").read_bytes()
    digest, n = _stream(tmp_path, data)
    assert digest == hashlib.sha256(data).hexdigest() and n == len(data)
    times: dict[str, float] = {}  # where the stream's seconds went, as the seeding's evidence records them
    (tmp_path / "w.tmp").unlink()
    assert receive_weights(io.BufferedReader(io.BytesIO(data)), tmp_path / "w.tmp", times) == (digest, n)
    assert set(times) == {"read", "hash", "write"} and all(v >= 0 for v in times.values())
    assert (tmp_path / "w.tmp").read_bytes() == data
    for bad, why in (
        (data[:-1], "ended after"),  # short: the step died mid-tensor
        (data + b"x", "past the end"),  # more than the header declares
        (b"\x00" * 8 + data[8:], "header is 0 bytes"),
        ((5).to_bytes(8, "little") + b"notjs", "not a safetensors header"),
        ((200 << 20).to_bytes(8, "little"), "header is"),
    ):
        with pytest.raises(ValueError, match=why):
            _stream(tmp_path, bad)


def test_a_stream_of_many_blocks_is_hashed_and_written_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each block is hashed and written on threads of their own while the next is read: the digest and the
    file are still the stream's bytes in order, over many blocks and a last one shorter than the rest."""
    from qualify.launch import local

    monkeypatch.setattr(local, "COPY_BLOCK", 64)
    g = torch.Generator().manual_seed(5)
    state = {f"p{i}.weight": torch.randn(97 + i, generator=g) for i in range(8)}
    save(state, tmp_path / "w.safetensors", {"seed": "5"})
    data = (tmp_path / "w.safetensors").read_bytes()
    assert len(data) > 50 * 64
    digest, n = _stream(tmp_path, data)
    assert digest == hashlib.sha256(data).hexdigest() and n == len(data)
    assert (tmp_path / "w.tmp").read_bytes() == data


def test_an_unsandboxed_launcher_seeds_through_the_stream_and_hashes_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qualify.launch import local
    from qualify.launch.base import EngineOptions
    from qualify.launch.sandbox import DigestCache

    monkeypatch.setenv("QUALIFY_CACHE_DIR", str(tmp_path / "cache"))
    launcher = local.LocalLauncher(
        EngineOptions("tiny", "torch", extra_args=("--device", "cpu")), tmp_path / "run", sandbox=None
    )
    planned = launcher.plan_weights()
    handed = launcher.prepare_weights(120)
    assert handed is not None and str(handed.path) == planned
    assert handed.path.stat().st_mode & 0o777 == 0o444
    data = handed.path.read_bytes()
    assert handed.digest == "sha256:" + hashlib.sha256(data).hexdigest() and handed.bytes == len(data)
    digests = DigestCache(tmp_path / "cache" / "weights-digests.json")
    assert "sha256:" + str(digests.lookup(str(handed.path), handed.path.stat())) == handed.digest
    phases = launcher.weights_phases
    assert {"seeding_step", "kept_after_step", "stream_read", "stream_hash", "stream_write"} <= set(phases)
    # the stream's stages ran beside each other: none took longer than the step that fed them
    assert max(phases[f"stream_{k}"] for k in ("hash", "write")) <= phases["seeding_step"] + 0.5
    assert not list(handed.path.parent.glob("*.tmp*")) and not (tmp_path / "run" / "weights-step").exists()
    # the file is the one `save` writes for these weights
    from qualify.engine.config import EngineConfig
    from qualify.engine.model import HybridModel
    from qualify.engine.weights import generate

    model = HybridModel(EngineConfig(preset="tiny", device="cpu"), torch.device("cpu"))
    save(generate(model, 0), tmp_path / "want.safetensors", {"seed": "0", "preset": "tiny"})
    assert data == (tmp_path / "want.safetensors").read_bytes()


def test_a_seeding_step_that_dies_mid_stream_keeps_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys

    from qualify.launch import local
    from qualify.launch.base import EngineOptions

    monkeypatch.setenv("QUALIFY_CACHE_DIR", str(tmp_path / "cache"))
    launcher = local.LocalLauncher(EngineOptions("tiny", "torch"), tmp_path / "run", sandbox=None)
    cached = Path(launcher.plan_weights())

    def popen(argv, scratch, env, **kw):  # writes a header and half a tensor, then dies
        fd = int(argv[argv.index("--out-fd") + 1])
        head = b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
        code = (
            f"import os; os.write({fd}, {len(head).to_bytes(8, 'little') + head + bytes(8)!r}); os._exit(9)"
        )
        return subprocess.Popen([sys.executable, "-c", code], pass_fds=kw["pass_fds"]), None

    monkeypatch.setattr(launcher, "_popen", popen)
    with pytest.raises(RuntimeError, match="could not seed"):
        launcher.prepare_weights(60)
    assert not cached.exists() and not list(cached.parent.glob("*"))


def test_an_engine_told_to_wait_loads_a_file_that_appears_later_and_refuses_one_that_never_does(
    tmp_path: Path,
) -> None:
    """The launch document's weights.wait_s (the harness still seeding the file when the engine starts):
    the file renamed into place while the engine waits is loaded; past the wait, a missing file is the
    refusal it always was, saying it waited."""
    import threading

    from qualify.engine.config import EngineConfig
    from qualify.engine.model import HybridModel
    from qualify.engine.weights import WeightsError, ensure_weights, generate

    model = HybridModel(EngineConfig(preset="tiny", device="cpu"), torch.device("cpu"))
    state = generate(model, 4)
    save(state, tmp_path / "made.safetensors", {"seed": "4", "preset": "tiny"})
    path = tmp_path / "handed" / "w.safetensors"
    path.parent.mkdir()
    cfg = EngineConfig(preset="tiny", device="cpu", weights=str(path), weights_wait_s=30.0)
    later = threading.Timer(0.5, lambda: (tmp_path / "made.safetensors").rename(path))
    later.start()
    try:
        assert ensure_weights(model, cfg) == path
    finally:
        later.cancel()
    assert all(torch.equal(p, state[n]) for n, p in model.state_dict().items() if n in state)
    gone = EngineConfig(preset="tiny", device="cpu", weights=str(tmp_path / "never.safetensors"),
                        weights_wait_s=0.3)  # fmt: skip
    with pytest.raises(WeightsError, match="does not exist after waiting 0.3 s"):
        ensure_weights(model, gone)
