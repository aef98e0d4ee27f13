#pragma once
// One backend's run of `epx serve-bench` (CUDA builds): warm-up, decode graph capture, then the
// whole workload step by step, timed.

#include "epx/config.hpp"
#include "epx/world.hpp"
#include "serve_flags.hpp"
#include "serve_ranks.hpp"
#include "serve_report.hpp"

namespace epx::cli::serve {

// Runs the workload of `p` through `backend` on the ranks' layers: eagerly, or with `cuda_graph`
// its decode-only steps as replays of decode graphs; with `overlap` every decode-only step
// within one chunk (eager or captured) as two micro-batches on two rounds in flight. The backend's All2All group lives for this
// call alone (the ranks' graphs, which hold it, are destroyed before it returns). Errors of the
// backend are reported in the result (status unavailable or error) and on stderr, not thrown;
// progress goes to stderr.
BackendResult run_backend(const Plan& p, const BackendMix& backend, bool cuda_graph, bool overlap,
                          const InProcessWorld& world, Ranks& ranks, RankThreads& threads);

}  // namespace epx::cli::serve
