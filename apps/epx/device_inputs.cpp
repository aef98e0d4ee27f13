#include "device_inputs.hpp"

#include <exception>
#include <string>
#include <thread>

#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

namespace epx::cli {

DeviceInputs::DeviceInputs(const InProcessWorld& world, const EpConfig& cfg, int tokens,
                           ref::RoutingKind routing, uint64_t seed)
    : tokens_(tokens), fp8_input_(cfg.input_fp8()), ranks_(world.size()) {
  std::vector<int> devices(size_t(world.size()));
  for (int r = 0; r < world.size(); ++r) devices[size_t(r)] = world.device_of(r);
  init(devices, cfg, routing, seed);
}

DeviceInputs::DeviceInputs(int rank, int device, const EpConfig& cfg, int tokens,
                           ref::RoutingKind routing, uint64_t seed)
    : tokens_(tokens), fp8_input_(cfg.input_fp8()), ranks_(cfg.world_size) {
  EPX_CHECK(rank >= 0 && rank < cfg.world_size, InputError, "rank", rank,
            "in [0, world_size = " + std::to_string(cfg.world_size) + ")");
  std::vector<int> devices(size_t(cfg.world_size), -1);
  devices[size_t(rank)] = device;
  init(devices, cfg, routing, seed);
}

void DeviceInputs::init(const std::vector<int>& devices, const EpConfig& cfg,
                        ref::RoutingKind routing, uint64_t seed) {
  const int W = int(devices.size());
  const int tokens = tokens_;
  const size_t T = tokens, H = cfg.hidden, K = cfg.topk, G = cfg.num_scale_groups();
  // Generating activations is the slow part: one thread per rank (each is independent).
  std::vector<ref::RankInput> host(W);
  routings_.resize(W);
  {
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(W);
    for (int r = 0; r < W; ++r) {
      threads.emplace_back([&, r] {
        try {
          const uint64_t rs = seed * 0x9E3779B97F4A7C15ull + uint64_t(r) * 7919 + 1;
          routings_[r] = ref::make_routing(routing, tokens, cfg.num_experts, cfg.topk, rs,
                                           int(seed % uint64_t(cfg.num_experts)));
          if (devices[size_t(r)] < 0) return;  // another process's rank: its routing only
          host[r] = ref::make_rank_input(cfg, tokens, routings_[r], rs ^ 0xB5AD4ECEDA1CE2A9ull);
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }
  try {
    for (int r = 0; r < W; ++r) {
      if (devices[size_t(r)] < 0) continue;
      Rank& d = ranks_[r];
      const ref::RankInput& in = host[r];
      EPX_CUDA_CHECK(cudaSetDevice(devices[size_t(r)]));
      EPX_CUDA_CHECK(cudaMalloc(&d.x, T * H * (fp8_input_ ? 1 : 2)));
      EPX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d.ids), T * K * sizeof(int32_t)));
      EPX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d.weights), T * K * sizeof(float)));
      EPX_CUDA_CHECK(cudaMalloc(&d.y, T * H * 2));
      if (fp8_input_) {
        EPX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d.scales), T * G * sizeof(float)));
        EPX_CUDA_CHECK(cudaMemcpy(d.x, in.x_fp8.data(), T * H, cudaMemcpyHostToDevice));
        EPX_CUDA_CHECK(
            cudaMemcpy(d.scales, in.scales.data(), T * G * sizeof(float), cudaMemcpyHostToDevice));
      } else {
        EPX_CUDA_CHECK(cudaMemcpy(d.x, in.x_bf16.data(), T * H * 2, cudaMemcpyHostToDevice));
      }
      EPX_CUDA_CHECK(cudaMemcpy(d.ids, in.routing.ids.data(), T * K * sizeof(int32_t),
                                cudaMemcpyHostToDevice));
      EPX_CUDA_CHECK(cudaMemcpy(d.weights, in.routing.weights.data(), T * K * sizeof(float),
                                cudaMemcpyHostToDevice));
      EPX_CUDA_CHECK(cudaMemset(d.y, 0, T * H * 2));
    }
  } catch (...) {
    release();
    throw;
  }
}

DeviceInputs::~DeviceInputs() {
  release();
}

void DeviceInputs::release() noexcept {
  for (Rank& d : ranks_) {
    for (void* p : {d.x, static_cast<void*>(d.scales), static_cast<void*>(d.ids),
                    static_cast<void*>(d.weights), d.y})
      if (p) (void)cudaFree(p);
    d = Rank{};
  }
}

DispatchInput DeviceInputs::input(int rank) const {
  const Rank& d = ranks_[rank];
  DispatchInput in;
  in.num_tokens = tokens_;
  in.x = d.x;
  in.x_scales = fp8_input_ ? d.scales : nullptr;
  in.topk_ids = d.ids;
  in.ids_type = IdType::kInt32;
  in.topk_weights = d.weights;
  return in;
}

}  // namespace epx::cli
