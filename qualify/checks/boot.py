"""boot: the engine becomes healthy within the timeout; versions, device, driver and identity recorded; the
harness hashes the weights file itself (local launcher) and, on a GPU, sees the engine's pid on the GPU."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from qualify import settings
from qualify.checks.base import Check, Cond, Context, Outcome, engine_says, fail_unless, observed
from qualify.checks.weights import handed_reload_keeps_output
from qualify.launch.local import DEFAULT_ENGINE_MODULE
from qualify.protocol import SUPPORTED_PROTOCOL_VERSIONS, Describe
from qualify.run import launch as launch_doc
from qualify.run.geometry import geometry_for
from qualify.run.receipt import bare_hex, engine_code_digest_on_disk, file_digest, module_source_digest
from qualify.watch.procs import resolve_ns_pid

MANIFEST_TIMEOUT_S = 60.0  # `python -m MODULE manifest` imports the engine's package, nothing more
LATE_KERNELS_WAIT_S = 120.0  # the engine under test's first request waits at most this for the warm step


def sent_config(ctx: Context) -> dict[str, Any]:
    """What the harness asked the engine to be (its launch options): the config the receipt digests."""
    doc = ctx.facts.get("launch_document")
    if doc is not None:
        return launch_doc.sent_config(doc)
    r = ctx.request
    g = geometry_for(r)  # the KV geometry is sent as explicit flags too (qualify/run/geometry.py)
    return {
        "preset": r.preset,
        "kda_decode_backend": r.kda_backend,
        "num_spec": r.num_spec,
        "layer_pattern": g.layer_pattern,
        "block_size": g.block_size,
        "dcp_size": g.dcp_size,
        "dcp_ranks": g.dcp_ranks,
        "max_num_seqs": g.max_num_seqs,
        "max_model_len": g.max_model_len,
    }


def _weights(ctx: Context, d: Describe) -> tuple[dict[str, Any], Cond | None]:
    """The weights file the harness hashed and handed the engine (read-only, at a path it chose: the launch
    document's weights.path, create false); the engine must name that path. Otherwise (a launcher that
    hands over none, or a foreign engine that writes its own) the file the engine names, which must be the
    file the launch document named (without a document: a file in the data dir the harness and the engine
    share); docker: say that the harness could not (the file is inside the container)."""
    handed = getattr(ctx.launcher, "weights", None)
    if handed is not None:
        facts = {**handed.evidence(), "engine_names": d.engine.weights_path}
        named = d.engine.weights_path == handed.engine_path
        facts["engine_names_handed_file"] = named
        return facts, observed(True, f"{handed.path.name}: {handed.digest}")
    if ctx.launcher.kind != "local":
        return {"hashed": False, "why": "docker launcher: the weights are inside the container"}, None
    named = d.engine.weights_path
    if not named:
        return {"hashed": False, "why": "the engine named no weights file"}, observed(
            False, "the engine named no weights file (describe's engine.weights_path is null)"
        )
    host = getattr(ctx.launcher, "host_path", Path)  # a sandbox's scratch dir, as the harness sees it
    path = host(named).resolve()
    doc = ctx.facts.get("launch_document")
    if doc is not None:
        sent = host(doc.weights.path).resolve()
        if path != sent or not path.is_file():
            why = f"the engine names {path}, the launch document named {sent} (weights.path)"
            if path == sent:
                why = f"{path}, the file the launch document named, is not a file"
            return {"hashed": False, "path": str(path), "why": why}, observed(False, why)
    home = settings.data_dir().resolve()
    if doc is None and (not path.is_relative_to(home) or not path.is_file()):
        why = f"{path} is not a file under the data dir {home}"
        return {"hashed": False, "path": str(path), "why": why}, observed(False, why)
    digest = file_digest(path)
    facts = {"hashed": True, "path": str(path), "digest": digest, "bytes": path.stat().st_size}
    return facts, observed(True, f"{path.name}: {digest}")


def _device(ctx: Context, d: Describe, engine_pid: int | None) -> Cond:
    """On a GPU target with NVML running, the harness sees whether the engine's process is on a GPU;
    elsewhere (a CPU target, docker's own pid namespace, no NVML, or an NVML whose pids are not this pid
    namespace's, as inside some containers) only the engine's word is left, and the source says so."""
    device_target = "gpu" if d.device.type == "cuda" else "cpu"
    said = f"engine device {device_target}, target {ctx.target}"
    pids = ctx.gpu_pids() if ctx.target == "gpu" and ctx.launcher.kind == "local" else None
    if pids is None or engine_pid is None:
        return engine_says(device_target == ctx.target, said)
    on = pids.get(engine_pid, [])
    if on:
        return observed(True, f"NVML lists engine pid {engine_pid} on GPU {on}")
    if not any(Path(f"/proc/{pid}").exists() for pid in pids):
        return engine_says(device_target == ctx.target, f"{said}; NVML lists no pid of this namespace")
    return observed(False, f"NVML does not list engine pid {engine_pid} on any GPU (it lists {sorted(pids)})")


def holds_listener(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds the TCP socket listening on `port` (Linux /proc: the listening socket's
    inode among the process's open files); None when /proc cannot say. The tables are those of the
    process's own network namespace (a sandboxed engine's is not the harness's)."""
    inodes: set[str] = set()
    tables = 0
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        tables += 1
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    if not tables:
        return None
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


def serving_process(ctx: Context, health_pid: int, port: int | None) -> tuple[Cond, dict[str, Any]]:
    """`/health`'s pid, as the engine sees itself (its own pid namespace's view), mapped through /proc's
    NSpid onto the launched process tree: exactly one process of the tree must be it, and (where /proc can
    say) it must hold the socket listening on the engine's port. The pid is the engine's number, so the
    condition is `engine` (a supervisor naming itself passes it; /proc's restarts catch that one)."""
    tree = ctx.procs.sample() if ctx.procs is not None else {}
    hits = resolve_ns_pid(health_pid, tree.values())
    facts: dict[str, Any] = {"health_pid": health_pid, "tree": sorted(tree), "matches": [p.pid for p in hits]}
    if len(hits) != 1:
        why = f"/health pid {health_pid} is {len(hits)} processes of the launched tree {sorted(tree)}"
        return engine_says(False, why), facts
    proc = hits[0]
    facts.update(host_pid=proc.pid, start_ticks=proc.start)
    held = holds_listener(proc.pid, port) if port is not None else None
    facts["holds_listener"] = held
    ctx.facts["serving_process"] = {"pid": proc.pid, "start_ticks": proc.start, "health_pid": health_pid}
    if held is False:
        why = f"/health pid {health_pid} (host pid {proc.pid}) does not hold the listener on port {port}"
        return engine_says(False, why), facts
    return engine_says(True, f"/health pid {health_pid} is host pid {proc.pid} of the launched tree"), facts


def prepare_launch(ctx: Context) -> tuple[dict[str, Any], str | None]:
    """Before boot: read the engine's manifest, refuse a protocol version the harness does not speak, and
    write the launch document into the launcher's options (docs/PROTOCOL.md, "Launch"). (evidence, why
    the engine cannot be launched). A launcher that cannot read manifests boots with flags as before."""
    t0 = time.monotonic()
    raw, command, error = ctx.launcher.manifest(min(MANIFEST_TIMEOUT_S, max(1.0, ctx.remaining())))
    if error is not None and "cannot read an engine manifest" in error:
        return {"manifest": {"read": False, "why": error}}, None
    manifest, why = (None, error) if error else launch_doc.parse_manifest(raw, command)
    if manifest is None:
        return {"manifest": {"read": False, "command": command, "why": why}}, why
    ctx.facts["manifest"] = manifest
    evidence: dict[str, Any] = {"manifest": {"read": True, "command": command, **manifest.model_dump()}}
    ctx.facts["boot_phases"] = {"manifest": round(time.monotonic() - t0, 3)}
    refusal = launch_doc.manifest_refusal(manifest, ctx.request.preset, ctx.request.dcp)
    if refusal is not None:
        return evidence, refusal
    g = launch_doc.harness_geometry(ctx.request)
    kv = "bfloat16" if ctx.target == "gpu" else "float32"
    name = launch_doc.weights_name(manifest, ctx.request.preset, g.layer_pattern, kv, 0)
    # The reference engine's seeded weights fit an engine of its manifest (the reference, a wrapper of it):
    # the harness seeds and hashes them first and the document hands them over read-only (create false).
    # Another engine's weights are its own: it writes them where the document says (create true).
    # A launcher that can name the file before it exists (plan_weights) gets the document first, so the
    # reference engine's warm step (which reads the document, not the weights) starts beside the seeding.
    # A launcher that can also start the engine beside the seeding (begin_weights) tells the engine, in the
    # document, to wait for the file (weights.wait_s); the seeding's outcome is then the launcher's start's.
    prepare = getattr(ctx.launcher, "prepare_weights", None)
    plan = getattr(ctx.launcher, "plan_weights", None)
    begin = getattr(ctx.launcher, "begin_weights", None)
    reference = prepare is not None and manifest.name == launch_doc.REFERENCE_ENGINE_NAME
    beside = reference and plan is not None and begin is not None
    if reference and plan is not None:
        plan(dtype=kv)
        wait_s = float(getattr(ctx.launcher, "weights_wait_s", 0.0)) if beside else 0.0
        _launch_document(ctx, manifest, name, evidence, create=False, wait_s=wait_s)
        kernels = getattr(ctx.launcher, "prepare_kernels", None)
        if kernels is not None:
            kernels()
        ctx.facts["boot_phases"]["kernels_started"] = round(time.monotonic() - t0, 3)
    if reference:
        try:
            if beside:
                begin(max(1.0, ctx.remaining()), dtype=kv)
            else:
                prepare(max(1.0, ctx.remaining()), dtype=kv)
        except RuntimeError as exc:  # the seeding step failed: the engine cannot be handed its weights
            return evidence, str(exc)
    elif hasattr(ctx.launcher, "weights"):
        ctx.launcher.weights = None  # type: ignore[attr-defined]
        ctx.launcher.hand_weights = False  # type: ignore[attr-defined]
    # seeding beside the engine's start (the launcher's start takes its outcome), or done (cached, handed)
    begun = beside and getattr(ctx.launcher, "weights", None) is None
    mark = "weights_seeding_begun" if begun else "weights_seeded_and_hashed"
    ctx.facts["boot_phases"][mark] = round(time.monotonic() - t0, 3)
    if "launch_document" not in ctx.facts:
        _launch_document(ctx, manifest, name, evidence, create=getattr(ctx.launcher, "weights", None) is None)
    return evidence, None


def _launch_document(
    ctx: Context, manifest: Any, name: str, evidence: dict[str, Any], create: bool, wait_s: float = 0.0
) -> None:
    """Build the launch document (the weights where the launcher hands or lets the engine write them; wait_s:
    how long the engine waits for a handed file still being seeded) and give it to the launcher's options."""
    weights, scratch = ctx.launcher.launch_paths(name)
    doc = launch_doc.build(
        ctx.request, manifest, ctx.target, weights_path=weights, scratch_dir=scratch, weights_create=create,
        weights_wait_s=wait_s,
    )  # fmt: skip
    ctx.facts["launch_document"] = doc
    options = getattr(ctx.launcher, "options", None)
    if options is not None:
        ctx.launcher.options = replace(options, launch=doc.model_dump_json())  # type: ignore[attr-defined]
    evidence["launch"] = {"digest": launch_doc.document_digest(doc), "document": doc.model_dump(mode="json")}


def _code_identity(ctx: Context, d: Describe) -> tuple[str | None, Cond | None, dict[str, Any]]:
    """The harness's digest of the code a local engine runs, and whether the engine's claim agrees.

    The reference module: qualify/engine, protocol.py, shm.py and kernels. Another module is named as
    itself: either its own tree (a foreign engine: the module's package, `tree_digest`), or, for a module
    that runs the reference engine inside it (a wrapper, a patched build), the reference digest combined
    with its own (`sha256(reference NUL module NUL own)`). A foreign engine claiming the reference's digest
    matches neither, so it never borrows the reference's identity."""
    if ctx.launcher.kind != "local":
        return None, None, {}
    module = getattr(ctx.launcher, "module", DEFAULT_ENGINE_MODULE)
    base = engine_code_digest_on_disk()
    claim = bare_hex(d.engine.code_digest)
    if module == DEFAULT_ENGINE_MODULE:
        cond = engine_says(claim == bare_hex(base), f"engine says {d.engine.code_digest}, disk has {base}")
        return base, cond, {"harness_on_disk": base}
    own, where = module_source_digest(module)
    if own is None:
        return base, engine_says(False, f"the harness cannot hash the engine module: {where}"), {"why": where}
    wrapped = "sha256:" + hashlib.sha256(f"{base}\0{module}\0{own}".encode()).hexdigest()
    seen = {"module": module, "own_tree": own, "reference_wrapped": wrapped, "where": where}
    if claim == bare_hex(own):
        ctx.facts["code_identity"] = (own, f"{where}: the engine's own code, hashed by the harness")
        return own, engine_says(True, f"engine says {own}: its own tree ({where})"), seen
    if claim == bare_hex(wrapped):
        scope = f"qualify/engine, qualify/protocol.py and kernels, hashed by the harness, plus {where}: {own}"
        ctx.facts["code_identity"] = (wrapped, scope)
        ok = engine_says(True, f"engine says {wrapped}: the reference engine run by {module}")
        return wrapped, ok, seen
    detail = (
        f"engine says {d.engine.code_digest}; the harness hashed {module} as {own} (its own tree: {where}) "
        f"and as {wrapped} (the reference engine {base} run by it); a foreign engine reports its own tree's "
        "digest (docs/PROTOCOL.md, Identity)"
    )
    return own, engine_says(False, detail), seen


def run(ctx: Context) -> Outcome:
    t0 = time.monotonic()
    prep, refusal = prepare_launch(ctx)
    prepared_s = time.monotonic() - t0
    if refusal is not None:
        return Outcome("fail", prep, refusal, {"engine_manifest_accepted": observed(False, refusal)})
    if hasattr(ctx.launcher, "on_spawn"):  # work that needs only the engine's process starts with it
        ctx.launcher.on_spawn = ctx.engine_spawned  # type: ignore[attr-defined]
    try:
        ctx.url = ctx.launcher.start(ctx.remaining())
    except TimeoutError as exc:
        return Outcome("error", {"logs": ctx.launcher.logs_tail(15)}, str(exc))
    except RuntimeError as exc:
        return Outcome(
            "fail",
            {"status": ctx.launcher.status().to_evidence(), "logs": ctx.launcher.logs_tail(15)},
            str(exc),
        )
    ready_s = time.monotonic() - t0
    started_s = ready_s - prepared_s
    ctx.engine_up()  # later checks' work that needs only a running engine starts now, beside boot's
    # The engine under test boots while the warm step compiles (launch/kernels.py): before its first request
    # the harness waits (bounded) for the step and gives it the kernels the step compiled.
    late = getattr(ctx.launcher, "give_kernels_late", None)
    kernels_late = late(min(LATE_KERNELS_WAIT_S, ctx.remaining() / 4)) if late is not None else None
    kernels_late_s = time.monotonic() - t0 - ready_s
    if ctx.procs is not None:
        ctx.procs.start().mark_baseline()  # the engine as booted: what a later restart would replace
    health = ctx.client.health()
    d = ctx.client.describe()
    ctx.describe = d
    sent = sent_config(ctx)
    described = {k: d.config.get(k) for k in sent}
    described["num_spec"] = d.capacity.num_spec
    # A local engine's self-reported code digest must equal the digest the harness computes of the code it
    # launched (the receipt's code subject is the harness's).
    disk_digest, code_cond, code_seen = _code_identity(ctx, d)
    launcher_pid = ctx.launcher.status().detail.get("pid")
    weights, weights_cond = _weights(ctx, d)
    ctx.facts["weights_file"] = weights
    evidence = {
        "url": ctx.url,
        "ready_seconds": round(ready_s, 3),
        "pid": health.pid,
        "launcher_pid": launcher_pid,
        "engine": d.engine.model_dump(mode="json"),
        "device": d.device.model_dump(mode="json"),
        "driver": d.device.driver,
        "versions": d.versions.model_dump(mode="json"),
        "config": {"sent": sent, "described": described, "described_digest": d.config_digest},
        "target": {"expected": ctx.target, "engine_device": d.device.type},
        "code_digest": {"engine": d.engine.code_digest, "harness_on_disk": disk_digest, **code_seen},
        "protocol_version": d.protocol_version,
        **prep,
        "weights_file": weights,
        "cudagraph_mode": d.cudagraph_mode,
        "launcher": ctx.launcher.identity(),
    }
    differ = {k: (v, described[k]) for k, v in sent.items() if described[k] != v}
    spoken = d.protocol_version in SUPPORTED_PROTOCOL_VERSIONS
    speaks = list(SUPPORTED_PROTOCOL_VERSIONS)
    conditions = {
        # The version the engine answers in; the harness reads nothing else right from another version.
        "protocol_version_spoken": engine_says(
            spoken,
            f"protocol {d.protocol_version}"
            if spoken
            else f"the engine reports protocol version {d.protocol_version!r} in describe; this harness "
            f"speaks {speaks}",
        ),
        # What the harness sent is the receipt's config; the engine's account of it must agree.
        "described_config_agrees_with_sent": engine_says(
            not differ, f"sent vs described: {differ}" if differ else None
        ),
        "device_matches_target": _device(ctx, d, launcher_pid if isinstance(launcher_pid, int) else None),
    }
    if ctx.procs is not None:
        # /health's pid is compared with the processes the harness launched, not just recorded.
        cond, facts = serving_process(ctx, health.pid, urlsplit(ctx.url).port)
        evidence["health_pid"] = facts
        conditions["health_pid_is_the_serving_process"] = cond
    port = urlsplit(ctx.url).port
    if ctx.launcher.kind == "local" and isinstance(launcher_pid, int) and port is not None:
        # The process the harness launched is the one listening where the harness sends its requests.
        held = holds_listener(launcher_pid, port)
        evidence["listener"] = {"pid": launcher_pid, "port": port, "held": held}
        if held is not None:
            conditions["launched_process_serves_the_port"] = observed(
                held, None if held else f"pid {launcher_pid} does not hold the listener on port {port}"
            )
    if weights_cond is not None:
        conditions["weights_file_hashed"] = weights_cond
    handed = getattr(ctx.launcher, "weights", None)
    if handed is not None:
        conditions["engine_names_handed_weights"] = engine_says(
            bool(weights.get("engine_names_handed_file")),
            None
            if weights.get("engine_names_handed_file")
            else f"the engine names {weights.get('engine_names')}, not {handed.engine_path}",
        )
        t_reload = time.monotonic()
        cond, evidence["handed_weights_reload"] = handed_reload_keeps_output(ctx, handed.engine_path)
        conditions["handed_weights_reload_keeps_output"] = cond
        evidence["handed_weights_reload"]["seconds"] = round(time.monotonic() - t_reload, 3)
    if code_cond is not None:
        # The harness hashed the code it launched; the engine's claim about itself must agree with it (one
        # side is the engine's number: `engine`).
        conditions["code_digest_matches_disk"] = code_cond
    doc = ctx.facts.get("launch_document")
    if doc is not None:
        ctx.facts["protocol_version"] = d.protocol_version
        cap = d.capacity
        want = {"max_num_seqs": doc.capacity.max_num_seqs, "num_spec": doc.capacity.num_spec,
                "max_num_batched_tokens": doc.capacity.max_num_batched_tokens}  # fmt: skip
        got = {k: getattr(cap, k) for k in want}
        conditions["capacity_as_sent"] = engine_says(
            got == want, f"describe's capacity {got}, the launch document sent {want}"
        )
    # Where boot's time went (cumulative marks of prepare_launch, then each step's own seconds): what a
    # faster qualification starts from (bench/qualify_run.py reports them).
    evidence["phases"] = {
        # the harness's seconds from its process's start to this check (imports, the run dir, watchers)
        **(
            {"harness_before_boot": ctx.facts["before_first_check_s"]}
            if "before_first_check_s" in ctx.facts
            else {}
        ),
        **{f"harness_before_boot_{k}_s": v for k, v in ctx.facts.get("before_first_check_each", {}).items()},
        **{f"prepare_{k}_at": v for k, v in (ctx.facts.get("boot_phases") or {}).items()},
        # durations inside the weights mark: the sandboxed seeding step, the harness's copy and hash
        **{f"prepare_weights_{k}_s": v for k, v in getattr(ctx.launcher, "weights_phases", {}).items()},
        "prepare": round(prepared_s, 3),
        "engine_start_to_ready": round(started_s, 3),
        # waiting for the warm step and copying its kernels into the running engine (none: given at start)
        **({"kernels_given_after_ready": round(kernels_late_s, 3)} if kernels_late is not None else {}),
        "checks_after_ready": round(time.monotonic() - t0 - ready_s, 3),
    }
    return fail_unless(conditions, evidence)


CHECK = Check("boot", run, timeout_s=300.0)
