#!/bin/bash
# Stands in for epx_fault_rank when tests/fault/test_fault_matrix_script.sh runs
# scripts/fault_matrix.sh on a machine without a GPU: it prints what the driver prints for the
# case its flags name (one in-process process, or one rank under `epx launch`), and misbehaves as
# FAKE_FAULT says: pass | fail (a survivor's verdict) | silent (no result) | orphan (leaves a
# process of its name behind) | socket (leaves a file at the bootstrap address) | hang (sleeps).
# Must be installed under the name epx_fault_rank (the matrix finds leftovers by name).
set -u
if [ "${1:-}" = --linger ]; then sleep "$2"; exit 0; fi
kind=in-process world=3 mode=eager fault="" at="" faulty=1 mask=0
while [ $# -gt 0 ]; do
  case $1 in
    --world-kind) kind=$2; shift ;;
    --world) world=$2; shift ;;
    --mode) mode=$2; shift ;;
    --fault) fault=$2; shift ;;
    --at) at=$2; shift ;;
    --faulty-rank) faulty=$2; shift ;;
    --mask) mask=1 ;;
  esac
  shift
done
name=$fault; [ -n "$at" ] && name="$fault@$at"
behaviour=${FAKE_FAULT:-pass}
if [ "$kind" = ipc ]; then world=$EPX_WORLD_SIZE; ranks=$EPX_RANK; else ranks=$(seq 0 $((world - 1))); fi
fields="world=$kind ranks=$world mode=$mode case=$name faulty=$faulty mask=$mask"
expected="TimeoutError|PeerError" seen=TimeoutError recreated=ok
[ "$kind" = ipc ] && recreated=n/a
[ "$mask" = 1 ] && { expected=masked; seen=masked; recreated=n/a; }
for r in $ranks; do
  if [ "$r" = "$faulty" ]; then
    echo "fault-injected rank=$r $fields round=3 detail=\"fake\""
    [ "$fault" = killed ] && echo "fault-ended rank=$r pid=$$ status=\"killed by signal 9 (Killed)\" planned=1"
    continue
  fi
  verdict=pass why=""
  [ "$behaviour" = fail ] && { verdict=fail; why="took 3.500 s, expected at most 3.000 s"; }
  [ "$behaviour" = silent ] && continue
  echo "fault-result rank=$r $fields expected=$expected seen=$seen phase=combine/partials-ready round=3 seconds=2.01$r bound=3.000 alive=1 recreated=$recreated masked=0x0 dropped=0 verdict=$verdict why=\"$why\" error=\"rank $r in combine/partials-ready: waited 2000 ms for rank $faulty seen=nothing\""
done
case $behaviour in
  orphan) setsid "$0" --linger 30 </dev/null >/dev/null 2>&1 & ;;
  socket) [ "$kind" = ipc ] && [ "${EPX_RANK:-}" = 0 ] && : >"$EPX_BOOTSTRAP" ;;
  hang) sleep 600 ;;
esac
# (under `epx launch` a survivor exits 0 whatever its verdict, as the driver does)
[ "$behaviour" = fail ] && [ "$kind" = in-process ] && exit 1
exit 0
