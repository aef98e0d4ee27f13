// `epx check --moe`, steps 2 to 5 (CUDA builds): the worlds, their layers and the forwards
// whose outputs moe_compare.cpp compares.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <utility>
#include <vector>

#include "epx/all2all.hpp"
#include "epx/cuda_check.hpp"
#include "epx/moe.hpp"
#include "epx/world.hpp"
#include "moe_check_steps.hpp"
#include "report.hpp"
#include "testing/moe_weights.hpp"

namespace epx::cli::moe {
namespace {

// Device memory freed on scope exit (cudaFree works from any current device with UVA).
struct DevMem {
  void* p = nullptr;
  DevMem() = default;
  DevMem(int device, size_t bytes) {
    EPX_CUDA_CHECK(cudaSetDevice(device));
    EPX_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
  }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  DevMem(DevMem&& o) noexcept : p(o.p) { o.p = nullptr; }
  DevMem& operator=(DevMem&& o) noexcept {
    std::swap(p, o.p);
    return *this;
  }
  ~DevMem() {
    if (p) (void)cudaFree(p);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

struct Stream {
  cudaStream_t s = nullptr;
  explicit Stream(int device) {
    EPX_CUDA_CHECK(cudaSetDevice(device));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
    if (s) (void)cudaStreamDestroy(s);
  }
};

// One rank's buffers of one run; its tokens on the host.
struct RankRun {
  int device = 0;
  HostRun host;
  DevMem dx, dy, dids, dw;
};

void upload_inputs(RankRun& r, int hidden, int topk) {
  const size_t n = size_t(r.host.tokens);
  r.dx = DevMem(r.device, n * hidden * 2);
  r.dy = DevMem(r.device, n * hidden * 2);
  r.dids = DevMem(r.device, n * topk * sizeof(int32_t));
  r.dw = DevMem(r.device, n * topk * sizeof(float));
  if (n > 0)
    EPX_CUDA_CHECK(
        cudaMemcpy(r.dx.p, r.host.x.data(), r.host.x.size() * 2, cudaMemcpyHostToDevice));
}

void download_outputs(RankRun& r, int hidden, int topk) {
  HostRun& h = r.host;
  const size_t n = size_t(h.tokens);
  h.y.resize(n * hidden);
  h.ids.resize(n * topk);
  h.weights.resize(n * topk);
  if (n == 0) return;
  EPX_CUDA_CHECK(cudaSetDevice(r.device));
  EPX_CUDA_CHECK(cudaMemcpy(h.y.data(), r.dy.p, h.y.size() * 2, cudaMemcpyDeviceToHost));
  EPX_CUDA_CHECK(
      cudaMemcpy(h.ids.data(), r.dids.p, h.ids.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  EPX_CUDA_CHECK(cudaMemcpy(h.weights.data(), r.dw.p, h.weights.size() * sizeof(float),
                            cudaMemcpyDeviceToHost));
}

}  // namespace

Forwards run_forwards(const Plan& p) {
  const MoeShape& shape = p.shape;
  // 2. Worlds, groups and every layer before any forward.
  auto t0 = std::chrono::steady_clock::now();
  const int num_ranks = p.cfg.world_size;
  InProcessWorld world(num_ranks);
  InProcessWorld world1(1);
  auto group = make_all2all_group(p.backend, p.cfg, world, p.launch);
  EpConfig cfg1 = p.cfg;
  cfg1.rank = 0;
  cfg1.world_size = 1;
  auto group1 = make_all2all_group(p.backend, cfg1, world1, p.launch);
  // [rank] then the one-rank layer's: the seeded weights the layers read (they outlive them).
  std::vector<testing::DeviceMoeWeights> layer_weights(static_cast<size_t>(num_ranks) + 1);
  std::vector<std::unique_ptr<MoeLayer>> layers(static_cast<size_t>(num_ranks));
  std::unique_ptr<MoeLayer> layer1;
  // Threads 0..W-1 build the ranks' layers, thread W the one-rank layer.
  parallel_for(num_ranks + 1, [&](int i) {
    testing::DeviceMoeWeights& weights = layer_weights[size_t(i)];
    if (i < num_ranks) {
      EPX_CUDA_CHECK(cudaSetDevice(world.device_of(i)));
      weights = testing::make_device_moe_weights(shape, p.seed, i, num_ranks);
      layers[size_t(i)] = std::make_unique<MoeLayer>(shape, weights.view(),
                                                     group[size_t(i)]->config(), world.sm_budget(i));
    } else {
      EPX_CUDA_CHECK(cudaSetDevice(world1.device_of(0)));
      weights = testing::make_device_moe_weights(shape, p.seed, 0, 1);
      layer1 = std::make_unique<MoeLayer>(shape, weights.view(), group1[0]->config());
    }
  });
  fmt::print("  built {} rank layer(s) and the one-rank layer in {:.1f} s\n", num_ranks,
             seconds_since(t0));
  std::fflush(stdout);

  // 3. Inputs.
  std::vector<RankRun> runs(static_cast<size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) {
    RankRun& run = runs[size_t(r)];
    run.device = world.device_of(r);
    run.host.tokens = p.tokens[size_t(r)];
    run.host.x =
        ref::moe::make_moe_input(p.shape, run.host.tokens, p.seed * 1000003ULL + uint64_t(r) + 1);
    upload_inputs(run, shape.hidden, shape.topk);
  }
  RankRun one;
  one.device = world1.device_of(0);
  one.host.tokens = static_cast<int>(p.total);
  one.host.x.reserve(size_t(p.total) * shape.hidden);
  for (const RankRun& run : runs)
    one.host.x.insert(one.host.x.end(), run.host.x.begin(), run.host.x.end());
  upload_inputs(one, shape.hidden, shape.topk);
  std::vector<std::unique_ptr<Stream>> streams;
  for (int r = 0; r < num_ranks; ++r)
    streams.push_back(std::make_unique<Stream>(world.device_of(r)));
  Stream stream1(one.device);

  // 4. W ranks, one host thread each.
  t0 = std::chrono::steady_clock::now();
  parallel_for(num_ranks, [&](int r) {
    RankRun& run = runs[size_t(r)];
    EPX_CUDA_CHECK(cudaSetDevice(run.device));
    const MoeRoutingOut routing{run.dids.as<int32_t>(), run.dw.as<float>()};
    All2All& a2a = *group[size_t(r)];
    cudaStream_t s = streams[size_t(r)]->s;
    layers[size_t(r)]->forward(run.dx.p, run.host.tokens, run.dy.p, a2a, s, p.chunks, &routing);
    a2a.synchronize(s);
  });
  const double secs_w = seconds_since(t0);
  for (RankRun& run : runs) download_outputs(run, shape.hidden, shape.topk);

  // 5. One rank, every expert local, all tokens.
  t0 = std::chrono::steady_clock::now();
  {
    EPX_CUDA_CHECK(cudaSetDevice(one.device));
    const MoeRoutingOut routing{one.dids.as<int32_t>(), one.dw.as<float>()};
    layer1->forward(one.dx.p, one.host.tokens, one.dy.p, *group1[0], stream1.s, 0, &routing);
    group1[0]->synchronize(stream1.s);
  }
  const double secs_1 = seconds_since(t0);
  download_outputs(one, shape.hidden, shape.topk);
  fmt::print("  forward: world {} in {:.3f} s (host threads, first call), one rank in {:.3f} s\n",
             num_ranks, secs_w, secs_1);

  Forwards out;
  for (RankRun& run : runs) out.ranks.push_back(std::move(run.host));
  out.one = std::move(one.host);
  return out;
}

}  // namespace epx::cli::moe
