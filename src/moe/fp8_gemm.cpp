// cuBLASLt block-scaled fp8 GEMM (see fp8_gemm.hpp for the operand mapping and
// scale layouts).

#include "moe/fp8_gemm.hpp"

#include <cublasLt.h>

#include <string>

#include "epx/cuda_check.hpp"
#include "moe/kernels.hpp"
#include "epx/error.hpp"

// Throws CudaError with the call text and cuBLASLt's status name.
#define EPX_CUBLASLT_CHECK(call)                                                     \
  do {                                                                               \
    cublasStatus_t epx_st_ = (call);                                                 \
    if (epx_st_ != CUBLAS_STATUS_SUCCESS) {                                          \
      throw ::epx::CudaError(::epx::detail::located(                                 \
          std::string(#call) + " failed: " + cublasLtGetStatusName(epx_st_) + " (" + \
              cublasLtGetStatusString(epx_st_) + ")",                                \
          __FILE__, __LINE__));                                                      \
    }                                                                                \
  } while (0)

namespace epx::moe {
namespace {

cublasLtHandle_t lt(void* h) { return static_cast<cublasLtHandle_t>(h); }

std::string shape_text(int m, int n, int k, GemmOut out) {
  std::string s =
      "M " + std::to_string(m) + ", N " + std::to_string(n) + ", K " + std::to_string(k) + ", D ";
  s += out == GemmOut::kBF16 ? "bf16" : "f32";
  return s;
}

}  // namespace

std::string to_string(const Fp8ScaleLayouts& l) {
  std::string s = l.act == ActScaleOrder::kBlockMajor ? "block_major" : "row_major";
  s += l.weight == WeightScaleOrder::kRowMajor ? ",row_major" : ",transposed";
  return s;
}

std::vector<float> weight_scales_for_gemm(WeightScaleOrder o, const std::vector<float>& ref_scales,
                                          int rows, int cols) {
  const int br = rows / 128;
  const int bc = cols / 128;
  EPX_CHECK(ref_scales.size() == size_t(br) * size_t(bc), InputError, "ref_scales.size()",
            ref_scales.size(), "(rows / 128) * (cols / 128)");
  if (o == WeightScaleOrder::kRowMajor) return ref_scales;
  std::vector<float> t(ref_scales.size());
  for (int i = 0; i < br; ++i) {
    for (int j = 0; j < bc; ++j) t[size_t(j) * br + i] = ref_scales[size_t(i) * bc + j];
  }
  return t;
}

const char* to_string(GemmOrder o) {
  return o == GemmOrder::kWeightsFirst ? "weights_first" : "acts_first";
}

struct Fp8Gemm::Plan {
  GemmOrder order = GemmOrder::kWeightsFirst;
  int ld_d = 0;  // leading dimension of cuBLAS's D
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr;
  cublasLtMatrixLayout_t b = nullptr;
  cublasLtMatrixLayout_t d = nullptr;  // also C
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
  // cuBLAS's A and B scale pointers for this order.
  void set_scales(const Fp8GemmArgs& g) const {
    const float* sa = order == GemmOrder::kWeightsFirst ? g.b_scales : g.a_scales;
    const float* sb = order == GemmOrder::kWeightsFirst ? g.a_scales : g.b_scales;
    EPX_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    EPX_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  }
};

Fp8Gemm::Fp8Gemm(Fp8ScaleLayouts layouts, size_t workspace_bytes, int sm_count_target)
    : layouts_(layouts), workspace_bytes_(workspace_bytes), sm_count_target_(sm_count_target) {
  EPX_CHECK(sm_count_target >= 0, InputError, "sm_count_target", sm_count_target,
            ">= 0 (0 = the whole device)");
  cublasLtHandle_t h = nullptr;
  EPX_CUBLASLT_CHECK(cublasLtCreate(&h));
  handle_ = h;
  if (workspace_bytes_ > 0) {
    const cudaError_t err = cudaMalloc(&workspace_, workspace_bytes_);
    if (err != cudaSuccess) {
      cublasLtDestroy(h);
      EPX_CUDA_CHECK(err);
    }
  }
}

Fp8Gemm::~Fp8Gemm() {
  plans_.clear();
  if (scratch_) cudaFree(scratch_);
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(lt(handle_));
}

std::unique_ptr<Fp8Gemm::Plan> Fp8Gemm::try_plan(const Fp8GemmArgs& g, GemmOrder order,
                                                 std::string* why) {
  const int m = g.m, n = g.n, k = g.k;
  auto p = std::make_unique<Plan>();
  p->order = order;
  const bool wf = order == GemmOrder::kWeightsFirst;
  EPX_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T;
  const cublasOperation_t op_n = CUBLAS_OP_N;
  EPX_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  EPX_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  // The weights carry 128x128 blocks, the activations 1x128 blocks along K.
  const int32_t blk = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const int32_t mode_a = wf ? blk : vec;
  const int32_t mode_b = wf ? vec : blk;
  EPX_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                    &mode_a, sizeof(mode_a)));
  EPX_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                    &mode_b, sizeof(mode_b)));
  p->set_scales(g);
  const cudaDataType_t d_type = g.out == GemmOut::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
  const int rows_a = wf ? n : m, rows_b = wf ? m : n;
  p->ld_d = wf ? n : (m + 15) / 16 * 16;
  EPX_CUBLASLT_CHECK(
      cublasLtMatrixLayoutCreate(&p->a, CUDA_R_8F_E4M3, uint64_t(k), uint64_t(rows_a), k));
  EPX_CUBLASLT_CHECK(
      cublasLtMatrixLayoutCreate(&p->b, CUDA_R_8F_E4M3, uint64_t(k), uint64_t(rows_b), k));
  EPX_CUBLASLT_CHECK(
      cublasLtMatrixLayoutCreate(&p->d, d_type, uint64_t(rows_a), uint64_t(rows_b), p->ld_d));

  if (sm_count_target_ > 0) {
    const int32_t sms = sm_count_target_;
    EPX_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(
        p->desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof(sms)));
  }
  // With an SM target, several candidates are asked for so that one without a thread-block
  // cluster can be preferred (below).
  constexpr int kCandidates = 16;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  const int asked = sm_count_target_ > 0 ? kCandidates : 1;
  int found = 0;
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  // With an SM target, first without split-K reduction (see the header), then with any.
  for (int attempt = sm_count_target_ > 0 ? 0 : 1; attempt < 2 && found == 0; ++attempt) {
    cublasLtMatmulPreference_t pref = nullptr;
    EPX_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = workspace_bytes_;
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                              sizeof(ws));
    if (st == CUBLAS_STATUS_SUCCESS && attempt == 0) {
      const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                &none, sizeof(none));
    }
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = cublasLtMatmulAlgoGetHeuristic(lt(handle_), p->desc, p->a, p->b, p->d, p->d, pref,
                                          asked, results, &found);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    if (attempt == 0 && st != CUBLAS_STATUS_SUCCESS) {  // the restricted ask failed: ask again
      st = CUBLAS_STATUS_SUCCESS;
      found = 0;
    }
  }
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    if (why != nullptr) {
      *why += std::string(*why == "" ? "" : "; ") + to_string(order) +
              (wf ? " (A weights BLK128x128_32F, B activations VEC128_32F)"
                  : " (A activations VEC128_32F, B weights BLK128x128_32F)") +
              ": " +
              (st != CUBLAS_STATUS_SUCCESS ? std::string(cublasLtGetStatusName(st))
                                           : std::string("no algorithm"));
    }
    return nullptr;
  }
  // A cluster of N blocks launches only when N SMs of one GPC are free at once; beside spinning
  // kernels of other ranks that can wait for a whole timeout. With an SM target, take the
  // heuristic's best candidate of cluster shape 1x1x1, else ask for the best one with that
  // shape, kept where cuBLASLt accepts it within the workspace.
  const auto flat = [](const cublasLtMatmulAlgo_t& algo) {
    uint16_t cluster = 0;
    size_t written = 0;
    return cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
                                                &cluster, sizeof(cluster),
                                                &written) == CUBLAS_STATUS_SUCCESS &&
           cluster == CUBLASLT_CLUSTER_SHAPE_1x1x1;
  };
  int pick = 0;
  if (sm_count_target_ > 0) {
    while (pick < found &&
           !(results[pick].state == CUBLAS_STATUS_SUCCESS && flat(results[pick].algo)))
      ++pick;
    if (pick == found) pick = 0;
  }
  cublasLtMatmulHeuristicResult_t result = results[pick];
  if (sm_count_target_ > 0 && !flat(result.algo)) {
    cublasLtMatmulAlgo_t algo = result.algo;
    cublasLtMatmulHeuristicResult_t checked{};
    const uint16_t one = CUBLASLT_CLUSTER_SHAPE_1x1x1;
    if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &one,
                                             sizeof(one)) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulAlgoCheck(lt(handle_), p->desc, p->a, p->b, p->d, p->d, &algo, &checked) ==
            CUBLAS_STATUS_SUCCESS &&
        checked.workspaceSize <= workspace_bytes_) {
      result = checked;
      result.algo = algo;
    }
  }
  p->algo = result.algo;
  return p;
}

Fp8Gemm::Plan& Fp8Gemm::plan(const Fp8GemmArgs& g) {
  const auto key = std::make_tuple(g.m, g.n, g.k, static_cast<int>(g.out));
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;
  std::vector<GemmOrder> orders = {GemmOrder::kWeightsFirst, GemmOrder::kActsFirst};
  if (only_order_) orders = {*only_order_};
  std::string why;
  for (GemmOrder o : orders) {
    if (auto p = try_plan(g, o, &why)) return *plans_.emplace(key, std::move(p)).first->second;
  }
  throw CudaError("cublasLtMatmulAlgoGetHeuristic (" + shape_text(g.m, g.n, g.k, g.out) +
                  ", e4m3 TN) refused every operand order: " + why);
}

bool Fp8Gemm::supports(int m, int n, int k, GemmOut out) {
  // Any non-null device address stands in for the scale tensors (the heuristic reads none).
  const float* dummy = static_cast<const float*>(workspace_);
  Fp8GemmArgs g{.m = m, .n = n, .k = k, .a_scales = dummy, .b_scales = dummy, .out = out};
  try {
    plan(g);
    return true;
  } catch (const CudaError&) {
    return false;
  }
}

GemmOrder Fp8Gemm::order_for(const Fp8GemmArgs& g) { return plan(g).order; }

void Fp8Gemm::run(const Fp8GemmArgs& g, cudaStream_t stream) {
  EPX_CHECK(g.m >= 0, InputError, "m", g.m, ">= 0");
  EPX_CHECK(g.n > 0 && g.n % 128 == 0, InputError, "n", g.n, "a positive multiple of 128");
  // K / 128 a multiple of 4: the weight scale rows are then 16-byte aligned
  // whether or not cuBLASLt pads their leading dimension.
  EPX_CHECK(g.k > 0 && g.k % 512 == 0, InputError, "k", g.k,
            "a positive multiple of 512 (K / 128 blocks a multiple of 4)");
  if (g.m == 0) return;
  EPX_CHECK(g.a && g.a_scales && g.b && g.b_scales && g.d, InputError, "fp8 GEMM pointers",
            "a null pointer", "all of a, a_scales, b, b_scales, d set");
  if (plans_.find(std::make_tuple(g.m, g.n, g.k, static_cast<int>(g.out))) == plans_.end()) {
    // The heuristic is not to be asked while a graph is being captured: shapes are planned (and
    // their kernels loaded) by an eager run first, as MoeLayer's warm-up does.
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    EPX_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    EPX_CHECK(capturing == cudaStreamCaptureStatusNone, StateError, "fp8 GEMM shape",
              shape_text(g.m, g.n, g.k, g.out) + " first seen under stream capture",
              "a shape run eagerly once before capture");
  }
  Plan& p = plan(g);
  p.set_scales(g);
  const float alpha = 1.0f;
  const float beta = 0.0f;
  const bool wf = p.order == GemmOrder::kWeightsFirst;
  const size_t elem = g.out == GemmOut::kBF16 ? 2 : 4;
  void* d = g.d;
  if (!wf) {
    const size_t need = size_t(p.ld_d) * size_t(g.n) * elem;
    if (need > scratch_bytes_) {
      // Under capture the allocation would become a graph node, which a conditional node's body
      // (MoeLayer's captured expert stage) may not hold: the caller reserves it eagerly first.
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      EPX_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
      EPX_CHECK(capturing == cudaStreamCaptureStatusNone, StateError, "acts-first GEMM scratch",
                std::to_string(need) + " bytes needed under stream capture",
                std::to_string(scratch_bytes_) + " bytes reserved (run this shape eagerly once)");
      // Grows to the largest M seen so far, stream-ordered: cudaFree / cudaMalloc would wait
      // for the whole device, including in-process peers' kernels waiting for this rank.
      if (scratch_) EPX_CUDA_CHECK(cudaFreeAsync(scratch_, stream));
      scratch_ = nullptr;
      scratch_bytes_ = 0;
      EPX_CUDA_CHECK(cudaMallocAsync(&scratch_, need, stream));
      scratch_bytes_ = need;
    }
    d = scratch_;
  }
  const void* a = wf ? static_cast<const void*>(g.b) : g.a;
  const void* b = wf ? static_cast<const void*>(g.a) : g.b;
  EPX_CUBLASLT_CHECK(cublasLtMatmul(lt(handle_), p.desc, &alpha, a, p.a, b, p.b, &beta, d, p.d, d,
                                    p.d, &p.algo, workspace_, workspace_bytes_, stream));
  if (!wf) launch_transpose(d, p.ld_d, g.m, g.n, int(elem), g.d, stream);
}

}  // namespace epx::moe
