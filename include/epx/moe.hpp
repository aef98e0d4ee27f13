#pragma once
// MoeLayer: one expert-parallel MoE layer on one rank, a consumer of All2All (DESIGN §2, §4):
//   router (bf16 gating GEMM + DeepSeek-V3/R1 sigmoid-grouped or softmax top-k)
//   -> dispatch (any backend, either output layout, bf16 or fp8 on the wire)
//   -> per local expert: fp8 SwiGLU MLP (cuBLASLt block-scaled fp8 GEMMs; fp8 e4m3 weights
//      with 128x128 block scales, activations fp8 with 1x128 scales)
//   -> router weights applied before combine (token-major partials) or by combine (expert-major)
//   -> combine -> + shared expert on the rank's own tokens.
// Numerics are those of the CPU reference (src/reference/moe_ref.hpp). The weights are the
// caller's, in device memory laid out as a DeepSeek-V3/R1 checkpoint stores them (MoeWeights
// below), read in place: the layer copies none of them. Nothing is downloaded.
//
// Host synchronisation, eager (stream not capturing): forward() synchronises
// `stream` once per chunk after dispatch to read the received row count and the
// rows' expert ids (token-major), or the per-expert counts (expert-major), and
// launches each local expert's GEMMs at its exact (bucketed) row count. Cost: one
// stream sync + small copies per chunk.
//
// CUDA graph capture: when `stream` is capturing (cudaStreamBeginCapture; use
// cudaStreamCaptureModeThreadLocal when ranks capture from their own threads), forward()
// records the whole layer without any host synchronisation, allocation or copy
// from the host, and the graph replays with whatever the inputs then hold:
//   router, shared expert, quantisation, dispatch, combine: captured as eager;
//   expert stage: the row counts stay on the device. Token-major rows are grouped
//   by local expert by one kernel (same lists and order as the eager path). Each
//   local expert gets a conditional SWITCH node (CUDA 12.8+) whose body i runs
//   its quantise + GEMM w1 + GEMM w3 + SiLU-quantise + GEMM w2 (+ a copy of the
//   rows into place) at M = the i-th row bucket (row_buckets.hpp); a small kernel
//   picks each expert's body from its count (body 0: no rows, nothing runs); with
//   set_capture_experts(kAllRows) each expert runs its largest body, no conditional nodes.
//   With SWITCH nodes the GEMMs run at the same M as eagerly (padded_rows(count)), so a
//   replay gives the eager forward's results; all-rows GEMMs run at a larger M (results
//   within rounding of the eager ones, the extra rows computed and dropped).
// Cost (SWITCH): the GEMMs are those of the eager path; the graph holds local experts x
// buckets x 6-9 nodes per chunk, buckets = the distinct padded_rows values up to
// the most rows an expert can receive (world_size x tokens per rank, at most the
// capacity: 28 buckets at 1024 rows), so capture and instantiation take ~ms per
// layer and the executable graph some MB. set_capture_token_bound() shrinks it.
// Rules: capture every rank's forward (each on its own stream, the same number of
// chunks; capture only records, nothing runs and no rank waits); replays run
// dispatch and combine, so they must run on all ranks together like any eager
// forward (ranks may mix replays with eager forwards, all2all.hpp). Instantiating,
// uploading and destroying a graph may wait for the whole device: on a GPU that
// ranks share, no rank's kernels may spin on this rank meanwhile (line the ranks up
// after every rank's cudaGraphUpload, before the first replay). A replay uses
// the pointers and token counts captured: copy new inputs into the captured x. The
// layer's scratch is shared by its graphs and eager calls: run them in one stream
// order. Construct the layer (its warm-up reserves every GEMM's scratch) and make
// one eager forward or none before capturing; nothing else is required.
//
// In-process worlds (ranks spinning on each other on one GPU): construct every
// rank's MoeLayer before any rank's first forward(), and run with
// CUDA_MODULE_LOADING=EAGER. A kernel loaded while peers spin waits for them,
// and they wait for this rank: the layer preloads its own kernels, and its
// constructor launches every cuBLASLt GEMM shape forward() can use (GEMM rows
// come from a few buckets, src/moe/row_buckets.hpp) so that none loads later.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "epx/all2all.hpp"
#include "epx/config.hpp"
#include "epx/moe_shape.hpp"

namespace epx {

// How forward() records the expert stage under capture (set_capture_experts).
enum class CaptureExperts {
  kSwitch,   // one SWITCH node per local expert picks its GEMMs' row bucket from the device
             // count: the eager path's GEMMs (empty experts run nothing)
  kAllRows,  // no conditional nodes: every local expert's GEMMs at the most rows it can receive
             // under the capture bound (rows beyond its count computed and dropped)
};

// ---- weights: device memory the caller owns, in a DeepSeek-V3/R1 checkpoint's layout ----------

// An fp8 e4m3 matrix with one f32 scale per 128x128 block, as the checkpoint stores a linear
// layer (`weight`, `weight_scale_inv`): element (r, c) is
// fp8(weight[r][c]) * scale_inv[r / 128][c / 128].
struct Fp8BlockWeight {
  const void* weight = nullptr;      // [rows][cols] fp8 e4m3 (torch.float8_e4m3fn), row-major
  const float* scale_inv = nullptr;  // [rows / 128][cols / 128] f32, row-major
};

// One SwiGLU expert: out = down(silu(gate(x)) * up(x)).
struct MoeExpertWeights {
  Fp8BlockWeight gate;  // w1, gate_proj: [I][H]
  Fp8BlockWeight up;    // w3, up_proj:   [I][H]
  Fp8BlockWeight down;  // w2, down_proj: [H][I]
};

// The weights of one rank's layer: a view of device memory on the device that is current when
// the layer is constructed (or managed memory). The names in the comments are those of a
// DeepSeek-V3/R1 checkpoint's MoE layer (model.layers.N.mlp.*). Each matrix may be a tensor of
// its own or a slice of a larger one (an engine's stacked [E][2I][H] gate+up tensor: gate at
// rows [0, I), up at rows [I, 2I) of expert e's slice, their scales likewise).
// Alignment: every fp8 matrix, every scale tensor and the router weight on 16 bytes (cuBLASLt's
// fp8 operands and block scales; any cudaMalloc or torch allocation is), the bias on 4.
// Lifetime: the layer keeps the pointers and reads the memory on every forward and graph replay;
// it never copies, writes or frees it. Keep it allocated until the layer is destroyed and its
// last forward or replay has finished. Weights written in place between forwards (ordered with
// them on the stream) are what the next forward reads.
struct MoeWeights {
  const void* router = nullptr;            // gate.weight: [E][H] bf16, row-major
  const float* correction_bias = nullptr;  // gate.e_score_correction_bias: [E] f32
                                           // (kSigmoidGrouped; null for kSoftmax, which has none)
  // experts.{id}: [E / world_size] entries, entry i is global expert rank * E / world_size + i.
  std::vector<MoeExpertWeights> experts;
  MoeExpertWeights shared;  // shared_experts, I = shared_intermediate; all null when that is 0
};

// Device pointers the caller owns, filled by forward() with the routing of all
// N tokens.
struct MoeRoutingOut {
  int32_t* topk_ids = nullptr;    // [N, topk] int32
  float* topk_weights = nullptr;  // [N, topk] f32
};

// Two All2All objects of one rank and the engines' choice between them: a high_throughput one
// for prefill-sized steps (no caller chunking, memory that does not grow with the tokens) and a
// low_latency one for decode. A step goes through `prefill` when its largest per-rank token count
// exceeds `threshold`. Both must fit the layer (MoeLayer::forward); `prefill` may hold more tokens
// per call than `decode`.
struct All2AllChoice {
  All2All* decode = nullptr;
  All2All* prefill = nullptr;
  int threshold = 0;
  All2All& pick(int step_max_tokens) const {
    return step_max_tokens > threshold ? *prefill : *decode;
  }
};

class MoeLayer {
 public:
  // hidden, intermediate and shared_intermediate must be multiples of 512 (fp8
  // GEMMs with K/128 a multiple of 4; DeepSeek-R1's 7168 and 2048 are),
  // ConfigError otherwise. `ep` is the All2All's config of this rank (rank,
  // world size, max_tokens_per_rank, hidden, experts, topk must agree with
  // `shape`; ConfigError names the first mismatch). `weights`: this rank's (MoeWeights above;
  // the view is copied, the memory it points to is not); InputError names the first field
  // (e.g. "weights.experts[3].up.scale_inv") that is null, misaligned or not memory of the
  // current device, an expert count other than E / world_size, a correction bias missing for
  // kSigmoidGrouped or given for kSoftmax, or shared-expert pointers for a shape without one.
  // Allocates the layer's scratch on the current device, creates the cuBLASLt handle, loads
  // the layer's kernels and runs every GEMM shape once on the weights (see all2all.hpp on lazy
  // loading).
  // `gemm_sms`: the multiprocessors the layer's GEMMs may count on. Ranks that share a GPU pass
  // their world's sm_budget(): a peer's dispatch or combine blocks spin on the SMs it holds until
  // this rank arrives, so a GEMM planned for the whole device could wait for blocks that never
  // become resident. 0 (one GPU per rank): the whole device. InputError when negative.
  MoeLayer(const MoeShape& shape, const MoeWeights& weights, const EpConfig& ep,
           int gemm_sms = 0);
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  const MoeShape& shape() const;

  // y[N, H] bf16 = MoE(x[N, H] bf16) on `stream`. N >= 0 (may exceed the All2All's
  // max_tokens_per_rank: the tokens go in chunks of that many). Every
  // rank must run the same number of chunks: num_chunks = 0 means ceil(N /
  // max_tokens_per_rank) (at least 1), which is only right when all ranks' N
  // give the same count; otherwise pass the maximum over ranks (>= this rank's
  // need, InputError otherwise). `a2a` is this rank's All2All, created with the
  // `ep` above or with a smaller max_tokens_per_rank (every other field the same: a layer built
  // for the largest calls serves a decode All2All too); the layer uses its results'
  // combine buffers for its expert outputs.
  // `routing`, when given, receives the router's output. Synchronises `stream`
  // once per chunk when eager; when `stream` is capturing, records the layer
  // without synchronising (see above). x and y must not overlap. Throws InputError for
  // bad arguments, CudaError for CUDA / cuBLASLt failures, and whatever the
  // All2All throws.
  void forward(const void* x, int num_tokens, void* y, All2All& a2a, cudaStream_t stream,
               int num_chunks = 0, const MoeRoutingOut* routing = nullptr);

  // forward() through choice.pick(step_max_tokens), in ceil(step_max_tokens / its
  // max_tokens_per_rank) chunks. `step_max_tokens`: the largest num_tokens of any rank in this
  // step, the same on every rank (a scheduler knows it), so that every rank picks the same
  // All2All and runs the same number of chunks; InputError when below num_tokens.
  void forward(const void* x, int num_tokens, void* y, const All2AllChoice& choice,
               int step_max_tokens, cudaStream_t stream, const MoeRoutingOut* routing = nullptr);

  // One micro-batch of forward_pair(): y[num_tokens, H] bf16 = MoE(x[num_tokens, H] bf16).
  struct MicroBatch {
    const void* x = nullptr;
    int num_tokens = 0;  // 0 .. max_tokens_per_rank (one chunk)
    void* y = nullptr;
  };

  // Two micro-batches of one step with each one's communication waiting under the other's
  // compute (dual-batch overlap), on one stream, with the halves of dispatch and combine:
  //   route a, dispatch_send a | route b, shared expert a        | dispatch_recv a
  //   dispatch_send b          | expert stage a                  | dispatch_recv b
  //   combine_send a           | expert stage b                  | combine_recv a
  //   combine_send b           | shared a added, shared expert b | combine_recv b
  // so that a rank reaches each receive half one stage of work after its peers could have sent.
  // Results are those of forward() on each micro-batch. `a2a` must have rounds_in_flight = 2
  // (b is dispatched before a is combined; InputError otherwise); each micro-batch holds at most
  // max_tokens_per_rank tokens (under capture: the set_capture_token_bound() bound), 0 is legal.
  // Every rank calls it for the same steps (its calls are collective, as forward()'s). Eager:
  // synchronises `stream` once per micro-batch for the row counts; under capture, records
  // everything as forward() does (the capture split of set_capture_split() is not used).
  void forward_pair(const MicroBatch& a, const MicroBatch& b, All2All& a2a, cudaStream_t stream);

  // For graphs captured from now on: every rank's chunks hold at most
  // `max_tokens_per_rank` tokens (0, the default: the EpConfig's
  // max_tokens_per_rank), so an expert receives at most world_size x that many
  // rows and the SWITCH bodies stop at that row bucket (a decode graph of 4
  // tokens per rank on 8 ranks needs 2 buckets instead of 28). forward() under
  // capture throws InputError for a chunk above the bound; a replay in which some
  // rank sends more than the bound (its graph, or an eager call, was made with a
  // larger one) leaves the overflowing experts' outputs unwritten: wrong results.
  // InputError outside [0, max_tokens_per_rank]. Eager forwards ignore it.
  // Call it (0 is fine) before capturing a token-major forward: it allocates the
  // captured path's staging buffer ([rows][H], once); a capture without it is a
  // StateError.
  void set_capture_token_bound(int max_tokens_per_rank);

  // For captures from now on: `split`, when set, is called on the host as forward() records each
  // chunk's expert stage, once just before its first node and once just after its last, with the
  // capturing stream; the caller may end the capture there and begin the next one on the same
  // stream (cudaStreamEndCapture + cudaStreamBeginCapture), recording its own work between the
  // stages if it likes (as an engine overlapping another micro-batch would): dispatch, expert
  // stage and combine then land in graphs of their own. The stream must be capturing again when
  // `split` returns (StateError otherwise). Replay the pieces in capture order on one stream.
  // Measured on an H200 (8 in-process ranks, DeepSeek-R1 shape, 2 layers): the decode step costs
  // the same split (5 graphs) or whole (16.97 vs 16.83 ms). An empty function (the default)
  // records one graph. Eager forwards never call it.
  void set_capture_split(std::function<void(cudaStream_t)> split);

  // For captures from now on: how the expert stage is recorded (default kSwitch). kAllRows
  // trades GEMM work (every local expert at world_size x the token bound rows, at most the
  // capacity, rounded to a row bucket) for a graph without conditional nodes. Measured on an H200 with in-process ranks on
  // one GPU (32 hardware queues): graphs with SWITCH nodes keep a peer's graph from starting from
  // 20 ranks, whether or not they are split (set_capture_split), and did once at 8 ranks; graphs
  // without them replayed every time, at 8 and 32 ranks.
  void set_capture_experts(CaptureExperts mode);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace epx
