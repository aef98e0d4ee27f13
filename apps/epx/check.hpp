#pragma once
// `epx check` and `epx diag graph-replay`: the flags of one dispatch -> identity expert ->
// combine check against the CPU reference (src/testing), and its runs on an in-process world and
// with one process per rank; `epx check --fuzz`: random cases (src/testing/fuzz_cases.hpp)
// until a time is up.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "flags.hpp"

#if EPX_HAVE_CUDA
#include "testing/harness.hpp"
#endif

namespace epx::cli {

// The flags of a check that `epx check` and `epx diag graph-replay` share.
struct CheckRunFlags {
  ShapeFlags shape;
  std::string tokens = "128";  // one count, or one per rank
  std::string routing = "uniform";
  std::string backend;  // empty = EPX_BACKEND or low_latency
  uint64_t seed = 1;
  int iters = 2;
  int graph = 0;
  int verify_every = 1;  // with --graph: compare every K-th replay (and the last)
  bool mixed = false;
  bool ids64 = false;
  bool one_launch = false;  // in-process: the ranks of each GPU in one kernel per op
  bool halves = false;      // in-process: each op as its send and receive halves, one stream
};

// Binds the shape flags (with --max-tokens), --tokens, --routing, --backend, --seed, --iters,
// --graph, --verify-every, --mixed, --ids64, --one-launch and --halves.
void add_check_run_flags(CLI::App* c, CheckRunFlags& f);

// `epx check --fuzz MINUTES`: the flags it takes (the cases draw everything else).
struct FuzzFlags {
  double minutes = 0;
  uint64_t seed = 1;     // --seed: the stream of cases
  int timeout_ms = 0;    // --timeout-ms; 0 = EPX_TIMEOUT_MS or the library's default
  std::string json;      // --json: the cases and the summary
};

#if EPX_HAVE_CUDA
// The harness options of the flags: per-rank token counts, max_tokens_per_rank = --max-tokens
// or the largest count, the backend (--backend, EPX_BACKEND or low_latency) and the launch shapes
// of EPX_CONFIG_PATH. Throws ConfigError naming the flag, the value and the bound.
testing::CheckOptions check_options(const CheckRunFlags& f);

// Runs the check on an in-process world (o.gpus GPUs): prints the shape, the progress and
// memory lines, the mismatches and a PASS / FAIL line; with `json` non-empty writes the options
// and the report (memory samples included) there. Returns the exit code (0 only on PASS).
int run_in_process_check(const testing::CheckOptions& o, const CheckRunFlags& f,
                         const std::string& json = "");

// This process is rank EPX_RANK of EPX_WORLD_SIZE (`epx launch` sets both), in a world of
// `kind` (ipc or nccl): every rank checks its own outputs, rank 0 prints, all return the same
// exit code. `fault_kill_ranks`: those ranks create their All2All, then kill themselves (SIGKILL)
// before their first dispatch, to prove that the others name them. `json`: as run_in_process_check,
// written by rank 0.
int run_world_check(const testing::CheckOptions& o, WorldKind kind, const CheckRunFlags& f,
                    const std::vector<int>& fault_kill_ranks, const std::string& json = "");

// `epx check --fuzz`: draws case after case (testing::make_fuzz_case of --seed, index 0, 1, ...)
// and checks each on an in-process world on GPU 0 until f.minutes have passed, one line per
// case; stops at the first mismatch or device error with its mismatches and the command that
// reproduces it. Ends with "fuzz: N cases, M calls, K mismatches, X.X min". Returns the exit
// code (0 only when every case passed).
int run_fuzz(const FuzzFlags& f);
#endif

}  // namespace epx::cli
