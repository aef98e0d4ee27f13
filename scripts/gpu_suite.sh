#!/usr/bin/env bash
# Builds (unless a build with the binaries is already there) and runs the GPU suite plus the
# `epx check` runs of the DeepSeek-R1 shape, on a machine with an NVIDIA GPU. Ends with one
# "gpu-total: N passed, N failed" line. Logs go to build/gpu-logs, and as one archive
# (gpu-logs.tar.gz) to $OUT when that is set.
# Usage: scripts/gpu_suite.sh [build-dir] [--quick]
# EPX_SUITE_PARTS (default core,python): which parts run — fresh (a clean copy of the tree, the
# README's first command and the GPU half of its second, as a new user runs them: 6-9 minutes), core (= gtest,cli: the C++ suites, and
# the CLI runs), cli (= checks,ht,procs: low_latency, baseline and MoE-layer checks; the
# high_throughput checks; one process per rank, its faults, serve-bench and several GPUs; each part
# fits in 10 minutes on an H200), python (the package: pip install, pytest, the Python example),
# deepep (DeepEP's own tests/legacy/test_low_latency.py through tests/compat/, with 2 and 4
# processes on GPU 0, also with --use-logfmt, its tests/legacy/test_intranode.py and V2's
# tests/elastic/test_ep.py with 2 and 4 (its perf part on the first mode; three variants with 2),
# these three across 2 emulated nodes of 2 processes, and
# its --shrink-test with 8 unless EPX_DEEPEP_SHRINK=0; needs EPX_DEEPEP_DIR, a DeepEP checkout
# with deep_ep/utils and tests; it installs the package itself), sanitize (compute-sanitizer
# memcheck and racecheck over `epx check` of every backend), fault (the reliability fault matrix,
# scripts/fault_matrix.sh, on GPU 0: 4-5 minutes expected; its rows count one each, its table goes
# to $logs/fault_matrix.md), multi (a node of several GPUs: in-process, IpcWorld and NcclWorld
# checks of both engines at 128 and 4096 tokens, NcclWorld refusing NCCL_CUMEM_ENABLE=0, bench
# beside NCCL's collectives with the DESIGN §9 figures, tune, killed ranks, DeepEP's own tests;
# runs with the default parts when two or more GPUs are visible, else prints "multi: skipped").
set -uo pipefail
cd "$(dirname "$0")/.."
# cuBLASLt (MoE layer) comes from the CUDA toolkit at run time.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
build=${1:-build}
quick=${2:-}
logs=${EPX_SUITE_LOGS:-$build/gpu-logs}  # (a folder under $OUT keeps the logs of a run cut short)
mkdir -p "$logs"
# Every verdict line also goes to $logs/summary.txt as it is printed: a run cut short by a time
# bound keeps the verdicts it reached.
exec > >(tee -a "$logs/summary.txt") 2>&1
parts=${EPX_SUITE_PARTS:-core,python}
[[ ",$parts," == *",core,"* ]] && parts="$parts,gtest,cli"
[[ ",$parts," == *",cli,"* ]] && parts="$parts,checks,ht,procs"
want() { [[ ",$parts," == *",$1,"* ]]; }
# NcclWorld (one rank, emulated nodes, several GPUs): never NVLink multicast, and the wheel's
# libnccl when the system has none.
export NCCL_NVLS_ENABLE=0
if [ -z "${EPX_NCCL_LIBRARY:-}" ]; then
  EPX_NCCL_LIBRARY=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null) && export EPX_NCCL_LIBRARY
fi
if { want gtest || want checks || want ht || want procs; } && { [ ! -x "$build/epx" ] || [ ! -x "$build/tests/epx_gpu_tests" ]; }; then
  scripts/setup.sh --tests "$build" || exit 1
elif want fault && { [ ! -x "$build/epx" ] || [ ! -x "$build/tests/epx_fault_rank" ]; }; then
  scripts/setup.sh --tests "$build" || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

passed=0; failed=0
L="$build/epx launch"
run() {  # run NAME CMD...: one counted check
  local name=$1; shift
  echo "=== $name: $*"
  # A hang must not eat the whole session: every counted run is bounded (exit 124 = timed out).
  if timeout "${EPX_RUN_TIMEOUT_S:-180}" "$@" >"$logs/$name.log" 2>&1; then passed=$((passed+1)); echo "    ok: $(tail -n 1 "$logs/$name.log")"
  else failed=$((failed+1)); echo "    FAILED:"; tail -n 15 "$logs/$name.log" | sed 's/^/      /'; fi
}

if want fresh; then
# A new user's first run: a clean copy of the tree (no build folder, nothing ignored), the
# README's first command (scripts/run.sh: set-up, build, the bench table) and then the second
# command's GPU half (scripts/test.sh --gpu: the GPU suites and the Python package's GPU tests),
# with no flag, no hand step and this machine's own compiler. Our own code must build without
# a warning there too (counted as its own check); a third-party header's warning does not count.
fresh=$(mktemp -d /tmp/epx-fresh.XXXXXX)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard | tar --null -cf - -T - | tar -xf - -C "$fresh"
else  # a copy of a tree without its .git: everything but the build folders and ignored paths
  tar -cf - --exclude=./.git --exclude='./build' --exclude='./build-*' --exclude=./.vllm \
    --exclude=./.whl --exclude=./.gl --exclude=./dist . | tar -xf - -C "$fresh"
fi
echo "fresh: a copy of the tree in $fresh ($(du -sh "$fresh" | cut -f1)), $(c++ --version | head -n 1)"
fresh_step() {  # fresh_step NAME CMD...: one counted step in the copy, timed
  local t0=$SECONDS
  EPX_RUN_TIMEOUT_S=${EPX_FRESH_TIMEOUT_S:-600} run "$1" bash -c "cd '$fresh' && ${*:2}"
  echo "    $1: $((SECONDS - t0)) s wall"
  tail -n "${fresh_tail:-0}" "$logs/$1.log" | sed 's/^/      /'
}
fresh_tail=14 fresh_step fresh_run scripts/run.sh
own=$(grep -hE "warning[: #]" "$logs/fresh_run.log" | grep -F "$fresh/" | grep -vE "^/usr/" | sort -u)
fresh_tail=8 fresh_step fresh_test_gpu scripts/test.sh --gpu
own=$( { echo "$own"; grep -hE "warning[: #]" "$logs/fresh_test_gpu.log" | grep -F "$fresh/"; } |
       grep -vE "^/usr/|^$" | sort -u)
echo "=== fresh_warnings: our own code's warnings with $(c++ -dumpfullversion) and nvcc"
if [ -z "$own" ]; then passed=$((passed+1)); echo "    ok: none"
else failed=$((failed+1)); echo "    FAILED:"; echo "$own" | head -20 | sed 's/^/      /'; fi
cp "$fresh/bench.json" "$logs/fresh_bench.json" 2>/dev/null || true  # the main job's table
cp "$fresh/build/Testing/Temporary/LastTest.log" "$logs/fresh_gpu_suites.log" 2>/dev/null || true
rm -rf "$fresh"
fi  # fresh

if want gtest; then
# GoogleTest suites: each test counts.
for suite in epx_gpu_tests epx_ipc_gpu_tests epx_moe_gpu_tests epx_bad_inputs_gpu_tests; do
  [ -x "$build/tests/$suite" ] || continue
  # (every test's line with its time goes to the log; the slowest ten are printed)
  timeout "${EPX_SUITE_TIMEOUT_S:-420}" "$build/tests/$suite" >"$logs/$suite.log" 2>&1
  grep -E "^\[       OK \] .* \([0-9]+ ms\)$" "$logs/$suite.log" | sed -E 's/^\[       OK \] (.*) \(([0-9]+) ms\)$/\2 ms  \1/' |
    sort -rn | head -10 | sed 's/^/    slowest: /'
  grep -E "^\[==========\] .* ran\." "$logs/$suite.log" | sed 's/^/    /'
  grep -E "FAILED|gpu-suite:|^\[  (PASSED|FAILED)" "$logs/$suite.log" | head -40
  line=$(grep -E "^gpu-suite: " "$logs/$suite.log" | tail -n 1)
  p=$(echo "$line" | sed -E 's/.* ([0-9]+) passed.*/\1/'); f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
  if [ -z "$line" ]; then failed=$((failed+1)); echo "$suite did not finish"; else passed=$((passed+p)); failed=$((failed+f)); fi
done
fi  # gtest

E="$build/epx check"
if want checks; then  # low_latency and the baselines on the R1 shape, and the MoE layer
for t in 128 1024; do
  for d in bf16-to-fp8 bf16 fp8; do
    for l in token expert; do
      [ -n "$quick" ] && [ "$t" = 1024 ] && continue
      it=2; [ "$t" = 1024 ] && it=1
      run "check_t${t}_${d}_${l}" $E --tokens $t --dtype $d --layout $l --iters $it
    done
  done
done
run check_t128_graph1000 $E --tokens 128 --graph 1000 --iters 1
run check_t128_mixed $E --tokens 128 --graph 100 --mixed --iters 1
run check_t128_expert_graph $E --tokens 128 --layout expert --graph 100 --iters 1
# Two rounds in flight: every call dispatches two rounds before combining either.
run check_t128_rounds2_mixed $E --tokens 128 --rounds-in-flight 2 --graph 100 --mixed --iters 2
run check_t128_rounds2_expert $E --tokens 128 --layout expert --rounds-in-flight 2 --graph 20 --iters 2
# Power-of-two scales (round_scale), token- and expert-major.
run check_t128_round_scale $E --tokens 128 --round-scale --iters 2
run check_t128_round_scale_expert $E --tokens 128 --round-scale --layout expert --scale-layout column \
  --iters 2
# Push combine (each rank writes its partials into the token's rank; the default only across GPUs).
run check_t128_push_mixed $E --tokens 128 --combine push --graph 100 --mixed --iters 2
run check_t128_push_expert_rounds2 $E --tokens 128 --layout expert --combine push \
  --rounds-in-flight 2 --graph 20 --iters 2
run check_w3_push_odd $E --world 3 --hidden 2176 --experts 24 --topk 5 --tokens 33,0,17 \
  --combine push --backend allgather_reducescatter --iters 2
[ -z "$quick" ] && run check_t1024_graph100 $E --tokens 1024 --graph 100 --iters 1
[ -z "$quick" ] && run check_t1024_mixed $E --tokens 1024 --graph 50 --mixed --iters 1

# The MoE layer (`epx check --moe`): W ranks against the same layer on one rank with every expert
# local, and against the CPU reference (small shape), chunked, with a rank that has no tokens.
MS="--world 4 --hidden 1024 --intermediate 512 --shared-intermediate 512 --experts 32 --topk 4"
MS="$MS --tokens 64,0,200,96 --max-tokens 64"
for b in low_latency allgather_reducescatter naive; do
  for l in token expert; do
    [ "$b" != low_latency ] && [ "$l" = expert ] && continue
    run "moe_${b}_${l}" $E --moe --backend $b --layout $l $MS
  done
done
run moe_high_throughput_token $E --moe --backend high_throughput $MS
[ -z "$quick" ] && run moe_r1_w8_t128 $E --moe --world 8 --tokens 128

fi  # checks

if want ht; then
# high_throughput: rows and partials through fixed rings, ordered rows, receive areas sized per
# call (a host read: each rank from its own thread, or one launch per GPU) or for the worst case
# (graph replays); odd shapes, empty and full ranks, and the prefill sizes.
H="$E --backend high_throughput"
for d in bf16-to-fp8 bf16 fp8; do
  run "ht_t1024_${d}" $H --tokens 1024 --dtype $d --iters 2
done
run ht_mixed_tokens $H --tokens 0,1,7,128,4096,3,0,1024 --max-tokens 4096 --iters 2
run ht_w3_odd_fp8_col $H --world 3 --hidden 2176 --experts 24 --topk 5 --tokens 333,0,17 \
  --dtype fp8 --scale-layout column --iters 2
run ht_w1 $H --world 1 --experts 8 --topk 2 --tokens 100 --iters 2
run ht_round_scale $H --tokens 1024 --round-scale --iters 2
run ht_t4096_one_launch $H --tokens 4096 --one-launch --iters 2
run ht_worst_case_graph $H --worst-case-output --tokens 1024 --graph 50 --iters 1
run ht_worst_case_mixed $H --worst-case-output --tokens 512 --graph 20 --mixed --iters 1
[ -z "$quick" ] && run ht_t8192_one_launch $H --tokens 8192 --one-launch --iters 1
[ -z "$quick" ] && run ht_w16_t2048 $H --world 16 --tokens 2048 --iters 1

fi  # ht

if want procs; then  # one process per rank, faults of such jobs, serve-bench, several GPUs
# One process per rank (IpcWorld through `epx launch`), all sharing this machine's GPU: processes
# on one GPU are time-sliced (a round takes milliseconds), so the round counts stay small.
EI="$build/epx check --world-kind ipc"
for n in 2 4; do
  run "ipc_example_n${n}" $L -n $n -- "$build/example_ipc_ranks"
  for d in bf16-to-fp8 bf16 fp8; do  # the DeepSeek-R1 shape, every dtype and both layouts
    run "ipc_n${n}_t128_${d}_token" $L -n $n -- $EI --world $n --tokens 128 --dtype $d --iters 2
    run "ipc_n${n}_t128_${d}_expert" $L -n $n -- $EI --world $n --tokens 128 --dtype $d \
      --layout expert --iters 2
  done
  run "ipc_n${n}_t128_graph20" $L -n $n -- $EI --world $n --tokens 128 --graph 20 --iters 1
done
run ipc_example_n2_cuda_ipc $L -n 2 -- "$build/example_ipc_ranks" cuda-ipc
run ipc_n2_t128_mixed $L -n 2 -- $EI --world 2 --tokens 128 --graph 10 --mixed --iters 1
run ipc_n2_t128_naive $L -n 2 -- $EI --world 2 --tokens 128 --backend naive --iters 1
run ipc_n2_t128_push $L -n 2 -- $EI --world 2 --tokens 128 --combine push --graph 10 --iters 2
run ipc_n2_t1024_ht $L -n 2 -- $EI --world 2 --tokens 1024 --backend high_throughput --iters 2
run ipc_n4_ht_worst_case_graph $L -n 4 -- $EI --world 4 --tokens 256 --backend high_throughput \
  --worst-case-output --graph 10 --iters 1

# `epx bench` over IpcWorld: every backend verified, then timed on each rank's own stream; rank 0
# prints the table (time-sliced on one GPU: the run proves the path, not the speed).
BI="$build/epx bench --world-kind ipc"
for n in 2 4; do
  run "ipc_bench_n${n}" $L -n $n -- $BI --world $n --tokens 128 --iters 50 --warmup 5 \
    --json "$logs/ipc_bench_n${n}.json"
  run "ipc_bench_n${n}_json" grep -q '"kind": "ipc"' "$logs/ipc_bench_n${n}.json"
done

# ---- faults of one-process-per-rank jobs ----------------------------------------------------------
# The bootstrap's start-up and collective faults are proven on the CPU (tests/cpu/
# test_bootstrap.cpp: threads and forked processes) and a missing rank / a configuration mismatch
# by epx_ipc_gpu_tests; these runs add the rest on the GPU, through the real CLI, with CUDA
# contexts and spinning kernels in the loop, and keep every message in $logs/fault_*.log. Each
# counts as passed only when the expected error appears, nothing hangs, every surviving rank exits
# with epx's error code (2, not a signal) and no socket file is left behind. Ranks are started by
# hand (EPX_RANK, EPX_WORLD_SIZE, EPX_BOOTSTRAP), not by `epx launch`, where a job must outlive a
# dead rank: the launcher stops the others as soon as one rank dies.
FT=2000  # EPX_TIMEOUT_MS of the fault runs: the whole section takes well under a minute
export LC_NUMERIC=C  # $EPOCHREALTIME with a decimal point
FSHAPE="--hidden 2048 --experts 16 --topk 4 --tokens 64"
sockdir=$(mktemp -d /tmp/epx-suite.XXXXXX)
pids=(); rcs=()
source scripts/gpu_suite_faults.sh  # stamp, start_rank, ..., fault_kill
fault_kill fault_kill_rank1_of2 2 1
fault_kill fault_kill_rank0_of2 2 0  # rank 0 held the socket: the survivor removes its file
fault_kill fault_kill_rank2_of4 4 2  # ranks 1 and 3 learn it from rank 0

# (b) A rank that never arrives (`epx bench --world-kind ipc`): a TimeoutError naming it within
# EPX_TIMEOUT_MS + 1 s of the bootstrap's start (allowing 2 s for the process and CUDA start-up).
fault_missing() {  # fault_missing NAME PRESENT MISSING REGEX
  local name=$1 present=$2 missing=$3 log=$logs/$1.log why=""
  echo "=== $name: world of 2, rank $missing never started (EPX_TIMEOUT_MS=$FT)"
  addr=$sockdir/$name.sock
  local t0=$EPOCHREALTIME
  start_rank "$present" 2 $BI --world 2 --tokens 64 --iters 50 >"$log"
  wait_ranks
  [ "${rcs[0]}" = 2 ] || why+="rank $present exited ${rcs[0]}, expected 2; "
  grep -Eq "\[rank $present\] epx: timeout error: .*$4" "$log" || why+="no TimeoutError naming rank $missing; "
  local ms; ms=$(ms_between "$t0" "$(stamp_of "epx: timeout error" "$log")")
  echo "the TimeoutError came $ms ms after the process started (bound $((FT + 3000)) ms)" >>"$log"
  [ "$ms" -le $((FT + 3000)) ] || why+="took $ms ms; "
  [ -e "$addr" ] && why+="socket file $addr left behind; "
  verdict "$name" "$why"
}
fault_missing fault_missing_rank1_bench 0 1 "rank 1 of 2 did not arrive within $FT ms"
fault_missing fault_missing_rank0_bench 1 0 "rank 0 did not arrive within $FT ms"

# (c) World sizes that disagree, (d) a rank number used twice or out of range: refused at
# start-up on every rank that got that far, long before the timeout.
fault_startup() {  # fault_startup NAME REGEX (ranks started by the caller, as "RANK WORLD" pairs)
  local name=$1 re=$2 log=$logs/$1.log why="" r rc; shift 2
  echo "=== $name: expects /$re/ on every rank, before EPX_TIMEOUT_MS=$FT"
  addr=$sockdir/$name.sock
  local t0=$EPOCHREALTIME
  while [ $# -gt 0 ]; do start_rank "$1" "$2" $EI $FSHAPE; shift 2; done >"$log"
  wait_ranks
  for r in "${!rcs[@]}"; do [ "${rcs[$r]}" = 2 ] || why+="process $r exited ${rcs[$r]}, expected 2; "; done
  [ "$(grep -Ec "epx: config error: .*$re" "$log")" -ge "${#rcs[@]}" ] ||
    why+="not every process reported /$re/; "
  # A late detection would be a TimeoutError, not the ConfigError above; this only bounds a hang.
  local ms; ms=$(ms_between "$t0" "$EPOCHREALTIME")
  echo "all processes ended $ms ms after the start (EPX_TIMEOUT_MS=$FT)" >>"$log"
  [ "$ms" -le $((FT + 3000)) ] || why+="took $ms ms; "
  [ -e "$addr" ] && why+="socket file $addr left behind; "
  verdict "$name" "$why"
}
# (World sizes that divide --experts 16, so that each rank's shape is valid on its own.)
fault_startup fault_world_size_mismatch "world size disagrees" 0 2 1 4
fault_startup fault_rank_used_twice "rank 1 used twice" 0 4 1 4 1 4
fault_startup fault_rank_out_of_range "EPX_RANK = \"2\", expected" 2 2

# (e) A second job on the address of a running one: refused at start-up (its rank 0 finds the
# address taken, its rank 1 is refused by the running job's rank 0), the running job passes.
fault_second_job() {
  local name=fault_second_job log=$logs/fault_second_job.log why="" t
  echo "=== $name: a second job on the socket of a running one"
  addr=$sockdir/$name.sock
  # The first job: the default (DeepSeek-R1) shape, so that its CPU reference, built after its
  # bootstrap, keeps it running for a few seconds.
  EPX_TIMEOUT_MS=20000 timeout 120 $L -n 2 --bootstrap "$addr" -- $EI --world 2 --tokens 512 \
    --iters 2 >"$logs/${name}_first.log" 2>&1 &
  local first=$!
  for t in $(seq 300); do grep -q "epx check: ipc world" "$logs/${name}_first.log" && break; sleep 0.1; done
  EPX_TIMEOUT_MS=$FT timeout 60 $L -n 2 --bootstrap "$addr" -- $EI --world 2 $FSHAPE >"$log" 2>&1
  local second=$?
  grep -Eq "PASS|FAIL" "$logs/${name}_first.log" &&
    why+="the first job had ended before the second started (inconclusive); "
  wait "$first"; local first_rc=$?
  sed 's/^/first job: /' "$logs/${name}_first.log" >>"$log"
  [ "$second" = 2 ] || why+="the second job exited $second, expected 2; "
  grep -Eq "epx: config error: .*(already in use by a live process|in use by a running job)" "$log" ||
    why+="no 'address in use' ConfigError; "
  [ "$first_rc" = 0 ] || why+="the first job exited $first_rc, expected 0 (undisturbed); "
  [ -e "$addr" ] && why+="socket file $addr left behind; "
  verdict "$name" "$why"
}
fault_second_job
rm -rf "$sockdir"

# serve-bench, every backend, eager and CUDA-graph decode, on a small shape (the path, not speed).
run serve_small_graph $build/epx serve-bench --world 8 --experts 64 --hidden 2048 \
  --intermediate 512 --shared-intermediate 512 --num-prompts 32 --isl 256 --osl 32 \
  --chunk-size 64 --max-batched-tokens 256 --cuda-graph --json "$logs/serve_small.json"
# Dual-batch overlap (--overlap): decode steps as two micro-batches, eager and graph, beside the
# plain runs.
run serve_small_overlap $build/epx serve-bench --world 8 --experts 64 --hidden 2048 \
  --intermediate 512 --shared-intermediate 512 --num-prompts 32 --isl 256 --osl 32 \
  --chunk-size 64 --max-batched-tokens 256 --cuda-graph --overlap --backends low_latency,naive \
  --json "$logs/serve_small_overlap.json"
# Prefill steps through high_throughput (DECODE+PREFILL), beside each backend alone; long prompts.
run serve_small_prefill_mix $build/epx serve-bench --world 8 --experts 64 --hidden 2048 \
  --intermediate 512 --shared-intermediate 512 --num-prompts 16 --isl 2048 --osl 8 \
  --chunk-size 64 --max-batched-tokens 512 --cuda-graph \
  --backends low_latency,high_throughput,low_latency+high_throughput \
  --json "$logs/serve_small_prefill_mix.json"
# 32 ranks: decode graphs without conditional nodes (--graph-experts auto picks all-rows there).
run serve_small_graph_w32 $build/epx serve-bench --world 32 --experts 64 --hidden 2048 \
  --intermediate 512 --shared-intermediate 512 --num-prompts 16 --isl 128 --osl 8 \
  --chunk-size 64 --max-batched-tokens 256 --layers 1 --cuda-graph --backends low_latency
run serve_small_graph_world $build/epx serve-bench --world 8 --experts 64 --hidden 2048 \
  --intermediate 512 --shared-intermediate 512 --num-prompts 32 --isl 256 --osl 32 \
  --chunk-size 64 --max-batched-tokens 256 --cuda-graph --graph-scope world \
  --graph-buckets 2,8,64 --backends low_latency

# Several GPUs: in-process ranks spread over them, and one process per GPU over NcclWorld.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
w=1; while [ $((w * 2)) -le "$gpus" ]; do w=$((w * 2)); done; gpus=$w  # 256 experts divide evenly
if [ "$gpus" -ge 2 ]; then
  echo "NcclWorld runs with EPX_NCCL_LIBRARY=${EPX_NCCL_LIBRARY:-libnccl.so.2}"
  run multi_inproc_t128 $E --world 8 --gpus "$gpus" --tokens 128 --iters 2
  run multi_inproc_t128_graph $E --world 8 --gpus "$gpus" --tokens 128 --graph 100 --mixed --iters 1
  run nccl_example $L -n "$gpus" -- "$build/example_ipc_ranks" nccl
  EN="$build/epx check --world-kind nccl"
  for d in bf16-to-fp8 bf16 fp8; do
    run "nccl_t128_${d}_token" $L -n "$gpus" -- $EN --tokens 128 --dtype $d --iters 2
    run "nccl_t128_${d}_expert" $L -n "$gpus" -- $EN --tokens 128 --dtype $d --layout expert --iters 2
  done
  run nccl_t128_graph $L -n "$gpus" -- $EN --tokens 128 --graph 200 --mixed --iters 1
  run nccl_t1024 $L -n "$gpus" -- $EN --tokens 1024 --iters 1
  run nccl_bench $L -n "$gpus" -- $build/epx bench --world-kind nccl --tokens 128 --iters 50 \
    --warmup 5 --json "$logs/nccl_bench.json"
else
  echo "(one GPU visible: the in-process multi-GPU and NcclWorld runs need two or more)"
fi

fi  # procs

if want python || want deepep; then
# The Python package as users get it (`pip install --no-build-isolation .` into a scratch target:
# torch, nanobind, scikit-build-core and pytest must be installed), its tests (each counts) and
# its example of two processes on one GPU under `epx launch` (the python part; the deepep part
# alone installs the package and runs DeepEP's tests on it).
py=$build/python-target
echo "=== python: pip install --no-build-isolation --target $py ."
if ! CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-build-isolation --no-deps \
     --upgrade -q --target "$py" . >"$logs/python_install.log" 2>&1; then
  failed=$((failed+1)); echo "    FAILED: pip install"; tail -n 15 "$logs/python_install.log" | sed 's/^/      /'
elif want python; then
  PYTHONPATH=$py timeout "${EPX_PYTHON_TIMEOUT_S:-1800}" python3 -m pytest -q -rs \
    -p no:cacheprovider tests/python >"$logs/python_tests.log" 2>&1
  line=$(grep -E "^[=]* ?[0-9]+ (passed|failed|skipped|error)" "$logs/python_tests.log" | tail -n 1)
  count() { echo "$line" | grep -oE "[0-9]+ $1" | grep -oE "^[0-9]+" || echo 0; }
  p=$(count passed); f=$(( $(count failed) + $(count error) )); s=$(count skipped)
  [ -z "$line" ] && f=1  # pytest did not finish
  passed=$((passed+p)); failed=$((failed+f))
  echo "    python: $p passed, $f failed, $s skipped"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$logs/python_tests.log" | head -20 | sed 's/^/      /'
  run python_example_n2 $L -n 2 -- env PYTHONPATH="$py" python3 examples/python/two_ranks_one_gpu.py
fi

if want deepep; then
  # DeepEP's acceptance test, unmodified, against epx.deep_ep (tests/compat/run_deepep_low_latency.py).
  DS="--num-tokens 128 --hidden 7168 --num-topk 8"
  for c in ${EPX_DEEPEP_CASES:-2:32 2:64 4:32 4:64}; do  # processes:experts
    n=${c%:*}; e=${c#*:}
    run "deepep_n${n}_e${e}" env PYTHONPATH="$py" python3 tests/compat/run_deepep_low_latency.py \
        "${EPX_DEEPEP_DIR:?EPX_DEEPEP_DIR: a DeepEP checkout}" -- --num-processes $n $DS --num-experts $e
  done
  # LogFMT combine (the test's --use-logfmt) and the normal mode (tests/legacy/test_intranode.py
  # at its own hidden size and top-k, tokens few enough for its tuning loop on a shared GPU).
  for n in 2 4; do
    run "deepep_logfmt_n${n}" env PYTHONPATH="$py" python3 tests/compat/run_deepep_low_latency.py \
        "$EPX_DEEPEP_DIR" -- --num-processes $n $DS --num-experts 32 --use-logfmt
    run "deepep_intranode_n${n}" env PYTHONPATH="$py" python3 tests/compat/run_deepep_low_latency.py \
        "$EPX_DEEPEP_DIR" --test tests/legacy/test_intranode.py -- --num-processes $n \
        --num-tokens ${EPX_DEEPEP_INTRANODE_TOKENS:-256} --hidden 7168 --num-topk 8 --num-experts 64
    run "deepep_ep_n${n}" env PYTHONPATH="$py" python3 tests/compat/run_deepep_low_latency.py \
        "$EPX_DEEPEP_DIR" --test tests/elastic/test_ep.py -- --num-processes $n --num-tokens 256 \
        --skip-perf-test
    # its perf part (kernels found by DeepEP's names) on the first mode: all 144 outlive a slot
    run "deepep_ep_perf_n${n}" env PYTHONPATH="$py" python3 tests/compat/run_deepep_low_latency.py \
        "$EPX_DEEPEP_DIR" --test tests/elastic/test_ep.py -- --num-processes $n --num-tokens 256 \
        --test-first-only
  done
  # V2's test in the variants its acceptance names, 2 processes.
  for v in "--allow-multiple-reduction 0" "--do-cpu-sync 0" "--masked-ratio 0.1"; do
    run "deepep_ep_n2_$(echo "$v" | tr -dc 'a-z')" env PYTHONPATH="$py" \
        python3 tests/compat/run_deepep_low_latency.py "$EPX_DEEPEP_DIR" \
        --test tests/elastic/test_ep.py -- --num-processes 2 --num-tokens 256 --skip-perf-test $v
  done
  # Across 2 emulated nodes of 2 processes (an NcclWorld; every process its own NCCL host id).
  run deepep_nodes_2x2 env PYTHONPATH="$py" python3 tests/compat/run_deepep_low_latency.py \
      "$EPX_DEEPEP_DIR" --emulated-nodes 2 -- --num-processes 4 $DS --num-experts 32
  # The normal mode (dispatch with and without top-k: by ids and by a rank mask) and V2 there too.
  run deepep_intranode_nodes_2x2 env PYTHONPATH="$py" python3 tests/compat/run_deepep_low_latency.py \
      "$EPX_DEEPEP_DIR" --emulated-nodes 2 --test tests/legacy/test_intranode.py -- \
      --num-processes 4 --num-tokens 64 --hidden 7168 --num-topk 8 --num-experts 64
  run deepep_ep_nodes_2x2 env PYTHONPATH="$py" python3 tests/compat/run_deepep_low_latency.py \
      "$EPX_DEEPEP_DIR" --emulated-nodes 2 --test tests/elastic/test_ep.py -- --num-processes 4 \
      --num-tokens 64 --skip-perf-test
  # Shrink mode (the test's --shrink-test: 8 processes, ranks 1, 3 and 5 stop calling): every
  # survivor's object waits EPX_TIMEOUT_MS (10 s in the runner) once per stopped rank it meets,
  # about a dozen times, on a time-sliced GPU: 168 s measured on an H200.
  if [ "${EPX_DEEPEP_SHRINK:-1}" = 1 ]; then
    EPX_RUN_TIMEOUT_S=${EPX_DEEPEP_SHRINK_TIMEOUT_S:-400} run deepep_shrink_n8 env PYTHONPATH="$py" \
      python3 tests/compat/run_deepep_low_latency.py "$EPX_DEEPEP_DIR" --shrink
  fi
fi
fi  # python

if want sanitize; then
# compute-sanitizer over `epx check` of every backend (small shapes, one launch per GPU: the
# tools serialise kernels, and ranks spinning on each other's kernels need them concurrent):
# memcheck (out-of-bounds and misaligned accesses, leaks) and racecheck (shared-memory races).
CS=${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer
if [ -x "$CS" ]; then
  SS="--world 4 --hidden 2048 --experts 16 --topk 4 --tokens 64,0,7,33 --max-tokens 64"
  SS="$SS --one-launch --iters 1 --timeout-ms 300000"
  for tool in memcheck racecheck; do
    for b in low_latency high_throughput allgather_reducescatter naive; do
      run "sanitize_${tool}_${b}" $CS --tool $tool --error-exitcode 9 $build/epx check \
        --backend $b $SS
    done
    run "sanitize_${tool}_low_latency_expert" $CS --tool $tool --error-exitcode 9 \
      $build/epx check --backend low_latency --layout expert --dtype fp8 $SS
  done
else
  echo "sanitize: $CS not found: the compute-sanitizer runs did not happen"
fi
fi  # sanitize
if want fault; then
# The reliability fault matrix: each row one fault case (a rank that never arrives, is killed,
# stops calling or faults its context, at each point of a round), counted by the script's own
# summary line; the table of the run stays in $logs/fault_matrix.md.
echo "=== fault matrix: scripts/fault_matrix.sh $build"
FAULT_LOGS=$logs/fault-matrix FAULT_TABLE=$logs/fault_matrix.md \
  timeout "${EPX_FAULT_MATRIX_TIMEOUT_S:-540}" scripts/fault_matrix.sh "$build" >"$logs/fault_matrix.log" 2>&1
line=$(grep -E "^fault-matrix: [0-9]+ passed, [0-9]+ failed" "$logs/fault_matrix.log" | tail -n 1)
if [ -z "$line" ]; then
  failed=$((failed+1)); echo "    FAILED: the fault matrix did not finish"; tail -n 15 "$logs/fault_matrix.log" | sed 's/^/      /'
else
  p=$(echo "$line" | sed -E 's/.* ([0-9]+) passed.*/\1/'); f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
  passed=$((passed+p)); failed=$((failed+f))
  echo "    $line"
  grep -E "^\| .*\| FAIL" "$logs/fault_matrix.log" | head -20 | sed 's/^/      /'
fi
fi  # fault

# ---- multi: the first day on a node of several GPUs (8 expected) ------------------------------
# With the default parts it runs by itself when two or more GPUs are visible; on one GPU it says
# so. Everything is checked against the CPU reference (`epx check`), or counted as passed only
# when the expected refusal appears. Ranks: 8, spread round-robin over MG GPUs (8 on an 8-GPU
# node); one process per GPU for the process worlds.
mgpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if want multi || [ -z "${EPX_SUITE_PARTS:-}" ]; then
if [ "$mgpus" -lt 2 ]; then
  echo "multi: skipped: one GPU"
else
  [ -x "$build/epx" ] || scripts/setup.sh "$build" || exit 1
  MG=1; while [ $((MG * 2)) -le "$mgpus" ] && [ $((MG * 2)) -le 8 ]; do MG=$((MG * 2)); done
  echo "=== multi: $mgpus GPUs visible, 8 ranks over $MG of them"
  nvidia-smi topo -m >"$logs/multi_topology.log" 2>&1 || true
  export NCCL_NVLS_ENABLE=0  # never NVLink multicast
  if [ -z "${EPX_NCCL_LIBRARY:-}" ]; then  # the wheel's libnccl when the system has none
    EPX_NCCL_LIBRARY=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null) && export EPX_NCCL_LIBRARY
  fi
  run_refused() {  # run_refused NAME REGEX CMD...: passed when the output matches REGEX (a refusal)
    local name=$1 re=$2; shift 2
    echo "=== $name (expects /$re/): $*"
    timeout "${EPX_RUN_TIMEOUT_S:-180}" "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    if [ "$rc" != 124 ] && grep -Eq "$re" "$logs/$name.log"; then
      passed=$((passed+1)); echo "    ok (exit $rc): $(grep -Em1 "$re" "$logs/$name.log" | cut -c1-240)"
    else
      failed=$((failed+1)); echo "    FAILED (exit $rc): no /$re/"; tail -n 15 "$logs/$name.log" | sed 's/^/      /'
    fi
  }
  ME="$build/epx check --world 8 --gpus $MG"
  # In-process ranks over the GPUs (peer access, push combine by default across GPUs).
  for t in 128 4096; do
    # (the CPU reference of 8 ranks x 4096 tokens of the R1 shape takes a while)
    it=2; tmo=${EPX_RUN_TIMEOUT_S:-180}; [ "$t" = 4096 ] && it=1 && tmo=${EPX_MULTI_LONG_TIMEOUT_S:-480}
    for c in push pull; do
      for l in token expert; do
        EPX_RUN_TIMEOUT_S=$tmo run "multi_ll_t${t}_${c}_${l}" $ME --tokens $t --combine $c \
          --layout $l --iters $it
      done
    done
    # high_throughput in direct mode (the default in one process), a thread per GPU (sized per
    # call) and one launch per GPU; its worst-case areas replayed as a graph.
    EPX_RUN_TIMEOUT_S=$tmo run "multi_ht_direct_t${t}" $ME --backend high_throughput --tokens $t \
      --iters $it
    EPX_RUN_TIMEOUT_S=$tmo run "multi_ht_direct_t${t}_one_launch" $ME --backend high_throughput \
      --tokens $t --one-launch --iters $it
  done
  run multi_ht_direct_worst_case_graph $ME --backend high_throughput --worst-case-output \
    --tokens 1024 --graph 20 --iters 1
  run multi_ll_t128_graph_mixed $ME --tokens 128 --graph 100 --mixed --iters 1
  run multi_baselines_t128 $ME --tokens 128 --backend allgather_reducescatter --iters 2
  # One process per GPU: IpcWorld (cuMem + POSIX descriptors) and NcclWorld, both engines.
  EI="$build/epx check --world-kind ipc"
  EN="$build/epx check --world-kind nccl"
  for b in low_latency high_throughput; do
    run "multi_ipc_${b}_t128" $L -n $MG -- $EI --world $MG --backend $b --tokens 128 --iters 2
    EPX_RUN_TIMEOUT_S=${EPX_MULTI_LONG_TIMEOUT_S:-480} run "multi_ipc_${b}_t4096" $L -n $MG -- \
      $EI --world $MG --backend $b --tokens 4096 --iters 1
    run "multi_nccl_${b}_t128" $L -n $MG -- $EN --backend $b --tokens 128 --iters 2
  done
  run multi_ipc_cuda_ipc_example $L -n $MG -- "$build/example_ipc_ranks" cuda-ipc
  # NCCL without symmetric memory: refused by name on every rank, no illegal address.
  run_refused multi_nccl_cumem_off "NCCL_CUMEM_ENABLE=0" \
    env NCCL_CUMEM_ENABLE=0 $L -n $MG -- $EN --tokens 128 --iters 1
  # Measured: every backend in process (one launch per GPU), then NcclWorld with NCCL's own
  # all-gather + reduce-scatter and all-to-all on the same data.
  EPX_RUN_TIMEOUT_S=${EPX_MULTI_LONG_TIMEOUT_S:-480} run multi_bench_inproc $build/epx bench --world 8 --gpus $MG --tokens 128,4096 \
    --backends low_latency,allgather_reducescatter,naive,high_throughput --iters 50 --warmup 5 \
    --json "$logs/multi_bench_inproc.json"
  EPX_RUN_TIMEOUT_S=${EPX_MULTI_LONG_TIMEOUT_S:-480} run multi_bench_nccl $L -n $MG -- \
    $build/epx bench --world-kind nccl --tokens 128,4096 \
    --iters 50 --warmup 5 --json "$logs/multi_bench_nccl.json"
  echo "    expected on the first day (DESIGN §9, EP8 decode, 128 tokens per rank, H 7168, 256"
  echo "    experts, top-8, fp8 dispatch, bf16 combine): low_latency dispatch <= 20 us, combine <= 28 us"
  for f in multi_bench_inproc multi_bench_nccl; do
    grep -E "^ +(128|4096) " "$logs/$f.log" | sed "s/^/    $f: /"
    grep -E "^ +128 +low_latency" "$logs/$f.log" | sed 's/^/    (target: dispatch <= 20 us, combine <= 28 us) /'
  done
  # epx tune of high_throughput over the GPUs (a thread per GPU: its dispatch waits on the host).
  run multi_tune_ht $build/epx tune --backend high_throughput --world 8 --gpus $MG --tokens 4096 \
    --blocks 8,16 --warps 16,32 --iters 10 --warmup 2 --output "$logs/multi_tune_ht.json"
  # Killed ranks (one process per GPU): every survivor names the dead rank within the bound.
  FT=2000; FSHAPE="--hidden 2048 --experts 16 --topk 4 --tokens 64"
  export LC_NUMERIC=C
  sockdir=$(mktemp -d /tmp/epx-suite.XXXXXX); pids=(); rcs=()
  source scripts/gpu_suite_faults.sh
  fault_kill "multi_fault_kill_rank1_of${MG}" "$MG" 1
  fault_kill "multi_fault_kill_rank0_of${MG}" "$MG" 0
  rm -rf "$sockdir"
  # DeepEP's own tests, one GPU per rank, run as DeepEP runs them (no runner: the deep_ep package
  # assembled once, then DeepEP's scripts with their own process spawning and NCCL group).
  py=$build/python-target
  if [ -z "${EPX_DEEPEP_DIR:-}" ]; then
    echo "multi: DeepEP tests skipped: EPX_DEEPEP_DIR unset"
  elif [ ! -d "$py/epx" ]; then
    echo "multi: DeepEP tests skipped: no Python package in $py (run the python part first)"
  else
    dd=$(mktemp -d /tmp/epx-deep_ep.XXXXXX)
    PYTHONPATH=$py python3 tests/compat/run_deepep_low_latency.py "$EPX_DEEPEP_DIR" \
      --assemble-only "$dd" >"$logs/multi_deepep_assemble.log" 2>&1
    DE="env PYTHONPATH=$dd:$py MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 python3"
    run "multi_deepep_low_latency_n${MG}" $DE "$EPX_DEEPEP_DIR/tests/legacy/test_low_latency.py" \
      --num-processes $MG --num-tokens 128 --hidden 7168 --num-topk 8 --num-experts 256
    [ -f "$EPX_DEEPEP_DIR/tests/legacy/test_intranode.py" ] &&
      run "multi_deepep_intranode_n${MG}" $DE "$EPX_DEEPEP_DIR/tests/legacy/test_intranode.py" \
        --num-processes $MG
    rm -rf "$dd"
  fi
fi
fi  # multi

[ -n "${OUT:-}" ] && [[ "$logs" != "$OUT"* ]] && tar -czf "$OUT/gpu-logs.tar.gz" -C "$logs" .
echo "gpu-total: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
