"""The rollout-gate examples, as far as the CLI goes: examples/rollout/gate.sh (a plain CI step) and the
exact command of examples/rollout/analysis-template.yaml (an Argo Rollouts Job) map a decision to exit
0 approved, 1 denied, 2 could not decide, and the template's podFailurePolicy maps those the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from receipts import dsse
from receipts.canonical import canonical_json
from receipts.keys import SigningKey
from receipts.testing import synthetic_statement

ROOT = Path(__file__).resolve().parents[2]
GATE = ROOT / "examples" / "rollout" / "gate.sh"
TEMPLATE = ROOT / "examples" / "rollout" / "analysis-template.yaml"
QUALIFY = str(Path(sys.executable).parent / "qualify")
SUBJECT = "sha256:" + "5e" * 32


def _store(cli, home: Path, tmp_path: Path, subject: str, hosts: list[str]) -> dict[str, Any]:
    url = f"sqlite:///{tmp_path / 'gate.db'}"
    assert cli("keys", "generate", "--algorithm", "p256", "--db", url).code == 0
    key = SigningKey.load(home / "keys" / "operator.key")
    ids = []
    for n, host in enumerate(hosts):
        statement = synthetic_statement(n, subject_digest=subject.removeprefix("sha256:"))
        statement["predicate"]["host"]["hostname"] = host
        path = tmp_path / f"r{n}.json"
        path.write_text(json.dumps(dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, canonical_json(statement), key)))
        done = cli("receipts", "import", path, "--db", url, "--json")
        assert done.code == 0, done.err
        ids.append(json.loads(done.out)[0]["id"])
    vkey = tmp_path / "log.vkey"
    vkey.write_text(cli("log", "vkey", "--db", url).out)
    return {"url": url, "ids": ids, "vkey": vkey}


def _policy(tmp_path: Path, hosts: int) -> Path:
    path = tmp_path / f"policy-{hosts}.toml"
    path.write_text(f'name = "gate"\nverdict = "qualified"\nmin_hosts = {hosts}\n')
    return path


def _gate(home: Path, tmp_path: Path, url: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "QUALIFY_HOME": str(home), "QUALIFY_DB_URL": url, "QUALIFY": QUALIFY}
    full["DECISION"] = str(tmp_path / "decision.json")
    return subprocess.run(
        ["bash", str(GATE)], env={**full, **env}, capture_output=True, text=True, timeout=120
    )


def test_the_ci_step_exits_0_approved_1_denied_2_undecided(cli, home, tmp_path: Path) -> None:
    made = _store(cli, home, tmp_path, SUBJECT, ["node-a", "node-b"])
    approved = _gate(home, tmp_path, made["url"], POLICY=str(_policy(tmp_path, 2)), SUBJECT=SUBJECT)
    assert approved.returncode == 0, approved.stderr
    assert "approved" in approved.stdout
    assert json.loads((tmp_path / "decision.json").read_text())["decision"] == "approved"

    denied = _gate(home, tmp_path, made["url"], POLICY=str(_policy(tmp_path, 3)), SUBJECT=SUBJECT)
    assert denied.returncode == 1 and "DENIED" in denied.stderr
    assert "the policy needs 3" in denied.stderr  # the reasons are printed for the person reading CI logs

    missing = _gate(home, tmp_path, made["url"], POLICY=str(tmp_path / "nope.toml"), SUBJECT=SUBJECT)
    assert missing.returncode == 2 and "could not decide" in missing.stderr
    no_store = _gate(home, tmp_path, f"sqlite:///{tmp_path / 'typo.db'}", POLICY=str(_policy(tmp_path, 2)),
                     SUBJECT=SUBJECT)  # fmt: skip
    assert no_store.returncode == 2 and "could not decide" in no_store.stderr
    bad_subject = _gate(home, tmp_path, made["url"], POLICY=str(_policy(tmp_path, 2)), SUBJECT="sha256:x")
    assert bad_subject.returncode == 2


def _template() -> dict[str, Any]:
    return yaml.safe_load(TEMPLATE.read_text())


def test_the_analysis_template_maps_exit_codes_as_documented() -> None:
    doc = _template()
    assert doc["kind"] == "AnalysisTemplate" and doc["apiVersion"] == "argoproj.io/v1alpha1"
    job = doc["spec"]["metrics"][0]["provider"]["job"]["spec"]
    rules = {r["action"]: r["onExitCodes"]["values"] for r in job["podFailurePolicy"]["rules"]}
    assert rules == {"FailJob": [1], "Count": [2]}  # denied fails at once; undecided is retried, then fails
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it
    (container,) = job["template"]["spec"]["containers"]
    assert container["command"][:2] == ["qualify", "approve"] and "--json" in container["command"]


def _run_template(home: Path, url: str, policy: Path, vkey: Path, image: str) -> subprocess.CompletedProcess:
    (container,) = _template()["spec"]["metrics"][0]["provider"]["job"]["spec"]["template"]["spec"][
        "containers"
    ]
    swap = {
        "/etc/qualify/fleet.toml": str(policy),
        "/etc/qualify/log.vkey": str(vkey),
        "{{args.image}}": image,
    }
    command = [QUALIFY, *(swap.get(arg, arg) for arg in container["command"][1:])]
    env = {**os.environ, "QUALIFY_DB_URL": url, "QUALIFY_HOME": str(home)}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_the_analysis_templates_command_through_the_cli(cli, home, tmp_path, pushed_image, registry) -> None:
    """The Job's exact command (paths swapped for this test's files) against a real registry: 1 while
    one host's receipt is attached, 0 once both are, 2 when the registry cannot be reached."""
    ref = pushed_image["ref"]
    made = _store(cli, home, tmp_path, pushed_image["image_id"], ["node-a", "node-b"])
    policy = _policy(tmp_path, 2)
    assert cli("receipts", "attach", made["ids"][0], "--image", ref, "--db", made["url"]).code == 0
    one = _run_template(home, made["url"], policy, made["vkey"], ref)
    assert one.returncode == 1, one.stdout + one.stderr
    assert cli("receipts", "attach", made["ids"][1], "--image", ref, "--db", made["url"]).code == 0
    both = _run_template(home, made["url"], policy, made["vkey"], ref)
    assert both.returncode == 0, both.stdout + both.stderr
    decision = json.loads(both.stdout)
    assert decision["decision"] == "approved" and decision["approval_id"]  # recorded in the log
    gone = _run_template(home, made["url"], policy, made["vkey"], "127.0.0.1:1/qualify-test/engine:none")
    assert gone.returncode == 2 and gone.stdout == ""
