#include "serve_run.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "epx/all2all.hpp"
#include "epx/error.hpp"
#include "serve_sched.hpp"
#include "serve_steps.hpp"

namespace epx::cli::serve {
namespace {

constexpr double kProgressEveryS = 5.0;

// The workload from the first step to the last, each step's wall time measured around
// `run_all` (which runs `steps` on every rank); fills br's step counts, step times and latencies.
void run_workload(const Plan& p, bool cuda_graph, bool overlap, bool mixed,
                  std::vector<RankStep>& steps, const std::function<void()>& run_all,
                  const std::string& tag, BackendResult& br) {
  const Workload& w = p.workload;
  const std::vector<int>& buckets = p.graph_buckets;
  Scheduler sched(w);
  std::vector<double> step_s;
  const auto t0 = std::chrono::steady_clock::now();
  auto last_progress = t0;
  while (!sched.done()) {
    const StepPlan& plan = sched.plan_step();
    // A window of the input rows that moves every step: the same tokens are not routed alike
    // step after step.
    const size_t first_row = size_t(sched.steps()) * 7919 % (size_t(w.max_batched_tokens) + 1);
    // A decode-only step within one chunk replays every rank's graph of the bucket that holds
    // the largest rank's batch; anything else runs eagerly.
    const int most = *std::max_element(plan.tokens.begin(), plan.tokens.end());
    // A mix's prefill backend takes the steps whose largest rank exceeds the threshold, in its
    // own chunks; the decode backend the others.
    const bool prefill = mixed && most > p.prefill_threshold;
    const int chunks = prefill ? (most + p.prefill_chunk - 1) / p.prefill_chunk : plan.num_chunks;
    const bool decode_path = !prefill && !plan.has_prefill() && plan.num_chunks == 1;
    const int bucket = cuda_graph && decode_path ? decode_bucket(buckets, most) : 0;
    const bool pair = overlap && decode_path;
    for (int r = 0; r < w.world; ++r)
      steps[size_t(r)] =
          RankStep{plan.tokens[size_t(r)], chunks, first_row, bucket, pair, prefill};
    br.prefill_steps += plan.has_prefill();
    br.prefill_backend_steps += prefill;
    br.graph_steps += bucket > 0;
    const auto s0 = std::chrono::steady_clock::now();
    run_all();
    const auto s1 = std::chrono::steady_clock::now();
    step_s.push_back(std::chrono::duration<double>(s1 - s0).count());
    sched.finish_step(std::chrono::duration<double>(s1 - t0).count());
    if (std::chrono::duration<double>(s1 - last_progress).count() >= kProgressEveryS) {
      last_progress = s1;
      fmt::print(stderr, "{}: step {}, {}/{} output tokens, {:.1f} s\n", tag, sched.steps(),
                 sched.output_tokens(), sched.total_output_tokens(), seconds_since(t0));
    }
  }
  br.steps = sched.steps();
  br.step_s = summarize_values(std::move(step_s));
  br.latency = latency_report(sched.requests());
}

// The replays' launch times (every rank's, or the world graphs') and, with split graphs, each
// piece's GPU time over every rank's replays.
void summarize_graph_times(const Ranks& ranks, const WorldGraphs& world_graphs, BackendResult& br) {
  std::vector<double> launches = world_graphs.launch_s;
  for (auto& r : ranks) launches.insert(launches.end(), r->launch_s.begin(), r->launch_s.end());
  br.launch_s = summarize_values(std::move(launches));
  for (size_t i = 0; !ranks.empty() && i < ranks[0]->piece_s.size(); ++i) {
    std::vector<double> ms;
    for (auto& r : ranks)
      if (i < r->piece_s.size()) ms.insert(ms.end(), r->piece_s[i].begin(), r->piece_s[i].end());
    br.piece_s.push_back(summarize_values(std::move(ms)));
  }
}

}  // namespace

BackendResult run_backend(const Plan& p, const BackendMix& backend, bool cuda_graph, bool overlap,
                          const InProcessWorld& world, Ranks& ranks, RankThreads& threads) {
  BackendResult br;
  br.backend = backend;
  br.cuda_graph = cuda_graph;
  br.overlap = overlap;
  const std::string tag = fmt::format("serve-bench [{}{}{}]", backend.name(),
                                      cuda_graph ? ", cuda graph" : "", overlap ? ", overlap" : "");
  const Workload& w = p.workload;
  const int W = w.world;
  const size_t row_bytes = size_t(p.shape.hidden) * 2;
  All2AllGroup group, prefill_group;
  try {
    EpConfig cfg = p.cfg;
    if (overlap) cfg.rounds_in_flight = 2;  // micro-batch b is dispatched before a is combined
    // high_throughput alone sizes its receive areas per call (a host read), which a decode graph
    // cannot hold: with --cuda-graph it keeps the worst case instead.
    cfg.worst_case_output = cuda_graph;
    group = make_all2all_group(backend.decode, cfg, world, p.launch.launch);
    if (backend.prefill) {
      EpConfig pc = p.cfg;
      pc.max_tokens_per_rank = p.prefill_chunk;
      prefill_group = make_all2all_group(*backend.prefill, pc, world, p.launch.launch);
    }
  } catch (const UnsupportedError& e) {
    br.status = "unavailable";
    br.message = e.what();
  } catch (const Error& e) {
    br.status = "error";
    br.message = e.what();
  }
  if (br.status != "ok") {
    fmt::print(stderr, "{}: {}: {}\n", tag, br.status, one_line(br.message));
    return br;
  }

  std::vector<RankStep> steps(static_cast<size_t>(W));
  // Declared before the try block: its graphs hold the group's All2All, drained below.
  WorldGraphs world_graphs;
  auto run_all = [&] {
    if (p.world_graphs && steps[0].graph_bucket > 0) {
      run_world_step(world_graphs, ranks, steps, row_bytes, threads, group);
      return;
    }
    threads.run([&](int r) {
      run_step(*ranks[size_t(r)], *group[size_t(r)],
               prefill_group.empty() ? nullptr : prefill_group[size_t(r)].get(), p.layers,
               steps[size_t(r)], row_bytes);
    });
  };
  try {
    // Warm-up, untimed: a full prefill step, one chunk, one token (first-use costs of the
    // GEMM shapes and the backend).
    const auto t_warm = std::chrono::steady_clock::now();
    const int chunk = w.chunk_size;
    for (const int n : {w.max_batched_tokens, std::min(chunk, w.max_batched_tokens), 1}) {
      const bool prefill = backend.prefill && n > p.prefill_threshold;
      const int c = prefill ? p.prefill_chunk : chunk;
      for (auto& s : steps) s = RankStep{n, (n + c - 1) / c, 0, 0, false, prefill};
      run_all();
    }
    if (overlap) {  // the decode path the timed steps take
      for (auto& s : steps) s = RankStep{2, 1, 0, 0, true};
      run_all();
    }
    // Decode graphs: captured per rank, then each replayed once on every rank (untimed).
    const std::vector<int>& buckets = p.graph_buckets;
    if (cuda_graph) {
      const auto t_capture = std::chrono::steady_clock::now();
      if (p.world_graphs) {
        capture_world_graphs(world_graphs, ranks, group, p.layers, buckets);
      } else {
        threads.run([&](int r) {
          capture_decode_graphs(*ranks[size_t(r)], *group[size_t(r)], p.layers, buckets,
                                p.split_graphs && !overlap, overlap);
        });
      }
      br.capture_s = seconds_since(t_capture);
      for (const int b : buckets) {
        for (auto& s : steps) s = RankStep{b, 1, 0, b, overlap};
        run_all();
      }
    }
    br.warmup_s = seconds_since(t_warm);

    for (auto& r : ranks) {  // the timed steps' replays only
      r->launch_s.clear();
      r->piece_s.clear();
    }
    world_graphs.launch_s.clear();
    run_workload(p, cuda_graph, overlap, backend.prefill.has_value(), steps, run_all, tag, br);
    summarize_graph_times(ranks, world_graphs, br);
    fmt::print(stderr, "{}: done, {} steps ({} graph replays), {:.1f} s (warm-up {:.1f} s{})\n",
               tag, br.steps, br.graph_steps, br.latency.end_s, br.warmup_s,
               cuda_graph ? fmt::format(", of which capture {:.1f} s", br.capture_s) : "");
  } catch (const Error& e) {
    br.status = "error";
    br.message = e.what();
    fmt::print(stderr, "{}: error: {}\n", tag, one_line(br.message));
  }
  drain(ranks);
  // The graphs hold this backend's All2All: gone with it.
  for (auto& r : ranks) {
    (void)cudaSetDevice(r->device);
    r->destroy_graphs();
  }
  return br;
}

}  // namespace epx::cli::serve
