"""Distributed decode-context parallelism on CPU (gloo): one engine process per DCP shard, stepping in
lockstep, generates what the folded engine generates; a lost rank ends the engine naming the rank, and no
rank process or shared-memory file is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from qualify.engine.model.attention import DcpGeometry

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The hybrid engine", "KDA keeps a recurrent state per head. " * 3, "Receipts are evidence:"]


def test_every_token_is_stored_by_exactly_one_rank_where_the_folded_engine_stores_it():
    folded = DcpGeometry(block_size=8, dcp=4, interleave=2, max_model_len=200, max_blocks=7)
    fpos, fcol, foff = folded.context_tables(torch.device("cpu"))
    positions = torch.arange(200)
    fcol_of, foff_of = folded.locate(positions)
    owners = torch.zeros(200, dtype=torch.long)
    for r in range(4):
        g = DcpGeometry(block_size=8, dcp=4, interleave=2, max_model_len=200, max_blocks=7, rank=r)
        pos, col, off = g.context_tables(torch.device("cpu"))
        # A rank's context table is the folded table's row for its shard, stored from offset 0 of a block.
        assert torch.equal(pos[0], fpos[r]) and torch.equal(col[0], fcol[r])
        assert torch.equal(off[0], foff[r] - r * 8)
        c, o = g.locate(positions)
        mine = o >= 0
        owners += mine.long()
        assert torch.equal(c, fcol_of)
        assert torch.equal(o[mine] + r * 8, foff_of[mine])
        assert g.block_storage == 8 and folded.block_storage == 32
    assert torch.equal(owners, torch.ones(200, dtype=torch.long))


def _serve(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "qualify.engine", "serve", "--port", "0", "--device", "cpu", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )


def _ready(proc: subprocess.Popen[str], timeout_s: float = 180.0) -> str:
    end = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("QUALIFY_ENGINE_READY "):
            return dict(kv.split("=", 1) for kv in line.split()[1:])["url"]
    raise AssertionError("engine not ready: " + "".join(lines[-20:]))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _generate(url: str) -> list[list[int]]:
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS, "max_tokens": 10}, timeout=120)
    assert r.status_code == 200, r.text
    return [c["token_ids"] for c in r.json()["choices"]]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.serial
@pytest.mark.parametrize("ranks", [2, 4])
def test_dcp_ranks_generate_what_the_folded_engine_generates_and_leave_nothing(tmp_path, ranks):
    from qualify.engine.layout import SHM_PREFIX, _shm_dir

    folded = _serve(tmp_path, "--dcp-size", str(ranks), "--dcp-ranks", "1")
    dist = _serve(tmp_path, "--dcp-size", str(ranks), "--dcp-ranks", str(ranks))
    try:
        folded_url = _ready(folded)
        ref = _generate(folded_url)
        url = _ready(dist)
        d = httpx.get(url + "/v1/describe", timeout=60).json()
        assert d["dcp_mode"] == "distributed"
        assert [r["rank"] for r in d["dcp_ranks"]] == list(range(ranks))
        assert d["layout"]["spans"] == [2304, 2304, 2304, 2304 * ranks]
        pids = [r["pid"] for r in d["dcp_ranks"]]
        assert len(set(pids)) == ranks and pids[0] == dist.pid
        # Each rank stores one shard: its attention KV is the folded engine's divided by the ranks.
        fd = httpx.get(folded_url + "/v1/describe", timeout=60).json()
        attn = [g["nbytes"] for g in fd["layout"]["groups"] if g["kind"] == "attention"][0]
        mine = [g["nbytes"] for g in d["dcp_ranks"][1]["groups"] if g["kind"] == "attention"][0]
        assert mine < attn / ranks * 1.01
        assert _generate(url) == ref
        # Reload in place on every rank, then the same tokens again.
        r = httpx.post(url + "/qualify/reload", json={}, timeout=120)
        assert r.status_code == 200 and r.json()["census"]["addresses_unchanged"]
        assert _generate(url) == ref
    finally:
        _stop(dist)
        _stop(folded)
    assert not any(_alive(p) for p in pids)
    owners = {str(p) for p in pids}
    assert [n for n in os.listdir(_shm_dir()) if n.startswith(SHM_PREFIX) and n.split("-")[3] in owners] == []


def test_a_killed_rank_ends_the_engine_naming_the_rank_and_no_rank_is_left(tmp_path):
    proc = _serve(tmp_path, "--dcp-size", "2", "--dcp-ranks", "2")
    try:
        url = _ready(proc)
        ranks = httpx.get(url + "/v1/describe", timeout=60).json()["dcp_ranks"]
        follower = ranks[1]["pid"]
        os.kill(follower, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=60)
    finally:
        _stop(proc)
    assert proc.returncode == 4
    assert "QUALIFY_DCP_RANK_LOST rank=1 killed by signal 9" in rest
    assert not _alive(follower) and not _alive(ranks[0]["pid"])
