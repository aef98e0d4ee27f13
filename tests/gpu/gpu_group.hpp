#pragma once
// What the GPU suites share: the skip of a test on a machine without a GPU, the small
// configuration of the error-path tests, and an in-process group on GPU 0 with one stream per
// rank and the device memory a test uploads (streams drained and memory freed at the end).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "epx/all2all.hpp"
#include "epx/cuda_check.hpp"
#include "epx/world.hpp"

#define REQUIRE_GPU()                                                         \
  do {                                                                        \
    if (epx::cuda_device_count() == 0) GTEST_SKIP() << "needs an NVIDIA GPU"; \
  } while (0)

namespace epx::gpu_test {

// H 2048, 16 experts, top-4, 8 tokens per rank, bf16, 300 ms waits.
inline EpConfig small_config() {
  EpConfig c;
  c.hidden = 2048;
  c.num_experts = 16;
  c.topk = 4;
  c.max_tokens_per_rank = 8;
  c.dtype = DispatchDtype::kBF16;
  c.timeout_ms = 300;
  return c;
}

struct Group {
  EpConfig cfg;  // world_size set to the group's
  InProcessWorld world;
  std::vector<std::unique_ptr<All2All>> a2a;
  std::vector<cudaStream_t> streams;
  std::vector<void*> device_buffers;

  Group(EpConfig c, int ranks, Backend backend = Backend::kLowLatency, LaunchConfigs launch = {})
      : cfg(c), world(ranks) {
    cfg.world_size = ranks;
    a2a = make_all2all_group(backend, cfg, world, launch);
    streams.resize(size_t(ranks));
    for (auto& s : streams) EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  ~Group() {
    for (cudaStream_t s : streams) {
      (void)cudaStreamSynchronize(s);
      (void)cudaStreamDestroy(s);
    }
    for (void* b : device_buffers) (void)cudaFree(b);
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  // A device copy of `h` (at least 16 bytes), freed with the group.
  template <typename T>
  T* upload(const std::vector<T>& h) {
    void* d = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&d, std::max<size_t>(16, h.size() * sizeof(T))));
    if (!h.empty()) {
      EPX_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    }
    device_buffers.push_back(d);
    return static_cast<T*>(d);
  }
};

}  // namespace epx::gpu_test
