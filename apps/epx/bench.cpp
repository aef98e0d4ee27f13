// `epx bench`: dispatch and combine latency and bandwidth of every requested backend, side by
// side, in one run (DESIGN §8). Each backend and token count is first checked against the CPU
// reference (src/testing); one that fails is reported FAILED and not timed, one that this build
// cannot serve is reported unavailable.
//
// Two worlds: in-process (default; every rank a stream of this process, timed as one fork/join)
// and ipc (one process per rank under `epx launch`; each process times its own rank on its own
// stream, rank 0 gathers every rank's figures and reports the slowest rank's).
//
// This file: the flags and the plan they make (bench.hpp has the rest).
#include <fmt/format.h>

#include <memory>
#include <string>

#include "bench.hpp"
#include "commands.hpp"
#include "epx/error.hpp"

namespace epx::cli {
namespace {

struct BenchFlags {
  SweepFlags sweep;
  std::string backends = "low_latency,allgather_reducescatter,naive";
  int iters = 100;
  int warmup = 20;
  std::string json_path;
  bool no_verify = false;
  std::string world_kind = "in-process";
};

// `world_given`: --world was on the command line (over ipc it must then equal EPX_WORLD_SIZE;
// left out, it is EPX_WORLD_SIZE).
bench::Plan validate(const BenchFlags& f, bool world_given) {
  bench::Plan p;
  const WorldKind kind = parse_world_kind(f.world_kind);
  p.ipc = one_process_per_rank(kind);
  p.nccl = kind == WorldKind::kNccl;
  SweepFlags sweep = f.sweep;
  if (p.ipc) take_world_from_env(sweep.shape, world_given, "epx bench");
  // --combine-format is a list here: every format's configs pass EpConfig::validate(), and
  // shape.cfg carries the first.
  p.formats = parse_combine_format_list(sweep.shape.combine_format, "--combine-format");
  for (auto f = p.formats.rbegin(); f != p.formats.rend(); ++f) {
    sweep.shape.combine_format = to_string(*f);
    p.shape = make_sweep(sweep);
  }
  p.backends = parse_backend_list(f.backends, "--backends");
  check_range("--iters", f.iters, bench::kMinIters, bench::kMaxIters,
              "median and p90 need at least 50 timed iterations, DESIGN §8");
  check_range("--warmup", f.warmup, 0, bench::kMaxIters);
  p.iters = f.iters;
  p.warmup = f.warmup;
  p.verify = !f.no_verify;
  p.json_path = f.json_path;
  p.launch = launch_from_env();  // throws ConfigError naming the file, key and range
  return p;
}

}  // namespace

void add_bench(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<BenchFlags>();
  CLI::App* c = app.add_subcommand(
      "bench",
      "dispatch/combine latency (median, p90; CUDA graph and eager) and bandwidth of "
      "each backend side by side, after checking each against the CPU reference "
      "(honours EPX_CONFIG_PATH and EPX_TIMEOUT_MS)");
  add_sweep_flags(c, f->sweep);
  c->add_option("--backends", f->backends,
                "comma list of naive | allgather_reducescatter | low_latency | high_throughput")
      ->capture_default_str();
  c->get_option("--combine-format")
      ->description(
          "comma list of bf16 | logfmt: each backend measured once per format, each result row "
          "naming its combine_format (logfmt: LogFMT-10 rows, low_latency only; the other "
          "backends are reported unavailable for it)");
  c->add_option("--iters", f->iters, "timed rounds (at least 50)")->capture_default_str();
  c->add_option("--warmup", f->warmup, "untimed rounds before them")->capture_default_str();
  c->add_option("--json", f->json_path,
                "also write the results as JSON to FILE (in-process worlds rewrite a regular "
                "file after each token count, with \"complete\": false until the last)");
  c->add_flag("--no-verify", f->no_verify, "skip the correctness check before timing");
  c->add_option("--world-kind", f->world_kind,
                "in-process (every rank a stream of this process) | ipc (this process is one rank: "
                "run under `epx launch -n W`; --world defaults to EPX_WORLD_SIZE) | nccl (as ipc, "
                "memory through NCCL windows; one GPU per rank)")
      ->capture_default_str();
  CLI::Option* world_opt = c->get_option("--world");
  c->callback([f, world_opt, &exit_code] {
    const bench::Plan plan = validate(*f, world_opt->count() > 0);
#if EPX_HAVE_CUDA
    exit_code =
        (plan.ipc ? bench::run_one_process_per_rank(plan) : bench::run_in_process(plan)) ? 0 : 1;
#else
    (void)plan;
    (void)exit_code;
    EPX_THROW(UnsupportedError, "epx bench needs an NVIDIA GPU and a CUDA build of epx");
#endif
  });
}

}  // namespace epx::cli
