"""Store benchmark: append rate with signing, whole-log verification time, inclusion-proof time.

Uses synthetic receipts (receipts.testing) in a fresh SQLite store (or --db URL for an empty
PostgreSQL database). Prints JSON and writes it to --out.

    python bench/store.py                      # 2,000 timed appends; verify at 10k and 100k entries
    python bench/store.py --sizes 1000 --appends 500
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench._common import write_result  # noqa: E402
from receipts import keys, merkle  # noqa: E402
from receipts.checkpoint import NoteSigner, open_checkpoint  # noqa: E402
from receipts.store import Store  # noqa: E402
from receipts.testing import synthetic_envelope  # noqa: E402
from receipts.verify import verify_log  # noqa: E402

FILL_BATCH = 1000


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def time_appends(store: Store, key: keys.SigningKey, n: int, start: int) -> dict[str, float]:
    """One transaction per receipt: the rate `qualify run` sees. Envelopes are signed beforehand for the
    first figure (store only: DSSE verify, statement parse, Merkle update, checkpoint signing, commit),
    and inside the loop for the second (operator signing too)."""
    envelopes = [synthetic_envelope(key, start + i) for i in range(n)]
    t0 = time.perf_counter()
    for envelope in envelopes:
        store.append_receipt(envelope)
    store_only = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(n):
        store.append_receipt(synthetic_envelope(key, start + n + i))
    end_to_end = n / (time.perf_counter() - t0)
    return {"appends_per_s": round(store_only, 1), "sign_and_append_per_s": round(end_to_end, 1)}


def fill_to(store: Store, key: keys.SigningKey, target: int, next_n: int) -> int:
    """Append synthetic receipts, FILL_BATCH per transaction, until the log holds `target` entries."""
    while (size := store.size()) < target:
        count = min(FILL_BATCH, target - size)
        store.append_receipts([synthetic_envelope(key, next_n + i) for i in range(count)])
        next_n += count
    return next_n


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the verification workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def time_verify(store: Store, signer: NoteSigner, checkpoint: str) -> dict[str, float | int]:
    """Whole-log verification as an auditor runs it (only the log's public key) and as the operator runs
    it (`qualify log verify` with the log key at hand checks checkpoint notes by deterministic re-signing)."""
    out: dict[str, float | int] = {}
    for mode, log_signer in (("auditor", None), ("operator", signer)):
        t0, c0 = time.perf_counter(), _cpu_seconds()
        report = verify_log(
            store, checkpoint_text=checkpoint, verifiers=[signer.verifier()], log_signer=log_signer
        )
        out[f"{mode}_verify_s"] = round(time.perf_counter() - t0, 3)
        out[f"{mode}_cpu_s"] = round(_cpu_seconds() - c0, 3)
        out["entries"], out["checkpoints"], out["subtrees"] = report.size, report.checkpoints, report.subtrees
    return out


def time_proofs(store: Store, signer: NoteSigner, samples: int = 300) -> dict[str, float]:
    """Median and p99 ms for one inclusion proof read from the stored subtrees (and, separately, the
    proof checked against the signed checkpoint)."""
    cp = open_checkpoint(store.latest_checkpoint(), [signer.verifier()])
    rng = random.Random(0)
    timings, checked = [], []
    for _ in range(samples):
        idx = rng.randrange(cp.size)
        t0 = time.perf_counter()
        proof = store.inclusion_proof(idx, cp.size)
        t1 = time.perf_counter()
        merkle.verify_inclusion(idx, cp.size, store.entry(idx).leaf_hash, proof, cp.root)
        timings.append((t1 - t0) * 1e3)
        checked.append(len(proof))
    timings.sort()
    return {
        "size": cp.size,
        "proof_ms_median": round(statistics.median(timings), 3),
        "proof_ms_p99": round(timings[int(len(timings) * 0.99) - 1], 3),
        "proof_hashes_max": max(checked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="database URL (default: a fresh SQLite file in a temp dir)")
    parser.add_argument("--appends", type=int, default=2000, help="timed single-transaction appends")
    parser.add_argument("--sizes", default="10000,100000", help="log sizes at which to time verification")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "store.json"))
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(",") if s)

    tmp = tempfile.mkdtemp(prefix="qualify-bench-")
    url = args.db or f"sqlite:///{tmp}/bench.db"
    signer = NoteSigner("bench.qualify.local/log", keys.generate("ed25519").crypto)
    store = Store.open(url, log_signer=signer)
    operator = keys.generate("ed25519")
    store.trust_key(operator.public_key(), "bench operator")

    result: dict[str, object] = {
        "bench": "store",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "dialect": store.dialect,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": _cpus(),
    }
    result["append"] = time_appends(store, operator, args.appends, start=0)
    next_n = 2 * args.appends
    # The external checkpoint an auditor kept early on: verification proves consistency from it.
    early = store.latest_checkpoint()
    result["verify"] = []
    for size in sizes:
        next_n = fill_to(store, operator, size, next_n)
        result["verify"].append(time_verify(store, signer, early))  # type: ignore[union-attr]
    result["inclusion_proof"] = time_proofs(store, signer)
    result["load_average_1m"] = round(os.getloadavg()[0], 2)
    result["targets"] = {"appends_per_s": ">= 1000", "verify_s_at_100k": "<= 10", "proof_ms_at_100k": "<= 10"}
    store.close()

    write_result(result, args.out)


if __name__ == "__main__":
    main()
