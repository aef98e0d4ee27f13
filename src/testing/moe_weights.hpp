#pragma once
// Seeded MoE weights on the device for checks, tests and benchmarks: the CPU reference's
// generator (src/reference/moe_ref.hpp) uploaded in the checkpoint layout that MoeLayer reads
// (epx::MoeWeights, include/epx/moe.hpp), so a GPU layer and the reference hold the same bytes.

#include <cstdint>
#include <vector>

#include "epx/moe.hpp"
#include "reference/moe_ref.hpp"

namespace epx::testing {

// One rank's MoE weights in device memory of the device that was current at upload. Owns the
// memory (freed by the destructor); view() points into it and is what MoeLayer takes. Destroy it
// only after every layer built on view() (MoeLayer does not own its weights).
class DeviceMoeWeights {
 public:
  DeviceMoeWeights() = default;
  ~DeviceMoeWeights();
  DeviceMoeWeights(DeviceMoeWeights&& other) noexcept;
  DeviceMoeWeights& operator=(DeviceMoeWeights&& other) noexcept;
  DeviceMoeWeights(const DeviceMoeWeights&) = delete;
  DeviceMoeWeights& operator=(const DeviceMoeWeights&) = delete;

  const MoeWeights& view() const { return view_; }

 private:
  friend class WeightUploader;
  std::vector<void*> allocations_;
  MoeWeights view_;
};

// Rank `rank`'s share of `weights` for a world of `world_size` ranks, uploaded to the current
// device: its E / world_size local experts (rank * E / world_size onwards), the router, the
// correction bias (kSigmoidGrouped only: null for kSoftmax, which has none) and the shared expert
// (when the shape has one). InputError when `weights` does not fit `shape` or the rank and world
// do not divide the experts; CudaError when an allocation or copy fails.
DeviceMoeWeights upload_moe_weights(const MoeShape& shape, const ref::moe::MoeWeights& weights,
                                    int rank, int world_size);

// The same bytes as upload_moe_weights(shape, ref::moe::make_moe_weights(shape, seed), rank,
// world_size), generating only this rank's experts, in batches on every host core (the slow part:
// seconds per DeepSeek-R1 expert).
DeviceMoeWeights make_device_moe_weights(const MoeShape& shape, uint64_t seed, int rank,
                                         int world_size);

}  // namespace epx::testing
