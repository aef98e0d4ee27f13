#pragma once
// The steps of `epx check --moe` (the procedure is at the top of moe_check.cpp): the plan made
// from the flags (moe_check.cpp), the forwards on the GPU (moe_check_run.cpp, CUDA builds), and
// the comparisons of their outputs as ||d|| / ||ref|| over all tokens with the worst token
// (moe_compare.cpp, no CUDA).

#include <cstdint>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "epx/config.hpp"
#include "epx/error.hpp"
#include "epx/moe_shape.hpp"
#include "reference/moe_ref.hpp"

namespace epx::cli::moe {

// What the flags ask for, validated.
struct Plan {
  EpConfig cfg;             // the W-rank world's; max_tokens_per_rank = the chunk
  std::vector<int> tokens;  // per rank
  std::string tokens_text;  // --tokens as given
  int64_t total = 0;        // over all ranks
  int chunks = 1;           // per rank: the largest need, every rank runs as many
  Backend backend = Backend::kLowLatency;
  LaunchConfigs launch;
  MoeShape shape;  // the layer, as MoeLayer and the CPU reference take it
  uint64_t seed = 1;
  double tolerance = 0;
  bool with_cpu_ref = false;  // H <= 1024 and E <= 64
};

// One run's tokens on the host.
struct HostRun {
  int tokens = 0;
  std::vector<uint16_t> x;     // [tokens][H] bf16 input
  std::vector<uint16_t> y;     // [tokens][H] bf16 output
  std::vector<int32_t> ids;    // [tokens][K] the routing the GPU chose
  std::vector<float> weights;  // [tokens][K]
};

#if EPX_HAVE_CUDA
// Steps 2 to 5: the W-rank world and the one-rank world with their layers, every rank's forward
// from its own host thread, then the one-rank forward on all tokens; their tokens on the host.
struct Forwards {
  std::vector<HostRun> ranks;
  HostRun one;
};
Forwards run_forwards(const Plan& p);
#endif

// Whether every comparison held, and their norms for the PASS / FAIL line.
struct Verdict {
  bool ok = true;
  std::string summary;
};

// Step 5: every rank's outputs against the one-rank run's (its tokens are the ranks' in rank
// order); prints how many tokens the two runs routed differently and the norm line.
void compare_with_one_rank(const Plan& p, const std::vector<HostRun>& ranks, const HostRun& one,
                           Verdict& v);
// Step 6: both runs against ref::moe::moe_forward_routed with each run's own GPU routing.
void compare_with_reference(const Plan& p, const std::vector<HostRun>& ranks, const HostRun& one,
                            Verdict& v);

// Runs fn(i) for i in [0, n) on n host threads; rethrows the first exception (by index) after
// all have finished.
template <typename Fn>
void parallel_for(int n, Fn fn) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      try {
        fn(i);
      } catch (...) {
        errors[size_t(i)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  // The root cause first: a rank's own failure, not a peer's timeout waiting for that rank.
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const TimeoutError&) {
    } catch (const PeerError&) {
    } catch (...) {
      throw;
    }
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace epx::cli::moe
