// `epx bench` on an in-process world: every rank a stream of this process, each backend checked
// against the CPU reference, then timed as one fork/join (bench_common.hpp).
#include <fmt/format.h>

#include <chrono>
#include <string>
#include <vector>

#include "bench.hpp"
#include "epx/all2all.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

namespace epx::cli::bench {

testing::CheckOptions verify_options(const Plan& p, Backend backend, const EpConfig& cfg,
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

namespace {

// Verification, then graph and eager timing of one backend at one token count.
BackendResult run_backend(const Plan& p, Backend backend, const EpConfig& cfg,
                          const InProcessWorld& world, const DeviceInputs& inputs, ForkJoin& fj) {
  BackendResult br;
  br.backend = backend;
  br.format = cfg.combine_format;
  const std::string tag =
      fmt::format("[tokens {}] {}", inputs.tokens(), result_name(backend, br.format));
  if (p.verify) {
    const auto t0 = std::chrono::steady_clock::now();
    const testing::CheckOptions o = verify_options(p, backend, cfg, inputs.tokens());
    try {
      const testing::CheckReport rep = testing::run_check(o);
      br.verification = rep.ok ? "passed" : "failed";
      if (!rep.ok) {
        br.status = "failed";
        br.message = rep.mismatches.empty()
                         ? "output differs from the CPU reference"
                         : "output differs from the CPU reference: " + rep.mismatches.front();
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
  for (int m = 0; m < 4; ++m) {
    const TimingMode mode = timing_of(m);
    const LaunchMode launch = launch_of(m);
    auto& res = br.mode[m];
    // high_throughput with exact output sizes reads each round's row count back on the host:
    // no graph, and the ranks of one host thread must share one launch (a rank's dispatch waits
    // for its peers' counts before the next rank's call is enqueued).
    if (reads_counts_on_host(backend, cfg) &&
        (mode == TimingMode::kGraph || launch == LaunchMode::kPerRank)) {
      continue;
    }
    res.run = true;
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
      const RoundSamples s = time_rounds(group, inputs, fj, mode, launch, p.warmup, p.iters);
      res.op[0] = summarize(s.dispatch_us);
      res.op[1] = summarize(s.combine_us);
      res.ok = true;
      progress(fmt::format("{}: {:<5} {:<11} dispatch {:8.2f} us, combine {:8.2f} us (median of {})",
                           tag, to_string(mode), to_string(launch), res.op[0].median_us,
                           res.op[1].median_us, p.iters));
    } catch (const Error& e) {
      res.error = e.what();
      group.clear();  // unusable after an error; the next mode gets a fresh group
      progress(fmt::format("{}: {} {} timing error: {}", tag, to_string(mode), to_string(launch),
                           one_line(res.error)));
    }
  }
  return br;
}

}  // namespace

bool run_in_process(const Plan& p) {
  const auto t_start = std::chrono::steady_clock::now();
  require_gpu("epx bench");
  EpConfig base = p.shape.cfg;
  const int W = base.world_size;
  InProcessWorld world(W, p.shape.devices);
  const GpuInfo gpu = gpu_info(world.device_of(0));
  fmt::print(
      "epx bench: {} in-process ranks on {} x {} ({} SMs, {} blocks per rank), H {}, "
      "E {}, K {}, dtype {}, layout {}, routing {}, seed {}\n",
      W, p.shape.devices.size(), gpu.name, gpu.sm_count, world.sm_budget(0), base.hidden,
      base.num_experts, base.topk, to_string(base.dtype), to_string(base.layout),
      p.shape.routing_name, p.shape.seed);
  fmt::print(
      "  backends {}, tokens/rank {}, {} timed rounds after {} warm-up, verify {}, "
      "launch shapes: {}, timeout {} ms, commit {}\n",
      backend_list(p), fmt::join(p.shape.tokens, ","), p.iters, p.warmup, p.verify ? "on" : "off",
      p.launch.origin, base.timeout_ms, git_commit());
  const CopyBandwidth bw = measure_copy_bandwidth(world.device_of(0), kCopyBytes, kCopyRepeats);
  progress(
      fmt::format("copy bandwidth: {:.1f} GB/s (device-to-device copy of {:.1f} GiB, read + "
                  "write, median of {})",
                  bw.gbps, double(bw.bytes) / double(1 << 30), bw.repeats));
  ForkJoin fj(world);
  const double fork_join_us = time_fork_join_floor(fj, p.warmup, p.iters);
  progress(
      fmt::format("fork/join floor: {:.2f} us (graph of {} ranks' streams with a 16-byte "
                  "memset each, median of {})",
                  fork_join_us, W, p.iters));

  std::vector<TokenResult> results;
  for (const int T : p.shape.tokens) {
    const EpConfig cfg = p.shape.config_for(T);
    const auto t0 = std::chrono::steady_clock::now();
    DeviceInputs inputs(world, cfg, T, p.shape.routing, p.shape.seed);
    TokenResult tr;
    tr.tokens = T;
    tr.volumes = compute_volumes(with_format(cfg, CombineFormat::kBF16), inputs.routings());
    tr.logfmt_volumes =
        compute_volumes(with_format(cfg, CombineFormat::kLogFMT), inputs.routings());
    for (int op = 0; op < 2; ++op)
      tr.floor_us[op] = double(op_bytes(tr.volumes, op).floor) / (bw.gbps * 1e3);
    progress(
        fmt::format("[tokens {}] inputs on the device: {} ranks x {} tokens, {:.2f} "
                    "destination ranks per token ({:.1f} s)",
                    T, W, T,
                    double(tr.volumes.rows_crossing + tr.volumes.rows_self) /
                        double(std::max<int64_t>(1, tr.volumes.tokens)),
                    seconds_since(t0)));
    for (Backend b : p.backends) {
      for (CombineFormat f : p.formats) {
        if (auto skipped = format_not_taken(b, f)) {
          tr.backends.push_back(*skipped);
          continue;
        }
        tr.backends.push_back(run_backend(p, b, with_format(cfg, f), world, inputs, fj));
      }
    }
    results.push_back(std::move(tr));
    // The token counts done so far, so that a run cut short keeps them ("complete": false); not
    // into a pipe or a device (--json /dev/stdout gets one document, at the end).
    if (!p.json_path.empty() && results.size() < p.shape.tokens.size() &&
        regular_or_new(p.json_path)) {
      write_json(p.json_path,
                 make_json(p, in_process_world_json(world), gpu, bw, fork_join_us, results), false);
      progress(fmt::format("[tokens {}] results so far written to {}", T, p.json_path));
    }
  }

  print_table(p, results);
  if (!p.json_path.empty()) {
    write_json(p.json_path,
               make_json(p, in_process_world_json(world), gpu, bw, fork_join_us, results));
  }
  const bool ok = all_ok(results);
  fmt::print("{} ({:.0f} s)\n", ok ? "done" : "done, with FAILED or erroneous backends (exit 1)",
             seconds_since(t_start));
  return ok;
}

}  // namespace epx::cli::bench
