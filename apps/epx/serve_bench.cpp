// `epx serve-bench`: inter-token latency of a simulated serving workload per backend (DESIGN §1,
// the end-to-end test plan of the system we descend from: DeepSeek-R1 with 8-way data + expert
// parallelism, naive vs allgather_reducescatter vs low_latency).
//
// W in-process ranks on GPU 0, one host thread and one stream each. The workload and its
// chunked-prefill scheduler live in serve_sched.hpp (no CUDA, unit-tested). Every engine step:
// the scheduler gives each rank its tokens; each rank runs --layers MoE layers (MoeLayer,
// include/epx/moe.hpp) on them through the backend's All2All, in chunks of --chunk-size with the
// same chunk count on every rank; the step's wall time runs from the release of all ranks'
// threads until every thread has drained its stream and joined. Output tokens are stamped with the
// end of their step. With --cuda-graph each backend runs a second time with its decode-only steps
// replayed as per-rank CUDA graphs (one per batch bucket, MoeLayer's captured path). Only the MoE
// layers are simulated (no attention, no dense layers), and every layer reads the step's input
// activations (there is no residual stream).
//
// The parts: serve_flags (options, --preset, validation into a Plan), serve_sched (workload,
// scheduler, statistics), serve_ranks (rank threads, device state, layers), serve_steps (one
// step, eager or replayed, and the capture of decode graphs), serve_run (one backend's run),
// serve_report (header, table, JSON). This file registers the command and runs it.
#include <fmt/format.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "commands.hpp"
#include "epx/error.hpp"
#include "serve_flags.hpp"
#if EPX_HAVE_CUDA
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "bench_common.hpp"
#include "epx/world.hpp"
#include "serve_ranks.hpp"
#include "serve_report.hpp"
#include "serve_run.hpp"
#endif

namespace epx::cli {
namespace {

#if EPX_HAVE_CUDA

// The CUDA environment serve-bench depends on, read (and set) here alone, before any CUDA call:
// CUDA_MODULE_LOADING=EAGER unless the environment says otherwise (moe.hpp: cuBLASLt loads its
// kernels lazily, and a lazy load waits for the other ranks' spinning kernels), and
// CUDA_DEVICE_MAX_CONNECTIONS, one hardware work queue per rank stream (`epx` sets 32 unless the
// environment gives a value; CUDA's default is 8). Returns the line that reports both.
std::string apply_cuda_env() {
  std::string note = load_modules_eagerly("epx serve-bench", "a lazy kernel load may deadlock");
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  note += fmt::format(", CUDA_DEVICE_MAX_CONNECTIONS={}", connections ? connections : "8");
  return note;
}

// Ranks that share a GPU run their GEMMs between their own dispatch and combine while the
// others' blocks spin. At 8 ranks, 16 blocks per op (8 x 16 = 128 of 132 SMs) used to stop
// there: the GEMMs' 4-block clusters, gone since fp8_gemm plans without one (16 blocks then
// passed the small shape three times, docs/perf-notes.md). Half the SM budget stays the
// default until the full budget has been measured on the R1 shape.
void default_launch_shapes(const InProcessWorld& world, LaunchSource& launch) {
  if (launch.from_file || world.ranks_on_device(world.device_of(0)) <= 1) return;
  const int blocks = std::max(1, world.sm_budget(0) / 2);
  launch.launch.dispatch.num_blocks = launch.launch.combine.num_blocks = blocks;
  launch.origin = fmt::format(
      "{} blocks per op (half the SM budget; EPX_CONFIG_PATH overrides), backend warps", blocks);
}

// Every backend of the plan (each eager, then with --cuda-graph again with decode graphs) on one
// world, one set of ranks and layers; prints the table and writes the JSON. False when a backend
// failed (one that is unavailable is reported, not a failure).
bool run_serve_bench(const serve::Plan& plan) {
  serve::Plan p = plan;
  const auto t_start = std::chrono::steady_clock::now();
  const std::string env_note = apply_cuda_env();
  require_gpu("epx serve-bench");
  InProcessWorld world(p.workload.world);
  const GpuInfo gpu = gpu_info(world.device_of(0));
  default_launch_shapes(world, p.launch);
  serve::print_header(p, gpu, world.sm_budget(0), env_note);
  if (!p.json_path.empty()) serve::check_json_path(p.json_path);

  const auto t0 = std::chrono::steady_clock::now();
  serve::Ranks ranks = serve::make_ranks(p, world);
  const serve::LayerWeights weights = serve::build_layers(p, world, ranks);
  fmt::print("  weights: {}; activations and layers ready in {:.1f} s\n", weights.note,
             seconds_since(t0));
  std::fflush(stdout);

  serve::RankThreads threads(p.workload.world);
  std::vector<serve::BackendResult> results;
  for (const serve::BackendMix& b : p.backends) {
    for (const bool overlap : {false, true}) {
      if (overlap && !p.overlap) continue;
      results.push_back(serve::run_backend(p, b, false, overlap, world, ranks, threads));
      if (p.cuda_graph)
        results.push_back(serve::run_backend(p, b, true, overlap, world, ranks, threads));
    }
  }

  serve::print_table(results);
  if (!p.json_path.empty()) {
    write_json(p.json_path, serve::make_json(p, world.sm_budget(0), gpu, weights.note,
                                             weights.distinct, results));
  }
  bool ok = true;
  for (const serve::BackendResult& br : results)
    ok &= br.status == "ok" || br.status == "unavailable";
  fmt::print("{} ({:.0f} s)\n", ok ? "done" : "done, with erroneous backends (exit 1)",
             seconds_since(t_start));
  return ok;
}

#endif  // EPX_HAVE_CUDA

}  // namespace

void add_serve_bench(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<serve::Flags>();
  CLI::App* c = app.add_subcommand(
      "serve-bench",
      "inter-token latency of a simulated serving workload (chunked prefill + decode of N "
      "requests over W data-parallel ranks, DeepSeek-R1-shaped MoE layers) per backend; only "
      "the MoE layers are simulated (honours EPX_CONFIG_PATH and EPX_TIMEOUT_MS)");
  const std::vector<CLI::Option*> workload_opts = serve::add_flags(c, *f);
  c->callback([f, workload_opts, &exit_code] {
    std::set<std::string> given;  // the workload flags given, apart from --world
    for (CLI::Option* o : workload_opts)
      if (o->count() > 0 && o->get_name() != "--world") given.insert(o->get_name());
    const serve::Plan plan = serve::make_plan(*f, given);
#if EPX_HAVE_CUDA
    exit_code = run_serve_bench(plan) ? 0 : 1;
#else
    (void)plan;
    (void)exit_code;
    EPX_THROW(UnsupportedError, "epx serve-bench needs an NVIDIA GPU and a CUDA build of epx");
#endif
  });
}

}  // namespace epx::cli
