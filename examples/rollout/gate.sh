#!/usr/bin/env bash
# A plain CI step in front of a deploy: ask qualify whether the build may roll out.
#   IMAGE=registry.example/glm-engine:5.3.1 POLICY=examples/fleet.toml bash examples/rollout/gate.sh
# or SUBJECT=sha256:<image id> instead of IMAGE; FROM_REGISTRY=1 reads the receipts attached to IMAGE in
# its registry (qualify receipts attach). The decision (JSON) is written to ${DECISION:-decision.json}.
# Exit codes, passed on unchanged: 0 approved (deploy), 1 denied (do not deploy; the reasons are printed),
# 2 could not decide (bad policy, no store, registry unreachable, ...: do not deploy, and page a person).
set -u
policy=${POLICY:?set POLICY to the rollout policy file}
out=${DECISION:-decision.json}
args=(approve --policy "$policy" --json)
if [ -n "${SUBJECT:-}" ]; then args+=(--subject "$SUBJECT"); else args+=(--image "${IMAGE:?set IMAGE or SUBJECT}"); fi
[ -n "${FROM_REGISTRY:-}" ] && args+=(--from-registry)
[ -n "${VKEY:-}" ] && args+=(--vkey "$VKEY")
[ -n "${DRY_RUN:-}" ] && args+=(--dry-run)

"${QUALIFY:-qualify}" "${args[@]}" >"$out"
rc=$?
case $rc in
  0) echo "qualify: approved ($(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["decision"], d["subject"])' "$out"))" ;;
  1) echo "qualify: DENIED; not deploying:" >&2
     python3 -c 'import json,sys; [print("  -", r) for r in json.load(open(sys.argv[1]))["reasons"]]' "$out" >&2 ;;
  *) echo "qualify: could not decide (exit $rc); not deploying" >&2; rc=2 ;;
esac
exit $rc
