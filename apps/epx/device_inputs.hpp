#pragma once
// The inputs of a measured op on the device (CUDA builds): every rank's activations, routing and
// combine output for one token count, drawn from the reference generators.

#include <cstdint>
#include <vector>

#include "epx/all2all.hpp"
#include "epx/config.hpp"
#include "reference/reference.hpp"

namespace epx {
class InProcessWorld;
}

namespace epx::cli {

// Random inputs of every rank for one token count, on the device, uploaded once; y is the
// combine output. Only the routing stays on the host (for the byte volumes). The inputs depend
// only on (cfg, tokens, routing, seed), so every world gets the same ones.
class DeviceInputs {
 public:
  // Every rank of an in-process world, each on its own GPU.
  DeviceInputs(const InProcessWorld& world, const EpConfig& cfg, int tokens,
               ref::RoutingKind routing, uint64_t seed);
  // One process of an IPC world: only rank `rank`'s inputs, on `device`; every rank's routing is
  // still drawn (routings() covers the world). input(r) and y(r) are valid for r == rank only.
  DeviceInputs(int rank, int device, const EpConfig& cfg, int tokens, ref::RoutingKind routing,
               uint64_t seed);
  ~DeviceInputs();
  DeviceInputs(const DeviceInputs&) = delete;
  DeviceInputs& operator=(const DeviceInputs&) = delete;

  int tokens() const { return tokens_; }
  DispatchInput input(int rank) const;
  void* y(int rank) const { return ranks_[rank].y; }
  const std::vector<ref::Routing>& routings() const { return routings_; }

 private:
  // devices[r] = the GPU of rank r, or -1 when rank r lives in another process.
  void init(const std::vector<int>& devices, const EpConfig& cfg, ref::RoutingKind routing,
            uint64_t seed);
  void release() noexcept;
  struct Rank {
    void* x = nullptr;         // [T, H] bf16 or fp8
    float* scales = nullptr;   // [T, H/128] (fp8 input only)
    int32_t* ids = nullptr;    // [T, K]
    float* weights = nullptr;  // [T, K]
    void* y = nullptr;         // [T, H] bf16
  };
  int tokens_ = 0;
  bool fp8_input_ = false;
  std::vector<Rank> ranks_;
  std::vector<ref::Routing> routings_;
};

}  // namespace epx::cli
