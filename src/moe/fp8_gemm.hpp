#pragma once
// Block-scaled fp8 GEMM through cuBLASLt (no hand-written GEMM).
//
//   D[M][N] = dequant(A)[M][K] . dequant(B)[N][K]^T     (moe_ref's fp8_gemm_nt)
//
// A: activations, fp8 e4m3 [M][K] row-major, one f32 scale per 1x128 block along K.
// B: weights, fp8 e4m3 [N][K] row-major, one f32 scale per 128x128 block.
// D: [M][N] row-major, bf16 or f32.
// N is a multiple of 128 and K of 512 (K/128 a multiple of 4: the weight scale rows are 16-byte
// aligned whether or not cuBLASLt pads them). M >= 1 is any size; the scale buffer of A is laid
// out for M_pad = padded_rows(M) rows, and callers run the GEMM at M_pad (row_buckets.hpp).
//
// Mapping onto cuBLASLt (column-major, TN, the only fp8 order Hopper accepts), two operand
// orders (GemmOrder); the first one cuBLASLt offers an algorithm for is used and remembered:
//   kWeightsFirst (D comes out row-major [M][N] directly):
//     cuBLAS A := the weights,     stored K x N column-major (ld K), op T, BLK128x128_32F
//     cuBLAS B := the activations, stored K x M column-major (ld K), op N, VEC128_32F
//     cuBLAS D := N x M column-major (ld N) = our row-major [M][N]
//   kActsFirst (the order of NVIDIA's block-scaled fp8 sample):
//     cuBLAS A := the activations, stored K x M column-major (ld K), op T, VEC128_32F
//     cuBLAS B := the weights,     stored K x N column-major (ld K), op N, BLK128x128_32F
//     cuBLAS D := M x N column-major (ld round_up(M, 16)) in a scratch buffer, then transposed
//                 into our row-major [M][N] (launch_transpose)
// The scale pointers are set before the heuristic is asked (block-scaled modes are refused
// without them). Tests that compare the two orders restrict a GEMM to one (set_operand_order).
//
// Scale tensor layouts. cuBLASLt documents block scales relative to its column-major view;
// which of two plausible orders it reads is settled on a GPU (the test below; the defaults pass it
// on an H200), so both are implemented and chosen by Fp8ScaleLayouts (defaults below):
//   activations (VEC128_32F):
//     kBlockMajor  [K/128][M_pad] f32, scale of (row m, block b) at b * M_pad + m  (default:
//                  row index fastest, "outer-dimension major", as grouped fp8 GEMMs read)
//     kRowMajor    [M_pad][K/128] f32, moe_ref's quantize_fp8 order (block fastest)
//   weights (BLK128x128_32F):
//     kRowMajor    [N/128][K/128] f32, moe_ref's Fp8BlockMatrix::scales and a DeepSeek-V3/R1
//                  checkpoint's weight_scale_inv as they are (default: the column-major
//                  (K/128) x (N/128) grid of cuBLAS's stored A); MoeLayer relies on it
//     kTransposed  [K/128][N/128] f32 (weight_scales_for_gemm transposes on the host)
// tests/gpu/test_moe.cpp (MoeFp8Gemm.ScaleLayoutProbe) runs all four combinations in both operand
// orders against moe_ref's fp8_gemm_nt and prints which one matches.
//
// Which algorithm cuBLASLt picked for each GEMM (tile, split-K, reduction scheme, stages,
// cluster shape): cuBLASLt's own log, CUBLASLT_LOG_LEVEL=2 (every matmul it launches) or 4 (also
// the heuristic's status), to stdout or CUBLASLT_LOG_FILE.
//
// Threading: one Fp8Gemm per rank; not thread-safe. Host-only; calls are asynchronous on
// `stream`. The workspace and handle are created once; a matmul descriptor and the heuristic's
// algorithm are cached per (M, N, K, out dtype).

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "moe/row_buckets.hpp"  // padded_rows: M_pad, a multiple of 16

#if defined(__CUDACC__)
#define EPX_MOE_HOST_DEVICE __host__ __device__
#else
#define EPX_MOE_HOST_DEVICE
#endif

namespace epx::moe {

enum class ActScaleOrder { kBlockMajor, kRowMajor };
enum class WeightScaleOrder { kRowMajor, kTransposed };
enum class GemmOut { kBF16, kF32 };
enum class GemmOrder { kWeightsFirst, kActsFirst };
const char* to_string(GemmOrder o);

struct Fp8ScaleLayouts {
  ActScaleOrder act = ActScaleOrder::kBlockMajor;
  WeightScaleOrder weight = WeightScaleOrder::kRowMajor;
};
std::string to_string(const Fp8ScaleLayouts& l);


// Index of the activation scale (row m, block b) in a scale buffer for m_pad
// rows.
EPX_MOE_HOST_DEVICE inline int64_t act_scale_index(ActScaleOrder o, int m, int b, int m_pad,
                                                   int num_blocks) {
  return o == ActScaleOrder::kBlockMajor ? int64_t(b) * m_pad + m : int64_t(m) * num_blocks + b;
}

// Host: moe_ref's [rows/128][cols/128] row-major weight scales -> the order
// cuBLASLt reads.
std::vector<float> weight_scales_for_gemm(WeightScaleOrder o, const std::vector<float>& ref_scales,
                                          int rows, int cols);

struct Fp8GemmArgs {
  int m = 0;                        // rows of A and D (tokens); 0 = nothing to do
  int n = 0;                        // rows of B, cols of D; multiple of 128
  int k = 0;                        // multiple of 128
  const uint8_t* a = nullptr;       // [m][k] fp8 e4m3, row-major (ld k)
  const float* a_scales = nullptr;  // padded_rows(m) rows, in layouts.act order
  const uint8_t* b = nullptr;       // [n][k] fp8 e4m3, row-major
  const float* b_scales = nullptr;  // in layouts.weight order
  void* d = nullptr;                // [m][n] row-major, bf16 or f32 (ld n)
  GemmOut out = GemmOut::kF32;
};

class Fp8Gemm {
 public:
  // sm_count_target > 0: the multiprocessors this GEMM may count on while kernels of other streams
  // hold the rest (ranks sharing a GPU, whose dispatch/combine blocks spin until this rank
  // arrives). cuBLASLt then plans for that many SMs (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET) and,
  // where it offers one, picks an algorithm without split-K reduction, whose blocks could wait on
  // blocks that cannot be resident, and the best candidate without a thread-block cluster (a
  // cluster needs several SMs of one GPC free at once). 0: the whole device.
  explicit Fp8Gemm(Fp8ScaleLayouts layouts = {}, size_t workspace_bytes = size_t(32) << 20, int sm_count_target = 0);
  ~Fp8Gemm();
  Fp8Gemm(const Fp8Gemm&) = delete;
  Fp8Gemm& operator=(const Fp8Gemm&) = delete;

  const Fp8ScaleLayouts& layouts() const { return layouts_; }

  // Enqueues D = A . B^T on `stream`. Throws InputError for bad shapes/pointers
  // and CudaError naming the cuBLASLt status (and the shape) when cuBLASLt
  // refuses or has no algorithm.
  void run(const Fp8GemmArgs& args, cudaStream_t stream);

  // Whether cuBLASLt offers an algorithm, in either operand order, for this shape and output
  // type (no launch).
  bool supports(int m, int n, int k, GemmOut out);

  // The operand order used for this shape (planning it if needed; throws like run()).
  GemmOrder order_for(const Fp8GemmArgs& args);

  // Shapes planned from now on try only `order` (tests comparing the two); nullopt, the default:
  // weights-first, else acts-first, whichever cuBLASLt offers an algorithm for first.
  void set_operand_order(std::optional<GemmOrder> order) { only_order_ = order; }

 private:
  struct Plan;
  Plan& plan(const Fp8GemmArgs& g);  // cached; throws naming every order's refusal
  std::unique_ptr<Plan> try_plan(const Fp8GemmArgs& g, GemmOrder order, std::string* why);

  Fp8ScaleLayouts layouts_;
  void* handle_ = nullptr;  // cublasLtHandle_t
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  int sm_count_target_ = 0;
  std::optional<GemmOrder> only_order_;
  void* scratch_ = nullptr;  // kActsFirst: the column-major D before its transpose
  size_t scratch_bytes_ = 0;
  std::map<std::tuple<int, int, int, int>, std::unique_ptr<Plan>> plans_;
};

}  // namespace epx::moe
