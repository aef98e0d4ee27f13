# The helpers of the GPU suite's fault runs (scripts/gpu_suite.sh: the procs and multi parts),
# sourced there. They use the suite's globals: logs, passed, failed, FT (EPX_TIMEOUT_MS of the
# runs), FSHAPE (their shape flags), EI (`epx check --world-kind ipc`), sockdir, pids, rcs.
# shellcheck shell=bash
stamp() {  # stamp RANK: prefixes every line with "@<epoch seconds> [rank RANK] "
  local line
  while IFS= read -r line; do printf '@%s [rank %s] %s\n' "$EPOCHREALTIME" "$1" "$line"; done
}
start_rank() {  # start_rank RANK WORLD CMD...: one rank in the background, at address $addr
  local r=$1 w=$2; shift 2
  (EPX_RANK=$r EPX_WORLD_SIZE=$w EPX_BOOTSTRAP=$addr EPX_TIMEOUT_MS=$FT timeout 60 "$@" 2>&1 |
     stamp "$r"; exit "${PIPESTATUS[0]}") 2>&1 &  # (bash's "Killed" notice to the log too)
  pids+=($!)
}
wait_ranks() {  # rcs[i] = exit code of the i-th rank started
  local p; rcs=()
  for p in "${pids[@]}"; do wait "$p"; rcs+=($?); done
  pids=()
}
stamp_of() { grep -Em1 "$1" "$2" | sed -E 's/^@([0-9.]+) .*/\1/'; }  # time of the first match
ms_between() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%d", (b - a) * 1000 }'; }
verdict() {  # verdict NAME WHY: one counted fault run, passed when WHY is empty
  local log=$logs/$1.log
  if [ -z "$2" ]; then
    passed=$((passed+1))
    echo "    ok: $(grep -Em1 'error: ' "$log" | sed -E 's/^@[0-9.]+ //' | cut -c1-240)"
  else
    failed=$((failed+1)); echo "    FAILED: $2"; tail -n 15 "$log" | sed 's/^/      /'
  fi
}
# survivors_named LOG DEAD RANK...: why not, when a listed rank did not exit 2 naming rank DEAD
survivors_named() {
  local log=$1 dead=$2 r why=""; shift 2
  for r in "$@"; do
    [ "${rcs[$r]}" = 2 ] || why+="rank $r exited ${rcs[$r]}, expected 2; "
    grep -Eq "\[rank $r\] epx: (peer|timeout) error: .*rank $dead( \(pid|[^0-9]|$)" "$log" ||
      why+="rank $r did not name rank $dead; "
  done
  echo "$why"
}

# (a) A rank killed (SIGKILL) after creating its All2All, before its first dispatch: every other
# rank raises PeerError/TimeoutError naming it within EPX_TIMEOUT_MS + 1 s of its death.
fault_kill() {  # fault_kill NAME WORLD DEAD
  local name=$1 n=$2 dead=$3 log=$logs/$1.log r why="" survivors=()
  echo "=== $name: rank $dead of $n killed before its first dispatch (EPX_TIMEOUT_MS=$FT)"
  addr=$sockdir/$name.sock
  for ((r = 0; r < n; r++)); do
    start_rank $r $n $EI $FSHAPE --fault-kill-rank $dead
    [ $r = $dead ] || survivors+=($r)
  done >"$log"
  wait_ranks
  why=$(survivors_named "$log" "$dead" "${survivors[@]}")
  local t_dead; t_dead=$(stamp_of "fault injection: rank $dead" "$log")
  [ -n "$t_dead" ] || why+="rank $dead did not reach the fault; "
  for r in "${survivors[@]}"; do
    local t_err; t_err=$(stamp_of "\[rank $r\] epx: .* error: " "$log")
    [ -n "$t_dead" ] && [ -n "$t_err" ] || continue
    local ms; ms=$(ms_between "$t_dead" "$t_err")
    echo "rank $r raised its error $ms ms after rank $dead died (bound $((FT + 1000)) ms)" >>"$log"
    [ "$ms" -le $((FT + 1000)) ] || why+="rank $r took $ms ms; "
  done
  [ -e "$addr" ] && why+="socket file $addr left behind; "
  verdict "$name" "$why"
}
