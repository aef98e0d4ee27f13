// `epx check --moe`: MoE layer on W in-process ranks vs the same layer on one rank with every
// expert local (and no communication between ranks), and vs the CPU reference on small shapes.
//
// Procedure (CUDA builds):
//  1. CUDA_MODULE_LOADING=EAGER unless the environment sets it (before any CUDA call; moe.hpp:
//     cuBLASLt loads its kernels lazily and a lazy load waits for other ranks' spinning kernels).
//  2. An in-process world of W ranks and its All2All group; a one-rank world and its group.
//     Every rank's MoeLayer and the one-rank layer are built (in parallel host threads: the host
//     generation of the weights is the slow part) before any forward.
//  3. Inputs: x_r = make_moe_input(shape, tokens_r, seed_r) per rank, bf16.
//  4. forward() on every rank, each from its own host thread on its own non-blocking stream:
//     the layer synchronises its stream after each dispatch, and a dispatch completes only
//     once every rank has dispatched, so one host thread driving the ranks in turn would wait
//     on rank 0 forever. Every rank runs the same number of chunks (the largest need).
//  5. The one-rank layer on all ranks' tokens concatenated (rank 0's first), in chunks of the
//     same max_tokens. Compare per token: ||y_W - y_1|| / ||y_1|| over all tokens < tolerance;
//     the worst token is reported.
//  6. When H <= 1024 and E <= 64: ref::moe::moe_forward_routed with each run's own GPU routing,
//     compared the same way (both runs).
#include "moe_check.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "epx/error.hpp"
#include "moe_check_steps.hpp"
#include "report.hpp"
#if EPX_HAVE_CUDA
#include "epx/cuda_check.hpp"
#endif

namespace epx::cli {
namespace {

[[maybe_unused]] MoeScoring parse_scoring(const std::string& s) {
  if (s == "sigmoid") return MoeScoring::kSigmoidGrouped;
  if (s == "softmax") return MoeScoring::kSoftmax;
  EPX_THROW(ConfigError, "--scoring = '" + s + "', expected sigmoid or softmax");
}

// The flags, validated (no CUDA).
[[maybe_unused]] moe::Plan make_plan(const MoeCheckFlags& f) {
  moe::Plan p;
  const MoeLayerFlags& l = f.layer;
  EPX_CHECK(l.tolerance > 0 && std::isfinite(l.tolerance), ConfigError, "--tolerance", l.tolerance,
            "> 0");
  p.tolerance = l.tolerance;
  const std::vector<int> list = parse_token_counts(f.tokens, "--tokens");
  p.cfg = f.shape.config(std::max(1, *std::max_element(list.begin(), list.end())));
  p.tokens = tokens_per_rank(list, p.cfg.world_size, "--tokens", f.tokens);
  p.tokens_text = f.tokens;
  p.backend = backend_or_env(f.backend, "--backend");
  p.launch = launch_from_env().launch;
  p.seed = f.seed;

  MoeShape& rs = p.shape;
  rs.hidden = p.cfg.hidden;
  rs.intermediate = l.intermediate;
  rs.num_experts = p.cfg.num_experts;
  rs.topk = p.cfg.topk;
  rs.num_groups = l.groups;
  rs.topk_groups = l.topk_groups;
  rs.shared_intermediate = l.shared_intermediate;
  rs.scoring = parse_scoring(l.scoring);
  rs.validate();

  const int t = p.cfg.max_tokens_per_rank;
  for (int n : p.tokens) {
    p.chunks = std::max(p.chunks, (n + t - 1) / t);
    p.total += n;
  }
  EPX_CHECK(p.total <= int64_t(1) << 30, ConfigError, "--tokens", f.tokens,
            "at most 2^30 tokens over all ranks");
  p.with_cpu_ref = p.cfg.hidden <= 1024 && p.cfg.num_experts <= 64;
  return p;
}

}  // namespace

int run_moe_check(const MoeCheckFlags& flags) {
#if EPX_HAVE_CUDA
  // Step 1, before any CUDA call of this process.
  const std::string loading_note = load_modules_eagerly(
      "epx check --moe: ranks spin on each other and a lazy kernel load would wait for them",
      "a lazy cuBLASLt kernel load may deadlock the ranks");
  const moe::Plan p = make_plan(flags);
  require_gpu("epx check --moe");
  const EpConfig& cfg = p.cfg;
  const MoeShape& s = p.shape;
  fmt::print(
      "epx check --moe: backend {}, world {}, H {}, I {}, E {}, K {}, groups {}/{}, "
      "shared I {}, scoring {}, tokens {}, max {} ({} chunk(s) per rank), dtype {}, "
      "layout {}, scales {}, seed {}, tolerance {:.1e}\n",
      to_string(p.backend), cfg.world_size, s.hidden, s.intermediate, s.num_experts, s.topk,
      s.num_groups, s.topk_groups, s.shared_intermediate, ref::moe::to_string(s.scoring),
      p.tokens_text, cfg.max_tokens_per_rank, p.chunks, to_string(cfg.dtype), to_string(cfg.layout),
      to_string(cfg.scale_layout), p.seed, p.tolerance);
  fmt::print("  {}\n", loading_note);
  std::fflush(stdout);

  const moe::Forwards runs = moe::run_forwards(p);
  moe::Verdict v;
  moe::compare_with_one_rank(p, runs.ranks, runs.one, v);
  if (p.with_cpu_ref) {
    moe::compare_with_reference(p, runs.ranks, runs.one, v);
  } else {
    fmt::print("  CPU reference: skipped (runs only when H <= 1024 and E <= 64)\n");
  }
  fmt::print(
      "{}: MoE layer, backend {}, world {}, layout {}, dtype {}: ||d||/||ref|| {}; "
      "tolerance {:.1e}\n",
      v.ok ? "PASS" : "FAIL", to_string(p.backend), cfg.world_size, to_string(cfg.layout),
      to_string(cfg.dtype), v.summary, p.tolerance);
  std::fflush(stdout);
  return v.ok ? 0 : 1;
#else
  (void)flags;
  EPX_THROW(UnsupportedError, "epx check --moe needs an NVIDIA GPU and a CUDA build of epx");
#endif
}

}  // namespace epx::cli
