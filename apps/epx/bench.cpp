// `epx bench`: dispatch and combine latency and bandwidth of every requested backend, side by
// side, in one run (DESIGN §8). Each backend and token count is first checked against the CPU
// reference (src/testing); one that fails is reported FAILED and not timed, one that this build
// cannot serve is reported unavailable.
//
// Two worlds: in-process (default; every rank a stream of this process, timed as one fork/join)
// and ipc (one process per rank under `epx launch`; each process times its own rank on its own
// stream, rank 0 gathers every rank's figures and reports the slowest rank's).
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "commands.hpp"
#include "epx/bootstrap.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#if EPX_HAVE_CUDA
#include "testing/harness.hpp"
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
  SweepFlags sweep;
  std::string backends = "low_latency,allgather_reducescatter,naive";
  int iters = 100;
  int warmup = 20;
  std::string json_path;
  bool no_verify = false;
  std::string world_kind = "in-process";
};

struct BenchPlan {
  Sweep shape;
  std::vector<Backend> backends;
  LaunchSource launch;
  int iters = 0;
  int warmup = 0;
  bool verify = true;
  std::string json_path;
  bool ipc = false;   // one process per rank (--world-kind ipc or nccl)
  bool nccl = false;  // --world-kind nccl
};

// `world_given`: --world was on the command line (over ipc it must then equal EPX_WORLD_SIZE;
// left out, it is EPX_WORLD_SIZE).
BenchPlan validate(const BenchFlags& f, bool world_given) {
  BenchPlan p;
  const WorldKind kind = parse_world_kind(f.world_kind);
  p.ipc = one_process_per_rank(kind);
  p.nccl = kind == WorldKind::kNccl;
  SweepFlags sweep = f.sweep;
  if (p.ipc) {
    const BootstrapOptions env = BootstrapOptions::from_env();  // throws naming the variable
    if (world_given && sweep.shape.world != env.world_size) {
      EPX_THROW(ConfigError,
                fmt::format("--world = {}, expected EPX_WORLD_SIZE = {} with --world-kind ipc (one "
                            "process per rank: run `epx launch -n {} -- epx bench --world-kind "
                            "ipc ...`, or leave --world out)",
                            sweep.shape.world, env.world_size, sweep.shape.world));
    }
    sweep.shape.world = env.world_size;
  }
  p.shape = make_sweep(sweep);
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
    Stats op[2];  // dispatch, combine; ipc: those of the slowest rank (largest median)
    // ipc only: every rank's own figures, and which rank op[] comes from
    std::vector<Stats> per_rank[2];
    int slowest_rank[2] = {-1, -1};
  } mode[2];      // graph, eager
};

struct TokenResult {
  int tokens = 0;
  Volumes volumes;
  double floor_us[2] = {0, 0};  // dispatch, combine
  std::vector<BackendResult> backends;
};

const OpBytes& op_bytes(const Volumes& v, int op) { return op == 0 ? v.dispatch : v.combine; }

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

nlohmann::json in_process_world_json(const InProcessWorld& world) {
  return {{"kind", "in_process"},
          {"ranks", world.size()},
          {"gpus_used", gpus_used(world)},
          {"ranks_per_gpu", world.ranks_on_device(world.device_of(0))},
          {"sm_budget_per_rank", world.sm_budget(0)}};
}

// `world_json`: the "world" object (kind, ranks, placement); `fork_join_us`: the in-process
// harness floor (none over ipc).
nlohmann::json make_json(const BenchPlan& p, const nlohmann::json& world_json, const GpuInfo& gpu,
                         const CopyBandwidth& bw, std::optional<double> fork_join_us,
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
  doc["machine"] = machine_json(gpu);
  doc["world"] = world_json;
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
                     {"timeout_ms", cfg.timeout_ms}};
  doc["copy_bandwidth"] = {{"bytes", bw.bytes},
                           {"repeats", bw.repeats},
                           {"median_us", bw.median_us},
                           {"gbps", bw.gbps},
                           {"counts", "read + write (2 x bytes per copy)"}};
  doc["fork_join_floor_us"] = fork_join_us ? json(*fork_join_us) : json(nullptr);
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
            if (!mode.per_rank[op].empty()) {
              rec["slowest_rank"] = mode.slowest_rank[op];
              json per_rank = json::array();
              for (const Stats& s : mode.per_rank[op]) per_rank.push_back(stats_json(s));
              rec["per_rank"] = per_rank;
            }
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

void write_json(const std::string& path, const nlohmann::json& doc) {
  std::ofstream out(path);
  out << doc.dump(2) << "\n";
  out.close();
  if (!out) {
    EPX_THROW(InputError, fmt::format("--json = '{}' could not be written", path));
  }
  fmt::print("wrote {}\n", path);
}

bool all_ok(const std::vector<TokenResult>& results) {
  bool ok = true;  // an unavailable backend is reported, not a failure
  for (const TokenResult& tr : results)
    for (const BackendResult& br : tr.backends)
      if (br.status != "unavailable" && (br.status != "ok" || !br.mode[0].ok || !br.mode[1].ok))
        ok = false;
  return ok;
}

// The check `epx bench` runs before timing a backend: one call on the bench's own inputs.
testing::CheckOptions verify_options(const BenchPlan& p, Backend backend, const EpConfig& cfg,
                                   int tokens) {
  testing::CheckOptions o;
  o.cfg = cfg;
  o.backend = backend;
  o.launch = p.launch.launch;
  o.tokens = {tokens};
  o.routing = p.shape.routing;
  o.seed = p.shape.seed;
  o.iters = 1;
  o.pool = 1;
  return o;
}

std::string backend_list(const BenchPlan& p) {
  std::string out;
  for (Backend b : p.backends) {
    if (!out.empty()) out += ',';
    out += to_string(b);
  }
  return out;
}

// Verification, then graph and eager timing of one backend at one token count.
BackendResult run_backend(const BenchPlan& p, Backend backend, const EpConfig& cfg,
                          const InProcessWorld& world, const DeviceInputs& inputs, ForkJoin& fj) {
  BackendResult br;
  br.backend = backend;
  const std::string tag = fmt::format("[tokens {}] {}", inputs.tokens(), to_string(backend));
  if (p.verify) {
    const auto t0 = std::chrono::steady_clock::now();
    const testing::CheckOptions o = verify_options(p, backend, cfg, inputs.tokens());
    try {
      const testing::CheckReport rep = testing::run_check(o);
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
  require_gpu("epx bench");
  EpConfig base = p.shape.cfg;
  const int W = base.world_size;
  InProcessWorld world(W, p.shape.devices);
  const GpuInfo gpu = gpu_info(world.device_of(0));
  fmt::print("epx bench: {} in-process ranks on {} x {} ({} SMs, {} blocks per rank), H {}, "
             "E {}, K {}, dtype {}, layout {}, routing {}, seed {}\n",
             W, p.shape.devices.size(), gpu.name, gpu.sm_count, world.sm_budget(0), base.hidden, base.num_experts,
             base.topk, to_string(base.dtype), to_string(base.layout), p.shape.routing_name,
             p.shape.seed);
  fmt::print("  backends {}, tokens/rank {}, {} timed rounds after {} warm-up, verify {}, "
             "launch shapes: {}, timeout {} ms, commit {}\n",
             backend_list(p), fmt::join(p.shape.tokens, ","), p.iters, p.warmup,
             p.verify ? "on" : "off", p.launch.origin, base.timeout_ms, git_commit());
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
    const EpConfig cfg = p.shape.config_for(T);
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
    write_json(p.json_path, make_json(p, in_process_world_json(world), gpu, bw, fork_join_us,
                                      results));
  }
  const bool ok = all_ok(results);
  fmt::print("{} ({:.0f} s)\n", ok ? "done" : "done, with FAILED or erroneous backends (exit 1)",
             seconds_since(t_start));
  return ok;
}

// ---- one process per rank (IpcWorld) -----------------------------------------------------------

constexpr const char* kTimeSlicedNote =
    "processes that share one GPU are time-sliced (no MPS): the timings below are not "
    "meaningful, only the verification is";

// Collective: every rank passes its (status, message) of one step; all return the first rank's
// (in rank order) whose status is not "ok", or ok when none. Makes every rank take the same path
// after a step that may fail on some ranks only. Errors of the bootstrap propagate.
struct Verdict {
  std::string status = "ok";
  std::string message;
};
Verdict agree(Bootstrap& boot, const std::string& status, const std::string& message) {
  const std::vector<std::string> all =
      boot.all_gather(status == "ok" ? std::string() : status + "\n" + message);
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    const size_t eol = all[r].find('\n');
    return {all[r].substr(0, eol), fmt::format("rank {}: {}", r, all[r].substr(eol + 1))};
  }
  return {};
}

// Verification (run_check_ipc), then graph and eager timing of this rank's object.
std::string handles_name(IpcWorld& world) { return to_string(world.handles()); }
std::string handles_name(NcclWorld&) { return "nccl-window"; }

template <typename World>
BackendResult run_backend_ipc(const BenchPlan& p, Backend backend, const EpConfig& cfg,
                              World& world, const DeviceInputs& inputs) {
  Bootstrap& boot = world.bootstrap();
  const int me = world.rank();
  auto say = [&](const std::string& s) {
    if (me == 0) progress(s);
  };
  BackendResult br;
  br.backend = backend;
  const std::string tag = fmt::format("[tokens {}] {}", inputs.tokens(), to_string(backend));
  auto fail = [&](const Verdict& v) {
    br.status = v.status;
    br.message = v.message;
    say(fmt::format("{}: {}: {}", tag, v.status, one_line(br.message)));
    return br;
  };
  if (p.verify) {
    const auto t0 = std::chrono::steady_clock::now();
    const testing::CheckOptions o = verify_options(p, backend, cfg, inputs.tokens());
    std::string status = "ok", message;
    try {
      const testing::CheckReport rep = testing::run_check_world(o, world);  // same report on every rank
      if (!rep.ok) {
        status = "failed";
        message = rep.mismatches.empty() ? "output differs from the CPU reference"
                                         : "output differs from the CPU reference: " +
                                               rep.mismatches.front();
      }
    } catch (const UnsupportedError& e) {
      status = "unavailable";
      message = e.what();
    } catch (const ConfigError& e) {
      status = "error";
      message = e.what();
    } catch (const Error& e) {
      status = "failed";
      message = e.what();
    }
    const Verdict v = agree(boot, status, message);
    br.verification = v.status == "ok" ? "passed" : v.status == "failed" ? "failed" : "not_run";
    say(fmt::format("{}: verify {} ({:.1f} s)", tag, v.status == "ok" ? "passed" : v.status,
                    seconds_since(t0)));
    if (v.status != "ok") return fail(v);
  } else {
    br.verification = "skipped";
  }

  cudaStream_t stream = nullptr;
  struct StreamGuard {
    cudaStream_t& s;
    ~StreamGuard() {
      if (!s) return;
      (void)cudaStreamSynchronize(s);
      (void)cudaStreamDestroy(s);
    }
  } stream_guard{stream};
  std::unique_ptr<All2All> a2a;
  for (int m = 0; m < 2; ++m) {
    const TimingMode mode = m == 0 ? TimingMode::kGraph : TimingMode::kEager;
    auto& res = br.mode[m];
    if (!a2a) {  // collective; a rank that fails makes the others throw, so agree right after
      std::string status = "ok", message;
      try {
        if (!stream && cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
          (void)cudaGetLastError();
          EPX_THROW(CudaError, "cudaStreamCreateWithFlags failed");
        }
        a2a = make_all2all(backend, cfg, world, p.launch.launch);
      } catch (const UnsupportedError& e) {
        status = "unavailable";
        message = e.what();
      } catch (const Error& e) {
        status = "error";
        message = e.what();
      }
      const Verdict v = agree(boot, status, message);
      if (v.status != "ok") return fail(v);
    }
    RoundSamples samples;
    const std::string error = time_rank_rounds(*a2a, inputs.input(me), inputs.y(me), stream, boot,
                                               mode, p.warmup, p.iters, samples);
    if (!error.empty()) {
      res.error = error;
      boot.barrier();  // every rank has stopped before any object goes away
      a2a.reset();     // unusable after an error; the next mode gets a fresh one
      say(fmt::format("{}: {} timing error: {}", tag, to_string(mode), one_line(res.error)));
      continue;
    }
    // Every rank's figures to every rank; the world's figure of an op is its slowest rank's.
    const nlohmann::json mine = {{"dispatch", stats_json(summarize(samples.dispatch_us))},
                                 {"combine", stats_json(summarize(samples.combine_us))}};
    const std::vector<std::string> all = boot.all_gather(mine.dump());
    for (int op = 0; op < 2; ++op) {
      std::vector<Stats>& ranks = res.per_rank[op];
      for (const std::string& text : all)
        ranks.push_back(stats_from_json(nlohmann::json::parse(text).at(kOps[op])));
      const auto slowest = std::max_element(ranks.begin(), ranks.end(), [](auto& a, auto& b) {
        return a.median_us < b.median_us;
      });
      res.slowest_rank[op] = int(slowest - ranks.begin());
      res.op[op] = *slowest;
    }
    res.ok = true;
    say(fmt::format("{}: {:<5} dispatch {:8.2f} us (rank {}), combine {:8.2f} us (rank {}): "
                    "median of {} of the slowest rank",
                    tag, to_string(mode), res.op[0].median_us, res.slowest_rank[0],
                    res.op[1].median_us, res.slowest_rank[1], p.iters));
  }
  boot.barrier();  // after every rank's last synchronize, before any object goes away
  return br;
}

// NCCL's own collectives on the same data (--world-kind nccl): all-gather of the dispatched rows
// and reduce-scatter of bf16 partials (what allgather_reducescatter does), and all-to-all of the
// deduplicated rows by grouped send/recv, there and back. Eager, timed like the backends; the
// world's figure of each is its slowest rank's. Returns one JSON record per (collective, op).
nlohmann::json run_nccl_yardstick(const BenchPlan& p, NcclWorld& world, const EpConfig& cfg,
                                  int T, const std::vector<ref::Routing>& routings) {
  Bootstrap& boot = world.bootstrap();
  const int W = world.size(), me = world.rank();
  const size_t H = cfg.hidden;
  const size_t row = size_t(cfg.wire_row_bytes()) +
                     (cfg.wire_fp8() ? size_t(cfg.num_scale_groups()) * sizeof(float) : 0);
  // rows[s][d]: tokens of rank s that go to rank d (deduplicated per rank).
  std::vector<std::vector<size_t>> rows(size_t(W), std::vector<size_t>(size_t(W), 0));
  const int local = cfg.num_local_experts();
  for (int s = 0; s < W; ++s) {
    const ref::Routing& r = routings[size_t(s)];
    for (int n = 0; n < r.num_tokens; ++n) {
      uint64_t seen = 0;
      for (int k = 0; k < r.topk; ++k) {
        const int id = r.ids[size_t(n) * r.topk + k];
        if (id >= 0) seen |= uint64_t(1) << (id / local);
      }
      for (int d = 0; d < W; ++d) rows[size_t(s)][size_t(d)] += (seen >> d) & 1;
    }
  }
  auto plan = [&](size_t unit, bool back, std::vector<size_t>& so, std::vector<size_t>& sb,
                  std::vector<size_t>& ro, std::vector<size_t>& rb) {
    so.assign(size_t(W), 0), sb.assign(size_t(W), 0), ro.assign(size_t(W), 0), rb.assign(size_t(W), 0);
    size_t s_off = 0, r_off = 0;
    for (int q = 0; q < W; ++q) {
      sb[size_t(q)] = unit * (back ? rows[size_t(q)][size_t(me)] : rows[size_t(me)][size_t(q)]);
      rb[size_t(q)] = unit * (back ? rows[size_t(me)][size_t(q)] : rows[size_t(q)][size_t(me)]);
      so[size_t(q)] = s_off, s_off += sb[size_t(q)];
      ro[size_t(q)] = r_off, r_off += rb[size_t(q)];
    }
    return std::max(s_off, r_off);
  };
  std::vector<size_t> dso, dsb, dro, drb, cso, csb, cro, crb;
  const size_t a2a_d = plan(row, false, dso, dsb, dro, drb);
  const size_t a2a_c = plan(H * 2, true, cso, csb, cro, crb);
  const size_t bytes = std::max({size_t(W) * T * row, size_t(W) * T * H * 2, a2a_d, a2a_c, size_t(1)});

  nlohmann::json out = nlohmann::json::array();
  void* a = nullptr;
  void* b = nullptr;
  cudaStream_t st = nullptr;
  std::string error;
  try {
    EPX_CUDA_CHECK(cudaSetDevice(world.device()));
    EPX_CUDA_CHECK(cudaMalloc(&a, bytes));
    EPX_CUDA_CHECK(cudaMalloc(&b, bytes));
    EPX_CUDA_CHECK(cudaMemset(a, 0, bytes));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  } catch (const Error& e) {
    error = e.what();
  }
  const std::vector<std::string> setup = boot.all_gather(error);
  for (int r = 0; r < W && error.empty(); ++r)
    if (!setup[size_t(r)].empty()) error = fmt::format("rank {}: {}", r, setup[size_t(r)]);
  auto sync = [&] { EPX_CUDA_CHECK(cudaStreamSynchronize(st)); };
  struct Pair {
    const char* name;
    std::function<void()> dispatch, combine;
    int64_t dispatch_bytes, combine_bytes;  // per rank, sent
  };
  const Pair pairs[] = {
      {"nccl_allgather_reducescatter",
       [&] { world.all_gather(a, b, T * row, st); },
       [&] { world.reduce_scatter_bf16(a, b, size_t(T) * H, st); }, int64_t(T * row) * (W - 1),
       int64_t(T) * int64_t(H) * 2 * (W - 1)},
      {"nccl_alltoall",
       [&] { world.all_to_all(a, dso.data(), dsb.data(), b, dro.data(), drb.data(), st); },
       [&] { world.all_to_all(a, cso.data(), csb.data(), b, cro.data(), crb.data(), st); },
       int64_t(a2a_d), int64_t(a2a_c)}};
  for (const Pair& pr : pairs) {
    nlohmann::json rec = {{"collective", pr.name}, {"tokens_per_rank", T}, {"mode", "eager"}};
    RoundSamples samples;
    const std::string err = error.empty() ? time_op_rounds(pr.dispatch, pr.combine, sync, st, boot,
                                                           TimingMode::kEager, p.warmup, p.iters,
                                                           samples)
                                          : error;
    if (!err.empty()) {
      rec["status"] = "error";
      rec["message"] = err;
      out.push_back(rec);
      continue;
    }
    const nlohmann::json mine = {{"dispatch", stats_json(summarize(samples.dispatch_us))},
                                 {"combine", stats_json(summarize(samples.combine_us))}};
    const std::vector<std::string> all = boot.all_gather(mine.dump());
    rec["status"] = "ok";
    for (int op = 0; op < 2; ++op) {
      Stats worst;
      int worst_rank = 0;
      for (int r = 0; r < W; ++r) {
        const Stats st_r = stats_from_json(nlohmann::json::parse(all[size_t(r)]).at(kOps[op]));
        if (r == 0 || st_r.median_us > worst.median_us) worst = st_r, worst_rank = r;
      }
      rec[kOps[op]] = stats_json(worst);
      rec[kOps[op]]["slowest_rank"] = worst_rank;
      rec[kOps[op]]["bytes_sent_per_rank"] = op == 0 ? pr.dispatch_bytes : pr.combine_bytes;
    }
    out.push_back(rec);
  }
  if (st) (void)cudaStreamDestroy(st);
  (void)cudaFree(a);
  (void)cudaFree(b);
  boot.barrier();
  return out;
}

template <typename World>
bool run_bench_process(const BenchPlan& p, World& world,
                       std::chrono::steady_clock::time_point t_start) {
  const std::string kind = p.nccl ? "nccl" : "ipc";
  EPX_CUDA_CHECK(cudaSetDevice(world.device()));
  Bootstrap& boot = world.bootstrap();
  const int me = world.rank();
  const bool lead = me == 0;
  const EpConfig base = p.shape.cfg;
  const int W = world.size();
  EPX_CHECK(base.world_size == W, ConfigError, "--world", base.world_size,
            fmt::format("the ranks of the {} world = {}", kind, W));
  const GpuInfo gpu = gpu_info(world.device());

  // Where every rank runs: its GPU's PCI bus id (ordinals differ with CUDA_VISIBLE_DEVICES).
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), world.device()) != cudaSuccess) {
    (void)cudaGetLastError();
    std::snprintf(bus, sizeof(bus), "device %d", world.device());
  }
  std::map<std::string, int> ranks_per_bus;
  for (const std::string& b : boot.all_gather(bus)) ++ranks_per_bus[b];
  int most_on_one_gpu = 0;
  for (const auto& [b, n] : ranks_per_bus) most_on_one_gpu = std::max(most_on_one_gpu, n);
  const bool time_sliced = most_on_one_gpu > 1;
  if (lead) {
    fmt::print("epx bench: {} world, {} processes on {} GPU(s) ({}, {} SMs, {} blocks per rank, "
               "{} handles), H {}, E {}, K {}, dtype {}, layout {}, routing {}, seed {}\n",
               kind, W, ranks_per_bus.size(), gpu.name, gpu.sm_count, world.sm_budget(),
               handles_name(world), base.hidden, base.num_experts, base.topk,
               to_string(base.dtype), to_string(base.layout), p.shape.routing_name, p.shape.seed);
    fmt::print("  backends {}, tokens/rank {}, {} timed rounds after {} warm-up (eager and graph "
               "on each rank's own stream, a bootstrap barrier before every round), verify {}, "
               "launch shapes: {}, timeout {} ms, commit {}\n",
               backend_list(p), fmt::join(p.shape.tokens, ","), p.iters, p.warmup,
               p.verify ? "on" : "off", p.launch.origin, base.timeout_ms, git_commit());
    if (time_sliced) {
      fmt::print("  NOTE: {} ranks on one GPU: {}\n", most_on_one_gpu, kTimeSlicedNote);
    }
    std::fflush(stdout);
  }
  // Rank 0 measures the copy bandwidth alone (the others wait), then tells everyone.
  CopyBandwidth bw;
  if (lead) {
    bw = measure_copy_bandwidth(world.device(), kCopyBytes, kCopyRepeats);
    progress(fmt::format("copy bandwidth: {:.1f} GB/s (device-to-device copy of {:.1f} GiB, read "
                         "+ write, median of {}, rank 0's GPU)",
                         bw.gbps, double(bw.bytes) / double(1 << 30), bw.repeats));
  }
  const nlohmann::json bw_json =
      nlohmann::json::parse(boot.all_gather(nlohmann::json{
          {"bytes", bw.bytes}, {"repeats", bw.repeats}, {"median_us", bw.median_us},
          {"gbps", bw.gbps}}.dump())[0]);
  bw.bytes = bw_json.at("bytes").get<size_t>();
  bw.repeats = bw_json.at("repeats").get<int>();
  bw.median_us = bw_json.at("median_us").get<double>();
  bw.gbps = bw_json.at("gbps").get<double>();

  std::vector<TokenResult> results;
  nlohmann::json yardstick = nlohmann::json::array();  // --world-kind nccl: NCCL's collectives
  for (const int T : p.shape.tokens) {
    const EpConfig cfg = p.shape.config_for(T);
    const auto t0 = std::chrono::steady_clock::now();
    DeviceInputs inputs(me, world.device(), cfg, T, p.shape.routing, p.shape.seed);
    TokenResult tr;
    tr.tokens = T;
    tr.volumes = compute_volumes(cfg, inputs.routings());
    for (int op = 0; op < 2; ++op)
      tr.floor_us[op] = double(op_bytes(tr.volumes, op).floor) / (bw.gbps * 1e3);
    if (lead) {
      progress(fmt::format("[tokens {}] inputs on the device: {} tokens on each of {} ranks, "
                           "{:.2f} destination ranks per token ({:.1f} s)",
                           T, T, W,
                           double(tr.volumes.rows_crossing + tr.volumes.rows_self) /
                               double(std::max<int64_t>(1, tr.volumes.tokens)),
                           seconds_since(t0)));
    }
    for (Backend b : p.backends) tr.backends.push_back(run_backend_ipc(p, b, cfg, world, inputs));
    if constexpr (std::is_same_v<World, NcclWorld>) {
      for (auto& rec : run_nccl_yardstick(p, world, cfg, T, inputs.routings()))
        yardstick.push_back(std::move(rec));
    }
    results.push_back(std::move(tr));
  }

  const bool ok = all_ok(results);  // the same on every rank: every step was agreed on
  if (lead) {
    print_table(p, results);
    fmt::print("{} world: the figures are those of the slowest rank (largest median) of each "
               "op; --json lists every rank's.\n",
               kind);
    if (time_sliced) {
      fmt::print("NOTE: {} ranks on one GPU: {}.\n", most_on_one_gpu, kTimeSlicedNote);
    }
    if (!yardstick.empty()) {
      fmt::print("\nNCCL's collectives on the same data (eager medians of the slowest rank, us):\n");
      fmt::print("{:>7}  {:<30} {:>12} {:>12}\n", "tokens", "collective", "dispatch", "combine");
      for (const auto& rec : yardstick) {
        if (rec.at("status") != "ok") {
          fmt::print("{:>7}  {:<30} error: {}\n", rec.at("tokens_per_rank").get<int>(),
                     rec.at("collective").get<std::string>(),
                     one_line(rec.at("message").get<std::string>()));
          continue;
        }
        fmt::print("{:>7}  {:<30} {:>12.2f} {:>12.2f}\n", rec.at("tokens_per_rank").get<int>(),
                   rec.at("collective").get<std::string>(),
                   rec.at("dispatch").at("median_us").get<double>(),
                   rec.at("combine").at("median_us").get<double>());
      }
    }
    if (!p.json_path.empty()) {
      nlohmann::json world_json = {{"kind", kind},
                                   {"ranks", W},
                                   {"gpus_used", int(ranks_per_bus.size())},
                                   {"ranks_per_gpu", world.ranks_on_device()},
                                   {"sm_budget_per_rank", world.sm_budget()},
                                   {"handles", handles_name(world)},
                                   {"time_sliced", time_sliced},
                                   {"figures", "slowest rank (largest median) per op"}};
      if (time_sliced) world_json["note"] = kTimeSlicedNote;
      nlohmann::json doc = make_json(p, world_json, gpu, bw, std::nullopt, results);
      if (!yardstick.empty()) doc["nccl_yardstick"] = yardstick;
      write_json(p.json_path, doc);
    }
    fmt::print("{} ({:.0f} s)\n", ok ? "done" : "done, with FAILED or erroneous backends (exit 1)",
               seconds_since(t_start));
    std::fflush(stdout);
  }
  boot.barrier();  // no rank leaves (and unmaps its peers) while rank 0 still works
  return ok;
}

// One process per rank (--world-kind ipc|nccl); ranks go round-robin over the GPUs this process
// sees (as `epx check`).
bool run_bench_ipc(const BenchPlan& p) {
  const auto t_start = std::chrono::steady_clock::now();
  require_gpu("epx bench");
  const BootstrapOptions env = BootstrapOptions::from_env();
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1) gpus = 1;
  if (p.nccl) {
    NcclWorld world = NcclWorld::from_env(env.rank % gpus);
    return run_bench_process(p, world, t_start);
  }
  IpcWorld world = IpcWorld::from_env(env.rank % gpus);
  return run_bench_process(p, world, t_start);
}
#endif  // EPX_HAVE_CUDA

}  // namespace

void add_bench(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<BenchFlags>();
  CLI::App* c = app.add_subcommand(
      "bench", "dispatch/combine latency (median, p90; CUDA graph and eager) and bandwidth of "
               "each backend side by side, after checking each against the CPU reference "
               "(honours EPX_CONFIG_PATH and EPX_TIMEOUT_MS)");
  add_sweep_flags(c, f->sweep);
  c->add_option("--backends", f->backends,
                "comma list of naive | allgather_reducescatter | low_latency")
      ->capture_default_str();
  c->add_option("--iters", f->iters, "timed rounds (at least 50)")->capture_default_str();
  c->add_option("--warmup", f->warmup, "untimed rounds before them")->capture_default_str();
  c->add_option("--json", f->json_path, "also write the results as JSON to FILE");
  c->add_flag("--no-verify", f->no_verify, "skip the correctness check before timing");
  c->add_option("--world-kind", f->world_kind,
                "in-process (every rank a stream of this process) | ipc (this process is one rank: "
                "run under `epx launch -n W`; --world defaults to EPX_WORLD_SIZE) | nccl (as ipc, "
                "memory through NCCL windows; one GPU per rank)")
      ->capture_default_str();
  CLI::Option* world_opt = c->get_option("--world");
  c->callback([f, world_opt, &exit_code] {
    const BenchPlan plan = validate(*f, world_opt->count() > 0);
#if EPX_HAVE_CUDA
    exit_code = (plan.ipc ? run_bench_ipc(plan) : run_bench(plan)) ? 0 : 1;
#else
    (void)plan;
    (void)exit_code;
    EPX_THROW(UnsupportedError, "epx bench needs an NVIDIA GPU and a CUDA build of epx");
#endif
  });
}

}  // namespace epx::cli
