"""Live sequences held between decode steps (`/qualify/sessions`, docs/PROTOCOL.md).

A session admits and prefills its prompts like one generate batch, then waits: each step decodes one token
of every sequence, and close frees their state slots and KV blocks. Between two steps the harness's peer
may change the exported memory the sequences own; the next step reads whatever is there. Every sequence
reports the state slots and KV block ids it holds, so the harness can say which bytes belong to whom."""

from __future__ import annotations

import torch

from qualify.protocol import SESSION_TOP_K

from .runner import Request

MAX_SESSIONS = 4  # open at once; each also holds its sequences' slots and blocks until closed


def _sequences(engine, reqs: list[Request], logits: torch.Tensor) -> list[dict]:
    top = torch.topk(logits.float(), min(SESSION_TOP_K, logits.shape[-1]), dim=-1)
    ids, vals = top.indices.tolist(), top.values.tolist()
    return [
        {
            "index": i,
            "token_id": r.output[-1],
            "top_ids": ids[i],
            "top_logits": vals[i],
            "num_tokens": r.num_tokens,
            "state_slots": list(r.slots),
            "kv_blocks": list(r.blocks),
        }
        for i, r in enumerate(reqs)
    ]


def _open(engine) -> dict:
    if not hasattr(engine, "sessions"):
        engine.sessions = {}
    return engine.sessions


def session_start(engine, sid: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Admit (or refuse as a whole, CapacityError) and prefill the prompts; hold them as session `sid`."""
    open_ = _open(engine)
    if len(open_) >= MAX_SESSIONS:
        raise ValueError(f"{len(open_)} sessions are open already (at most {MAX_SESSIONS}); close one first")
    r = engine.runner
    r.check_admission(prompts, max_tokens)
    budget = engine.cfg.max_num_batched_tokens
    if sum(len(p) for p in prompts) > budget:
        raise ValueError(f"a session's prompts together must fit max_num_batched_tokens {budget}")
    reqs = [r.admit(p, max_tokens) for p in prompts]
    try:
        logits = r.prefill(reqs)
        toks, gaps, seconds = r.pick_top2(logits)
        for q, t, g, t2 in zip(reqs, toks, gaps, seconds, strict=True):
            r._append(q, t, g, t2)
    except BaseException:
        for q in reqs:
            r.release(q)
        raise
    engine.counters.requests += 1
    open_[sid] = reqs
    return {"session": sid, "mode_used": "eager", "sequences": _sequences(engine, reqs, logits)}


def _session(engine, sid: str) -> list[Request]:
    reqs = _open(engine).get(sid)
    if reqs is None:
        raise ValueError(f"no open session {sid!r}")
    return reqs


def session_step(engine, sid: str, feed: list[int] | None) -> dict:
    """One decode step of every sequence of the session; `feed` replaces each one's last token first."""
    reqs = _session(engine, sid)
    vocab = engine.cfg.shape.vocab
    if feed is not None and (len(feed) != len(reqs) or any(not 0 <= t < vocab for t in feed)):
        raise ValueError(f"feed needs one token id in [0, {vocab}) for each of the {len(reqs)} sequences")
    full = [q for q in reqs if len(q.output) >= q.max_tokens]
    if full:
        raise ValueError(f"the session's sequences have generated their max_tokens ({full[0].max_tokens})")
    r = engine.runner
    if feed is not None:
        for q, t in zip(reqs, feed, strict=True):
            q.output[-1] = t
    logits, used = r.decode_step(reqs, "auto")
    toks, gaps, seconds = r.pick_top2(logits)
    for q, t, g, t2 in zip(reqs, toks, gaps, seconds, strict=True):
        r._append(q, t, g, t2)
    return {"session": sid, "mode_used": used, "sequences": _sequences(engine, reqs, logits)}


def session_close(engine, sid: str) -> dict:
    reqs = _session(engine, sid)
    for q in reqs:
        engine.runner.release(q)
    del _open(engine)[sid]
    return {"session": sid, "released": len(reqs)}
