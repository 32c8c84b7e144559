"""`qualify approve --dry-run` writes nothing, a closed stdout (`| head -1`) changes neither the exit code nor
the recorded decision, and `qualify serve` refuses a token file others can read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import SUBJECT, TOKEN, Log, start_serve
from .test_cli import FLEET, run


def test_dry_run_evaluates_without_writing(cli_log: Log, capsys) -> None:
    cli_log.add(host="gpu-1")
    cli_log.add(host="gpu-2")
    before = cli_log.store.counts()
    args = ["approve", "--policy", str(FLEET), "--subject", SUBJECT, "--db", cli_log.url, "--dry-run"]
    code, out, _ = run(capsys, *args, "--json")
    body = json.loads(out)
    assert code == 0 and body["decision"] == "approved"
    assert body["approval_id"] is None and body["log_index"] is None
    code, out, _ = run(capsys, *args)
    assert code == 0 and out.startswith("APPROVED") and "not recorded (--dry-run)" in out
    assert cli_log.store.counts() == before


def test_dry_run_exits_1_on_a_denial_and_needs_no_signing_key(cli_log: Log, capsys) -> None:
    cli_log.add(host="gpu-1", restarts=2)
    cli_log.key_path.unlink()  # nothing is signed, so no key is needed
    before = cli_log.store.counts()
    code, out, _ = run(
        capsys, "approve", "--policy", str(FLEET), "--subject", SUBJECT, "--db", cli_log.url, "--dry-run"
    )
    assert code == 1 and out.startswith("DENIED")
    assert cli_log.store.counts() == before


def _approve_into_closed_pipe(log: Log, home: Path, *extra: str, read_first_line: bool) -> tuple[int, bytes]:
    read_end, write_end = os.pipe()
    if not read_first_line:
        os.close(read_end)  # the reader is gone before the first byte is written
    env = {**os.environ, "QUALIFY_HOME": str(home)}
    args = ["approve", "--policy", str(FLEET), "--subject", SUBJECT, "--db", log.url, *extra]
    proc = subprocess.Popen(
        [sys.executable, "-m", "qualify.cli", *args], env=env, stdout=write_end, stderr=subprocess.PIPE
    )
    os.close(write_end)
    if read_first_line:
        with os.fdopen(read_end, "rb") as reader:  # what `head -1` does
            first = reader.readline()
            assert first, "nothing was printed"
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


@pytest.mark.parametrize("read_first_line", [False, True], ids=["closed-at-once", "head-1"])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_closed_stdout_changes_neither_the_exit_code_nor_the_record(
    cli_log: Log, home: Path, read_first_line: bool, as_json: bool
) -> None:
    cli_log.add(host="gpu-1")
    cli_log.add(host="gpu-2")
    for number in range(30):  # many printed lines, so the reader is gone while they are written
        cli_log.add(host="gpu-3", restarts=number + 1)
    size = cli_log.store.size()
    extra = ("--json",) if as_json else ()
    code, err = _approve_into_closed_pipe(cli_log, home, *extra, read_first_line=read_first_line)
    assert code == 0, err.decode()
    assert b"Traceback" not in err and b"Broken pipe" not in err
    [approval] = cli_log.store.list_approvals(subject=SUBJECT)
    assert approval.decision == "approved" and approval.log_idx == size


def test_a_denial_into_a_closed_pipe_still_exits_1(cli_log: Log, home: Path) -> None:
    cli_log.add(host="gpu-1", restarts=1)
    code, err = _approve_into_closed_pipe(cli_log, home, read_first_line=False)
    assert code == 1, err.decode()
    [approval] = cli_log.store.list_approvals(subject=SUBJECT)
    assert approval.decision == "denied"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602])
def test_a_token_file_others_can_access_is_refused(tmp_path: Path, mode: int) -> None:
    from qualify.commands.serve import read_token
    from qualify.errors import UsageError

    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(mode)
    with pytest.raises(UsageError, match=rf"mode {mode:04o}\).*chmod 600 {token}$"):
        read_token(str(token))


def test_serve_with_a_readable_token_file_exits_2_in_one_line(
    cli_log: Log, home: Path, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o644)
    env = {**os.environ, "QUALIFY_HOME": str(home)}
    args = ["serve", "--port", "1", "--db", cli_log.url, "--token-file", str(token)]
    done = subprocess.run(
        [sys.executable, "-m", "qualify.cli", *args], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "accessible by group or others" in done.stderr


def test_a_private_token_file_is_accepted(tmp_path: Path, monkeypatch) -> None:
    from qualify.commands.serve import read_token

    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    assert read_token(str(token)) == "t" * 32
    token.chmod(0o400)
    assert read_token(str(token)) == "t" * 32


def test_serve_stops_soon_after_sigterm_with_a_request_in_flight(cli_log: Log, home: Path, tmp_path) -> None:
    import signal
    import socket
    import time

    proc, port, _ = start_serve(home, cli_log.url, tmp_path)
    try:
        # A client that sends half a body and then stalls keeps its request in flight.
        with socket.create_connection(("127.0.0.1", port)) as stalled:
            stalled.sendall(
                b"POST /v1/decisions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"sub'
            )
            time.sleep(0.5)
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
            assert time.monotonic() - start < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
