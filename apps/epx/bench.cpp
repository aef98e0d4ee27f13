// `epx bench`: dispatch and combine latency and bandwidth of every requested backend, side by
// side, in one run (DESIGN §8). Each backend and token count is first checked against the CPU
// reference (src/check); one that fails is reported FAILED and not timed, one that this build
// cannot serve is reported unavailable.
#include <fmt/format.h>

#include <cstdlib>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "commands.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#if EPX_HAVE_CUDA
#include "check/harness.hpp"
#include "epx/all2all.hpp"
#include "epx/world.hpp"
#endif

namespace epx::cli {
namespace {

constexpr int kMinIters = 50;  // DESIGN §8: median and p90 over >= 50 timed iterations
constexpr int kMaxIters = 1000000;
constexpr size_t kCopyBytes = size_t(1) << 30;
constexpr int kCopyRepeats = 20;

struct BenchFlags {
  ShapeFlagValues shape;
  std::string backends = "low_latency,allgather_reducescatter,naive";
  int iters = 100;
  int warmup = 20;
  std::string json_path;
  bool no_verify = false;
};

struct BenchPlan {
  BenchShape shape;
  std::vector<Backend> backends;
  LaunchSource launch;
  int iters = 0;
  int warmup = 0;
  bool verify = true;
  std::string json_path;
};

BenchPlan validate(const BenchFlags& f) {
  BenchPlan p;
  p.shape = validate_shape(f.shape);
  for (const std::string& name : split_list(f.backends, "--backends")) {
    const Backend b = parse_backend_flag(name, "--backends");
    for (Backend seen : p.backends) {
      if (seen == b) {
        EPX_THROW(ConfigError, fmt::format("--backends = '{}' lists {} twice, expected each "
                                           "backend once", f.backends, name));
      }
    }
    p.backends.push_back(b);
  }
  check_range("--iters", f.iters, kMinIters, kMaxIters,
              "median and p90 need at least 50 timed iterations, DESIGN §8");
  check_range("--warmup", f.warmup, 0, kMaxIters);
  p.iters = f.iters;
  p.warmup = f.warmup;
  p.verify = !f.no_verify;
  p.json_path = f.json_path;
  p.launch = launch_from_env();  // throws ConfigError naming the file, key and range
  return p;
}

#if EPX_HAVE_CUDA
constexpr const char* kOps[] = {"dispatch", "combine"};

// One backend at one token count.
struct BackendResult {
  Backend backend{};
  std::string status = "ok";          // ok | unavailable | failed (verification) | error
  std::string verification = "not_run";  // passed | failed | skipped | not_run
  std::string message;
  struct Mode {
    bool ok = false;
    std::string error;
    Stats op[2];  // dispatch, combine
  } mode[2];      // graph, eager
};

struct TokenResult {
  int tokens = 0;
  Volumes volumes;
  double floor_us[2] = {0, 0};  // dispatch, combine
  std::vector<BackendResult> backends;
};

const OpBytes& op_bytes(const Volumes& v, int op) { return op == 0 ? v.dispatch : v.combine; }

std::string one_line(std::string s, size_t max = 160) {
  for (char& c : s)
    if (c == '\n') c = ' ';
  if (s.size() > max) s = s.substr(0, max - 3) + "...";
  return s;
}

// ---- output ------------------------------------------------------------------------------------

void print_table(const BenchPlan& p, const std::vector<TokenResult>& results) {
  const int W = p.shape.cfg.world_size;
  fmt::print("\n{:>7}  {:<8}  {:<23}  {:>10}  {:>10}  {:>10}  {:>12}  {:>9}  {:>8}\n", "tokens",
             "op", "backend", "graph med", "graph p90", "eager med", "cross GB/s", "floor", "x floor");
  fmt::print("{:>7}  {:<8}  {:<23}  {:>10}  {:>10}  {:>10}  {:>12}  {:>9}  {:>8}\n", "/rank", "",
             "", "us", "us", "us", "per rank", "us", "(graph)");
  for (const TokenResult& tr : results) {
    for (int op = 0; op < 2; ++op) {
      for (const BackendResult& br : tr.backends) {
        const std::string head =
            fmt::format("{:>7}  {:<8}  {:<23}", tr.tokens, kOps[op], to_string(br.backend));
        if (br.status != "ok") {
          const std::string what = br.status == "failed" ? "FAILED" : br.status;
          fmt::print("{}  {}: {}\n", head, what, one_line(br.message, 100));
          continue;
        }
        const auto& g = br.mode[0];
        const auto& e = br.mode[1];
        const std::string eager = e.ok ? fmt::format("{:10.2f}", e.op[op].median_us)
                                       : fmt::format("{:>10}", "error");
        if (!g.ok) {
          fmt::print("{}  {:>10}  {:>10}  {}  graph error: {}\n", head, "error", "", eager,
                     one_line(g.error, 80));
          continue;
        }
        const double med = g.op[op].median_us;
        fmt::print("{}  {:10.2f}  {:10.2f}  {}  {:12.1f}  {:9.2f}  {:8.2f}\n", head, med,
                   g.op[op].p90_us, eager, gbps(op_bytes(tr.volumes, op).crossing, med, W),
                   tr.floor_us[op], med / tr.floor_us[op]);
      }
    }
  }
  fmt::print("\ncross GB/s per rank = payload bytes between distinct ranks after per-rank dedup "
             "/ graph median / world ({});\nfloor = HBM bytes of the op (input rows read once, "
             "deduplicated output rows written once) / measured copy bandwidth.\n", W);
}

nlohmann::json figures(const Stats& s, const OpBytes& b, double floor_us, int world) {
  return {{"samples", s.samples},
          {"median_us", s.median_us},
          {"p90_us", s.p90_us},
          {"min_us", s.min_us},
          {"mean_us", s.mean_us},
          {"crossing_gbps_per_rank", gbps(b.crossing, s.median_us, world)},
          {"algorithm_gbps_per_rank", gbps(b.algorithm, s.median_us, world)},
          {"ratio_to_floor", s.median_us / floor_us}};
}

int gpus_used(const InProcessWorld& world) {
  std::vector<int> devices;
  for (int r = 0; r < world.size(); ++r)
    if (std::find(devices.begin(), devices.end(), world.device_of(r)) == devices.end())
      devices.push_back(world.device_of(r));
  return int(devices.size());
}

// EPX_ABLATE as set (the library validates it when the groups are created).
std::string ablate_setting() {
  const char* v = std::getenv("EPX_ABLATE");
  return v == nullptr ? std::string() : std::string(v);
}

nlohmann::json make_json(const BenchPlan& p, const InProcessWorld& world, const GpuInfo& gpu,
                         const CopyBandwidth& bw, double fork_join_us,
                         const std::vector<TokenResult>& results) {
  using nlohmann::json;
  const EpConfig& cfg = p.shape.cfg;
  const int W = cfg.world_size;
  auto launch_json = [](const LaunchConfig& lc) {
    return json{{"num_blocks", lc.num_blocks}, {"warps_per_block", lc.warps_per_block}};
  };
  json doc;
  doc["schema"] = "epx-bench/1";
  doc["commit"] = git_commit();
  doc["timestamp_utc"] = utc_timestamp();
  doc["machine"] = {{"hostname", host_name()},
                    {"gpu_name", gpu.name},
                    {"sm_count", gpu.sm_count},
                    {"gpu_count", gpu.gpu_count},
                    {"cuda_runtime", gpu.runtime_version},
                    {"cuda_driver", gpu.driver_version}};
  doc["world"] = {{"kind", "in_process"},
                  {"ranks", W},
                  {"gpus_used", gpus_used(world)},
                  {"ranks_per_gpu", world.ranks_on_device(world.device_of(0))},
                  {"sm_budget_per_rank", world.sm_budget(0)}};
  doc["shape"] = {{"hidden", cfg.hidden},
                  {"experts", cfg.num_experts},
                  {"topk", cfg.topk},
                  {"dtype", to_string(cfg.dtype)},
                  {"layout", to_string(cfg.layout)},
                  {"scale_layout", to_string(cfg.scale_layout)},
                  {"routing", p.shape.routing_name}};
  doc["launch_configs"] = {{"source", p.launch.origin},
                           {"dispatch", launch_json(p.launch.launch.dispatch)},
                           {"combine", launch_json(p.launch.launch.combine)},
                           {"note", "0 = chosen by the backend per world and shape"}};
  doc["settings"] = {{"iters", p.iters},
                     {"warmup", p.warmup},
                     {"verify", p.verify},
                     {"seed", p.shape.seed},
                     {"timeout_ms", cfg.timeout_ms},
                     {"ablate", ablate_setting()}};
  doc["copy_bandwidth"] = {{"bytes", bw.bytes},
                           {"repeats", bw.repeats},
                           {"median_us", bw.median_us},
                           {"gbps", bw.gbps},
                           {"counts", "read + write (2 x bytes per copy)"}};
  doc["fork_join_floor_us"] = fork_join_us;
  json volumes = json::array();
  json records = json::array();
  for (const TokenResult& tr : results) {
    const Volumes& v = tr.volumes;
    json vol = {{"tokens_per_rank", tr.tokens},
                {"tokens_total", v.tokens},
                {"rows_crossing", v.rows_crossing},
                {"rows_self", v.rows_self},
                {"destination_ranks_per_token",
                 v.tokens ? double(v.rows_crossing + v.rows_self) / double(v.tokens) : 0.0},
                {"wire_row_bytes", v.wire_row_bytes}};
    for (int op = 0; op < 2; ++op) {
      const OpBytes& b = op_bytes(v, op);
      vol[kOps[op]] = {{"crossing_bytes", b.crossing},
                       {"algorithm_bytes", b.algorithm},
                       {"floor_bytes", b.floor},
                       {"floor_us", tr.floor_us[op]}};
    }
    volumes.push_back(vol);
    for (const BackendResult& br : tr.backends) {
      for (int op = 0; op < 2; ++op) {
        for (int m = 0; m < 2; ++m) {
          const OpBytes& b = op_bytes(v, op);
          const auto& mode = br.mode[m];
          json rec = {{"backend", to_string(br.backend)},
                      {"tokens_per_rank", tr.tokens},
                      {"op", kOps[op]},
                      {"mode", m == 0 ? "graph" : "eager"},
                      {"verification", br.verification},
                      {"crossing_bytes", b.crossing},
                      {"algorithm_bytes", b.algorithm},
                      {"floor_bytes", b.floor},
                      {"floor_us", tr.floor_us[op]}};
          if (br.status != "ok") {
            rec["status"] = br.status;
            rec["message"] = br.message;
          } else if (!mode.ok) {
            rec["status"] = "error";
            rec["message"] = mode.error;
          } else {
            rec["status"] = "ok";
            rec["message"] = nullptr;
            rec.update(figures(mode.op[op], b, tr.floor_us[op], W));
          }
          for (const char* k : {"samples", "median_us", "p90_us", "min_us", "mean_us",
                                "crossing_gbps_per_rank", "algorithm_gbps_per_rank",
                                "ratio_to_floor"})
            if (!rec.contains(k)) rec[k] = nullptr;
          records.push_back(rec);
        }
      }
    }
  }
  doc["volumes"] = volumes;
  doc["results"] = records;
  return doc;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Verification, then graph and eager timing of one backend at one token count.
BackendResult run_backend(const BenchPlan& p, Backend backend, const EpConfig& cfg,
                          const InProcessWorld& world, const DeviceInputs& inputs, ForkJoin& fj) {
  BackendResult br;
  br.backend = backend;
  const std::string tag = fmt::format("[tokens {}] {}", inputs.tokens(), to_string(backend));
  if (p.verify) {
    const auto t0 = std::chrono::steady_clock::now();
    check::CheckOptions o;
    o.cfg = cfg;
    o.backend = backend;
    o.launch = p.launch.launch;
    o.tokens = {inputs.tokens()};
    o.routing = p.shape.routing;
    o.seed = p.shape.seed;
    o.iters = 1;
    o.pool = 1;
    try {
      const check::CheckReport rep = check::run_check(o);
      br.verification = rep.ok ? "passed" : "failed";
      if (!rep.ok) {
        br.status = "failed";
        br.message = rep.mismatches.empty() ? "output differs from the CPU reference"
                                            : "output differs from the CPU reference: " +
                                                  rep.mismatches.front();
      }
    } catch (const UnsupportedError& e) {
      br.status = "unavailable";
      br.message = e.what();
    } catch (const ConfigError& e) {
      br.status = "error";
      br.message = e.what();
    } catch (const Error& e) {
      br.status = "failed";
      br.verification = "failed";
      br.message = e.what();
    }
    progress(fmt::format("{}: verify {} ({:.1f} s){}", tag,
                         br.status == "ok" ? "passed" : br.status, seconds_since(t0),
                         br.status == "ok" ? "" : ": " + one_line(br.message)));
    if (br.status != "ok") return br;
  } else {
    br.verification = "skipped";
  }

  Group group;
  for (int m = 0; m < 2; ++m) {
    const TimingMode mode = m == 0 ? TimingMode::kGraph : TimingMode::kEager;
    auto& res = br.mode[m];
    try {
      if (group.empty()) group = make_all2all_group(backend, cfg, world, p.launch.launch);
    } catch (const UnsupportedError& e) {
      br.status = "unavailable";
      br.message = e.what();
      progress(fmt::format("{}: unavailable: {}", tag, one_line(br.message)));
      return br;
    } catch (const Error& e) {
      br.status = "error";
      br.message = e.what();
      progress(fmt::format("{}: error: {}", tag, one_line(br.message)));
      return br;
    }
    try {
      const RoundSamples s = time_rounds(group, inputs, fj, mode, p.warmup, p.iters);
      res.op[0] = summarize(s.dispatch_us);
      res.op[1] = summarize(s.combine_us);
      res.ok = true;
      progress(fmt::format("{}: {:<5} dispatch {:8.2f} us, combine {:8.2f} us (median of {})",
                           tag, to_string(mode), res.op[0].median_us, res.op[1].median_us,
                           p.iters));
    } catch (const Error& e) {
      res.error = e.what();
      group.clear();  // unusable after an error; the next mode gets a fresh group
      progress(fmt::format("{}: {} timing error: {}", tag, to_string(mode), one_line(res.error)));
    }
  }
  return br;
}

bool run_bench(const BenchPlan& p) {
  const auto t_start = std::chrono::steady_clock::now();
  require_gpu_for("epx bench");
  EpConfig base = p.shape.cfg;
  const int W = base.world_size;
  InProcessWorld world(W);
  const GpuInfo gpu = gpu_info(world.device_of(0));
  fmt::print("epx bench: {} in-process ranks on {} ({} SMs, {} blocks per rank), H {}, E {}, "
             "K {}, dtype {}, layout {}, routing {}, seed {}\n",
             W, gpu.name, gpu.sm_count, world.sm_budget(0), base.hidden, base.num_experts,
             base.topk, to_string(base.dtype), to_string(base.layout), p.shape.routing_name,
             p.shape.seed);
  std::string backends;
  for (Backend b : p.backends) backends += (backends.empty() ? "" : ",") + std::string(to_string(b));
  fmt::print("  backends {}, tokens/rank {}, {} timed rounds after {} warm-up, verify {}, "
             "launch shapes: {}, timeout {} ms, commit {}\n",
             backends, fmt::join(p.shape.tokens, ","), p.iters, p.warmup,
             p.verify ? "on" : "off", p.launch.origin, base.timeout_ms, git_commit());
  if (!ablate_setting().empty()) {
    fmt::print("  EPX_ABLATE={}: stages are left out to attribute time; results are wrong by "
               "design (run with --no-verify)\n",
               ablate_setting());
  }
  const CopyBandwidth bw = measure_copy_bandwidth(world.device_of(0), kCopyBytes, kCopyRepeats);
  progress(fmt::format("copy bandwidth: {:.1f} GB/s (device-to-device copy of {:.1f} GiB, read + "
                       "write, median of {})",
                       bw.gbps, double(bw.bytes) / double(1 << 30), bw.repeats));
  ForkJoin fj(world);
  const double fork_join_us = time_fork_join_floor(fj, p.warmup, p.iters);
  progress(fmt::format("fork/join floor: {:.2f} us (graph of {} ranks' streams with a 16-byte "
                       "memset each, median of {})",
                       fork_join_us, W, p.iters));

  std::vector<TokenResult> results;
  for (const int T : p.shape.tokens) {
    EpConfig cfg = base;
    cfg.max_tokens_per_rank = T;
    cfg.validate();
    const auto t0 = std::chrono::steady_clock::now();
    DeviceInputs inputs(world, cfg, T, p.shape.routing, p.shape.seed);
    TokenResult tr;
    tr.tokens = T;
    tr.volumes = compute_volumes(cfg, inputs.routings());
    for (int op = 0; op < 2; ++op)
      tr.floor_us[op] = double(op_bytes(tr.volumes, op).floor) / (bw.gbps * 1e3);
    progress(fmt::format("[tokens {}] inputs on the device: {} ranks x {} tokens, {:.2f} "
                         "destination ranks per token ({:.1f} s)",
                         T, W, T,
                         double(tr.volumes.rows_crossing + tr.volumes.rows_self) /
                             double(std::max<int64_t>(1, tr.volumes.tokens)),
                         seconds_since(t0)));
    for (Backend b : p.backends) tr.backends.push_back(run_backend(p, b, cfg, world, inputs, fj));
    results.push_back(std::move(tr));
  }

  print_table(p, results);
  if (!p.json_path.empty()) {
    const nlohmann::json doc = make_json(p, world, gpu, bw, fork_join_us, results);
    std::ofstream out(p.json_path);
    out << doc.dump(2) << "\n";
    out.close();
    if (!out) {
      EPX_THROW(InputError, fmt::format("--json = '{}' could not be written", p.json_path));
    }
    fmt::print("wrote {}\n", p.json_path);
  }
  bool ok = true;  // an unavailable backend is reported, not a failure
  for (const TokenResult& tr : results)
    for (const BackendResult& br : tr.backends)
      if (br.status != "unavailable" && (br.status != "ok" || !br.mode[0].ok || !br.mode[1].ok))
        ok = false;
  fmt::print("{} ({:.0f} s)\n", ok ? "done" : "done, with FAILED or erroneous backends (exit 1)",
             seconds_since(t_start));
  return ok;
}
#endif  // EPX_HAVE_CUDA

}  // namespace

void add_bench(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<BenchFlags>();
  CLI::App* c = app.add_subcommand(
      "bench", "dispatch/combine latency (median, p90; CUDA graph and eager) and bandwidth of "
               "each backend side by side, after checking each against the CPU reference "
               "(honours EPX_CONFIG_PATH and EPX_TIMEOUT_MS)");
  add_shape_flag_options(c, f->shape);
  c->add_option("--backends", f->backends,
                "comma list of naive | allgather_reducescatter | low_latency")
      ->capture_default_str();
  c->add_option("--iters", f->iters, "timed rounds (at least 50)")->capture_default_str();
  c->add_option("--warmup", f->warmup, "untimed rounds before them")->capture_default_str();
  c->add_option("--json", f->json_path, "also write the results as JSON to FILE");
  c->add_flag("--no-verify", f->no_verify, "skip the correctness check before timing");
  c->callback([f, &exit_code] {
    const BenchPlan plan = validate(*f);
#if EPX_HAVE_CUDA
    exit_code = run_bench(plan) ? 0 : 1;
#else
    (void)plan;
    (void)exit_code;
    EPX_THROW(UnsupportedError, "epx bench needs an NVIDIA GPU and a CUDA build of epx");
#endif
  });
}

}  // namespace epx::cli
