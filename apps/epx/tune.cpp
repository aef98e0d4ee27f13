// `epx tune`: sweeps the launch shape (num_blocks x warps_per_block) of dispatch, then of
// combine with the best dispatch, checks every candidate against the CPU reference before
// timing it (graph mode, DESIGN §8), and writes the best as a DESIGN §6 launch file.
#include <fmt/format.h>

#include <chrono>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "commands.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#if EPX_HAVE_CUDA
#include "testing/harness.hpp"
#include "epx/all2all.hpp"
#include "epx/world.hpp"
#endif

namespace epx::cli {
namespace {

constexpr int kMinTuneIters = 10;
constexpr int kMaxTuneIters = 100000;
// Block counts tried, up to the SM budget of one rank (which is added when not listed).
constexpr int kBlockSeries[] = {4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024};

struct TuneFlags {
  SweepFlags sweep;
  std::string backend = "low_latency";
  int iters = 30;
  int warmup = 10;
  std::string output = "epx_tuned.json";
  std::string blocks;  // empty = the series above, up to the SM budget
  std::string warps = "4,8,16,32";
};

struct TunePlan {
  Sweep shape;
  Backend backend{};
  int iters = 0;
  int warmup = 0;
  std::string output;
  std::vector<int> blocks;  // empty = derived from the SM budget
  std::vector<int> warps;
};

TunePlan validate(const TuneFlags& f) {
  TunePlan p;
  p.shape = make_sweep(f.sweep);
  p.backend = parse_backend_flag(f.backend, "--backend");
  check_range("--iters", f.iters, kMinTuneIters, kMaxTuneIters, "the median of each candidate");
  check_range("--warmup", f.warmup, 0, kMaxTuneIters);
  p.iters = f.iters;
  p.warmup = f.warmup;
  if (f.output.empty()) EPX_THROW(ConfigError, "--output = '', expected a file name");
  p.output = f.output;
  if (!f.blocks.empty()) p.blocks = parse_int_list(f.blocks, "--blocks", 1, kMaxBlocks);
  p.warps = parse_int_list(f.warps, "--warps", 1, kMaxWarpsPerBlock);
  return p;
}

#if EPX_HAVE_CUDA

std::string shape_name(const LaunchConfig& lc) {
  if (lc.num_blocks == 0 && lc.warps_per_block == 0) return "default";
  return fmt::format("{}x{}", lc.num_blocks, lc.warps_per_block);
}

double total(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

struct Candidate {
  std::string phase;  // default | dispatch | combine
  LaunchConfigs launch;
  std::string status = "ok";  // ok | FAILED (check) | skipped (config) | error
  std::string message;
  std::vector<double> median_us[2];  // [dispatch, combine][token count]

  // Summed median over the token counts; +inf unless every step passed.
  double sum(int op) const {
    return status == "ok" ? total(median_us[op]) : std::numeric_limits<double>::infinity();
  }
  const LaunchConfig& swept() const { return phase == "combine" ? launch.combine : launch.dispatch; }
};

class Tuner {
 public:
  Tuner(const TunePlan& p, const InProcessWorld& world, ForkJoin& fj,
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
        const RoundSamples s = time_rounds(group, *inputs_[i], fj_, TimingMode::kGraph,
                                           p_.warmup, p_.iters);
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

  static std::vector<std::string> format_us(const std::vector<double>& v) {
    std::vector<std::string> out;
    for (double x : v) out.push_back(fmt::format("{:.2f}", x));
    return out;
  }

 private:
  const TunePlan& p_;
  const InProcessWorld& world_;
  ForkJoin& fj_;
  const std::vector<std::unique_ptr<DeviceInputs>>& inputs_;
  std::vector<std::unique_ptr<testing::Checker>> checkers_;  // per token count, see checker()
};

// Index of the candidate of `phase` with the lowest summed median of `op`; -1 if none passed.
int best_of(const std::vector<Candidate>& cands, const std::string& phase, int op) {
  int best = -1;
  for (int i = 0; i < int(cands.size()); ++i) {
    if (cands[i].phase != phase || cands[i].status != "ok") continue;
    if (best < 0 || cands[i].sum(op) < cands[best].sum(op)) best = i;
  }
  return best;
}

std::string reason(const std::vector<Candidate>& cands, const std::string& phase, int op,
                   int best, const std::string& tokens) {
  const Candidate& b = cands[best];
  std::string r = fmt::format("lowest {} median summed over tokens/rank {}: {:.2f} us", phase,
                              tokens, b.sum(op));
  int runner = -1;
  for (int i = 0; i < int(cands.size()); ++i) {
    if (i == best || cands[i].phase != phase || cands[i].status != "ok") continue;
    if (runner < 0 || cands[i].sum(op) < cands[runner].sum(op)) runner = i;
  }
  if (runner >= 0) {
    r += fmt::format("; runner-up {} at {:.2f} us ({:+.1f}%)", shape_name(cands[runner].swept()),
                     cands[runner].sum(op), 100.0 * (cands[runner].sum(op) / b.sum(op) - 1.0));
  }
  for (const Candidate& c : cands) {
    if (c.phase != "default") continue;
    if (c.status == "ok") {
      r += fmt::format("; backend default at {:.2f} us ({:+.1f}%)", c.sum(op),
                       100.0 * (c.sum(op) / b.sum(op) - 1.0));
    } else {
      r += fmt::format("; backend default {}", c.status);
    }
  }
  return r;
}

void print_candidates(const std::vector<Candidate>& cands, const std::vector<int>& tokens) {
  const std::string tok = fmt::format("{}", fmt::join(tokens, "/"));
  fmt::print("\n{:<9} {:<9} {:<9} {:>28} {:>28}  {}\n", "phase", "dispatch", "combine",
             "dispatch us (" + tok + ")", "combine us (" + tok + ")", "status");
  for (const Candidate& c : cands) {
    auto col = [&](int op) {
      const std::vector<double>& m = c.median_us[op];
      if (m.empty()) return std::string("-");
      if (tokens.size() == 1) return fmt::format("{:.2f}", m[0]);
      return fmt::format("{} = {:.2f}", fmt::join(Tuner::format_us(m), "/"), total(m));
    };
    fmt::print("{:<9} {:<9} {:<9} {:>28} {:>28}  {}\n", c.phase, shape_name(c.launch.dispatch),
               shape_name(c.launch.combine), col(0), col(1),
               c.status == "ok" ? "ok" : c.status + ": " + one_line(c.message, 140));
  }
}

bool run_tune(const TunePlan& p) {
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
    if (budget <= kMaxBlocks && (blocks.empty() || blocks.back() != budget)) blocks.push_back(budget);
  }
  const GpuInfo gpu = gpu_info(world.device_of(0));
  const std::string tokens = fmt::format("{}", fmt::join(p.shape.tokens, ","));
  fmt::print("epx tune: backend {}, {} in-process ranks on {} ({} SMs, budget {} blocks per "
             "rank), H {}, E {}, K {}, dtype {}, layout {}, routing {}, tokens/rank {}\n",
             to_string(p.backend), W, gpu.name, gpu.sm_count, budget, base.hidden,
             base.num_experts, base.topk, to_string(base.dtype), to_string(base.layout),
             p.shape.routing_name, tokens);
  fmt::print("  num_blocks {{{}}} x warps_per_block {{{}}}: {} candidates per op, each checked "
             "against the CPU reference, then timed as a CUDA graph ({} rounds after {} "
             "warm-up, median); commit {}\n",
             fmt::join(blocks, ", "), fmt::join(p.warps, ", "), blocks.size() * p.warps.size(),
             p.iters, p.warmup, git_commit());
  if (read_env().config_path) {
    fmt::print("  note: EPX_CONFIG_PATH is not applied while tuning: every candidate is set "
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

  const size_t per_op = blocks.size() * p.warps.size();
  size_t n = 0;
  for (int b : blocks) {
    for (int w : p.warps) {
      Candidate c{"dispatch", LaunchConfigs{{b, w}, {}}};
      tuner.evaluate(c, fmt::format("[dispatch {}/{}]", ++n, per_op));
      cands.push_back(std::move(c));
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
  for (int b : blocks) {
    for (int w : p.warps) {
      Candidate c{"combine", LaunchConfigs{dispatch, {b, w}}};
      tuner.evaluate(c, fmt::format("[combine {}/{}]", ++n, per_op));
      cands.push_back(std::move(c));
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

  fmt::print("\nchoice:\n  dispatch {} (num_blocks x warps_per_block): {}\n  combine  {}: {}\n",
             shape_name(chosen.dispatch), reason(cands, "dispatch", 0, best_d, tokens),
             shape_name(chosen.combine), reason(cands, "combine", 1, best_c, tokens));
  const std::string text = to_json(chosen);
  std::ofstream out(p.output);
  out << text;
  out.close();
  if (!out) EPX_THROW(InputError, fmt::format("--output = '{}' could not be written", p.output));
  fmt::print("wrote {} (use it with EPX_CONFIG_PATH={}) ({:.0f} s)\n{}", p.output, p.output,
             seconds_since(t_start), text);
  return true;
}

#endif  // EPX_HAVE_CUDA

}  // namespace

void add_tune(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<TuneFlags>();
  CLI::App* c = app.add_subcommand(
      "tune", "sweep num_blocks x warps_per_block of dispatch, then of combine (with the best "
              "dispatch), check each candidate against the CPU reference, time it as a CUDA "
              "graph, and write the fastest as an EPX_CONFIG_PATH launch file");
  add_sweep_flags(c, f->sweep);
  c->add_option("--backend", f->backend, "naive | allgather_reducescatter | low_latency")
      ->capture_default_str();
  c->add_option("--iters", f->iters, "timed rounds per candidate and token count (at least 10)")
      ->capture_default_str();
  c->add_option("--warmup", f->warmup, "untimed rounds before them")->capture_default_str();
  c->add_option("--output", f->output, "launch file to write (DESIGN §6 JSON)")
      ->capture_default_str();
  c->add_option("--blocks", f->blocks,
                "num_blocks candidates, comma list (default 4,8,12,16,24,32,48,... up to the SM "
                "budget of one rank, and the budget itself)");
  c->add_option("--warps", f->warps, "warps_per_block candidates, comma list")
      ->capture_default_str();
  c->callback([f, &exit_code] {
    const TunePlan plan = validate(*f);
#if EPX_HAVE_CUDA
    exit_code = run_tune(plan) ? 0 : 1;
#else
    (void)plan;
    (void)exit_code;
    EPX_THROW(UnsupportedError, "epx tune needs an NVIDIA GPU and a CUDA build of epx");
#endif
  });
}

}  // namespace epx::cli
