#pragma once
// MoeLayer: one expert-parallel MoE layer on one rank, a consumer of All2All (DESIGN §2, §4):
//   router (bf16 gating GEMM + DeepSeek-V3/R1 sigmoid-grouped or softmax top-k)
//   -> dispatch (any backend, either output layout, bf16 or fp8 on the wire)
//   -> per local expert: fp8 SwiGLU MLP (cuBLASLt block-scaled fp8 GEMMs; fp8 e4m3 weights
//      with 128x128 block scales, activations fp8 with 1x128 scales)
//   -> router weights applied before combine (token-major partials) or by combine (expert-major)
//   -> combine -> + shared expert on the rank's own tokens.
// Numerics and weights are those of src/reference/moe_ref.hpp: the weights of
// this rank's local experts, the gate, the correction bias and the shared
// expert are generated on the host from the seed (the same bytes as
// ref::moe::make_moe_weights) and uploaded once. Nothing is downloaded.
//
// Host synchronisation (the current, simplest-correct version): forward()
// synchronises `stream` once per chunk after dispatch to read the received row
// count and the rows' expert ids (token-major), or the per-expert counts
// (expert-major), and launches each local expert's GEMMs at its exact row
// count. Cost: one stream sync + two small device-to-host copies + one small
// host-to-device copy per chunk; forward() cannot be captured in a CUDA graph.
// Removing it (device-side counts, capacity-bounded GEMMs) is future work.
//
// In-process worlds (ranks spinning on each other on one GPU): construct every
// rank's MoeLayer before any rank's first forward(), and run with
// CUDA_MODULE_LOADING=EAGER. A kernel loaded while peers spin waits for them,
// and they wait for this rank: the layer preloads its own kernels, and its
// constructor launches every cuBLASLt GEMM shape forward() can use (GEMM rows
// come from a few buckets, src/moe/row_buckets.hpp) so that none loads later.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "epx/all2all.hpp"
#include "epx/config.hpp"

namespace epx {

enum class MoeScoring {
  kSigmoidGrouped,  // DeepSeek-V3/R1: sigmoid + correction bias, best groups, top-k, scaled
  kSoftmax,         // plain softmax top-k, weights renormalised to sum 1
};

// Same fields and meaning as ref::moe::MoeShape (src/reference/moe_ref.hpp).
struct MoeShape {
  int hidden = 7168;
  int intermediate = 2048;  // routed experts' I
  int num_experts = 256;
  int topk = 8;
  int num_groups = 8;
  int topk_groups = 4;
  float routed_scaling = 2.5f;
  int shared_intermediate = 2048;  // 0 = no shared expert
  MoeScoring scoring = MoeScoring::kSigmoidGrouped;

  static MoeShape deepseek_r1() { return MoeShape{}; }
};

// Device pointers the caller owns, filled by forward() with the routing of all
// N tokens.
struct MoeRoutingOut {
  int32_t* topk_ids = nullptr;    // [N, topk] int32
  float* topk_weights = nullptr;  // [N, topk] f32
};

class MoeLayer {
 public:
  // hidden, intermediate and shared_intermediate must be multiples of 512 (fp8
  // GEMMs with K/128 a multiple of 4; DeepSeek-R1's 7168 and 2048 are),
  // ConfigError otherwise. `ep` is the All2All's config of this rank (rank,
  // world size, max_tokens_per_rank, hidden, experts, topk must agree with
  // `shape`; ConfigError names the first mismatch). Allocates device memory on
  // the current device, generates and uploads the weights (seconds for the
  // DeepSeek-R1 shape: host generation is single-threaded), creates the
  // cuBLASLt handle and loads the layer's kernels (see all2all.hpp on lazy
  // loading).
  MoeLayer(const MoeShape& shape, uint64_t seed, const EpConfig& ep);
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  const MoeShape& shape() const;

  // y[N, H] bf16 = MoE(x[N, H] bf16) on `stream`. N >= 0 (may exceed
  // max_tokens_per_rank: the tokens go in chunks of max_tokens_per_rank). Every
  // rank must run the same number of chunks: num_chunks = 0 means ceil(N /
  // max_tokens_per_rank) (at least 1), which is only right when all ranks' N
  // give the same count; otherwise pass the maximum over ranks (>= this rank's
  // need, InputError otherwise). `a2a` is this rank's All2All, created with the
  // `ep` above; the layer uses combine_buffer() for its expert outputs.
  // `routing`, when given, receives the router's output. Synchronises `stream`
  // once per chunk (see above). x and y must not overlap. Throws InputError for
  // bad arguments, CudaError for CUDA / cuBLASLt failures, and whatever the
  // All2All throws.
  void forward(const void* x, int num_tokens, void* y, All2All& a2a, cudaStream_t stream,
               int num_chunks = 0, const MoeRoutingOut* routing = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace epx
