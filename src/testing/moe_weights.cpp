// Seeded MoE weights on the device (moe_weights.hpp).

#include "testing/moe_weights.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <thread>
#include <utility>

#include "epx/cuda_check.hpp"
#include "epx/error.hpp"

namespace epx::testing {

namespace rm = ref::moe;

DeviceMoeWeights::~DeviceMoeWeights() {
  for (void* p : allocations_) (void)cudaFree(p);
}

DeviceMoeWeights::DeviceMoeWeights(DeviceMoeWeights&& other) noexcept
    : allocations_(std::exchange(other.allocations_, {})),
      view_(std::exchange(other.view_, {})) {}

DeviceMoeWeights& DeviceMoeWeights::operator=(DeviceMoeWeights&& other) noexcept {
  std::swap(allocations_, other.allocations_);
  std::swap(view_, other.view_);
  return *this;
}

// Copies host tensors into device memory that `owner` frees, and fills its view.
class WeightUploader {
 public:
  explicit WeightUploader(DeviceMoeWeights& owner) : owner_(owner) {}

  MoeWeights& view() { return owner_.view_; }

  template <typename T>
  const T* upload(const std::vector<T>& v) {
    const size_t bytes = v.size() * sizeof(T);
    void* d = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&d, std::max<size_t>(bytes, 1)));
    owner_.allocations_.push_back(d);
    // From pageable memory: returns once the source has been staged.
    EPX_CUDA_CHECK(cudaMemcpy(d, v.data(), bytes, cudaMemcpyHostToDevice));
    return static_cast<const T*>(d);
  }

  Fp8BlockWeight upload(const rm::Fp8BlockMatrix& m) {
    return Fp8BlockWeight{.weight = upload(m.q), .scale_inv = upload(m.scales)};
  }

  MoeExpertWeights upload(const rm::ExpertWeights& w) {
    return MoeExpertWeights{.gate = upload(w.w1), .up = upload(w.w3), .down = upload(w.w2)};
  }

 private:
  DeviceMoeWeights& owner_;
};

namespace {

std::string dims(int rows, int cols) {
  std::string s = "[";
  s += std::to_string(rows);
  s += "][";
  s += std::to_string(cols);
  s += "]";
  return s;
}

void check_world(const MoeShape& shape, int rank, int world_size) {
  EPX_CHECK(world_size >= 1 && shape.num_experts % world_size == 0, InputError, "world_size",
            world_size, "a divisor of num_experts = " + std::to_string(shape.num_experts));
  EPX_CHECK(rank >= 0 && rank < world_size, InputError, "rank", rank,
            "in [0, world_size = " + std::to_string(world_size) + ")");
}

void check_matrix(const rm::Fp8BlockMatrix& m, int rows, int cols, const std::string& name) {
  const bool sized =
      m.rows == rows && m.cols == cols && m.q.size() == size_t(rows) * size_t(cols) &&
      m.scales.size() == size_t(rows / rm::kWeightBlock) * size_t(cols / rm::kWeightBlock);
  EPX_CHECK(sized, InputError, name, dims(m.rows, m.cols),
            dims(rows, cols) + " with rows * cols codes and one scale per 128x128 block");
}

void check_expert(const rm::ExpertWeights& w, int hidden, int intermediate,
                  const std::string& name) {
  check_matrix(w.w1, intermediate, hidden, name + ".w1");
  check_matrix(w.w3, intermediate, hidden, name + ".w3");
  check_matrix(w.w2, hidden, intermediate, name + ".w2");
}

// The router and, where the scoring uses it, the correction bias.
void upload_router(const MoeShape& shape, const std::vector<uint16_t>& gate,
                   const std::vector<float>& bias, WeightUploader& up) {
  up.view().router = up.upload(gate);
  if (shape.scoring == MoeScoring::kSigmoidGrouped) up.view().correction_bias = up.upload(bias);
}

}  // namespace

DeviceMoeWeights upload_moe_weights(const MoeShape& shape, const rm::MoeWeights& weights,
                                    int rank, int world_size) {
  shape.validate();
  check_world(shape, rank, world_size);
  const size_t num_experts = size_t(shape.num_experts);
  EPX_CHECK(weights.gate.size() == num_experts * size_t(shape.hidden), InputError,
            "weights.gate.size()", weights.gate.size(), "num_experts * hidden");
  EPX_CHECK(weights.correction_bias.size() == num_experts ||
                shape.scoring != MoeScoring::kSigmoidGrouped,
            InputError, "weights.correction_bias.size()", weights.correction_bias.size(),
            "num_experts = " + std::to_string(num_experts));
  EPX_CHECK(weights.experts.size() == num_experts, InputError, "weights.experts.size()",
            weights.experts.size(), "num_experts = " + std::to_string(num_experts));
  EPX_CHECK(weights.shared.has_value() == shape.has_shared_expert(), InputError, "weights.shared",
            weights.shared ? "present" : "absent",
            "present iff shared_intermediate > 0 (" + std::to_string(shape.shared_intermediate) +
                ")");
  const int local = shape.num_experts / world_size;
  for (int i = 0; i < local; ++i) {
    const int e = rank * local + i;
    check_expert(weights.experts[size_t(e)], shape.hidden, shape.intermediate,
                 "weights.experts[" + std::to_string(e) + "]");
  }
  if (weights.shared)
    check_expert(*weights.shared, shape.hidden, shape.shared_intermediate, "weights.shared");

  DeviceMoeWeights out;
  WeightUploader up(out);
  upload_router(shape, weights.gate, weights.correction_bias, up);
  for (int i = 0; i < local; ++i)
    up.view().experts.push_back(up.upload(weights.experts[size_t(rank * local + i)]));
  if (weights.shared) up.view().shared = up.upload(*weights.shared);
  return out;
}

DeviceMoeWeights make_device_moe_weights(const MoeShape& shape, uint64_t seed, int rank,
                                         int world_size) {
  shape.validate();
  check_world(shape, rank, world_size);
  DeviceMoeWeights out;
  WeightUploader up(out);
  upload_router(shape, rm::make_gate_weight(shape, seed), rm::make_correction_bias(shape, seed),
                up);
  // This rank's experts, then the shared one: generated in batches on all cores (the slow part),
  // each batch uploaded in order.
  const int local = shape.num_experts / world_size;
  std::vector<int> ids;
  for (int i = 0; i < local; ++i) ids.push_back(rank * local + i);
  if (shape.has_shared_expert()) ids.push_back(rm::kSharedExpert);
  const size_t batch = std::max(1u, std::thread::hardware_concurrency());
  for (size_t b0 = 0; b0 < ids.size(); b0 += batch) {
    const size_t nb = std::min(batch, ids.size() - b0);
    std::vector<rm::ExpertWeights> gen(nb);
    std::vector<std::thread> workers;
    for (size_t i = 0; i < nb; ++i) {
      workers.emplace_back(
          [&, i] { gen[i] = rm::make_expert_weights(shape, seed, ids[b0 + i]); });
    }
    for (auto& w : workers) w.join();
    for (size_t i = 0; i < nb; ++i) {
      if (ids[b0 + i] == rm::kSharedExpert) {
        up.view().shared = up.upload(gen[i]);
      } else {
        up.view().experts.push_back(up.upload(gen[i]));
      }
    }
  }
  return out;
}

}  // namespace epx::testing
