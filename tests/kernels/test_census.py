"""The reload census's device digest (kernels/census.py): the kernel's block words equal the numpy
reference at sizes around its blocks (run under Triton's interpreter on CPU tensors, in a process of its own:
nothing here sets TRITON_INTERPRET in this one), and the digest moves with any one byte, with two bytes
exchanged, and with the byte count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from kernels import census

ROOT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import json, sys
import numpy as np, torch
from kernels import census
rng = np.random.default_rng(7)
sizes = [0, 1, 7, 1000, census.BLOCK, census.BLOCK + 5, 3 * census.BLOCK + 17]
tensors = [torch.frombuffer(bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) or bytearray(1),
                            dtype=torch.uint8)[:n] for n in sizes]
tensors.append(torch.arange(-50, 51, dtype=torch.float32).to(torch.bfloat16))  # 101 bf16: 202 bytes
words = torch.full((census.words_needed([t.numel() * t.element_size() for t in tensors]) + 3,), -1,
                   dtype=torch.int64)
got = census.digests(tensors, words)
want = [census.digest(t.numel() * t.element_size(),
                      census.block_words_reference(t.contiguous().view(torch.uint8).numpy().tobytes()))
        for t in tensors]
print(json.dumps({"got": got, "want": want}))
"""


def test_the_kernels_block_words_are_the_references_at_every_size() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["got"] == out["want"] and len(set(out["want"])) == len(out["want"])


def _digest(data: bytes) -> str:
    return census.digest(len(data), census.block_words_reference(data))


def test_the_digest_moves_with_any_byte_an_exchange_and_the_length() -> None:
    rng = np.random.default_rng(3)
    data = bytearray(rng.integers(0, 256, 2 * census.BLOCK + 100, dtype=np.uint8).tobytes())
    base = _digest(bytes(data))
    for i in (0, 1, census.BLOCK - 1, census.BLOCK, len(data) - 1):
        for bit in (0, 7):
            changed = bytearray(data)
            changed[i] ^= 1 << bit
            assert _digest(bytes(changed)) != base, (i, bit)
    swapped = bytearray(data)
    swapped[10], swapped[20] = data[20], data[10]
    assert data[10] != data[20] and _digest(bytes(swapped)) != base
    assert _digest(bytes(data) + b"\0") != base  # a trailing zero byte is still a byte
    assert _digest(b"") != _digest(b"\0")
    # one changed byte changes exactly its block's word
    changed = bytearray(data)
    changed[census.BLOCK + 3] ^= 0x10
    diff = census.block_words_reference(bytes(changed)) != census.block_words_reference(bytes(data))
    assert diff.tolist() == [False, True, False]
