// `epx tune`'s sweep on an in-process world: every candidate checked against the CPU reference,
// then timed as a CUDA graph (bench_common.hpp), and the launch file written.
#include <fmt/format.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "epx/all2all.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"
#include "testing/harness.hpp"
#include "tune.hpp"

namespace epx::cli::tune {
namespace {

// Graph replays (DESIGN §8), except for high_throughput sized per call: its dispatch reads the
// row count back on the host, which a capturing stream refuses.
TimingMode timing_mode(const Plan& p) {
  return reads_counts_on_host(p.backend, p.shape.cfg) ? TimingMode::kEager : TimingMode::kGraph;
}

class Tuner {
 public:
  Tuner(const Plan& p, const InProcessWorld& world, ForkJoin& fj,
        const std::vector<std::unique_ptr<DeviceInputs>>& inputs)
      : p_(p), world_(world), fj_(fj), inputs_(inputs) {}

  // Checks, then times `c` at every token count; records the outcome in `c`.
  void evaluate(Candidate& c, const std::string& tag) {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < p_.shape.tokens.size() && c.status == "ok"; ++i) {
      const int T = p_.shape.tokens[i];
      const EpConfig cfg = p_.shape.config_for(T);
      try {
        const testing::CheckReport rep = checker(i, cfg).run(c.launch);
        if (!rep.ok) {
          c.status = "FAILED";
          c.message = fmt::format("check at {} tokens: {}", T,
                                  rep.mismatches.empty() ? "output differs from the reference"
                                                         : rep.mismatches.front());
          break;
        }
        Group group = make_all2all_group(p_.backend, cfg, world_, c.launch);
        const RoundSamples s = time_rounds(group, *inputs_[i], fj_, timing_mode(p_),
                                           LaunchMode::kOnePerGpu, p_.warmup, p_.iters);
        c.median_us[0].push_back(summarize(s.dispatch_us).median_us);
        c.median_us[1].push_back(summarize(s.combine_us).median_us);
      } catch (const UnsupportedError&) {
        throw;  // the backend itself is unavailable: nothing to tune
      } catch (const ConfigError& e) {
        c.status = "skipped";
        c.message = e.what();
      } catch (const Error& e) {
        c.status = "error";
        c.message = fmt::format("at {} tokens: {}", T, e.what());
      }
    }
    const int op = c.phase == "combine" ? 1 : 0;
    if (c.status == "ok") {
      progress(fmt::format("{} {}: {} {} us, sum {:.2f} us ({:.1f} s)", tag, shape_name(c.swept()),
                           op == 0 ? "dispatch" : "combine",
                           fmt::join(format_us(c.median_us[op]), " / "), c.sum(op),
                           seconds_since(t0)));
    } else {
      progress(fmt::format("{} {}: {}: {}", tag, shape_name(c.swept()), c.status,
                           one_line(c.message, 140)));
    }
  }

  // The checker of token count i, built on first use: the inputs and CPU reference (tens of
  // seconds at thousands of tokens per rank) are computed once and shared by every candidate.
  // A failed construction is retried by the next candidate, as a failed check was.
  const testing::Checker& checker(size_t i, const EpConfig& cfg) {
    if (checkers_.size() < p_.shape.tokens.size()) checkers_.resize(p_.shape.tokens.size());
    if (!checkers_[i]) {
      testing::CheckOptions o;
      o.cfg = cfg;
      o.backend = p_.backend;
      o.tokens = {p_.shape.tokens[i]};
      o.routing = p_.shape.routing;
      o.seed = p_.shape.seed;
      o.iters = 1;
      o.pool = 1;
      checkers_[i] = std::make_unique<testing::Checker>(o);
    }
    return *checkers_[i];
  }

 private:
  const Plan& p_;
  const InProcessWorld& world_;
  ForkJoin& fj_;
  const std::vector<std::unique_ptr<DeviceInputs>>& inputs_;
  std::vector<std::unique_ptr<testing::Checker>> checkers_;  // per token count, see checker()
};

}  // namespace

bool run(const Plan& p) {
  const auto t_start = std::chrono::steady_clock::now();
  require_gpu("epx tune");
  const EpConfig& base = p.shape.cfg;
  const int W = base.world_size;
  InProcessWorld world(W, p.shape.devices);
  int budget = world.sm_budget(0);
  for (int r = 1; r < W; ++r) budget = std::min(budget, world.sm_budget(r));
  std::vector<int> blocks = p.blocks;
  if (blocks.empty()) {
    for (int b : kBlockSeries)
      if (b <= budget) blocks.push_back(b);
    if (budget <= kMaxBlocks && (blocks.empty() || blocks.back() != budget))
      blocks.push_back(budget);
  }
  const GpuInfo gpu = gpu_info(world.device_of(0));
  const std::string tokens = fmt::format("{}", fmt::join(p.shape.tokens, ","));
  fmt::print(
      "epx tune: backend {}, {} in-process ranks on {} ({} SMs, budget {} blocks per "
      "rank), H {}, E {}, K {}, dtype {}, layout {}, routing {}, tokens/rank {}\n",
      to_string(p.backend), W, gpu.name, gpu.sm_count, budget, base.hidden, base.num_experts,
      base.topk, to_string(base.dtype), to_string(base.layout), p.shape.routing_name, tokens);
  const bool ht = p.backend == Backend::kHighThroughput;
  // high_throughput: ring sizes too (0 = the backend's choice); its combine keeps the dispatch's
  // num_blocks (the channels), so only warps and rings are swept for it.
  const std::vector<int> rings = p.ring_rows.empty() ? std::vector<int>{0} : p.ring_rows;
  const std::string ring_list = p.ring_rows.empty()
                                    ? std::string(ht ? " x ring_rows {default}" : "")
                                    : fmt::format(" x ring_rows {{{}}}", fmt::join(rings, ", "));
  fmt::print(
      "  num_blocks {{{}}} x warps_per_block {{{}}}{}: {} candidates for dispatch, each "
      "checked against the CPU reference, then timed {} ({} rounds after {} warm-up, "
      "median); commit {}\n",
      fmt::join(blocks, ", "), fmt::join(p.warps, ", "), ring_list,
      blocks.size() * p.warps.size() * rings.size(),
      timing_mode(p) == TimingMode::kGraph
          ? "as a CUDA graph"
          : "eagerly (high_throughput reads its row count back on the host; "
            "--worst-case-output times graphs)",
      p.iters, p.warmup, git_commit());
  if (read_env().config_path) {
    fmt::print(
        "  note: EPX_CONFIG_PATH is not applied while tuning: every candidate is set "
        "explicitly and the baseline is the backend's built-in default\n");
  }

  ForkJoin fj(world);
  std::vector<std::unique_ptr<DeviceInputs>> inputs;
  for (int T : p.shape.tokens) {
    inputs.push_back(std::make_unique<DeviceInputs>(world, p.shape.config_for(T), T,
                                                    p.shape.routing, p.shape.seed));
  }
  progress(fmt::format("inputs on the device for tokens/rank {} ({:.1f} s)", tokens,
                       seconds_since(t_start)));

  Tuner tuner(p, world, fj, inputs);
  std::vector<Candidate> cands;
  cands.push_back({"default", LaunchConfigs{}});
  tuner.evaluate(cands.back(), "[default]");

  size_t per_op = blocks.size() * p.warps.size() * rings.size();
  size_t n = 0;
  for (int b : blocks) {
    for (int w : p.warps) {
      for (int rr : rings) {
        Candidate c{"dispatch", LaunchConfigs{{b, w, rr}, {}}};
        tuner.evaluate(c, fmt::format("[dispatch {}/{}]", ++n, per_op));
        cands.push_back(std::move(c));
      }
    }
  }
  const int best_d = best_of(cands, "dispatch", 0);
  if (best_d < 0) {
    print_candidates(cands, p.shape.tokens);
    fmt::print("no dispatch launch shape passed the check and the timing; {} not written\n",
               p.output);
    return false;
  }
  const LaunchConfig dispatch = cands[best_d].launch.dispatch;

  n = 0;
  const std::vector<int> combine_blocks = ht ? std::vector<int>{dispatch.num_blocks} : blocks;
  per_op = combine_blocks.size() * p.warps.size() * rings.size();
  for (int b : combine_blocks) {
    for (int w : p.warps) {
      for (int rr : rings) {
        Candidate c{"combine", LaunchConfigs{dispatch, {b, w, rr}}};
        tuner.evaluate(c, fmt::format("[combine {}/{}]", ++n, per_op));
        cands.push_back(std::move(c));
      }
    }
  }
  const int best_c = best_of(cands, "combine", 1);
  print_candidates(cands, p.shape.tokens);
  if (best_c < 0) {
    fmt::print("no combine launch shape passed the check and the timing; {} not written\n",
               p.output);
    return false;
  }
  const LaunchConfigs chosen{dispatch, cands[best_c].launch.combine};

  fmt::print("\nchoice:\n  dispatch {} (num_blocks x warps_per_block{}): {}\n  combine  {}: {}\n",
             shape_name(chosen.dispatch), ht ? ", r = ring_rows" : "",
             reason(cands, "dispatch", 0, best_d, tokens), shape_name(chosen.combine),
             reason(cands, "combine", 1, best_c, tokens));
  const std::string text = to_json(chosen);
  std::ofstream out(p.output);
  out << text;
  out.close();
  if (!out) EPX_THROW(InputError, fmt::format("--output = '{}' could not be written", p.output));
  fmt::print("wrote {} (use it with EPX_CONFIG_PATH={}) ({:.0f} s)\n{}", p.output, p.output,
             seconds_since(t_start), text);
  return true;
}

}  // namespace epx::cli::tune
