"""Store benchmark for a fleet log: hosts append through the sequencer; every figure beside its target.

Measures, on this machine and in one run:
- appends/s with 1 and 8 concurrent hosts on PostgreSQL and on SQLite: each host a process that holds
  only its operator key and submits one receipt per transaction (as `qualify run` does); one sequencer
  process holds the log key and integrates batches (up to 256, one signed checkpoint each). The rate is
  receipts integrated under a signed checkpoint per second of wall time, from the first submission to
  the last receipt sequenced; the log is then verified (gapless, every checkpoint).
- append to proof: one host's append (submit, wait for the sequencer, inclusion proof checked with the
  verifier key) while the sequencer runs with its 250 ms batch wait; median, p95 and max.
- `log verify` of a log of --verify-size entries (100,000 by default) written by the sequencer.
- `approve` with min_hosts = --approve-hosts over --approve-receipts receipts (10,000 from 1,000 hosts
  by default, each host with its own trusted key), and `receipts verify --all` over the same store.

PostgreSQL: --pg URL (a server on which fresh databases are made), else a throwaway cluster started here from
/usr/lib/postgresql/*/bin with its default durability (fsync on); skipped, with the reason, when there is
none. Synthetic receipts (receipts.testing). Prints JSON and writes it to --out.

    python bench/store.py
    nice python bench/store.py --per-host 300 --verify-size 30000 --approve-receipts 2000 --approve-hosts 200
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import multiprocessing
import os
import platform
import pwd
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat  # noqa: E402

from bench._common import write_result  # noqa: E402
from receipts import dsse, keys, sequencer  # noqa: E402
from receipts.checkpoint import NoteSigner  # noqa: E402
from receipts.store import Store  # noqa: E402
from receipts.testing import synthetic_envelope  # noqa: E402
from receipts.verify import verify_log  # noqa: E402

TARGETS = {
    "appends_per_s_8_hosts_postgresql": ">= 1500",
    "append_to_proof_s": "<= 2",
    "verify_s_at_100k": "<= 10",
    "approve_s_10k_receipts_1k_hosts": "<= 10",
}
SUBJECT = "sha256:" + hashlib.sha256(b"bench fleet image").hexdigest()
ORIGIN = "bench.qualify.local/fleet"
_FORK = multiprocessing.get_context("fork")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (verification workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _seed(signer: NoteSigner) -> bytes:
    return signer.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def _signer(seed: bytes) -> NoteSigner:
    return NoteSigner(ORIGIN, Ed25519PrivateKey.from_private_bytes(seed))


# ---------------------------------------------------------------------------------------- PostgreSQL


@contextlib.contextmanager
def pg_cluster() -> Iterator[str]:
    """A throwaway PostgreSQL cluster (default durability) run as the postgres user; its base URL."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise RuntimeError("no PostgreSQL server binaries (/usr/lib/postgresql/*/bin/initdb)")
    bindir = os.path.dirname(found[-1])
    user = pwd.getpwnam("postgres")
    root = tempfile.mkdtemp(prefix="qualify-bench-pg-")
    data, sock = os.path.join(root, "data"), os.path.join(root, "sock")
    os.makedirs(sock)
    for path in (root, sock):
        os.chown(path, user.pw_uid, user.pw_gid)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def as_pg(*cmd: str) -> None:
        run_as = [] if os.getuid() == user.pw_uid else ["runuser", "-u", "postgres", "--"]
        subprocess.run([*run_as, *cmd], check=True, capture_output=True, timeout=120)

    as_pg(f"{bindir}/initdb", "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8")
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c max_connections=100"
    as_pg(f"{bindir}/pg_ctl", "-D", data, "-o", opts, "-l", os.path.join(root, "log"), "-w", "start")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            as_pg(f"{bindir}/pg_ctl", "-D", data, "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


_DB_COUNTER = 0


def fresh_pg(base: str) -> str:
    global _DB_COUNTER
    import psycopg

    _DB_COUNTER += 1
    name = f"bench_{os.getpid()}_{_DB_COUNTER}"
    dsn = base.replace("postgresql+psycopg://", "postgresql://") + "/postgres"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{base}/{name}"


def fresh_sqlite(tmp: str, name: str) -> str:
    return f"sqlite:///{os.path.join(tmp, name)}.db"


# ---------------------------------------------------------------------------------------- processes


def _sequencer_main(url: str, seed: bytes, target: int, stop, interval: float) -> None:  # type: ignore[no-untyped-def]
    store = Store.open(url, log_signer=_signer(seed))
    try:
        while not stop.is_set():
            done = sequencer.integrate(store)
            if target and done.size >= target:
                return
            if done.integrated + done.refused < sequencer.BATCH_SIZE:
                stop.wait(interval)
    finally:
        store.close()


def _host_main(url: str, envelopes: list[bytes], go, out) -> None:  # type: ignore[no-untyped-def]
    store = Store.open(url)
    try:
        go.wait()
        t0 = time.perf_counter()
        for data in envelopes:
            sequencer.submit(store, "receipt", data)  # one transaction per receipt, as qualify run
        out.put(time.perf_counter() - t0)
    finally:
        store.close()


def _prepare(url: str, signer: NoteSigner, host_keys: list[keys.SigningKey]) -> int:
    """The log started by its sequencer, with each host's key trusted by the administrator."""
    with Store.open(url, log_signer=signer) as store:
        store.ensure_log()
        for n, key in enumerate(host_keys):
            store.trust_key(key.public_key(), f"host {n}")
        return store.size()


def measure_appends(url: str, hosts: int, per_host: int) -> dict[str, object]:
    signer = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    host_keys = [keys.generate() for _ in range(hosts)]
    start = _prepare(url, signer, host_keys)
    batches = [
        [
            dsse.envelope_bytes(synthetic_envelope(k, h * per_host + i, hostname=f"host-{h}"))
            for i in range(per_host)
        ]
        for h, k in enumerate(host_keys)
    ]
    total = hosts * per_host
    stop, go, out = _FORK.Event(), _FORK.Event(), _FORK.Queue()
    seq = _FORK.Process(target=_sequencer_main, args=(url, _seed(signer), start + total, stop, 0.05))
    workers = [_FORK.Process(target=_host_main, args=(url, b, go, out)) for b in batches]
    c0, load = _cpu_seconds(), os.getloadavg()[0]
    seq.start()
    for w in workers:
        w.start()
    time.sleep(1.0)  # every process connected and waiting
    t0 = time.perf_counter()
    go.set()
    submit_s = [out.get(timeout=900) for _ in workers]
    for w in workers:
        w.join(timeout=60)
    seq.join(timeout=900)
    elapsed = time.perf_counter() - t0
    stop.set()
    seq.join(timeout=60)
    cpu = _cpu_seconds() - c0  # hosts and sequencer (the database server's own time is not counted)
    with Store.open(url) as store:
        report = verify_log(store, verifiers=[signer.verifier()])
        checkpoints = store.counts()["checkpoints"]
    assert report.size == start + total, (report.size, start + total)
    return {
        "hosts": hosts,
        "receipts": total,
        "appends_per_s": round(total / elapsed, 1),
        "host_submits_per_s": round(total / max(submit_s), 1),
        "seconds": round(elapsed, 2),
        "client_cpu_s": round(cpu, 2),
        "load_average_1m": round(load, 2),
        "checkpoints_signed": checkpoints,
        "log_verified": True,
    }


def measure_append_to_proof(url: str, samples: int) -> dict[str, object]:
    signer = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    key = keys.generate()
    _prepare(url, signer, [key])
    stop = _FORK.Event()
    seq = _FORK.Process(target=_sequencer_main, args=(url, _seed(signer), 0, stop, sequencer.BATCH_WAIT_S))
    seq.start()
    timings = []
    try:
        with Store.open(url) as host:
            host.set_host(signer.verifier())
            for n in range(samples):
                data = dsse.envelope_bytes(synthetic_envelope(key, n))
                t0 = time.perf_counter()
                record = sequencer.append_as_host(host, data, signer.verifier(), timeout_s=30)
                timings.append(time.perf_counter() - t0)
                assert record.log_idx >= 1
    finally:
        stop.set()
        seq.join(timeout=60)
    timings.sort()
    return {
        "samples": samples,
        "batch_wait_s": sequencer.BATCH_WAIT_S,
        "median_s": round(statistics.median(timings), 3),
        "p95_s": round(timings[max(0, int(len(timings) * 0.95) - 1)], 3),
        "max_s": round(timings[-1], 3),
    }


def fill(url: str, signer: NoteSigner, host_keys: list[keys.SigningKey], per_host: int) -> float:
    """Receipts about SUBJECT, `per_host` from each host, queued and integrated by the sequencer."""
    t0 = time.perf_counter()
    with Store.open(url, log_signer=signer) as seq, Store.open(url) as host:
        chunk: list[tuple[str, bytes]] = []
        for i in range(per_host):
            for h, key in enumerate(host_keys):
                n = i * len(host_keys) + h
                envelope = synthetic_envelope(key, n, subject_digest=SUBJECT[7:], hostname=f"host-{h:04d}")
                chunk.append(("receipt", dsse.envelope_bytes(envelope)))
                if len(chunk) == 2000:
                    sequencer.submit_many(host, chunk)
                    chunk = []
                    while sequencer.integrate(seq).integrated:
                        pass
        if chunk:
            sequencer.submit_many(host, chunk)
        while sequencer.integrate(seq).integrated:
            pass
    return time.perf_counter() - t0


def measure_verify(url: str, size: int) -> dict[str, object]:
    signer = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    key = keys.generate()
    start = _prepare(url, signer, [key])
    fill_s = fill(url, signer, [key], size - start)
    out: dict[str, object] = {"fill_s": round(fill_s, 1)}
    with Store.open(url) as store:
        for mode, log_signer in (("auditor", None), ("operator", signer)):
            t0, c0, load = time.perf_counter(), _cpu_seconds(), os.getloadavg()[0]
            report = verify_log(store, verifiers=[signer.verifier()], log_signer=log_signer)
            out[f"{mode}_verify_s"] = round(time.perf_counter() - t0, 2)
            out[f"{mode}_cpu_s"] = round(_cpu_seconds() - c0, 2)  # all workers together
            out[f"{mode}_load_average_1m"] = round(load, 2)
        out.update(entries=report.size, checkpoints=report.checkpoints, subtrees=report.subtrees)
    return out


def measure_approve(url: str, receipts: int, hosts: int) -> dict[str, object]:
    from qualify.approve import decide
    from qualify.policy import PolicyError, load_policy_data

    signer = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    host_keys = [keys.generate() for _ in range(hosts)]
    _prepare(url, signer, host_keys)
    fill_s = fill(url, signer, host_keys, receipts // hosts)
    policy = {
        "name": "fleet",
        "verdict": "qualified",
        "min_hosts": hosts,
        "conditions": {"cpu-run": 'receipt.target == "cpu" && receipt.verdict == "qualified"'},
    }
    over_budget = {
        "min_hosts": hosts,
        # started_at differs from receipt to receipt: no outcome is reused, every one is evaluated.
        "conditions": {
            "pairs": 'receipt.started_at != ""'
            " && receipt.checks.all(a, receipt.checks.all(b, b.seconds >= 0.0))"
        },
    }
    from qualify.cel import Budget

    out: dict[str, object] = {"receipts": receipts, "hosts": hosts, "fill_s": round(fill_s, 1)}
    with Store.open(url) as store:
        t0, c0, load = time.perf_counter(), _cpu_seconds(), os.getloadavg()[0]
        decision = decide(store, load_policy_data(policy), SUBJECT, verifiers=[signer.verifier()])
        out["approve_s"] = round(time.perf_counter() - t0, 2)
        out["approve_cpu_s"] = round(_cpu_seconds() - c0, 2)
        out["approve_load_average_1m"] = round(load, 2)
        out["decision"] = decision.decision
        out["hosts_counted"] = len(decision.hosts)
        t0 = time.perf_counter()
        records = store.list_receipts(limit=None)
        c0 = _cpu_seconds()
        reports = store.verify_receipts(records, [signer.verifier()])
        out["receipts_verify_all_s"] = round(time.perf_counter() - t0, 2)
        out["receipts_verify_all_cpu_s"] = round(_cpu_seconds() - c0, 2)
        assert all(r.ok for r, _ in reports) and len(reports) == receipts
        t0 = time.perf_counter()
        try:
            decide(
                store,
                load_policy_data(over_budget),
                SUBJECT,
                verifiers=[signer.verifier()],
                budget=Budget(steps=2000),
            )
            refused = False
        except PolicyError:
            refused = True
        out["over_budget_policy_refused_s"] = round(time.perf_counter() - t0, 2)
        assert refused
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pg", help="a PostgreSQL server URL to make fresh databases on (default: a throwaway cluster)"
    )
    parser.add_argument("--per-host", type=int, default=1000, help="receipts each host appends")
    parser.add_argument("--proof-samples", type=int, default=30)
    parser.add_argument("--verify-size", type=int, default=100_000)
    parser.add_argument("--approve-receipts", type=int, default=10_000)
    parser.add_argument("--approve-hosts", type=int, default=1_000)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "store.json"))
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the throwaway cluster and files are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    tmp = tempfile.mkdtemp(prefix="qualify-bench-")
    result: dict[str, object] = {
        "bench": "store",
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": _cpus(),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
        "sizes": {
            "per_host": args.per_host,
            "verify_size": args.verify_size,
            "approve_receipts": args.approve_receipts,
            "approve_hosts": args.approve_hosts,
            "full_size": args.per_host >= 1000
            and args.verify_size >= 100_000
            and args.approve_receipts >= 10_000
            and args.approve_hosts >= 1000,
        },
        "targets": TARGETS,
    }
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        pg_base: str | None = None
        if args.pg is None:
            try:
                pg_base = stack.enter_context(pg_cluster())
            except Exception as error:  # noqa: BLE001 - reported in the result, not hidden
                result["postgresql_skipped"] = f"no PostgreSQL cluster: {error}"
        base = args.pg or pg_base
        dialects = {"sqlite": lambda name: fresh_sqlite(tmp, name)}
        if base is not None:
            dialects["postgresql"] = lambda name: fresh_pg(base)
        appends: dict[str, dict[str, object]] = {}
        for dialect, make in dialects.items():
            appends[dialect] = {
                f"{hosts}_hosts": measure_appends(make(f"appends{hosts}"), hosts, args.per_host)
                for hosts in (1, 8)
            }
        result["appends"] = appends
        proof_dialect = "postgresql" if "postgresql" in dialects else "sqlite"
        result["append_to_proof"] = {
            "dialect": proof_dialect,
            **measure_append_to_proof(dialects[proof_dialect]("proof"), args.proof_samples),
        }
        result["verify"] = {
            "dialect": "sqlite",
            **measure_verify(fresh_sqlite(tmp, "verify"), args.verify_size),
        }
        result["approve"] = {
            "dialect": "sqlite",
            **measure_approve(fresh_sqlite(tmp, "approve"), args.approve_receipts, args.approve_hosts),
        }
    pg8 = appends.get("postgresql", {}).get("8_hosts", {})
    result["against_targets"] = {
        "appends_per_s_8_hosts_postgresql": pg8.get("appends_per_s"),
        "append_to_proof_s": result["append_to_proof"]["p95_s"],  # type: ignore[index]
        "verify_s": result["verify"]["auditor_verify_s"],  # type: ignore[index]
        "approve_s": result["approve"]["approve_s"],  # type: ignore[index]
    }
    result["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
