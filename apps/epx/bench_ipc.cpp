// `epx bench` with one process per rank (--world-kind ipc or nccl, under `epx launch`): each
// process checks its rank, then times it on its own stream; rank 0 gathers every rank's figures
// and reports the slowest rank's.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "bench.hpp"
#include "epx/all2all.hpp"
#include "epx/bootstrap.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

namespace epx::cli::bench {
namespace {

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
std::string handles_name(IpcWorld& world) {
  return to_string(world.handles());
}
std::string handles_name(NcclWorld&) {
  return "nccl-window";
}

template <typename World>
BackendResult run_backend_ipc(const Plan& p, Backend backend, const EpConfig& cfg, World& world,
                              const DeviceInputs& inputs) {
  Bootstrap& boot = world.bootstrap();
  const int me = world.rank();
  auto say = [&](const std::string& s) {
    if (me == 0) progress(s);
  };
  BackendResult br;
  br.backend = backend;
  br.format = cfg.combine_format;
  const std::string tag =
      fmt::format("[tokens {}] {}", inputs.tokens(), result_name(backend, br.format));
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
      const testing::CheckReport rep =
          testing::run_check_world(o, world);  // same report on every rank
      if (!rep.ok) {
        status = "failed";
        message = rep.mismatches.empty()
                      ? "output differs from the CPU reference"
                      : "output differs from the CPU reference: " + rep.mismatches.front();
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
  for (const TimingMode mode : {TimingMode::kGraph, TimingMode::kEager}) {
    auto& res = br.mode[mode_index(mode, LaunchMode::kPerRank)];
    if (mode == TimingMode::kGraph && reads_counts_on_host(backend, cfg)) continue;
    res.run = true;
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
      const auto slowest = std::max_element(
          ranks.begin(), ranks.end(), [](auto& a, auto& b) { return a.median_us < b.median_us; });
      res.slowest_rank[op] = int(slowest - ranks.begin());
      res.op[op] = *slowest;
    }
    res.ok = true;
    say(
        fmt::format("{}: {:<5} dispatch {:8.2f} us (rank {}), combine {:8.2f} us (rank {}): "
                    "median of {} of the slowest rank",
                    tag, to_string(mode), res.op[0].median_us, res.slowest_rank[0],
                    res.op[1].median_us, res.slowest_rank[1], p.iters));
  }
  boot.barrier();  // after every rank's last synchronize, before any object goes away
  return br;
}

template <typename World>
bool run_bench_process(const Plan& p, World& world, std::chrono::steady_clock::time_point t_start) {
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
    fmt::print(
        "epx bench: {} world, {} processes on {} GPU(s) ({}, {} SMs, {} blocks per rank, "
        "{} handles), H {}, E {}, K {}, dtype {}, layout {}, routing {}, seed {}\n",
        kind, W, ranks_per_bus.size(), gpu.name, gpu.sm_count, world.sm_budget(),
        handles_name(world), base.hidden, base.num_experts, base.topk, to_string(base.dtype),
        to_string(base.layout), p.shape.routing_name, p.shape.seed);
    fmt::print(
        "  backends {}, tokens/rank {}, {} timed rounds after {} warm-up (eager and graph "
        "on each rank's own stream, a bootstrap barrier before every round), verify {}, "
        "launch shapes: {}, timeout {} ms, commit {}\n",
        backend_list(p), fmt::join(p.shape.tokens, ","), p.iters, p.warmup, p.verify ? "on" : "off",
        p.launch.origin, base.timeout_ms, git_commit());
    if (time_sliced) {
      fmt::print("  NOTE: {} ranks on one GPU: {}\n", most_on_one_gpu, kTimeSlicedNote);
    }
    std::fflush(stdout);
  }
  // Rank 0 measures the copy bandwidth alone (the others wait), then tells everyone.
  CopyBandwidth bw;
  if (lead) {
    bw = measure_copy_bandwidth(world.device(), kCopyBytes, kCopyRepeats);
    progress(
        fmt::format("copy bandwidth: {:.1f} GB/s (device-to-device copy of {:.1f} GiB, read "
                    "+ write, median of {}, rank 0's GPU)",
                    bw.gbps, double(bw.bytes) / double(1 << 30), bw.repeats));
  }
  const nlohmann::json bw_json = nlohmann::json::parse(boot.all_gather(nlohmann::json{
      {"bytes", bw.bytes}, {"repeats", bw.repeats}, {"median_us", bw.median_us}, {"gbps", bw.gbps}}
                                                                           .dump())[0]);
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
    tr.volumes = compute_volumes(with_format(cfg, CombineFormat::kBF16), inputs.routings());
    tr.logfmt_volumes =
        compute_volumes(with_format(cfg, CombineFormat::kLogFMT), inputs.routings());
    for (int op = 0; op < 2; ++op)
      tr.floor_us[op] = double(op_bytes(tr.volumes, op).floor) / (bw.gbps * 1e3);
    if (lead) {
      progress(
          fmt::format("[tokens {}] inputs on the device: {} tokens on each of {} ranks, "
                      "{:.2f} destination ranks per token ({:.1f} s)",
                      T, T, W,
                      double(tr.volumes.rows_crossing + tr.volumes.rows_self) /
                          double(std::max<int64_t>(1, tr.volumes.tokens)),
                      seconds_since(t0)));
    }
    for (Backend b : p.backends) {
      for (CombineFormat f : p.formats) {
        if (auto skipped = format_not_taken(b, f)) {
          tr.backends.push_back(*skipped);
          continue;
        }
        tr.backends.push_back(run_backend_ipc(p, b, with_format(cfg, f), world, inputs));
      }
    }
    if constexpr (std::is_same_v<World, NcclWorld>) {
      for (auto& rec : run_nccl_yardstick(p, world, cfg, T, inputs.routings()))
        yardstick.push_back(std::move(rec));
    }
    results.push_back(std::move(tr));
  }

  const bool ok = all_ok(results);  // the same on every rank: every step was agreed on
  if (lead) {
    print_table(p, results);
    fmt::print(
        "{} world: the figures are those of the slowest rank (largest median) of each "
        "op; --json lists every rank's.\n",
        kind);
    if (time_sliced) {
      fmt::print("NOTE: {} ranks on one GPU: {}.\n", most_on_one_gpu, kTimeSlicedNote);
    }
    if (!yardstick.empty()) print_yardstick(yardstick);
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

}  // namespace

// One process per rank (--world-kind ipc|nccl); ranks go round-robin over the GPUs this process
// sees (as `epx check`).
bool run_one_process_per_rank(const Plan& p) {
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

}  // namespace epx::cli::bench
