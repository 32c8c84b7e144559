"""`qualify approve`: decide from stored, verified receipts whether a build may roll out, and append the
signed decision to the log (or not, with --dry-run). Exit 0 approved (or warn), 1 denied, 2 bad input."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console

from qualify import settings
from qualify.commands._common import (
    db_option,
    emit,
    json_option,
    log_verifiers,
    open_append,
    open_read,
    opened,
    parse_vkey,
    store_errors,
    vkey_option,
    warn_served,
)
from qualify.errors import UsageError
from receipts.keys import SigningKey

if TYPE_CHECKING:
    from qualify.approve import Decision
    from receipts.store import Store

# qualify.approve and qualify.policy (pydantic, CEL) and the store are imported when a decision is made,
# so that `qualify approve --help` starts at once.

STYLE = {"approved": "bold green", "denied": "bold red", "warn": "bold yellow"}


def resolve_image(ref: str) -> str:
    """A local docker image's id (sha256:...), the digest receipts name; UsageError when docker cannot say."""
    try:
        from docker.errors import DockerException, ImageNotFound

        import docker
    except ImportError as exc:  # pragma: no cover - docker is a dependency
        raise UsageError(
            "--image needs the docker SDK (pip install docker); pass --subject sha256:... instead"
        ) from exc
    try:
        client = docker.from_env()
    except DockerException as exc:
        raise UsageError(
            f"cannot resolve --image {ref}: docker is not available ({str(exc).splitlines()[0][:120]}); "
            "pass --subject sha256:... instead"
        ) from None
    try:
        return str(client.images.get(ref).id)
    except ImageNotFound:
        raise UsageError(
            f"image {ref} is not in the local docker engine; docker pull it or pass --subject"
        ) from None
    except DockerException as exc:
        raise UsageError(f"cannot resolve --image {ref}: {str(exc).splitlines()[0][:160]}") from None
    finally:
        client.close()


def load_signing_key(store: Store, path: str | None) -> SigningKey:
    """The operator key that signs decisions (default: the one `qualify run` uses); the log must trust it."""
    key = SigningKey.load(Path(path) if path else settings.default_key_path())
    if key.keyid not in store.trusted_keys():
        raise UsageError(
            f"key {key.keyid[:16]} is not trusted by this log; "
            "trust it first: qualify keys trust <public key file>"
        )
    return key


class _PipeConsole(Console):
    """A console that, when its reader has gone (`| head -1`), lets the caller decide the exit code
    (rich's default exits 1, which reads as "denied")."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def _silence_stdout() -> None:
    # Later writes, and the interpreter's flush at exit, go nowhere instead of failing (exit 120).
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (captured): nothing to silence
        pass
    finally:
        os.close(devnull)


def print_even_if_closed(show: Callable[[], None]) -> None:
    """Print; a closed stdout stops the printing but changes nothing else (the decision is already
    recorded and the exit code still says what it was)."""
    try:
        show()
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()


def print_decision(console: Console, decision: Decision) -> None:
    style = STYLE.get(decision.decision, "bold")
    name = f" {decision.policy_name!r}" if decision.policy_name else ""
    console.print(
        f"[{style}]{decision.decision.upper()}[/] {decision.subject} by policy{name} "
        f"({decision.policy_digest[:19]}…, mode {decision.mode})",
        highlight=False,
    )
    console.print(
        f"  {len(decision.receipt_ids)} receipt(s) counted from {len(decision.hosts)} host(s) "
        f"({', '.join(decision.hosts) or 'none'}); the policy needs {decision.required_hosts}",
        highlight=False,
    )
    for rid in decision.receipt_ids:
        console.print(f"  relied on receipt {rid}", highlight=False)
    for reason in decision.reasons:
        console.print(f"  [red]-[/] {reason}", highlight=False)
    for note in decision.ignored:
        console.print(f"  [dim]ignored:[/] {note}", highlight=False)
    if decision.approval_id:
        console.print(
            f"  recorded as approval {decision.approval_id} at log #{decision.log_index}", highlight=False
        )
    else:
        console.print("  not recorded (--dry-run)", highlight=False)


@click.command("approve")
@click.option("--policy", "policy_path", metavar="FILE", help="Policy file (.toml, .yaml or .json).")
@click.option("--subject", metavar="DIGEST", help="sha256:<hex> of the engine image (or config) to approve.")
@click.option("--image", metavar="REF", help="A local docker image; its id is the subject.")
@db_option
@click.option("--key", "key_path", default=None, metavar="PATH", help="Key that signs the decision.")
@vkey_option
@json_option
@click.option(
    "--dry-run", is_flag=True, help="Evaluate and print the decision without writing it to the log."
)
@click.option("--schema", is_flag=True, help="Print the policy file's JSON Schema and exit.")
@click.option(
    "--from-registry",
    is_flag=True,
    help="With --image REGISTRY/REPO:TAG: judge the receipts attached to the image in its registry "
    "(qualify receipts attach), each verified against this log's keys.",
)
@click.option("--plain-http", is_flag=True, help="Talk HTTP to the registry (default: only for loopback).")
@store_errors
def approve(
    policy_path: str | None,
    subject: str | None,
    image: str | None,
    db_url: str | None,
    vkey: str | None,
    key_path: str | None,
    as_json: bool,
    dry_run: bool,
    schema: bool,
    from_registry: bool,
    plain_http: bool,
) -> None:
    """Approve or deny the rollout of a build from its stored receipts, and record the signed decision.

    Exit 0: approved (or denied in warn mode). 1: denied. 2: bad input, nothing written. With --dry-run
    the store is only read and nothing is signed or written; the exit code is the same. With
    --from-registry the receipts come from the image's registry (referrers and the .att tag), each
    counted only if its tlog-proof verifies under this log's checkpoint key and a key this log trusted
    at its index signed it.
    """
    from qualify.approve import check_subject, decide, record
    from qualify.policy import load_policy, policy_json_schema

    if schema:
        print_even_if_closed(lambda: click.echo(json.dumps(policy_json_schema(), indent=2)))
        return
    if not policy_path:
        raise UsageError("--policy FILE is required (see qualify approve --schema for its format)")
    if bool(subject) == bool(image):
        raise UsageError("give exactly one of --subject sha256:<hex> or --image REF")
    if from_registry and not image:
        raise UsageError("--from-registry reads the receipts attached to an image: give --image REF")
    # Everything that can be refused is checked before the store is written to.
    loaded = load_policy(policy_path)
    attestations = None
    if from_registry:
        from qualify import oci

        found, attestations = oci.read_back(image or "", plain_http or None)
        # Receipts of a docker run name the image by its id (the config digest docker shows).
        digest = check_subject(found.config_digest or found.digest)
    else:
        digest = check_subject(subject) if subject else check_subject(resolve_image(image or ""))
    pinned = [parse_vkey(vkey)] if vkey else None
    # The store must exist: an approval about a log that was never written is a mistake in --db.
    with opened(open_read(db_url) if dry_run else open_append(db_url, create=False)) as store:
        key = None if dry_run else load_signing_key(store, key_path)
        # Checkpoints are checked against the local log key (or --vkey), not the one the database names.
        verifiers = pinned or log_verifiers(store)[0]
        decision = decide(store, loaded, digest, verifiers=verifiers, attestations=attestations)
        warn_served(store)  # rows beyond the last good checkpoint: judged from it, and said so
        if key is not None:
            decision = record(store, decision, loaded, key)
    console = _PipeConsole(highlight=False, soft_wrap=True)
    print_even_if_closed(
        lambda: emit(as_json, decision.model_dump(mode="json"), lambda: print_decision(console, decision))
    )
    sys.exit(decision.exit_code)
