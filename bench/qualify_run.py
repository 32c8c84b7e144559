"""`qualify run` on the proxy preset with the local launcher, timed end to end; its JSON report, the wall
time, every check condition with its source and (with --spec) the acceptance histogram the harness drove,
read back from the stored receipt, are written to --out with the run's provenance; --show-out keeps the
human `qualify receipts show` of that receipt. --monitor-cost runs it a second time with the harness's CUDA
activity monitor switched off (QUALIFY_MONITOR=off; that run cannot qualify on a GPU) and reports both wall
times and every check's seconds side by side: the monitor's cost. --again runs it a second time as it was
(the harness's caches, the seeded weights and the warm step's kernels, kept from the first): the next build
qualified on a host that has qualified one, reported beside the first. --logs-out copies the run dirs' logs
(the engine's, the warm step's) into a folder. `engines_compiled_here` lists, per engine log, each kernel
that engine compiled itself with its specialization (the lines qualify/engine/precompile.py's
log_own_compiles writes); `engine_startup` each engine's own account of its start-up's seconds, and
`weights_step` the seeding step's (what a fresh host's boot spends where)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench._common import write_result  # noqa: E402
from qualify.engine import REQUEST_LINE, STARTUP_LINE  # noqa: E402
from qualify.engine.precompile import OWN_COMPILE_LINE  # noqa: E402

CLI = ["-m", "qualify.cli", "run", "--layout", "2304,2304,2304,9216", "--preset", "proxy", "--json"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before the run is stopped")
    ap.add_argument("--spec", default="none", help="none | mtp:N, passed to qualify run")
    ap.add_argument("--show-out", help="write `qualify receipts show` of the receipt here")
    ap.add_argument("--monitor-cost", action="store_true", help="a second run without the CUDA monitor")
    ap.add_argument("--again", action="store_true", help="a second run on the caches the first kept")
    ap.add_argument("--logs-out", help="copy each run dir's *.log files into this folder")
    args = ap.parse_args()
    cli = [*CLI, "--spec", args.spec]
    r, wall, report = _run([sys.executable, *cli], args.timeout, {})
    receipt = _receipt(report.get("receipt_id"), args.show_out)
    result = {
        "bench": "qualify_run",
        "cli": " ".join(["python", *cli]),
        "exit_code": r.returncode,
        "wall_s": round(wall, 2),
        "run": report,
        **receipt,
    }
    _logs(report, args.logs_out, "first")
    result["engines_compiled_here"] = own_compiles(report.get("run_dir"))
    result["engine_startup"] = engine_startup(report.get("run_dir"))
    result["weights_step"] = weights_step(report.get("run_dir"))
    result["engine_request_seconds"] = request_seconds(report.get("run_dir"), receipt.get("check_waits"))
    if args.again:
        r2, wall2, second = _run([sys.executable, *cli], args.timeout, {})
        _logs(second, args.logs_out, "again")
        receipt2 = _receipt(second.get("receipt_id"), None)
        keys = ("verdict", "boot_phases", "check_seconds", "check_details", "check_waits", "kernel_cache",
                "fresh_host", "spec_drafts", "acceptance_histogram", "monitor_window_costs_s",
                "capture_step_timing", "evidence_seconds", "conditions")  # fmt: skip
        result["again"] = {
            "engine_request_seconds": request_seconds(second.get("run_dir"), receipt2.get("check_waits")),
            "engine_startup": engine_startup(second.get("run_dir")),
            "exit_code": r2.returncode,
            "wall_s": round(wall2, 2),
            "note": "the same command run right after the first on the same host: the harness's caches "
            "(seeded weights, the warm step's kernel cache) are the first run's",
            **{k: receipt2.get(k) for k in keys},
            "checks": second.get("checks"),  # status and reason per check, from the run's JSON report
        }
    if args.monitor_cost:
        r_off, wall_off, off = _run([sys.executable, *cli], args.timeout, {"QUALIFY_MONITOR": "off"})
        receipt_off = _receipt(off.get("receipt_id"), None)
        seconds = {c["name"]: c["seconds"] for c in report.get("checks", [])}
        seconds_off = {c["name"]: c["seconds"] for c in off.get("checks", [])}
        result["monitor_cost"] = {
            "wall_s_with_monitor": round(wall, 2),
            "wall_s_without_monitor": round(wall_off, 2),
            "exit_code_without_monitor": r_off.returncode,
            "check_seconds": {k: [seconds.get(k), seconds_off.get(k)] for k in seconds},
            "boot_phases": [receipt.get("boot_phases"), receipt_off.get("boot_phases")],
            "note": "[with, without]; the run without the monitor runs second, after the first warmed the "
            "harness's caches (its boot's preparation is the part to compare with care); its monitor check "
            "runs and fails, so its seconds are not the check's cost",
        }
    write_result(result, args.out)


def _run(
    cmd: list[str], timeout: float, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess, float, dict]:
    start = time.perf_counter()
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **env}
        )
    except subprocess.TimeoutExpired:
        sys.exit(f"qualify run did not finish within {timeout:.0f} s")
    wall = time.perf_counter() - start
    try:
        report = json.loads(r.stdout)
    except json.JSONDecodeError:
        sys.exit(f"qualify run exited {r.returncode} without a JSON report: {r.stderr.strip()[-500:]}")
    return r, wall, report


def _logs(report: dict, folder: str | None, name: str) -> None:
    """Every *.log below the run dir (the engine's, the warm step's, a reference's) into folder/name."""
    run_dir = report.get("run_dir")
    if not folder or not run_dir or not os.path.isdir(run_dir):
        return
    for base, _, files in os.walk(run_dir):
        for f in files:
            if f.endswith(".log"):
                rel = os.path.relpath(os.path.join(base, f), run_dir)
                os.makedirs(os.path.dirname(os.path.join(folder, name, rel)), exist_ok=True)
                shutil.copyfile(os.path.join(base, f), os.path.join(folder, name, rel))


def log_records(path: str, prefix: str) -> list[dict]:
    """The JSON record after `prefix` on each line of one log that starts with it; a record cut short is
    kept as {"unreadable": its first 200 characters}."""
    found: list[dict] = []
    with open(path, errors="replace") as fh:
        for line in fh:
            if line.startswith(prefix):
                try:
                    found.append(json.loads(line[len(prefix) :]))
                except json.JSONDecodeError:
                    found.append({"unreadable": line[len(prefix) :][:200]})
    return found


def _run_logs(run_dir: str | None) -> Iterator[str]:
    """Every .log file below the run dir (normalized), in a fixed order; none where there is no run dir."""
    if not run_dir or not os.path.isdir(run_dir):
        return
    for base, _, files in os.walk(os.path.normpath(run_dir)):
        for f in sorted(files):
            if f.endswith(".log"):
                yield os.path.join(base, f)


def _records_by_log(run_dir: str | None, prefix: str) -> dict[str, list[dict]]:
    """Per log below the run dir that has any, its records after `prefix` (log_records)."""
    out: dict[str, list[dict]] = {}
    for path in _run_logs(run_dir):
        found = log_records(path, prefix)
        if found:
            out[os.path.relpath(path, run_dir)] = found
    return out


def own_compiles(run_dir: str | None) -> dict[str, list[dict]]:
    """Per engine log below the run dir (the engine under test's engine.log, a reference's), the kernels
    that engine compiled itself, each with its specialization (qualify/engine/precompile.py,
    log_own_compiles): what the warm step's recording did not reach, and why."""
    return _records_by_log(run_dir, OWN_COMPILE_LINE)


def engine_startup(run_dir: str | None) -> dict[str, list[dict]]:
    """Per engine log below the run dir, each boot's own account of where its start-up's seconds went
    (imports, backend, allocations, waiting for its weights, loading them: the STARTUP_LINE records)."""
    return _records_by_log(run_dir, STARTUP_LINE)


def weights_step(run_dir: str | None) -> dict | None:
    """The seeding step's own account (the last JSON line of the run dir's weights-step.log: its seconds to
    start, configure, import, generate and stream); None where no step ran (the weights were cached)."""
    path = os.path.join(run_dir or "", "weights-step.log")
    if not run_dir or not os.path.isfile(path):
        return None
    with open(path, errors="replace") as fh:
        lines = [ln for ln in fh if ln.startswith("{")]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return {"unreadable": lines[-1][:200]}


def _sum_requests(lines: list[dict]) -> dict:
    """Count and summed seconds of completions, in all and per (speculative, mode used, prompts)."""
    keys = ("verb_s", "prefill_s", "handler_s", "prompts")

    def total(rows: list[dict]) -> dict:
        out = {"requests": len(rows), **{k: round(sum(float(r.get(k) or 0) for r in rows), 4) for k in keys}}
        out["prefill_s_per_prompt"] = round(out["prefill_s"] / out["prompts"], 5) if out["prompts"] else None
        return out

    groups: dict[str, list[dict]] = {}
    for r in lines:
        key = f"{'spec' if r.get('spec') else 'plain'} {r.get('mode')} n={r.get('n')}"
        groups.setdefault(key, []).append(r)
    return {"all": total(lines), "by_shape": {k: total(v) for k, v in sorted(groups.items())}}


def request_seconds(run_dir: str | None, check_waits: dict | None) -> dict:
    """Where completions' time went inside each engine (the `# request:` lines its server logs: the verb's
    seconds on the engine's worker, the prefill's share, the handler's), per engine log; for the engine
    under test (engine.log) also per check, its lines split in order by the number of completions the
    receipt's check_waits counts for each check (`aligned` false where the totals differ: a request that
    failed logs no line)."""
    out: dict[str, dict] = {}
    for path in _run_logs(run_dir):
        lines = [r for r in log_records(path, REQUEST_LINE) if "unreadable" not in r]
        if not lines:
            continue
        entry = _sum_requests(lines)
        rel = os.path.relpath(path, run_dir)
        if rel == "engine.log" and isinstance(check_waits, dict):
            counts = [
                (name, int((w.get("POST /v1/completions") or {}).get("n") or 0))
                for name, w in check_waits.items()
                if isinstance(w, dict)
            ]
            entry["aligned"] = sum(n for _, n in counts) == len(lines)
            per_check, at = {}, 0
            for name, n in counts:
                if n:
                    per_check[name] = _sum_requests(lines[at : at + n])["all"]
                    wait = (check_waits[name].get("POST /v1/completions") or {}).get("s")
                    per_check[name]["harness_wait_s"] = wait
                at += n
            entry["by_check"] = per_check
        out[rel] = entry
    return out


def _receipt(receipt_id: str | None, show_out: str | None) -> dict:
    """Conditions (holds, source) per check and the generation check's acceptance histograms, read back
    from the stored receipt by `qualify receipts show`, never from the run's own summary."""
    if not receipt_id:
        return {"receipt": None}
    base = [sys.executable, "-m", "qualify.cli", "receipts", "show", receipt_id]
    r = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    if r.returncode != 0:
        return {"receipt": f"receipts show exited {r.returncode}: {r.stderr.strip()[-300:]}"}
    predicate = json.loads(r.stdout).get("predicate", {})
    checks = predicate.get("checks", [])

    def ev_of(name: str) -> dict:
        return next((c for c in checks if c.get("name") == name), {}).get("evidence") or {}

    generation = ev_of("generation")
    kernel_cache = ((predicate.get("engine") or {}).get("sandbox") or {}).get("kernel_cache")
    spec = generation.get("speculation", generation)
    if show_out:
        shown = subprocess.run(base, capture_output=True, text=True, timeout=120, cwd=ROOT)
        with open(show_out, "w") as f:
            f.write(shown.stdout + shown.stderr)
    return {
        "verdict": predicate.get("verdict"),
        "target": predicate.get("target"),
        "conditions": {
            c["name"]: {k: [v.get("holds"), v.get("source")] for k, v in (c.get("conditions") or {}).items()}
            for c in checks
        },
        "acceptance_histogram": spec.get("acceptance_histogram"),
        # The harness's drafted runs per prompt tried: outcome, first divergence, claimed and expected counts.
        "spec_drafts": _drafts(generation.get("comparisons", {})),
        "mtp_acceptance_histogram": spec.get("mtp_acceptance_histogram"),
        "xid_watch": predicate.get("faults", {}).get("xid_watch"),
        # Where boot's time went (the boot check's evidence.phases) and the check times, as the receipt has
        # them: what a faster qualification starts from.
        "boot_phases": ev_of("boot").get("phases"),
        "check_seconds": {c.get("name"): c.get("seconds") for c in checks},
        # The CUDA activity monitor's own seconds per window phase, summed (checks/monitor.py).
        "monitor_window_costs_s": ((ev_of("monitor").get("monitor") or {}).get("window_costs_s")),
        # The compiled kernels each engine process was given (qualify/launch/kernels.py).
        "kernel_cache": kernel_cache,
        # Where a fresh host's extra seconds go, in one place: the weights' seeding (streamed and hashed as
        # generated), the warm step's parallel compile (workers, specializations, seconds), when each engine
        # got the kernels (at its start, or late after a wait), what each compiled itself, and the checks'
        # waits for the step.
        "fresh_host": _fresh_host(ev_of("boot").get("phases") or {}, kernel_cache or {}),
        "check_details": _details(checks),
        # Every seconds figure the checks' evidence records (peer runs, reloads, the fresh engine...), by
        # its path in the evidence: where a check's time went beyond its waits on the engine.
        "evidence_seconds": {c.get("name"): evidence_seconds(c.get("evidence") or {}) for c in checks},
        # The capture check's timing rule as it was decided: per captured size, the eager and graph per-step
        # samples (seconds, in the order taken), their medians, the rank p and the rounds.
        "capture_step_timing": step_timing(ev_of("capture")),
        # The harness's wait on the engine under test per endpoint inside each check (the rest of a
        # check's seconds is the harness's own work and other engines it booted).
        "check_waits": {
            c.get("name"): (c.get("evidence") or {}).get("time_waited_on_engine") for c in checks
        },
    }


def _fresh_host(phases: dict, kc: dict) -> dict:
    """The fresh-host figures from the boot check's phases and the receipt's kernel-cache record."""
    pre = kc.get("precompile") or {}
    engines = {}
    for name, given in (kc.get("given") or {}).items():
        late = given.get("late") or {}
        engines[name] = {
            "given": given.get("given"),
            "at_start": not late and bool(given.get("given")),
            "late_waited_s": late.get("waited_s"),
            "late_entries": late.get("entries"),
            "late_entries_it_had": late.get("entries_it_had"),
            # what it got at its start from a warm step still running (its finished entries), and whether
            # those are the files the step left in the end
            "early_entries": (given.get("early") or {}).get("entries"),
            "early_matches_kept": (given.get("early") or {}).get("matches_kept"),
            "compiled_itself": (given.get("compiled_itself") or {}).get("entries"),
            "compiled_itself_kernels": (given.get("compiled_itself") or {}).get("kernels"),
        }
    return {
        "harness_before_boot_s": phases.get("harness_before_boot"),
        "weights_seeding_step_s": phases.get("prepare_weights_seeding_step_s"),
        "weights_kept_after_step_s": phases.get("prepare_weights_kept_after_step_s"),
        # the stream's seconds on the harness's side: waiting on the step, hashing, writing
        **{
            f"weights_stream_{k}_s": phases.get(f"prepare_weights_stream_{k}_s")
            for k in ("read", "hash", "write")
        },
        "prepare_s": phases.get("prepare"),
        # the engine started beside the seeding (launch/local.py begin_weights): how long its start waited
        # for the seeding to end after spawning it (None where the weights were done before it started)
        "weights_start_waited_for_seeding_s": phases.get("prepare_weights_start_waited_for_seeding_s"),
        "engine_start_to_ready_s": phases.get("engine_start_to_ready"),
        "kernels_given_after_ready_s": phases.get("kernels_given_after_ready"),
        "warm_step_s": kc.get("warm_step_s"),
        "warm_step_filled_this_run": kc.get("filled_this_run"),
        "warm_seconds_each": kc.get("warm_seconds_each"),
        "precompile_workers": pre.get("jobs"),
        "precompile_specializations": pre.get("specializations"),
        "precompile_compiled": pre.get("compiled"),
        "precompile_failed": pre.get("failed_count", len(pre.get("failed") or [])),
        "precompile_record_s": pre.get("record_s"),
        # Why a recording pass stopped early (the run of 2026-12-04 recorded 16 specializations where a
        # CPU recording of the proxy records 30 without the projections; its error was not kept), and
        # which kernels it recorded and which launchers failed to build.
        "precompile_record_error": pre.get("record_error"),
        "precompile_deferred": pre.get("deferred"),
        "precompile_kernels": pre.get("kernels"),
        "precompile_launcher_errors": pre.get("launcher_errors"),
        "precompile_wait_after_record_s": pre.get("wait_after_record_s"),
        "precompile_s": pre.get("seconds"),
        "precompile_compile_cpu_s": pre.get("compile_cpu_s"),
        "precompile_launchers_built": pre.get("launchers_built"),
        "precompile_slowest": pre.get("slowest"),
        # the step's clock: where it was when (marks), the first and last specialization recorded, and the
        # compiles that finished last, each with when it was recorded and done
        "precompile_marks": pre.get("marks"),
        "precompile_recorded_at_s": pre.get("recorded_at_s"),
        "precompile_finished_last": pre.get("finished_last"),
        "waited_before_timed_checks_s": kc.get("waited_before_timed_checks_s"),
        "engines": engines,
        "cache_files": kc.get("files"),
    }


def _drafts(comparisons: dict) -> list[list[dict]]:
    prompts = [*comparisons.get("speculative_drafts_set_aside", []), comparisons.get("speculative_drafts")]
    return [
        [
            {
                "j": d.get("j"),
                "outcome": d.get("outcome"),
                "first_divergence": (d.get("coherence") or {}).get("first_divergence"),
                "accepted_per_step": d.get("accepted_per_step"),
                "expected_per_step": d.get("expected_per_step"),
            }
            for d in one
        ]
        for one in prompts
        if one
    ]


MAX_EVIDENCE_SECONDS = 80  # per check: the bound on what evidence_seconds lists


def _names_seconds(key: object) -> bool:
    return isinstance(key, str) and (
        key == "seconds" or key.startswith("seconds_") or key.endswith(("_seconds", "_s"))
    )


def evidence_seconds(evidence: dict) -> dict[str, float]:
    """The numbers in a check's evidence under a key that names seconds ("seconds", "seconds_*",
    "*_seconds", "*_s") or inside a mapping under one ("seconds_each": {"load": ...}), by their path
    ("a.b[2].seconds"), in the evidence's order, at most MAX_EVIDENCE_SECONDS of them."""
    out: dict[str, float] = {}

    def walk(path: str, node: object, in_seconds: bool, depth: int) -> None:
        pairs = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, v in pairs:
            if len(out) >= MAX_EVIDENCE_SECONDS or depth > 12:
                return
            sub = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
            named = in_seconds or _names_seconds(key)
            if named and isinstance(v, int | float) and not isinstance(v, bool):
                out[sub] = round(float(v), 4)
            else:
                walk(sub, v, named and isinstance(v, dict), depth + 1)

    walk("", evidence, False, 0)
    return out


def step_timing(capture: dict) -> dict:
    """The capture check's graph-versus-eager timing per request count: samples, medians, p, rounds."""
    keys = ("eager_samples_s", "graph_samples_s", "eager_step_s", "graph_step_s", "bound_s", "rank_p",
            "rounds", "first_rounds")  # fmt: skip
    timing = capture.get("step_timing")
    if not isinstance(timing, dict):
        return {}
    return {n: {k: f.get(k) for k in keys} for n, f in timing.items() if isinstance(f, dict)}


def _details(checks: list[dict]) -> dict:
    """Seconds inside the slow checks, as their evidence records them: the engine's own time per reload,
    the fresh reference's boot and total, boot's reload of the handed file."""
    ev = {c.get("name"): c.get("evidence") or {} for c in checks}
    reload, boot = ev.get("reload", {}), ev.get("boot", {})
    return {
        "reload_engine_seconds": {
            k: (reload.get(key) or {}).get("seconds")
            for k, key in (("same", "same_weights"), ("other", "other_weights"), ("back", "reload_back"))
        },
        "fresh_reference_seconds": (reload.get("fresh_engine") or {}).get("seconds"),
        "boot_handed_weights_reload_s": (boot.get("handed_weights_reload") or {}).get("seconds"),
    }


if __name__ == "__main__":
    main()
