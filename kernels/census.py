"""The reload census's digest of a CUDA tensor's bytes, computed on the device.

A census hashes every parameter before and after a reload (qualify/engine/weights.py). Through the host
(a copy of each parameter through pinned buffers, sha256 in eight threads) it cost 0.36-0.54 s per census
of the proxy preset's 2.9 GB on an H100 (2026-12-05), twice per reload, seven reloads per qualification.
Here each program of one launch per tensor reads BLOCK bytes and writes one 64-bit word: the sum, modulo
2**64, of splitmix64((i << 8) | byte_i) over the bytes i of its block (i counted from the tensor's start).
(i << 8) | byte is distinct for every position and value and splitmix64 is a bijection of 64-bit words, so
changing one byte changes exactly one term and with it the block's word; several changes leave it equal
only if their differences cancel modulo 2**64. The host then hashes the block words (a few MB for the
whole model) with sha256, with the tensor's byte count in front. Not a cryptographic digest of the bytes:
the census is the engine's own evidence, compared only with itself (docs/PROTOCOL.md, "Weights").

`block_words_reference` is the same computation in numpy (the tests hold the kernel to it).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 16384  # bytes per program (one 64-bit word out)
SUB = 1024  # bytes mixed at a time inside a program
VERSION = b"qualify-census-v1"

_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


@triton.jit(do_not_specialize=["nbytes"])
def _census_kernel(x, out, nbytes, BLOCK: tl.constexpr, SUB: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BLOCK
    acc = tl.zeros((), dtype=tl.uint64)
    for j in range(0, BLOCK, SUB):
        offs = base + j + tl.arange(0, SUB)
        mask = offs < nbytes
        b = tl.load(x + offs, mask=mask, other=0).to(tl.uint64)
        h = (offs.to(tl.uint64) << 8) | b
        h = h + 0x9E3779B97F4A7C15
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB
        h = h ^ (h >> 31)
        acc += tl.sum(tl.where(mask, h, 0), axis=0)
    tl.store(out + pid, acc)


def blocks(nbytes: int) -> int:
    """The 64-bit words a tensor of `nbytes` bytes has in the census (one per BLOCK bytes, at least one)."""
    return max(1, -(-nbytes // BLOCK))


def launch(t: torch.Tensor, out: torch.Tensor) -> None:
    """Write `t`'s block words into `out` (int64, blocks(t's bytes) of them) on the current stream."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    assert out.dtype == torch.int64 and out.numel() == blocks(n) and out.device == flat.device
    if n == 0:
        out.zero_()
        return
    _census_kernel[(blocks(n),)](flat, out, n, BLOCK=BLOCK, SUB=SUB, num_warps=4)


def words_needed(sizes: list[int] | tuple[int, ...]) -> int:
    """The int64 words `digests` needs for tensors of these byte counts (each tensor's from an even index,
    so that every slice starts 16-byte aligned: one specialization of the kernel)."""
    return sum(blocks(n) + blocks(n) % 2 for n in sizes)


def digests(tensors: list[torch.Tensor], words: torch.Tensor) -> list[str]:
    """The census digest of each tensor (all on `words`' device; `words`: int64, at least words_needed),
    one launch each, then one copy of the words to the host."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    assert words.dtype == torch.int64 and words.numel() >= words_needed(sizes)
    spans, at = [], 0
    for t, n in zip(tensors, sizes, strict=True):
        k = blocks(n)
        launch(t, words[at : at + k])
        spans.append((at, k))
        at += k + k % 2
    host = words[:at].cpu().numpy().view("<u8")  # waits for the launches on this stream
    return [digest(n, host[o : o + k]) for n, (o, k) in zip(sizes, spans, strict=True)]


def digest(nbytes: int, words: np.ndarray) -> str:
    """A tensor's census digest from its byte count and its block words (as the kernel wrote them)."""
    h = hashlib.sha256(VERSION)
    h.update(nbytes.to_bytes(8, "little"))
    h.update(np.ascontiguousarray(words, dtype="<u8").tobytes())
    return h.hexdigest()


def _splitmix(h: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = h + np.uint64(_GOLDEN)
        h = (h ^ (h >> np.uint64(30))) * np.uint64(_M1)
        h = (h ^ (h >> np.uint64(27))) * np.uint64(_M2)
        return h ^ (h >> np.uint64(31))


def block_words_reference(data: bytes) -> np.ndarray:
    """The kernel's block words for `data`, in numpy (uint64)."""
    b = np.frombuffer(data, dtype=np.uint8).astype(np.uint64)
    i = np.arange(b.size, dtype=np.uint64)
    mixed = _splitmix((i << np.uint64(8)) | b)
    words = np.zeros(blocks(b.size), dtype=np.uint64)
    if b.size:
        np.add.at(words, (i // np.uint64(BLOCK)).astype(np.int64), mixed)
    return words
