#pragma once
// End-to-end correctness check of a backend on an in-process world: random inputs from the
// reference generators, dispatch -> identity expert -> combine on the GPU, every output
// compared with the CPU reference (dispatch exactly, combine bit for bit). Shared by `epx check`
// and the GPU test suite.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "epx/config.hpp"
#include "reference/reference.hpp"

namespace epx {
class IpcWorld;
class NcclWorld;
}

namespace epx::testing {

struct CheckOptions {
  EpConfig cfg;                     // world_size = ranks of the world (in-process or IPC)
  int gpus = 1;                     // in-process: ranks round-robin over GPUs 0 .. gpus-1
  Backend backend = Backend::kLowLatency;
  LaunchConfigs launch;
  std::vector<int> tokens;          // one count for all ranks, one per rank, or empty = random
  ref::RoutingKind routing = ref::RoutingKind::kUniform;
  uint64_t seed = 1;
  int iters = 2;                    // eager calls, each with fresh inputs
  int graph_replays = 0;            // > 0: capture once per rank, replay this many times
  int verify_every = 1;             // with graph_replays: every replay gets fresh inputs, but
                                    // only every verify_every-th (and the last) is downloaded
                                    // and compared; every replay's device status is checked
  bool mixed = false;               // with graph_replays: rank 0 eager, the others replay
  bool one_launch = false;          // in-process: the ranks of each GPU in one kernel per op
                                    // (dispatch_group / combine_group) on one stream, eager and
                                    // captured; not with mixed or the graph variants below
  bool halves = false;              // in-process: each op as its halves, every rank's send half
                                    // then every rank's receive half, all on one stream per GPU
                                    // (a send half never waits); eager and captured, as
                                    // one_launch (and not with it)
  // Variants of the graph replay (with graph_replays, in-process only) that diagnose the MoE
  // layer's captured path (`epx diag graph-replay`, tests/gpu):
  bool conditional = false;         // the captured expert runs in a SWITCH node (as MoeLayer's
                                    // captured path)
  bool rank_threads = false;        // each rank captures and replays from its own host thread
                                    // (as serve-bench), not all from one
  int graph_execs = 1;              // executable graphs per rank, each from its own capture,
                                    // replayed in turn (as serve-bench's buckets)
  bool graph_split = false;         // dispatch, expert and combine captured as three graphs
                                    // replayed in order (MoeLayer's set_capture_split), not one
  bool pool_expert_out = false;     // in-process: the expert stage writes into memory of its
                                    // own from the GPU's stream-ordered pool (cudaMallocAsync,
                                    // unreadable from other GPUs), not into combine_buffer(),
                                    // and combine takes it from there
  int pool = 3;                     // distinct input sets cycled through (each call differs)
  bool ids_int64 = false;
  int max_report = 8;               // mismatches listed
  int corrupt_rank = -1;            // test hook: flip one output byte of this rank before the
                                    // comparison, to prove that the comparison can fail
  std::function<void(const std::string&)> log;  // progress lines, may be empty
};

// Memory in use at one point of the graph replays (in-process check).
struct MemorySample {
  int64_t replays = 0;              // replays completed when taken
  size_t device_bytes = 0;          // total - free (cudaMemGetInfo), summed over the world's GPUs
  size_t host_rss_bytes = 0;        // resident set of this process (/proc/self/statm)
};

struct CheckReport {
  bool ok = true;
  int64_t calls = 0;                // dispatch+combine rounds checked (compared)
  int64_t replays = 0;              // graph replays run (checked or not: verify_every)
  std::vector<std::string> mismatches;
  size_t buffer_bytes = 0;          // device memory of one rank's object
  std::vector<int> tokens;          // per-rank counts of the first input set
  // In-process, with graph_replays: before the first replay, after every tenth of them and
  // after the last, so that a long run shows whether memory stays flat.
  std::vector<MemorySample> memory;
};

// The rules of the options that every world shares (no GPU needed): pool, graph replays,
// verify_every, mixed, and the token list against the world and max_tokens_per_rank. Throws
// InputError naming the option, the value and the bound.
void validate_shared_check_options(const CheckOptions& options);

// Everything run_check and Checker refuse before touching a GPU (no GPU needed): the config
// (EpConfig::validate(), with rank 0: ConfigError), the shared rules above and those of the
// in-process world: one_launch and halves (one stream per GPU: not with mixed, the graph
// variants or each other), halves with unordered rows only (not deterministic, not the naive
// backend), rounds_in_flight 2 without the conditional or split graph variants, graph_execs in
// [1, 64]. Throws InputError naming the option, the value and the bound.
void validate_check_options(const CheckOptions& options);

// The check of run_check split in two, for callers that check many launch shapes of one
// configuration (`epx tune`): the constructor validates the options (validate_check_options),
// resolves the token counts and builds the input sets with their CPU reference once (the slow
// part: tens of seconds at thousands of tokens per rank); every run() creates a fresh
// in-process world and group with the given launch shapes (options.launch is not used) and
// runs the eager / graph / mixed procedure of run_check on those same inputs, returning its own
// report. run_check(o) is Checker(o).run(o.launch).
class Checker {
 public:
  explicit Checker(const CheckOptions& options);
  ~Checker();
  Checker(Checker&&) noexcept;
  Checker& operator=(Checker&&) noexcept;
  Checker(const Checker&) = delete;
  Checker& operator=(const Checker&) = delete;

  CheckReport run(const LaunchConfigs& launch) const;

  // Per-rank token counts (the same for every run).
  const std::vector<int>& tokens() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

CheckReport run_check(const CheckOptions& options);

// The same check with one process per rank (an IpcWorld; `epx launch -n W -- epx check
// --world-kind ipc`). Collective: every rank calls it with the same options, where
// options.cfg.world_size must equal world.size(). Every rank builds every rank's inputs and
// the whole CPU reference from the seed, runs only its own rank (dispatch -> identity expert ->
// combine on its own stream; with `mixed`, rank 0 calls eagerly while the others replay) and
// compares its own outputs; after every round the ranks agree through the bootstrap whether to
// go on, and at the end they all-gather their results, so every rank returns the same report
// (mismatches of all ranks, in rank order). `log` is called on rank 0 only. A rank that fails
// or exits makes the others throw the bootstrap's PeerError / TimeoutError (or a device
// TimeoutError in the report), never hang.
CheckReport run_check_ipc(const CheckOptions& options, IpcWorld& world);
// The same over an NcclWorld (`epx check --world-kind nccl`, one GPU per process).
CheckReport run_check_nccl(const CheckOptions& options, NcclWorld& world);
inline CheckReport run_check_world(const CheckOptions& o, IpcWorld& w) { return run_check_ipc(o, w); }
inline CheckReport run_check_world(const CheckOptions& o, NcclWorld& w) { return run_check_nccl(o, w); }

}  // namespace epx::testing
