// run_check_ipc: the correctness check of harness.cpp with one process per rank (IpcWorld).
// Every rank computes the same inputs and CPU reference from the seed, runs and compares only
// its own rank, and the ranks agree on the outcome through the bootstrap.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "testing/harness.hpp"
#include "testing/harness_internal.hpp"
#include "testing/identity_expert.hpp"
#include "testing/graph_capture.hpp"
#include "epx/all2all.hpp"
#include "epx/bootstrap.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

namespace epx::testing {
namespace {

using namespace internal;  // the pieces shared with run_check (harness_internal.hpp)

// One line per mismatch in the all-gathered report.
std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

// "ok calls\nmismatch\nmismatch..." of one rank.
std::string encode(const CheckReport& rep) {
  std::string out = fmt::format("{} {}\n", rep.ok ? 1 : 0, rep.calls);
  for (const auto& m : rep.mismatches) out += one_line(m) + "\n";
  return out;
}

void merge(CheckReport& into, const std::string& text, int rank, int max_report) {
  const size_t eol = text.find('\n');
  const std::string head = text.substr(0, eol);
  int ok = 0;
  long long calls = 0;
  if (std::sscanf(head.c_str(), "%d %lld", &ok, &calls) != 2) {
    EPX_THROW(PeerError, fmt::format("epx check: rank {} sent a malformed report '{}'", rank, head));
  }
  into.ok = into.ok && ok != 0;
  into.calls = std::min<int64_t>(into.calls, calls);
  size_t pos = eol == std::string::npos ? text.size() : eol + 1;
  while (pos < text.size()) {
    const size_t e = std::min(text.find('\n', pos), text.size());
    if (e > pos && into.mismatches.size() < size_t(max_report))
      into.mismatches.push_back(text.substr(pos, e - pos));
    pos = e + 1;
  }
}

std::string describe(IpcWorld& world) {
  return fmt::format("ipc world: {} rank(s), {} handles, {} rank(s) on rank 0's GPU, SM budget {}",
                     world.size(), to_string(world.handles()), world.ranks_on_device(),
                     world.sm_budget());
}

std::string describe(NcclWorld& world) {
  return fmt::format("nccl world: {} rank(s), one GPU each, SM budget {}", world.size(),
                     world.sm_budget());
}

// One process per rank: the same steps over either world.
template <typename World>
CheckReport run_check_process(const CheckOptions& o, World& world) {
  require_gpu("epx check");
  CheckReport rep;
  EpConfig cfg = o.cfg;
  EPX_CHECK(cfg.world_size == world.size(), ConfigError, "world_size", cfg.world_size,
            fmt::format("the ranks of the world = {} (EPX_WORLD_SIZE)", world.size()));
  cfg.rank = 0;
  cfg.validate();
  EPX_CHECK(cfg.rounds_in_flight == 1, InputError, "rounds_in_flight", cfg.rounds_in_flight,
            "1 with one process per rank (the interleaved rounds are checked in-process)");
  EPX_CHECK(o.verify_every == 1, InputError, "verify_every", o.verify_every,
            "1 with one process per rank (the soak with sparse comparisons runs in-process)");
  const int W = cfg.world_size;
  const int me = world.rank();
  const std::vector<int> counts = resolve_token_counts(o, cfg);
  rep.tokens = counts;

  auto say = [&](const std::string& s) {
    if (o.log && me == 0) o.log(s);
  };
  // Every rank computes every rank's inputs and the whole reference (the expected outputs of
  // one rank depend on every rank's inputs).
  const std::vector<InputSet> sets = make_sets(o, cfg, counts);
  const int pool = int(sets.size());
  say(fmt::format("reference ready: {} input set(s), tokens per rank {}", pool,
                  fmt::join(counts, ",")));

  Bootstrap& boot = world.bootstrap();
  EPX_CUDA_CHECK(cudaSetDevice(world.device()));
  // Collective; compares every rank's configuration before allocating.
  std::unique_ptr<All2All> a2a = make_all2all(o.backend, cfg, world, o.launch);
  rep.buffer_bytes = a2a->symmetric_bytes();
  EPX_CUDA_CHECK(cudaSetDevice(world.device()));
  preload_identity_expert();
  say(describe(world));

  const size_t H = cfg.hidden, K = cfg.topk, G = cfg.num_scale_groups();
  const size_t maxT = cfg.max_tokens_per_rank;
  RankBuffers b;
  struct Cleanup {
    RankBuffers& b;
    ~Cleanup() {
      if (b.stream) (void)cudaStreamSynchronize(b.stream);
      if (b.exec) (void)cudaGraphExecDestroy(b.exec);
      (void)cudaFree(b.x);
      (void)cudaFree(b.scales);
      (void)cudaFree(b.ids);
      (void)cudaFree(b.weights);
      (void)cudaFree(b.y);
      if (b.stream) (void)cudaStreamDestroy(b.stream);
    }
  } cleanup{b};
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking));
  EPX_CUDA_CHECK(cudaMalloc(&b.x, maxT * H * 2));
  EPX_CUDA_CHECK(cudaMalloc(&b.scales, std::max<size_t>(1, maxT * G) * sizeof(float)));
  EPX_CUDA_CHECK(cudaMalloc(&b.ids, maxT * K * sizeof(int64_t)));
  EPX_CUDA_CHECK(cudaMalloc(&b.weights, maxT * K * sizeof(float)));
  EPX_CUDA_CHECK(cudaMalloc(&b.y, maxT * H * 2));

  auto upload = [&](const InputSet& s) {
    const RankInput& in = s.in[me];
    const size_t n = in.num_tokens;
    cudaStream_t st = b.stream;
    if (n == 0) return;
    if (cfg.input_fp8()) {
      EPX_CUDA_CHECK(cudaMemcpyAsync(b.x, in.x_fp8.data(), n * H, cudaMemcpyHostToDevice, st));
      EPX_CUDA_CHECK(cudaMemcpyAsync(b.scales, in.scales.data(), n * G * sizeof(float),
                                     cudaMemcpyHostToDevice, st));
    } else {
      EPX_CUDA_CHECK(cudaMemcpyAsync(b.x, in.x_bf16.data(), n * H * 2, cudaMemcpyHostToDevice, st));
    }
    if (o.ids_int64) {
      EPX_CUDA_CHECK(cudaMemcpyAsync(b.ids, s.ids64[me].data(), n * K * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, st));
    } else {
      EPX_CUDA_CHECK(cudaMemcpyAsync(b.ids, in.routing.ids.data(), n * K * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, st));
    }
    EPX_CUDA_CHECK(cudaMemcpyAsync(b.weights, in.routing.weights.data(), n * K * sizeof(float),
                                   cudaMemcpyHostToDevice, st));
    EPX_CUDA_CHECK(cudaMemsetAsync(b.y, 0xff, n * H * 2, st));  // poison: every row must be written
  };
  DispatchResult result;
  auto enqueue = [&] {
    DispatchInput in;
    in.num_tokens = counts[me];
    in.x = b.x;
    in.x_scales = cfg.input_fp8() ? b.scales : nullptr;
    in.topk_ids = b.ids;
    in.ids_type = o.ids_int64 ? IdType::kInt64 : IdType::kInt32;
    in.topk_weights = b.weights;
    result = a2a->dispatch(in, b.stream);
    launch_identity_expert(a2a->config(), result, a2a->combine_buffer(), b.stream);
    a2a->combine(a2a->combine_buffer(), b.y, b.stream);
  };
  Comparer cmp(rep, o.max_report);
  // Finishes this rank's round and compares its outputs; then every rank learns whether all
  // ranks passed, so that all of them go on to the next round or none does.
  auto finish_and_compare = [&](const InputSet& s) -> bool {
    bool device_ok = true;
    try {
      a2a->synchronize(b.stream);
    } catch (const Error& e) {
      cmp.add(fmt::format("rank {}: device error: {}", me, e.what()));
      (void)cudaStreamSynchronize(b.stream);
      device_ok = false;
    }
    if (device_ok) {
      if (o.corrupt_rank == me && counts[me] > 0) {
        // flip the low bit of the first element of y[0] on this rank
        uint16_t v = 0;
        EPX_CUDA_CHECK(cudaMemcpy(&v, b.y, 2, cudaMemcpyDeviceToHost));
        v ^= 1;
        EPX_CUDA_CHECK(cudaMemcpy(b.y, &v, 2, cudaMemcpyHostToDevice));
      }
      compare_dispatch(a2a->config(), o.backend, me, result, s, cmp);
      const size_t n = size_t(counts[me]) * H;
      cmp.eq(download<uint16_t>(b.y, n), s.y[me].data(), n, int(H),
             fmt::format("rank {} combine y", me));
      ++rep.calls;
    }
    const std::vector<std::string> oks = boot.all_gather(rep.ok ? "1" : "0");
    return std::all_of(oks.begin(), oks.end(), [](const std::string& v) { return v == "1"; });
  };

  bool go_on = true;
  // Eager calls.
  for (int it = 0; it < o.iters && go_on; ++it) {
    const InputSet& s = sets[it % pool];
    upload(s);
    enqueue();
    go_on = finish_and_compare(s);
  }
  if (o.iters > 0) say(fmt::format("eager: {} call(s) checked", rep.calls));

  // Graph replays.
  if (o.graph_replays > 0 && go_on) {
    if (!(o.mixed && me == 0)) {
      b.exec = capture_graph(b.stream, enqueue);
    }
    const int64_t before = rep.calls;
    for (int i = 0; i < o.graph_replays && go_on; ++i) {
      const InputSet& s = sets[(o.iters + i) % pool];
      upload(s);
      if (b.exec) {
        EPX_CUDA_CHECK(cudaGraphLaunch(b.exec, b.stream));
      } else {
        enqueue();
      }
      go_on = finish_and_compare(s);
      if ((i + 1) % 100 == 0) say(fmt::format("graph: {} replay(s) checked", i + 1));
    }
    say(fmt::format("graph{}: {} replay(s) checked", o.mixed ? " (rank 0 eager)" : "",
                    rep.calls - before));
  }

  // Everyone's outcome, in rank order, on every rank.
  const std::vector<std::string> all = boot.all_gather(encode(rep));
  CheckReport out;
  out.ok = true;
  out.calls = rep.calls;
  out.buffer_bytes = rep.buffer_bytes;
  out.tokens = rep.tokens;
  for (int r = 0; r < W; ++r) merge(out, all[size_t(r)], r, o.max_report);
  // No rank releases its buffer while a peer may still read it (kCudaIpc: the memory goes away
  // with its exporting process).
  boot.barrier();
  return out;
}

}  // namespace

CheckReport run_check_ipc(const CheckOptions& o, IpcWorld& world) {
  return run_check_process(o, world);
}

CheckReport run_check_nccl(const CheckOptions& o, NcclWorld& world) {
  return run_check_process(o, world);
}

}  // namespace epx::testing
