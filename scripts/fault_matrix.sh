#!/usr/bin/env bash
# The reliability fault matrix, on a machine with an NVIDIA GPU: one rank of a job fails (never
# arrives, is killed, stops calling, or faults its CUDA context) at each point of a round
# (before-dispatch, in-dispatch, between, in-combine), eager and graph, in an in-process world
# of 3 ranks and in jobs of 2 and 3 processes on one GPU (`epx launch`); every surviving rank
# must get a TimeoutError or PeerError that names the faulty rank and a phase within
# timeout_ms + 1 s of the start of the fault round, stay alive and (in-process) serve a
# recreated group; with --mask the survivors must instead mask the rank and go on serving.
# Each row is one run of `epx_fault_rank` (tests/fault/fault_rank.cpp), bounded by `timeout`;
# afterwards no epx_fault_rank process and no bootstrap socket file may remain.
#
# Usage: scripts/fault_matrix.sh [build-dir] [--list]
#   --list             print every row's command and stop (no GPU needed)
#   FAULT_TABLE=path   also write the markdown table there
#   FAULT_ROWS=regex   run only the rows whose name matches (e.g. 'ipc2-.*killed')
#   FAULT_TIMEOUT_MS   timeout_ms of every run (default 2000)
#   FAULT_GPU          the GPU every run uses (default 0)
#   FAULT_LOGS         where each row's output goes (default <build-dir>/fault-logs)
# Ends with "fault-matrix: N passed, M failed" (exit 0 when M = 0). Expected to take 4-5 minutes
# (55 rows of a few seconds each; estimated, not yet measured).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
build=build
list=""
for arg in "$@"; do
  case $arg in
    --list) list=1 ;;
    -*) echo "fault_matrix.sh: unknown option '$arg', expected [build-dir] [--list]" >&2; exit 2 ;;
    *) build=$arg ;;
  esac
done
driver=$build/tests/epx_fault_rank
launcher=$build/epx
timeout_ms=${FAULT_TIMEOUT_MS:-2000}
gpu=${FAULT_GPU:-0}
logs=${FAULT_LOGS:-$build/fault-logs}
filter=${FAULT_ROWS:-}
case $timeout_ms in
  ''|*[!0-9]*) echo "fault_matrix.sh: FAULT_TIMEOUT_MS = '$timeout_ms', expected milliseconds (an integer)" >&2; exit 2 ;;
esac
# A run outlives its case by far only when something hangs: start-up, the rounds, a timeout or
# two, the driver's own watchdog (30 s + 5 bounds) and the launcher's grace.
row_limit=$(( 45 + 6 * (timeout_ms / 1000 + 1) ))

# ---- the rows: NAME KIND RANKS MODE FAULT AT MASK FAULTY ('-' = no --at) ----------------------
rows=()
points="before-dispatch in-dispatch between in-combine"
for mode in eager graph; do
  rows+=("inproc3-$mode-never-arrives in-process 3 $mode never-arrives - 0 1")
  for at in $points; do rows+=("inproc3-$mode-stops-calling@$at in-process 3 $mode stops-calling $at 0 1"); done
done
rows+=("inproc3-eager-stops-calling@before-dispatch+mask in-process 3 eager stops-calling before-dispatch 1 1")
for n in 2 3; do
  # A rank that never arrives makes no world, so graph mode would run the same as eager.
  rows+=("ipc$n-eager-never-arrives ipc $n eager never-arrives - 0 1")
  for mode in eager graph; do
    for at in $points; do rows+=("ipc$n-$mode-killed@$at ipc $n $mode killed $at 0 1"); done
    for at in $points; do rows+=("ipc$n-$mode-stops-calling@$at ipc $n $mode stops-calling $at 0 1"); done
    for at in in-dispatch between; do rows+=("ipc$n-$mode-kernel-fault@$at ipc $n $mode kernel-fault $at 0 1"); done
  done
done
# Rank 0 listens on the bootstrap's socket: killed, it cannot remove the file itself.
rows+=("ipc2-eager-killed@between-rank0 ipc 2 eager killed between 0 0")
rows+=("ipc3-eager-killed@between+mask ipc 3 eager killed between 1 1")

command_of() {  # command_of KIND RANKS MODE FAULT AT MASK FAULTY SOCKET: the row's command
  local kind=$1 n=$2 mode=$3 fault=$4 at=$5 mask=$6 faulty=$7 sock=$8
  local args=(--world-kind "$kind" --mode "$mode" --fault "$fault" --faulty-rank "$faulty"
              --timeout-ms "$timeout_ms")
  [ "$at" != - ] && args+=(--at "$at")
  [ "$mask" = 1 ] && args+=(--mask)
  if [ "$kind" = in-process ]; then
    echo "$driver --world $n ${args[*]}"
  else
    echo "$launcher launch -n $n --bootstrap $sock -- $driver ${args[*]}"
  fi
}

if [ -n "$list" ]; then
  count=0
  for row in "${rows[@]}"; do
    read -r name kind n mode fault at mask faulty <<<"$row"
    [ -n "$filter" ] && ! [[ $name =~ $filter ]] && continue
    echo "$name: $(command_of "$kind" "$n" "$mode" "$fault" "$at" "$mask" "$faulty" "<dir>/$name.sock")"
    count=$((count + 1))
  done
  echo "fault-matrix: $count rows (listed, not run)"
  exit 0
fi

if [ ! -x "$driver" ] || [ ! -x "$launcher" ]; then
  echo "fault-matrix: $driver or $launcher is missing: build the targets epx_fault_rank and epx_cli"
  echo "fault-matrix: 0 passed, 1 failed"
  exit 1
fi
mkdir -p "$logs"
sockdir=$(mktemp -d /tmp/epx-fault.XXXXXX)
trap 'rm -rf "$sockdir"' EXIT
export CUDA_VISIBLE_DEVICES=$gpu

driver_pids() {  # every live epx_fault_rank process (by its name, as pgrep -x matches it)
  local p pids
  if command -v pgrep >/dev/null; then
    pids=$(pgrep -x epx_fault_rank)
  else
    pids=$(for d in /proc/[0-9]*; do
      [ "$(cat "$d/comm" 2>/dev/null)" = epx_fault_rank ] && echo "${d#/proc/}"; done)
  fi
  # A zombie has ended; only its parent has not collected it yet.
  for p in $pids; do
    [[ $(cut -d' ' -f3 "/proc/$p/stat" 2>/dev/null) == Z ]] || echo "$p"
  done
}
new_driver_pids() {  # those that were not there before the matrix
  local p
  for p in $(driver_pids); do [[ $before == *" $p "* ]] || echo "$p"; done
}
# Processes of the driver that ran before this script are not this script's orphans.
before=" $(driver_pids | tr '\n' ' ') "
[ "$before" != "  " ] && echo "fault-matrix: epx_fault_rank already running before the matrix (pids$before); they are not counted"

field() { sed -nE "s/.* $1=([^ \"]*).*/\1/p" <<<"$2"; }    # an unquoted field of a line
quoted() { sed -nE "s/.* $1=\"([^\"]*)\".*/\1/p" <<<"$2"; }  # a quoted field
cell() { local s=${1//|/ or }; echo "${s:--}"; }            # text fit for a table cell

passed=0; failed=0
table=("| case | world | mode | expected | seen | time to error (s) | survivor alive | recreated | orphans | result |"
       "|---|---|---|---|---|---|---|---|---|---|")
for row in "${rows[@]}"; do
  read -r name kind n mode fault at mask faulty <<<"$row"
  [ -n "$filter" ] && ! [[ $name =~ $filter ]] && continue
  log=$logs/$name.log
  sock=$sockdir/$name.sock
  cmd=$(command_of "$kind" "$n" "$mode" "$fault" "$at" "$mask" "$faulty" "$sock")
  echo "=== $name: $cmd"
  t0=$SECONDS
  # shellcheck disable=SC2086  # the command is words without spaces
  timeout -k 5 "$row_limit" $cmd >"$log" 2>&1
  rc=$?
  wall=$((SECONDS - t0))
  why=()
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && why+=("still running after ${row_limit} s: stopped by timeout")
  [ "$rc" != 0 ] && [ "$rc" != 124 ] && [ "$rc" != 137 ] && why+=("exit code $rc")

  # Every survivor's line, and its verdict.
  seen=(); secs=(); alive="yes"; recreated=""; expected=""
  for ((r = 0; r < n; r++)); do
    [ "$r" = "$faulty" ] && continue
    full=$(grep -ao "fault-result rank=$r .*" "$log" | tail -n 1)
    if [ -z "$full" ]; then why+=("no result from rank $r"); alive="no"; continue; fi
    line=${full%% why=\"*}  # the fields before the quoted ones, which may hold any words
    expected=$(field expected "$line")
    seen+=("$(field seen "$line")")
    secs+=("$(field seconds "$line")")
    [ "$(field alive "$line")" = 1 ] || alive="no"
    recreated=$(field recreated "$line")
    [ "$(field verdict "$line")" = pass ] || why+=("rank $r: $(quoted why "$full")")
  done
  # The fault itself happened where the faulty process can say so.
  grep -aq "fault-injected rank=$faulty " "$log" || why+=("rank $faulty did not reach its fault")
  if [ "$fault" = killed ]; then
    grep -aq "fault-ended rank=$faulty .*planned=1" "$log" || why+=("rank $faulty did not end by its SIGKILL")
  fi
  # Nothing of the run may remain (a process being torn down gets 2 s to go).
  for _ in $(seq 20); do [ -z "$(new_driver_pids)" ] && break; sleep 0.1; done
  mapfile -t orphans < <(new_driver_pids)
  if [ ${#orphans[@]} -gt 0 ]; then
    why+=("${#orphans[@]} epx_fault_rank process(es) left: ${orphans[*]}")
    for p in "${orphans[@]}"; do kill -9 "$p" 2>/dev/null; done
  fi
  if [ -e "$sock" ]; then why+=("socket file $sock left behind"); rm -f "$sock"; fi

  time_cell=$(printf '%s\n' "${secs[@]}" | grep -E '^[0-9.]+$' | sort -g | tail -n 1)
  seen_cell=$(printf '%s\n' "${seen[@]}" | sort -u | paste -sd/ -)
  if [ ${#why[@]} -eq 0 ]; then
    passed=$((passed + 1)); result="pass"
    echo "    ok (${wall} s): seen $seen_cell after ${time_cell:-?} s"
  else
    failed=$((failed + 1))
    result="FAIL: $(printf '%s; ' "${why[@]}")"; result=${result%; }
    echo "    FAILED (${wall} s): $result"
    tail -n 12 "$log" | sed 's/^/      /'
  fi
  label=${name#*-*-}
  table+=("| $(cell "$label") | $kind ×$n | $mode | $(cell "$expected") | $(cell "$seen_cell") | $(cell "$time_cell") | $alive | $(cell "$recreated") | ${#orphans[@]} | $(cell "$result") |")
done

echo
printf '%s\n' "${table[@]}"
if [ -n "${FAULT_TABLE:-}" ]; then
  {
    echo "Fault matrix: timeout_ms $timeout_ms, GPU $gpu ($(nvidia-smi --query-gpu=name --format=csv,noheader -i "$gpu" 2>/dev/null || echo unknown)), $(git rev-parse --short HEAD 2>/dev/null || echo unknown commit), $(date -u +%Y-%m-%d)"
    echo
    printf '%s\n' "${table[@]}"
    echo
    echo "fault-matrix: $passed passed, $failed failed"
  } >"$FAULT_TABLE"
fi
echo "fault-matrix: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
