"""The second engine: built from a launch document (docs/PROTOCOL.md), it owns its allocations, its
model and its counters, and answers the protocol's verbs as plain dicts (server.py puts them on HTTP)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

from . import kv
from .model import BOS, DIMS, Model, Seq, save_weights, seeded

NAME = "second-engine"
VERSION = "0.1"
PROTOCOL_VERSION = "2"
BACKENDS = (
    "auto",
    "torch",
)  # KDA here is torch code on the CPU; the protocol names auto, b12x, triton, torch
PROTOCOL_BACKENDS = ("auto", "b12x", "triton", "torch")
PACKAGE = Path(__file__).resolve().parent
COUNTERS = (
    "requests", "tokens_generated", "cuda_oom", "capacity_refusals", "graph_captures", "graph_replays",
    "graph_recaptures", "graph_oversize_eager", "eager_steps", "spec_drafted", "spec_accepted",
)  # fmt: skip


class Refused(Exception):
    """The launch document asks for something this engine cannot be: exit 2 with this one line."""


class OverCapacity(Exception):
    """A batch past the capacity envelope: 409 CapacityError, nothing allocated or moved."""


def code_digest() -> str:
    """The protocol's code digest of this engine's own tree: sha256 over every .py under its package,
    sorted by path, each as relative path, NUL, bytes, NUL."""
    h = hashlib.sha256()
    for f in sorted(PACKAGE.rglob("*.py")):
        h.update(f.relative_to(PACKAGE).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()


def manifest() -> dict:
    return {
        "name": NAME, "version": VERSION, "protocol_versions": [PROTOCOL_VERSION],
        "presets": {"tiny": dict(DIMS)}, "kda_backends": list(BACKENDS), "dcp_distributed": True,
    }  # fmt: skip


LOCKSTEP = ("generate", "speculative", "probe", "session_start", "session_step", "session_close")
SESSION_TOP_K = 8  # verbs that step the model: every DCP rank runs them


class Engine:
    def __init__(self, doc: dict, rank: int = 0, conns: list | None = None) -> None:
        """rank, conns: distributed DCP; rank 0 holds a connection to every follower (rank r at r - 1), a
        follower one to rank 0."""
        t0 = time.perf_counter()
        if doc.get("protocol_version") != PROTOCOL_VERSION:
            raise Refused(
                f"launch document protocol {doc.get('protocol_version')!r}; "
                f"this engine speaks {PROTOCOL_VERSION}"
            )
        backend = doc["kda_decode_backend"]
        if backend not in PROTOCOL_BACKENDS:
            raise Refused(
                f"unknown kda_decode_backend {backend!r}; "
                f"the protocol's backends are {', '.join(PROTOCOL_BACKENDS)}"
            )
        if backend not in BACKENDS:
            raise Refused(
                f"kda_decode_backend {backend!r} is not built into this engine; it runs auto or torch"
            )
        if doc["model"] != DIMS or doc["preset"] != "tiny":
            raise Refused(f"the launch document's model {doc['model']} is not this engine's {DIMS}")
        geo, cap = doc["geometry"], doc["capacity"]
        if geo["dcp_ranks"] not in (1, geo["dcp_size"]):
            raise Refused(f"dcp_ranks {geo['dcp_ranks']} must be 1 (folded) or dcp_size {geo['dcp_size']}")
        self.rank, self.world, self.conns = rank, geo["dcp_ranks"], conns or []
        if geo["kv_dtype"] != "float32":
            raise Refused(f"kv_dtype {geo['kv_dtype']}: this CPU engine keeps float32 caches")
        pattern = geo["layer_pattern"]
        mine = kv.layout(pattern, geo["group_size"], geo, cap, DIMS)
        sent = [
            {k: g[k] for k in ("name", "kind", "layers", "span", "nbytes", "probe", "views")}
            for g in doc["kv_groups"]
        ]
        if mine != sent:
            raise Refused("the launch document's kv_groups are not this engine's layout for its geometry")
        self.doc, self.geo, self.cap = doc, geo, cap
        self.num_spec = cap["num_spec"]
        self.groups = [kv.Group(g) for g in mine]
        caches: dict[int, dict] = {}
        for g in self.groups:
            for v in g.spec["views"]:
                caches.setdefault(v["layer"], {})[v["name"]] = g.view(v)
        shards = geo["dcp_size"]
        exchange = self._exchange if self.world > 1 else None
        self.model = Model(pattern, caches, {**geo, "shards": shards, "rank": rank, "exchange": exchange})
        self.max_blocks = -(-cap["max_model_len"] // (geo["block_size"] * geo["dcp_size"]))
        # The metadata arenas every step reads: slot rows and block tables, allocated once.
        self.slot_table = torch.zeros(cap["max_num_seqs"], dtype=torch.int32)
        self.block_table = torch.zeros(cap["max_num_seqs"], self.max_blocks, dtype=torch.int32)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.session: dict | None = None
        w = doc["weights"]
        self.weights_path = Path(w["path"])
        if not self.weights_path.is_file():
            if not w.get("create", False):
                raise Refused(f"weights file {self.weights_path} does not exist and create is false")
            self.weights_path.parent.mkdir(parents=True, exist_ok=True)
            save_weights(seeded(pattern, w.get("seed", 0)), str(self.weights_path))
        self.scratch = Path(doc["scratch_dir"])
        self.model.load(str(self.weights_path))
        self.weights_digest = self._digest(self.model.census()[1])
        self.boot_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------ distributed DCP
    def _exchange(self, mine: list[int], k: torch.Tensor, v: torch.Tensor, n: int) -> tuple:
        """Every rank's K and V rows of positions 0..n-1, in position order: followers send theirs to rank 0,
        which puts them together and sends the whole back, so every rank attends over the same rows."""
        if self.rank != 0:
            self.conns[0].send(("rows", mine, k.numpy(), v.numpy()))
            keys, vals = self.conns[0].recv()
            return torch.from_numpy(keys), torch.from_numpy(vals)
        keys = torch.empty((n, *k.shape[1:]), dtype=k.dtype)
        vals = torch.empty_like(keys)
        keys[mine], vals[mine] = k, v
        for conn in self.conns:
            _, pos, k_r, v_r = conn.recv()
            keys[pos], vals[pos] = torch.from_numpy(k_r), torch.from_numpy(v_r)
        for conn in self.conns:
            conn.send((keys.numpy(), vals.numpy()))
        return keys, vals

    def verb(self, name: str, *args):
        """Run a verb here, and with distributed DCP on every rank: the model-stepping ones in lockstep, a
        reload on every rank after rank 0's (the same file), the KV ones on the rank they name."""
        if self.world == 1 or name in ("describe", "capture"):
            return getattr(self, name)(*args)
        if name in ("kv_fill", "kv_echo"):
            rank, rest = args[0], args[1:]
            if rank == 0:
                return getattr(self, name)(0, *rest)
            self.conns[rank - 1].send(("kv", name, (0, *rest)))
            return _answer(self.conns[rank - 1].recv())
        if name == "reload":
            out = self.reload(*args)
            for conn in self.conns:
                conn.send(("verb", "reload", (out["weights_path"], None)))
            for conn in self.conns:
                _answer(conn.recv())
            return out
        if name in LOCKSTEP:
            if name in ("generate", "speculative", "session_start"):
                self._check(args[0], args[1])  # refused here before any rank steps
            for conn in self.conns:
                conn.send(("verb", name, args))
            try:
                return getattr(self, name)(*args)
            finally:
                for conn in self.conns:
                    _answer(conn.recv())
        raise ValueError(f"unknown verb {name}")

    def follow(self) -> None:
        """A follower: run what rank 0 sends until it closes the connection."""
        conn = self.conns[0]
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            kind, name, args = msg
            try:
                value = getattr(self, name)(*args) if kind in ("verb", "kv") else self.record()
                conn.send(("ok", value if kind in ("kv", "record") else None))
            except Exception as e:  # noqa: BLE001 - the error goes back to rank 0 as the answer
                conn.send(("error", f"rank {self.rank}: {type(e).__name__}: {e}"))

    def record(self) -> dict:
        shards = 1 if self.world > 1 else self.geo["dcp_size"]
        return {"rank": self.rank, "world": self.world, "local_shards": shards, "pid": os.getpid(),
                "device": "cpu", "groups": self.layout_groups()}  # fmt: skip

    def ranks(self) -> list[dict]:
        out = [self.record()]
        for conn in self.conns:
            conn.send(("record", "record", ()))
            out.append(_answer(conn.recv()))
        return out

    def layout_groups(self) -> list[dict]:
        return [
            {**{k: g.spec[k] for k in ("name", "kind", "layers", "span", "nbytes")},
             "alignment": kv.ALIGNMENT, "handle_kind": "shm"} for g in self.groups
        ]  # fmt: skip

    def kv_handles(self) -> dict:
        mine = [g.handle() for g in self.groups]
        if self.world == 1:
            return {"groups": mine, "ranks": []}
        ranks = [{"rank": 0, "groups": mine}]
        for r, conn in enumerate(self.conns, start=1):
            conn.send(("kv", "kv_handles_local", ()))
            ranks.append({"rank": r, "groups": _answer(conn.recv())})
        return {"groups": mine, "ranks": ranks}

    def kv_handles_local(self) -> list[dict]:
        return [g.handle() for g in self.groups]

    def _group(self, name: str):
        for g in self.groups:
            if g.spec["name"] == name:
                return g
        raise ValueError(f"no KV group named {name!r}")

    def kv_fill(self, rank: int, group: str, offset: int, length: int, nonce: str) -> str:
        self._rank_exists(rank)
        return self._group(group).fill(offset, length, nonce)

    def kv_echo(self, rank: int, group: str, offset: int, length: int) -> str:
        self._rank_exists(rank)
        return self._group(group).echo(offset, length)

    def _rank_exists(self, rank: int) -> None:
        if self.world == 1 and rank != 0:
            raise ValueError(f"rank {rank} does not exist: this engine folds DCP into one process")
        if rank >= self.world:
            raise ValueError(f"rank {rank} does not exist: this engine runs {self.world} DCP ranks")

    # ------------------------------------------------------------ requests
    def _check(self, prompts: list[list[int]], max_tokens: int) -> None:
        """Refuse a batch past the capacity envelope (counted), before anything is allocated or stepped."""
        n = self.cap["max_num_seqs"]
        if len(prompts) > n:
            self.counters["capacity_refusals"] += 1
            raise OverCapacity(
                f"{len(prompts)} requests in one batch; this engine holds {n} live (max_num_seqs)"
            )
        for p in prompts:
            need = len(p) + max_tokens + self.num_spec
            if need > self.cap["max_model_len"]:
                self.counters["capacity_refusals"] += 1
                raise OverCapacity(
                    f"a request needs {need} tokens; max_model_len is {self.cap['max_model_len']}"
                )

    def _admit(self, prompts: list[list[int]], max_tokens: int) -> list[Seq]:
        self._check(prompts, max_tokens)
        seqs = []
        per = 1 + self.num_spec
        for r in range(len(prompts)):
            self.slot_table[r] = 1 + r * per
            self.block_table[r] = torch.arange(1 + r * self.max_blocks, 1 + (r + 1) * self.max_blocks)
            for c in self.model.caches.values():
                if "state" in c:
                    c["state"][1 + r * per : 1 + (r + 1) * per] = 0
                    c["conv"][1 + r * per : 1 + (r + 1) * per] = 0
            seqs.append(Seq(row=r, blocks=self.block_table[r].tolist()))
        return seqs

    def _step(self, seq: Seq, token: int, col_in: int, col_out: int) -> torch.Tensor:
        base = int(self.slot_table[seq.row])
        logits = self.model.step(seq, token, base + col_in, base + col_out)
        seq.length += 1
        return logits

    @staticmethod
    def _pick(logits: torch.Tensor) -> tuple[int, int, float]:
        top = int(torch.argmax(logits))
        rest = logits.clone()
        rest[top] = -math.inf
        second = int(torch.argmax(rest))
        return top, second, float(logits[top] - logits[second])

    def _prefill(self, seq: Seq, prompt: list[int]) -> torch.Tensor:
        logits = None
        for t in prompt:
            logits = self._step(seq, t, 0, 0)
        assert logits is not None
        return logits

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[dict]:
        seqs = self._admit(prompts, max_tokens)
        self.counters["requests"] += 1
        out = []
        with torch.inference_mode():
            for seq, prompt in zip(seqs, prompts, strict=True):
                logits, toks, gaps, pairs = self._prefill(seq, prompt), [], [], []
                while True:
                    top, second, gap = self._pick(logits)
                    toks.append(top)
                    gaps.append(gap)
                    pairs.append([top, second])
                    if len(toks) == max_tokens:
                        break
                    logits = self._step(seq, top, 0, 0)
                    self.counters["eager_steps"] += 1
                out.append(
                    {"token_ids": toks, "top2_gaps": gaps, "top2_ids": pairs, "accepted_per_step": None}
                )
        self.counters["tokens_generated"] += sum(len(o["token_ids"]) for o in out)
        return out

    def speculative(
        self, prompts: list[list[int]], max_tokens: int, drafts: list[list[int]] | None
    ) -> list[dict]:
        """Verify steps of num_spec drafts: the last kept token and the drafts run in order, the state after
        position i kept in column i; the longest prefix the greedy verifier agrees with is accepted, plus
        its own next token; the next step starts from the column after the last accepted token. A step cut
        short by max_tokens still reports what the verifier accepted."""
        N = self.num_spec
        seqs = self._admit(prompts, max_tokens)
        self.counters["requests"] += 1
        out = []
        with torch.inference_mode():
            for seq, prompt in zip(seqs, prompts, strict=True):
                top, second, gap = self._pick(self._prefill(seq, prompt))
                toks, gaps, pairs, accepted = [top], [gap], [[top, second]], []
                s = 0
                while len(toks) < max_tokens:
                    row = drafts[s] if drafts is not None and s < len(drafts) else self._draft(prompt + toks)
                    row = (list(row) + [0] * N)[:N]
                    start = seq.length
                    picks, feed = [], [toks[-1], *row]
                    for i, t in enumerate(feed):
                        # position i reads the state column i - 1 left (the kept state for i = 0), writes i
                        picks.append(self._pick(self._step(seq, t, max(i - 1, 0), i)))
                        if i < N and picks[-1][0] != row[i]:
                            break
                    m = len(picks) - 1  # drafts the verifier agreed with
                    self.counters["spec_drafted"] += N
                    self.counters["spec_accepted"] += m
                    accepted.append(m)
                    for top, second, gap in picks:
                        if len(toks) < max_tokens:
                            toks.append(top)
                            gaps.append(gap)
                            pairs.append([top, second])
                    seq.length = start + m + 1
                    self._keep_column(seq, m)
                    s += 1
                out.append(
                    {"token_ids": toks, "top2_gaps": gaps, "top2_ids": pairs, "accepted_per_step": accepted}
                )
        self.counters["tokens_generated"] += sum(len(o["token_ids"]) for o in out)
        return out

    def _draft(self, context: list[int]) -> list[int]:
        """This engine's own drafter: what followed the last earlier occurrence of the current token."""
        last = context[-1]
        for i in range(len(context) - 2, -1, -1):
            if context[i] == last:
                return (context[i + 1 : i + 1 + self.num_spec] + [last] * self.num_spec)[: self.num_spec]
        return [last] * self.num_spec

    def _keep_column(self, seq: Seq, m: int) -> None:
        base = int(self.slot_table[seq.row])
        if m:
            for c in self.model.caches.values():
                if "state" in c:
                    c["state"][base] = c["state"][base + m]
                    c["conv"][base] = c["conv"][base + m]

    # ------------------------------------------------------------ live sessions (docs/PEER.md, intervention)
    def _seq_info(self, i: int, seq: Seq, logits: torch.Tensor) -> dict:
        top = torch.topk(logits, SESSION_TOP_K)
        base = int(self.slot_table[seq.row])
        return {
            "index": i, "token_id": int(torch.argmax(logits)), "top_ids": [int(t) for t in top.indices],
            "top_logits": [float(v) for v in top.values], "num_tokens": seq.length + 1,
            "state_slots": list(range(base, base + 1 + self.num_spec)), "kv_blocks": list(seq.blocks),
        }  # fmt: skip

    def session_start(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Admit and prefill the prompts and hold them live until closed (one session at a time)."""
        seqs = self._admit(prompts, max_tokens)
        seqs_out = []
        with torch.inference_mode():
            for i, (seq, p) in enumerate(zip(seqs, prompts, strict=True)):
                seqs_out.append(self._seq_info(i, seq, self._prefill(seq, p)))
        self.session = {"id": os.urandom(8).hex(), "seqs": seqs, "last": [s["token_id"] for s in seqs_out]}
        return {"session": self.session["id"], "mode_used": "eager", "sequences": seqs_out}

    def session_step(self, feed: list[int] | None) -> dict:
        """One decode step of every sequence: it reads `feed[i]` (else its last token) at its next place."""
        s = self.session
        if s is None:
            raise ValueError("no live session")
        if feed is not None and len(feed) != len(s["seqs"]):
            raise ValueError(f"feed has {len(feed)} tokens for {len(s['seqs'])} sequences")
        out = []
        with torch.inference_mode():
            for i, seq in enumerate(s["seqs"]):
                tok = feed[i] if feed is not None else s["last"][i]
                info = self._seq_info(i, seq, self._step(seq, tok, 0, 0))
                s["last"][i] = info["token_id"]
                out.append(info)
        return {"session": s["id"], "mode_used": "eager", "sequences": out}

    def session_close(self) -> dict:
        s, self.session = self.session, None
        return {"session": s["id"] if s else "", "released": len(s["seqs"]) if s else 0}

    # ------------------------------------------------------------ reload
    @staticmethod
    def _digest(sums: dict[str, str]) -> str:
        return (
            "sha256:"
            + hashlib.sha256("\n".join(f"{n}:{c}" for n, c in sorted(sums.items())).encode()).hexdigest()
        )

    def reload(self, path: str | None, seed: int | None) -> dict:
        t0 = time.perf_counter()
        if path is not None and seed is not None:
            raise ValueError("give either path or seed, not both")
        if seed is not None:
            self.scratch.mkdir(parents=True, exist_ok=True)
            target = self.scratch / f"{NAME}-seed{seed}.safetensors"
            if not target.is_file():
                save_weights(seeded(self.geo["layer_pattern"], seed), str(target))
        else:
            target = Path(path) if path is not None else self.weights_path
        if not target.is_file():
            raise ValueError(f"weights file {target} does not exist")
        arenas = self._arena_addresses()
        p0, s0 = self.model.census()
        self.model.load(str(target))
        p1, s1 = self.model.census()
        self.weights_path, self.weights_digest = target, self._digest(s1)
        return {
            "census": {
                "params": len(p1), "addresses_unchanged": p0 == p1,
                "changed": sorted(n for n in s1 if s1[n] != s0[n]),
                "before_digest": self._digest(s0), "after_digest": self._digest(s1),
                "arena_addresses_unchanged": arenas == self._arena_addresses(), "graph_addresses_moved": [],
            },
            "seconds": time.perf_counter() - t0, "weights_path": str(target),
        }  # fmt: skip

    # ------------------------------------------------------------ the rest
    def probe(self) -> dict:
        from torch.profiler import ProfilerActivity, profile

        seqs = self._admit([[BOS, 65]], 2)
        with torch.inference_mode():
            self._prefill(seqs[0], [BOS])
            if self.rank != 0:  # a follower steps in lockstep; only rank 0 profiles
                self._step(seqs[0], 65, 0, 0)
                return {}
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                self._step(seqs[0], 65, 0, 0)
        return {
            "kernel_names": sorted({e.key for e in prof.key_averages()}),
            "backend": "torch",
            "device_type": "cpu",
        }

    def capture(self) -> dict:
        why = "this engine has no CUDA graphs: it runs on the CPU only"
        return {"captured": False, "reason": why, "sizes": [],
                "pool_bytes": 0, "seconds": 0.0, "address_digest": None}  # fmt: skip

    def _arena_addresses(self) -> dict[str, int]:
        return {"slot_table": self.slot_table.data_ptr(), "block_table": self.block_table.data_ptr()}

    def config(self) -> dict:
        g, c = self.geo, self.cap
        return {
            "preset": self.doc["preset"], "kda_decode_backend": self.doc["kda_decode_backend"],
            "seed": self.doc.get("seed", 0), "num_spec": c["num_spec"], "layer_pattern": g["layer_pattern"],
            "group_size": g["group_size"], "block_size": g["block_size"], "dcp_size": g["dcp_size"],
            "dcp_ranks": g["dcp_ranks"], "interleave": g["interleave"], "max_num_seqs": c["max_num_seqs"],
            "max_model_len": c["max_model_len"], "max_num_batched_tokens": c["max_num_batched_tokens"],
            "capture_sizes": [], "model": dict(DIMS), "kv_dtype": g["kv_dtype"],
        }  # fmt: skip

    def describe(self) -> dict:
        cfg = self.config()
        spans = [g.spec["span"] for g in self.groups]
        chunk = math.lcm(*spans)
        drafted = self.counters["spec_drafted"]
        rate = self.counters["spec_accepted"] / drafted if drafted else 0.0
        return {
            "protocol_version": PROTOCOL_VERSION,
            "engine": {"name": NAME, "version": VERSION, "code_digest": code_digest(),
                       "weights_digest": self.weights_digest, "weights_path": str(self.weights_path)},
            "config": cfg,
            "config_digest": "sha256:" + hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest(),
            "backend": {"requested": self.doc["kda_decode_backend"], "resolved": "torch",
                        "reason": "the only KDA implementation this engine has (torch on the CPU)",
                        "prefill_path": "token by token through the decode step", "glue": "torch"},
            "layout": {"spans": spans, "chunk": chunk, "ratios": [chunk // s for s in spans],
                       "groups": self.layout_groups()},
            "dcp_mode": "folded" if self.world == 1 else "distributed",
            **({} if self.world == 1 else {"dcp": self.record(), "dcp_ranks": self.ranks()}),
            "arenas": {
                "slot_table": {"address": self.slot_table.data_ptr(), "capacity": self.slot_table.numel(),
                               "shape": list(self.slot_table.shape), "dtype": "int32"},
                "block_table": {"address": self.block_table.data_ptr(), "capacity": self.block_table.shape[0],
                                "shape": list(self.block_table.shape), "dtype": "int32"},
            },
            "capacity": {"live_slots": self.cap["max_num_seqs"], "max_num_seqs": self.cap["max_num_seqs"],
                         "max_num_batched_tokens": self.cap["max_num_batched_tokens"], "graph_max_batch": 0,
                         "num_spec": self.num_spec},
            "device": {"type": "cpu", "name": platform.machine()},
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "qualify": "none",
                         "second_engine": VERSION},
            "counters": {**self.counters, "spec_acceptance_rate": rate},
            "cudagraph_mode": "none",
            "pid": os.getpid(),
        }  # fmt: skip

    def close(self) -> None:
        for g in self.groups:
            g.close()
        self.groups = []


def _answer(msg: tuple):
    """A follower's ("ok", value) or ("error", why): the value, or the error raised here."""
    kind, value = msg
    if kind != "ok":
        raise ValueError(value)
    return value
