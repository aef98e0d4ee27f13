#!/usr/bin/env bash
# scripts/fault_matrix.sh without a GPU: a build directory whose epx_fault_rank is
# fake_fault_rank.sh (the real `epx launch` beside it) runs three rows of the matrix, once per
# way the fake behaves, and the script must count each as it should: passes, a survivor's failed
# verdict, a missing result, a process left behind, a socket file left behind.
# Usage: test_fault_matrix_script.sh EPX_BINARY REPO_ROOT
set -u
epx=$1 root=$2
work=$(mktemp -d /tmp/epx-fault-script.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/build/tests"
ln -s "$epx" "$work/build/epx"
cp "$root/tests/fault/fake_fault_rank.sh" "$work/build/tests/epx_fault_rank"
chmod +x "$work/build/tests/epx_fault_rank"
rows='^(inproc3-eager-stops-calling@between|ipc3-eager-killed@in-dispatch|ipc3-eager-killed@between\+mask)$'
errors=0
expect() {  # expect BEHAVIOUR EXIT SUMMARY TEXT...: the run's exit code, summary line and texts
  local behaviour=$1 want_rc=$2 summary=$3 out rc t; shift 3
  out=$(FAKE_FAULT=$behaviour FAULT_ROWS=$rows FAULT_LOGS=$work/logs FAULT_TABLE=$work/table.md \
        "$root/scripts/fault_matrix.sh" "$work/build" 2>&1)
  rc=$?
  [ "$rc" = "$want_rc" ] || { echo "FAIL $behaviour: exit $rc, expected $want_rc"; errors=$((errors + 1)); }
  for t in "fault-matrix: $summary" "$@"; do
    grep -qF -- "$t" <<<"$out" || { echo "FAIL $behaviour: no '$t' in:"; echo "$out"; errors=$((errors + 1)); }
  done
  grep -qF "fault-matrix: $summary" "$work/table.md" || { echo "FAIL $behaviour: table file"; errors=$((errors + 1)); }
}
expect pass 0 "3 passed, 0 failed" \
  "| stops-calling@between | in-process ×3 | eager | TimeoutError or PeerError | TimeoutError | 2.012 | yes | ok | 0 | pass |" \
  "| killed@between+mask | ipc ×3 | eager | masked | masked | 2.012 | yes | n/a | 0 | pass |"
expect fail 1 "0 passed, 3 failed" "rank 0: took 3.500 s, expected at most 3.000 s" "exit code 1" \
  "rank 2: took 3.500 s"
expect silent 1 "0 passed, 3 failed" "no result from rank 0; no result from rank 2"
expect orphan 1 "0 passed, 3 failed" "1 epx_fault_rank process(es) left"
expect socket 1 "1 passed, 2 failed" "ipc3-eager-killed@in-dispatch.sock left behind"
# The orphans were ended by the script.
if pgrep -f "$work/build/tests/epx_fault_rank --linger" >/dev/null; then
  echo "FAIL: a process the orphan run left is still there"; errors=$((errors + 1))
fi
listed=$("$root/scripts/fault_matrix.sh" "$work/build" --list | tail -n 1)
[ "$listed" = "fault-matrix: 55 rows (listed, not run)" ] || { echo "FAIL --list: $listed"; errors=$((errors + 1)); }
echo "fault_matrix.sh checks: $errors failed"
[ "$errors" -eq 0 ]
