"""`qualify approve`, `qualify audit report` and `qualify serve` from the command line: exit codes, JSON,
one-line errors, and nothing written on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qualify.cli import main
from qualify.commands.serve import read_token
from qualify.errors import UsageError
from receipts import dsse, keys
from receipts.canonical import canonical_json

from .approve_predicates import predicate
from .conftest import SUBJECT, TOKEN, Log, start_serve, statement

FLEET = Path(__file__).parents[2] / "examples" / "fleet.toml"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exit_.value.code or 0), out, err


def write_policy(tmp_path: Path, text: str) -> str:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return str(path)


def test_approved_build_exits_0_with_json_and_the_decision_is_in_the_log(
    cli_log: Log, capsys, tmp_path
) -> None:
    rid_a = cli_log.add(host="gpu-1")
    rid_b = cli_log.add(host="gpu-2")
    size = cli_log.store.size()
    code, out, _ = run(
        capsys, "approve", "--policy", str(FLEET), "--subject", SUBJECT, "--db", cli_log.url, "--json"
    )
    assert code == 0
    body = json.loads(out)
    assert body["decision"] == "approved" and sorted(body["receipt_ids"]) == sorted([rid_a, rid_b])
    assert body["log_index"] == size and body["policy_digest"].startswith("sha256:")
    assert cli_log.store.get_approval(body["approval_id"]).decision == "approved"


def test_denied_build_exits_1_and_prints_every_reason(cli_log: Log, capsys) -> None:
    cli_log.add(host="gpu-1", restarts=1)
    cli_log.add(host="gpu-2", backend="torch")
    code, out, _ = run(capsys, "approve", "--policy", str(FLEET), "--subject", SUBJECT, "--db", cli_log.url)
    assert code == 1
    assert out.startswith("DENIED")
    assert "condition 'no-restarts' is false" in out and "condition 'backend' is false" in out
    assert "gpu-1" in out and "gpu-2" in out
    assert "recorded as approval" in out


def test_warn_mode_exits_0_and_records_warn(cli_log: Log, capsys, tmp_path) -> None:
    cli_log.add(restarts=2)
    policy = write_policy(tmp_path, FLEET.read_text().replace('mode = "enforce"', 'mode = "warn"'))
    code, out, _ = run(
        capsys, "approve", "--policy", policy, "--subject", SUBJECT, "--db", cli_log.url, "--json"
    )
    assert code == 0
    body = json.loads(out)
    assert body["decision"] == "warn" and body["reasons"]
    assert cli_log.store.get_approval(body["approval_id"]).decision == "warn"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--subject", "latest"], "is not a digest"),
        (["--subject", SUBJECT, "--image", "engine:1"], "exactly one of --subject"),
        ([], "exactly one of --subject"),
    ],
)
def test_bad_subject_arguments_exit_2_and_write_nothing(cli_log: Log, capsys, args, message) -> None:
    before = cli_log.store.counts()
    code, out, err = run(capsys, "approve", "--policy", str(FLEET), "--db", cli_log.url, *args)
    assert code == 2 and message in err and err.count("\n") == 1 and out == ""
    assert cli_log.store.counts() == before


def test_a_policy_with_a_cel_error_exits_2_with_line_and_column(cli_log: Log, capsys, tmp_path) -> None:
    cli_log.add()
    before = cli_log.store.counts()
    policy = write_policy(tmp_path, FLEET.read_text().replace("restart_count == 0", "restart_count = 0"))
    code, _, err = run(capsys, "approve", "--policy", policy, "--subject", SUBJECT, "--db", cli_log.url)
    assert code == 2
    lines = Path(policy).read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.startswith("no-restarts"))
    column = lines[line - 1].index("= 0") + 1
    assert (
        err
        == f"error: policy {policy} line {line}, column {column}: condition 'no-restarts' does not compile: "
        "syntax error near '= 0'\n"
    )
    assert cli_log.store.counts() == before


def test_an_untrusted_signing_key_exits_2_and_writes_nothing(cli_log: Log, capsys, tmp_path) -> None:
    cli_log.add()
    stranger = keys.generate().save(tmp_path / "stranger.key")
    before = cli_log.store.counts()
    code, _, err = run(
        capsys,
        "approve",
        "--policy",
        str(FLEET),
        "--subject",
        SUBJECT,
        "--db",
        cli_log.url,
        "--key",
        str(stranger),
    )
    assert code == 2 and "is not trusted by this log" in err
    assert cli_log.store.counts() == before


def test_a_missing_store_exits_2(home: Path, capsys, tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'nothing-here.db'}"
    code, _, err = run(capsys, "approve", "--policy", str(FLEET), "--subject", SUBJECT, "--db", url)
    assert code == 2 and "no store" in err
    assert not (tmp_path / "nothing-here.db").exists()


def test_image_without_a_docker_engine_is_a_clear_error(cli_log: Log, capsys, monkeypatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    code, _, err = run(capsys, "approve", "--policy", str(FLEET), "--image", "engine:1", "--db", cli_log.url)
    assert code == 2 and "docker is not available" in err and "--subject" in err


def test_schema_flag_prints_the_policy_json_schema(capsys) -> None:
    code, out, _ = run(capsys, "approve", "--schema")
    assert code == 0 and json.loads(out)["properties"]["mode"]["enum"] == ["enforce", "warn"]


def test_a_receipt_signed_by_another_trusted_key_still_counts_unless_the_policy_names_keys(
    cli_log: Log, capsys, tmp_path
) -> None:
    other = keys.generate("p256")
    cli_log.store.trust_key(other.public_key(), "ci runner")
    payload = canonical_json(statement(SUBJECT, predicate(host="ci-1")))
    cli_log.store.append_receipt(dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, payload, other))
    base = 'verdict = "qualified"\n'
    code, _, _ = run(
        capsys, "approve", "--policy", write_policy(tmp_path, base), "--subject", SUBJECT, "--db", cli_log.url
    )
    assert code == 0
    pinned = base + f'trusted_keyids = ["{cli_log.key.keyid}"]\n'
    code, out, _ = run(
        capsys,
        "approve",
        "--policy",
        write_policy(tmp_path, pinned),
        "--subject",
        SUBJECT,
        "--db",
        cli_log.url,
    )
    assert code == 1 and "which the policy does not trust" in out


# ---------------------------------------------------------------- serve


def test_token_comes_from_the_file_or_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("QUALIFY_API_TOKEN", raising=False)
    assert read_token(None) is None
    monkeypatch.setenv("QUALIFY_API_TOKEN", "e" * 32)
    assert read_token(None) == "e" * 32
    (tmp_path / "token").write_text("f" * 40 + "\n")
    (tmp_path / "token").chmod(0o600)
    assert read_token(str(tmp_path / "token")) == "f" * 40
    (tmp_path / "short").write_text("abc")
    (tmp_path / "short").chmod(0o600)
    with pytest.raises(UsageError, match="at least 16 characters"):
        read_token(str(tmp_path / "short"))
    with pytest.raises(UsageError, match="cannot read the token file"):
        read_token(str(tmp_path / "missing"))


def test_a_checkpoint_key_other_than_the_logs_makes_no_receipt_count(cli_log: Log, capsys, tmp_path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from receipts.checkpoint import NoteSigner

    cli_log.add(host="gpu-1")
    cli_log.add(host="gpu-2")
    # An auditor pins a verifier key that did not sign this log's checkpoints: nothing verifies.
    wrong = NoteSigner("qualify.test/other", Ed25519PrivateKey.generate()).vkey()
    code, out, _ = run(
        capsys, "approve", "--policy", str(FLEET), "--subject", SUBJECT, "--db", cli_log.url, "--vkey", wrong
    )
    assert code == 1
    assert out.count("does not verify, so it counts for nothing") == 2


def test_serve_answers_health_and_refuses_decisions_without_the_token(
    cli_log: Log, home: Path, tmp_path
) -> None:
    import httpx

    cli_log.add()
    proc, port, health = start_serve(home, cli_log.url, tmp_path)
    try:
        base = f"http://127.0.0.1:{port}"
        assert health["decisions_enabled"] is True and health["log_size"] == cli_log.store.size()
        body = {"subject": SUBJECT, "policy": {"verdict": "qualified"}}
        assert httpx.post(f"{base}/v1/decisions", json=body, timeout=5).status_code == 401
        ok = httpx.post(
            f"{base}/v1/decisions", json=body, headers={"Authorization": "Bearer " + TOKEN}, timeout=5
        )
        assert ok.status_code == 200 and ok.json()["decision"] == "approved"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_junk_rows_beyond_the_last_good_checkpoint_do_not_deny_an_approval(cli_log: Log, capsys) -> None:
    """Two junk rows (an empty entry and a checkpoint row `junk`, which pass the insert guards) stop
    appends, but `approve` judges the receipts under the last good checkpoint, and says so."""
    from tests.store.conftest import Raw
    from tests.store.test_insert_guards import _forged_append

    cli_log.add(host="gpu-1")
    cli_log.add(host="gpu-2")
    args = (
        "approve",
        "--policy",
        str(FLEET),
        "--subject",
        SUBJECT,
        "--db",
        cli_log.url,
        "--dry-run",
        "--json",
    )
    code, out, _ = run(capsys, *args)
    before = json.loads(out)["decision"]
    raw = Raw(cli_log.url)
    try:
        _forged_append(raw, cli_log.store.size())
    finally:
        raw.close()
    code_after, out, err = run(capsys, *args)
    assert (code_after, json.loads(out)["decision"]) == (code, before)
    assert "beyond the last checkpoint that verifies with the log key" in err
