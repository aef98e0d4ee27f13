// `epx tune`: sweeps the launch shape (num_blocks x warps_per_block, and ring_rows for
// high_throughput) of dispatch, then of combine with the best dispatch, checks every candidate
// against the CPU reference before timing it (graph mode, DESIGN §8; eager where the backend
// cannot be captured), and writes the best as a DESIGN §6 launch file.
//
// This file: the flags and the plan they make (tune.hpp has the rest).
#include <fmt/format.h>

#include <memory>
#include <string>

#include "commands.hpp"
#include "epx/error.hpp"
#include "tune.hpp"

namespace epx::cli {
namespace {

struct TuneFlags {
  SweepFlags sweep;
  std::string backend = "low_latency";
  int iters = 30;
  int warmup = 10;
  std::string output = "epx_tuned.json";
  std::string blocks;  // empty = the series above, up to the SM budget
  std::string warps = "4,8,16,32";
  std::string ring_rows;  // empty = the backend's choice
};

tune::Plan validate(const TuneFlags& f) {
  tune::Plan p;
  p.shape = make_sweep(f.sweep);
  p.backend = parse_backend_flag(f.backend, "--backend");
  check_range("--iters", f.iters, tune::kMinIters, tune::kMaxIters, "the median of each candidate");
  check_range("--warmup", f.warmup, 0, tune::kMaxIters);
  p.iters = f.iters;
  p.warmup = f.warmup;
  if (f.output.empty()) EPX_THROW(ConfigError, "--output = '', expected a file name");
  p.output = f.output;
  if (!f.blocks.empty()) p.blocks = parse_int_list(f.blocks, "--blocks", 1, kMaxBlocks);
  p.warps = parse_int_list(f.warps, "--warps", 1, kMaxWarpsPerBlock);
  if (!f.ring_rows.empty()) {
    if (p.backend != Backend::kHighThroughput) {
      EPX_THROW(ConfigError, fmt::format("--ring-rows = '{}' with --backend {}: only "
                                         "high_throughput has rings",
                                         f.ring_rows, to_string(p.backend)));
    }
    p.ring_rows = parse_int_list(f.ring_rows, "--ring-rows", 1, kMaxRingRows);
  }
  return p;
}

}  // namespace

void add_tune(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<TuneFlags>();
  CLI::App* c = app.add_subcommand(
      "tune",
      "sweep num_blocks x warps_per_block of dispatch, then of combine (with the best "
      "dispatch), check each candidate against the CPU reference, time it as a CUDA "
      "graph, and write the fastest as an EPX_CONFIG_PATH launch file");
  add_sweep_flags(c, f->sweep);
  c->add_option("--backend", f->backend,
                "naive | allgather_reducescatter | low_latency | high_throughput")
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
  c->add_option("--ring-rows", f->ring_rows,
                "high_throughput: ring_rows candidates, comma list (default: the backend's "
                "choice; at least 2 x warps_per_block)");
  c->callback([f, &exit_code] {
    const tune::Plan plan = validate(*f);
#if EPX_HAVE_CUDA
    exit_code = tune::run(plan) ? 0 : 1;
#else
    (void)plan;
    (void)exit_code;
    EPX_THROW(UnsupportedError, "epx tune needs an NVIDIA GPU and a CUDA build of epx");
#endif
  });
}

}  // namespace epx::cli
