// `epx bench --world-kind nccl`: NCCL's own collectives timed on the backends' data, as a
// yardstick.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "bench.hpp"
#include "epx/bootstrap.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

namespace epx::cli::bench {

// NCCL's own collectives on the same data (--world-kind nccl): all-gather of the dispatched rows
// and reduce-scatter of bf16 partials (what allgather_reducescatter does), and all-to-all of the
// deduplicated rows by grouped send/recv, there and back. Eager, timed like the backends; the
// world's figure of each is its slowest rank's. Returns one JSON record per (collective, op).
nlohmann::json run_nccl_yardstick(const Plan& p, NcclWorld& world, const EpConfig& cfg, int T,
                                  const std::vector<ref::Routing>& routings) {
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
    so.assign(size_t(W), 0), sb.assign(size_t(W), 0), ro.assign(size_t(W), 0),
        rb.assign(size_t(W), 0);
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
  const size_t bytes =
      std::max({size_t(W) * T * row, size_t(W) * T * H * 2, a2a_d, a2a_c, size_t(1)});

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
      {"nccl_allgather_reducescatter", [&] { world.all_gather(a, b, T * row, st); },
       [&] { world.reduce_scatter_bf16(a, b, size_t(T) * H, st); }, int64_t(T * row) * (W - 1),
       int64_t(T) * int64_t(H) * 2 * (W - 1)},
      {"nccl_alltoall",
       [&] { world.all_to_all(a, dso.data(), dsb.data(), b, dro.data(), drb.data(), st); },
       [&] { world.all_to_all(a, cso.data(), csb.data(), b, cro.data(), crb.data(), st); },
       int64_t(a2a_d), int64_t(a2a_c)}};
  for (const Pair& pr : pairs) {
    nlohmann::json rec = {{"collective", pr.name}, {"tokens_per_rank", T}, {"mode", "eager"}};
    RoundSamples samples;
    const std::string err = error.empty()
                                ? time_op_rounds(pr.dispatch, pr.combine, sync, st, boot,
                                                 TimingMode::kEager, p.warmup, p.iters, samples)
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

}  // namespace epx::cli::bench
