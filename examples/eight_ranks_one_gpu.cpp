// Eight ranks of an expert-parallel layer on one GPU: dispatch -> a trivial expert -> combine.
// Build: part of the CMake build (target example_eight_ranks_one_gpu). Run: needs an NVIDIA GPU.
#include <cuda_runtime.h>

#include <cstdio>
#include <random>
#include <vector>

#include "epx/all2all.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

int main() try {
  constexpr int kRanks = 8, kTokens = 16;
  epx::EpConfig cfg;  // DeepSeek-R1 shape: hidden 7168, 256 experts, top-8
  cfg.max_tokens_per_rank = kTokens;
  cfg.dtype = epx::DispatchDtype::kBF16;
  epx::InProcessWorld world(kRanks);  // all on GPU 0
  auto ranks = epx::make_all2all_group(epx::Backend::kLowLatency, cfg, world);

  const size_t H = cfg.hidden, K = cfg.topk;
  std::mt19937 rng(1);
  std::vector<cudaStream_t> streams(kRanks);
  std::vector<void*> x(kRanks), y(kRanks), ids(kRanks), w(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking);
    std::vector<uint16_t> hx(kTokens * H, 0x3f80);  // every element 1.0
    std::vector<int32_t> hid(kTokens * K);
    std::vector<float> hw(kTokens * K, 1.0f / K);
    for (int n = 0; n < kTokens; ++n)
      for (size_t k = 0; k < K; ++k) hid[n * K + k] = int32_t((n * 37 + k * 29 + r) % 256);
    cudaMalloc(&x[r], hx.size() * 2);
    cudaMalloc(&y[r], hx.size() * 2);
    cudaMalloc(&ids[r], hid.size() * 4);
    cudaMalloc(&w[r], hw.size() * 4);
    cudaMemcpy(x[r], hx.data(), hx.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(ids[r], hid.data(), hid.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(w[r], hw.data(), hw.size() * 4, cudaMemcpyHostToDevice);
  }
  // Every rank's calls are enqueued before anything waits: the ranks meet inside the kernels.
  for (int r = 0; r < kRanks; ++r) {
    epx::DispatchInput in{.num_tokens = kTokens, .x = x[r], .topk_ids = ids[r],
                          .topk_weights = static_cast<const float*>(w[r])};
    epx::DispatchResult d = ranks[r]->dispatch(in, streams[r]);
    // "Expert": partial = received row (a real layer runs its experts here and scales by the
    // router weights of the local experts).
    cudaMemcpyAsync(ranks[r]->combine_buffer(), d.recv_x, size_t(d.capacity) * H * 2,
                    cudaMemcpyDeviceToDevice, streams[r]);
  }
  for (int r = 0; r < kRanks; ++r) ranks[r]->combine(ranks[r]->combine_buffer(), y[r], streams[r]);
  for (int r = 0; r < kRanks; ++r) ranks[r]->synchronize(streams[r]);
  // Each output element = number of ranks holding at least one of the token's experts.
  uint16_t first = 0;
  cudaMemcpy(&first, y[0], 2, cudaMemcpyDeviceToHost);
  std::printf("rank 0, token 0, element 0 = bf16 bits 0x%04x (the count of ranks it visited)\n", first);
  return 0;
} catch (const epx::Error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
