"""A fleet on one PostgreSQL store, as an operator runs it: three hosts, each with its own data dir and
only its own operator key and the log's verifier key; one sequencer (the administrator's machine, the only
holder of the log key). Two hosts append concurrently while the sequencer is killed with SIGKILL and
started again; the third approves the rollout from their receipts; `log verify` passes on every machine
and nothing is lost or out of place."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import sqlalchemy as sa

from receipts.keys import SigningKey
from receipts.testing import synthetic_envelope

SUBJECT = "sha256:" + hashlib.sha256(b"fleet image under test").hexdigest()
PER_HOST = 60


def _env(home: Path, url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUALIFY_")}
    return {**env, "QUALIFY_HOME": str(home), "QUALIFY_DB_URL": url, "COLUMNS": "200"}


def qualify(home: Path, url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qualify.cli", *map(str, args)],
        env=_env(home, url),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(home: Path, url: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "qualify.cli", *map(str, args)],
        env=_env(home, url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _count(url: str, table: str) -> int:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()
    finally:
        engine.dispose()


def _sequencer(home: Path, url: str) -> subprocess.Popen:
    return start(home, url, "log", "sequence", "--interval", "0.05")


def test_three_hosts_append_and_approve_through_one_sequencer(pg_url: str, tmp_path: Path) -> None:
    admin, *hosts = (tmp_path / name for name in ("sequencer", "host-a", "host-b", "host-c"))
    sequencer = _sequencer(admin, pg_url)
    try:
        deadline = time.monotonic() + 60
        while (shown := qualify(admin, pg_url, "log", "vkey")).returncode != 0:
            assert sequencer.poll() is None, sequencer.communicate()
            assert time.monotonic() < deadline, shown.stderr
            time.sleep(0.2)
        vkey = shown.stdout.strip()
        origin = vkey.split("+")[0]

        # Each host: its own operator key (not trusted by itself) and the log's verifier key. No host
        # holds a log key, and none is ever copied.
        public: dict[Path, Path] = {}
        for home in hosts:
            (home / "keys").mkdir(parents=True)
            (home / "keys" / "log.vkey").write_text(vkey + "\n")
            made = qualify(home, pg_url, "keys", "generate", "--no-trust")
            assert made.returncode == 0, made.stderr
            public[home] = tmp_path / f"{home.name}.pub"
            exported = qualify(home, pg_url, "keys", "export-public", "--key", home / "keys" / "operator.key")
            public[home].write_text(exported.stdout)

        files = {}
        for home in hosts[:2]:
            key = SigningKey.load(home / "keys" / "operator.key")
            lines = [
                json.dumps(synthetic_envelope(key, n, subject_digest=SUBJECT[7:], hostname=home.name))
                for n in range(PER_HOST)
            ]
            files[home] = tmp_path / f"{home.name}.jsonl"
            files[home].write_text("\n".join(lines) + "\n")

        # A host's first append does not trust its own key: its receipts are refused.
        refused = qualify(hosts[0], pg_url, "receipts", "import", files[hosts[0]])
        assert refused.returncode == 2 and "not by a trusted key" in refused.stderr, refused.stderr
        # Trusting an operator key is the administrator's act, a logged entry, where the log key is.
        for home in hosts:
            trusted = qualify(admin, pg_url, "keys", "trust", public[home], "--note", f"{home.name}")
            assert trusted.returncode == 0, trusted.stderr
        assert "administrator" in qualify(hosts[0], pg_url, "keys", "trust", public[hosts[1]]).stderr

        # Two hosts append concurrently; the sequencer is killed outright in the middle and restarted.
        importing = [start(home, pg_url, "receipts", "import", files[home], "--json") for home in hosts[:2]]
        deadline = time.monotonic() + 120
        while _count(pg_url, "receipts") == 0:  # the first batch is in: the hosts are mid-way
            assert time.monotonic() < deadline and all(p.poll() is None for p in importing)
            time.sleep(0.05)
        sequencer.send_signal(signal.SIGKILL)
        sequencer.wait(timeout=30)
        time.sleep(0.5)
        sequencer = _sequencer(admin, pg_url)
        placed: list[int] = []
        for process in importing:
            out, err = process.communicate(timeout=180)
            assert process.returncode == 0, err
            placed += [r["log_index"] for r in json.loads(out)]
        assert len(placed) == len(set(placed)) == 2 * PER_HOST

        # The third host approves from the two hosts' receipts; its decision goes through the queue too.
        policy = tmp_path / "policy.toml"
        policy.write_text('name = "fleet"\nverdict = "qualified"\nmin_hosts = 2\n')
        approved = qualify(hosts[2], pg_url, "approve", "--policy", policy, "--subject", SUBJECT, "--json")
        assert approved.returncode == 0, approved.stderr
        decision = json.loads(approved.stdout)
        assert decision["decision"] == "approved" and decision["hosts"] == ["host-a", "host-b"]
        assert len(decision["receipt_ids"]) == 2 * PER_HOST and decision["log_index"] is not None

        # Every machine verifies the whole log with the key it holds: gapless, nothing lost.
        size = 3 + 2 * PER_HOST + 1  # three key-trust entries, the receipts, the approval
        for home in (admin, *hosts):
            verified = qualify(home, pg_url, "log", "verify", "--json")
            assert verified.returncode == 0, verified.stderr
            report = json.loads(verified.stdout)
            assert report["size"] == size, report
            assert ("local log key" if home == admin else "verifier key from") in report["trusted_log_key"]
            checkpoint = json.loads(qualify(home, pg_url, "log", "checkpoint", "--json").stdout)
            assert checkpoint["origin"] == origin and checkpoint["size"] == size
        assert sorted(placed) == list(range(3, 3 + 2 * PER_HOST))
        # The untrusted host's import was refused before anything was queued; nothing waits in the queue.
        assert _count(pg_url, "pending_entries") == 0 and _count(pg_url, "pending_refusals") == 0
        for home in hosts:
            assert not (home / "keys" / "log.key").exists()
    finally:
        sequencer.send_signal(signal.SIGTERM)
        try:
            sequencer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sequencer.kill()
