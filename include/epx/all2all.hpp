#pragma once
// All2All: dispatch and combine of one expert-parallel MoE layer, one object per rank.
//
// Call order per layer forward, on every rank: dispatch -> expert stage -> combine, each on the
// caller's stream (one stream per rank, or events that order a rank's calls). Both calls are
// asynchronous, never synchronise the host, and may be captured in a CUDA graph; ranks may mix
// graph replays with eager calls. All cross-call state lives on the device.
//
// Rounds in flight (EpConfig::rounds_in_flight = R, 1 or 2): a dispatch whose combine has not
// been called is "due"; up to R rounds may be due at once, each in its own buffer slot, so with
// R = 2 the dispatch of the next round (another micro-batch) may come before the combine of this
// one. combine() serves the oldest due round (with none due, the last one combined, again). A
// dispatch with R rounds already due abandons the oldest: its outputs are overwritten and its
// combine is no longer due. A round's outputs stay valid until the dispatch that reuses its slot
// (with R = 1: the next dispatch) on any rank. Slots follow from the sequence of calls alone, so
// every rank's sequence of dispatches and combines must be the same (a captured graph holds its
// calls' slots: replay it where the eager sequence would make the same calls); a round that one
// rank placed in another slot than its peers is reported as a PeerError, never read.
//
// Errors: host-side argument problems throw InputError immediately and nothing is launched;
// among them a pointer that is not device memory of the rank's own GPU (host memory, or another
// GPU's: named with the argument and both GPUs; managed memory is accepted).
// Every call leaves the calling thread's current CUDA device as it found it.
// Device-side problems (timeouts, peers that never arrive, expert ids outside [-1, E) or
// repeated in one token) are recorded in a device status word; poll(), synchronize() and the
// next dispatch() throw the matching TimeoutError / InputError once, and every later call throws
// StateError: recreate the object (the whole group, in an in-process world) to continue.
// combine() does not look at the status word, so a round whose dispatch saw bad ids (those
// tokens are sent nowhere) still completes on every rank and nobody waits in vain. After a
// timeout the kernels of this rank return at once, so graph replays cannot hang either.
//
// NaN and infinity are data, never errors: nothing scans for them and every backend treats them
// alike (the reference, src/reference, does the same bit for bit).
//   * bf16 and fp8 rows, their scales, the top-k weights and the partials travel as bytes.
//   * bf16 quantised to fp8 in dispatch, per 1x128 block: a NaN never becomes the block's amax
//     (the scale comes from the other values) and is sent as the e4m3 NaN 0x7F; a block holding
//     +-Inf gets the scale +Inf, its Inf values are sent as 0x7F and its finite values as +-0, so
//     the whole block dequantises to NaN (0 * Inf), as a saturating cast would lose it anyway.
//   * combine sums in f32 with IEEE rules (NaN + x = NaN, Inf + -Inf = NaN) and rounds once: a
//     non-finite partial makes that element of y NaN or +-Inf (bf16 NaN is 0x7FFF).
//
// Backend high_throughput (prefill-sized calls; between processes rows and partials flow through
// rings of fixed size, so its memory does not grow with max_tokens_per_rank; in an in-process
// group they go straight between the ranks' receive areas at the offsets of the count exchange,
// unless the launch shapes set ring_rows; there the peers read the partials where the combine
// buffer holds them, and combine first copies an expert_out that is not combine_buffer() into
// it, on the caller's stream, so any memory of the rank's GPU will do — a stream-ordered pool,
// PyTorch's expandable segments): token-major rows only, always ordered by
// (source rank, source index), one round in flight, no send/receive halves (ConfigError), no
// masking. Its dispatch exchanges counts first; unless cfg.worst_case_output, it then reads the
// round's row count M back on the host (dispatch synchronises `stream` once and waits there for
// every peer's counts: call each rank from its own thread or process, or use dispatch_group, one
// host thread per GPU) and
// sizes the received rows' areas to it, moving them when a round needs more rows, so that
// DispatchResult::capacity and combine_buffer() follow the round (take them from each result; a
// capturing stream is refused with a StateError). With cfg.worst_case_output the areas hold
// world_size * max_tokens_per_rank rows from creation and nothing is read back (capturable).
//
// Kernels are loaded when the object is created: with CUDA's lazy module loading, the first
// launch of any kernel waits for the kernels already running, which deadlocks with ranks that
// spin on each other. Load your own expert kernels before the first dispatch too (or run with
// CUDA_MODULE_LOADING=EAGER).

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epx/config.hpp"

namespace epx {

class InProcessWorld;
class IpcWorld;
class NcclWorld;

enum class IdType { kInt32, kInt64 };

struct DispatchInput {
  int num_tokens = 0;               // N <= max_tokens_per_rank; 0 is legal
  const void* x = nullptr;          // [N, H] bf16 (kBF16, kBF16ToFP8) or fp8 e4m3 (kFP8)
  const float* x_scales = nullptr;  // [N, H/128] f32, row-major; kFP8 only
  const void* topk_ids = nullptr;   // [N, K] int32 or int64; -1 = no expert
  IdType ids_type = IdType::kInt32;
  const float* topk_weights = nullptr;  // [N, K]
  // Routing by rank instead of by expert (DeepEP's dispatch without top-k; high_throughput only,
  // InputError elsewhere): with topk_ids and topk_weights null, token n goes to every rank r with
  // rank_mask[n * W + r] != 0, and expert_counts[E] (this rank's (token, expert) pairs per global
  // expert, as the caller counted them) is summed over the senders into each receiver's
  // DispatchResult::expert_counts. The rows then carry top-k ids -1 and weights 0.
  const uint8_t* rank_mask = nullptr;      // [N, W]
  const int32_t* expert_counts = nullptr;  // [E]
};

// What combine may also do (high_throughput only, token-major; InputError elsewhere):
//   * topk_weights [capacity, K] f32, row-aligned with the round's rows (DispatchResult's
//     recv_topk_weights, or the caller's own): y_topk_weights[n] = their sum over the ranks that
//     got token n, in f32 in rank order (0 for a token sent nowhere; a rank that passes no
//     weights counts as zeros);
//   * bias[0], bias[1]: [N, H] bf16 each, or null: y[n] = bf16(((0 + b0[n]) + b1[n]) + the
//     partials in rank order), all in f32 and rounded once.
struct CombineExtras {
  const float* topk_weights = nullptr;  // [capacity, K]
  float* y_topk_weights = nullptr;      // [N, K]; set exactly when topk_weights is
  const void* bias[2] = {nullptr, nullptr};
  bool empty() const {
    return topk_weights == nullptr && y_topk_weights == nullptr && bias[0] == nullptr &&
           bias[1] == nullptr;
  }
};

// Device pointers into the object's own memory; valid until the next dispatch.
// Token-major (cfg.layout == kTokenMajor): rows [0, *recv_count) are valid. With
// cfg.deterministic they are ordered by (source rank, source index) (the ranks exchange their
// counts before any row moves); without it (the default) each sender places its rows where it
// reserved them, so rows from one sender keep their order in runs but the runs of different
// senders interleave from call to call. Combine's result is the same bits either way (it sums
// in rank order). The naive backend always orders its rows.
// Expert-major: expert e's rows [0, expert_counts[e]) of [E/W][capacity] are valid, in the
// order of the token-major rows; token-major staging fields are still filled (recv_count rows).
struct DispatchResult {
  int capacity = 0;  // rows of the token-major area (world_size * max_tokens_per_rank;
                     // high_throughput sized per call: at least M); rows per
                     // expert (expert-major)
  void* combine_buffer = nullptr;  // this round's combine_buffer() (see All2All::combine_buffer)
  const int32_t* recv_count = nullptr;       // device scalar M
  const void* recv_x = nullptr;              // [capacity, H] bf16 or fp8
  const float* recv_scales = nullptr;        // fp8: [capacity, H/128] or [H/128, capacity]
  const int32_t* recv_src_rank = nullptr;    // [capacity]
  const int32_t* recv_src_idx = nullptr;     // [capacity]
  const int32_t* recv_topk_ids = nullptr;    // [capacity, K] (the token's full row)
  const float* recv_topk_weights = nullptr;  // [capacity, K]
  const int32_t* expert_counts = nullptr;    // [E/W] rows using each local expert
  // expert-major only
  const void* expert_x = nullptr;        // [E/W, capacity, H]
  const float* expert_scales = nullptr;  // fp8: [E/W, capacity, H/128] or [E/W, H/128, capacity]
  const int32_t* expert_src_rank = nullptr;   // [E/W, capacity]
  const int32_t* expert_src_idx = nullptr;    // [E/W, capacity]
  const int32_t* expert_topk_slot = nullptr;  // [E/W, capacity] k of this expert in its token
  const float* expert_weight = nullptr;       // [E/W, capacity] topk_weights[k]
};

class All2All {
 public:
  virtual ~All2All() = default;

  virtual const EpConfig& config() const = 0;
  virtual Backend backend() const = 0;

  // Enqueues dispatch on `stream`. Throws InputError for bad arguments, StateError after an error.
  virtual DispatchResult dispatch(const DispatchInput& input, cudaStream_t stream) = 0;

  // Where the expert stage should write the output of the round the next combine serves, to
  // avoid a copy (each round in flight has its own; DispatchResult::combine_buffer is its round's):
  //   token-major: partials [capacity, H] bf16, row j = sum over local k of w_k * expert_k(row j);
  //   expert-major: expert outputs [E/W, capacity, H] bf16, row-aligned with expert_x.
  // (high_throughput without worst_case_output: null before the first dispatch.)
  virtual void* combine_buffer() = 0;

  // Enqueues combine of the oldest due round: y[N, H] bf16 (N = that dispatch's num_tokens; when
  // N = 0, y is not written and may be any pointer, null included). `expert_out` is the
  // token-major partials or the expert-major outputs; the round's combine buffer avoids a copy.
  // StateError before any dispatch.
  virtual void combine(const void* expert_out, void* y, cudaStream_t stream) = 0;
  // combine() with the extras above; with none it is combine(expert_out, y, stream).
  virtual void combine(const void* expert_out, void* y, const CombineExtras& extras,
                       cudaStream_t stream);

  // The halves of each op, so that compute runs between them (overlap with another micro-batch's
  // work). dispatch(in) equals dispatch_send(in) then dispatch_recv(), and combine(out, y) equals
  // combine_send(out) then combine_recv(y), with the same results and errors. A send half never
  // waits for a peer (the ranks sharing a GPU may even enqueue all their send halves, then all
  // their receive halves, on one stream) — except dispatch_send with ordered rows
  // (cfg.deterministic, and the naive backend), which exchanges counts with every peer first, and
  // high_throughput without worst-case output across nodes, which reads them on the host first; a
  // receive half waits for every peer's send half of the round, then lays the rows out
  // (dispatch) or pulls and sums the partials (combine; with push combine, EpConfig::combine,
  // combine_send writes them into their tokens' ranks and combine_recv sums them locally). Each
  // send half must be followed by its receive half before the next op (StateError otherwise);
  // dispatch_recv's result is that of dispatch(). Between combine_send and combine_recv the
  // partials must stay as they are: peers read them (pull combine).
  virtual void dispatch_send(const DispatchInput& input, cudaStream_t stream) = 0;
  virtual DispatchResult dispatch_recv(cudaStream_t stream) = 0;
  virtual void combine_send(const void* expert_out, cudaStream_t stream) = 0;
  virtual void combine_recv(void* y, cudaStream_t stream) = 0;

  // Throws the recorded device error, if any (never synchronises).
  virtual void poll() = 0;
  // cudaStreamSynchronize(stream), then poll().
  virtual void synchronize(cudaStream_t stream) = 0;

  // Bytes of symmetric (peer-visible) memory and of all device memory this object holds.
  virtual size_t symmetric_bytes() const = 0;

  // Masking (EpConfig::mask_failed_ranks): the ranks whose wait this rank gave up on (bit r), and
  // the (token, expert) pairs its dispatches dropped because their expert's rank was masked,
  // since creation or clear_mask(). A masked rank's rows of the round it was masked in may be
  // missing or partly written (nothing waits for them), and its partials are left out of every
  // combine from then on. Read from mapped host memory: never synchronises; what a running
  // kernel masks shows up as it happens. Both 0 without masking.
  virtual uint64_t masked_ranks() const = 0;
  virtual uint64_t dropped_pairs() const = 0;
  // Unmasks every rank for the calls enqueued on `stream` after this one, and zeroes the
  // dropped count (for a rank brought back on the same memory, or a test).
  virtual void clear_mask(cudaStream_t stream) = 0;
};

// Bytes of device memory one rank's object needs for `cfg` (the one sizing function), with
// CombineMode::kAuto as on ranks that share one GPU (pull); a world over several GPUs resolves it
// to push, which adds its area (EpConfig::combine).
size_t buffer_bytes(Backend backend, const EpConfig& cfg);
size_t low_latency_buffer_bytes(const EpConfig& cfg);

// One kernel launch for several ranks of one in-process group that share a GPU: their
// dispatches (combines) in a single kernel on `stream`, so that the group pays one launch per op
// as a rank with a GPU of its own does, instead of one per rank on parallel streams. Same
// checks, contract and results as each rank's dispatch() / combine(); the objects stay usable
// per rank (poll(), synchronize(), and per-rank calls in later rounds). `ranks` are distinct
// ranks of one make_all2all_group() result on one GPU with the same launch shapes, in any order;
// inputs / expert_out / y are given per entry of `ranks`, and all inputs use one id type.
// InputError (nothing launched) otherwise. A rank left out of a round must make its own call, or
// its peers wait for it.
std::vector<DispatchResult> dispatch_group(std::span<All2All* const> ranks,
                                           std::span<const DispatchInput> inputs,
                                           cudaStream_t stream);
void combine_group(std::span<All2All* const> ranks, std::span<const void* const> expert_out,
                   std::span<void* const> y, cudaStream_t stream);

// The copy epilogue of a dispatch, for callers whose results must outlive the next round (the
// received rows live in the object's memory until then): row i of dst (rows dst_stride bytes
// apart) gets row_bytes bytes from row index[i] of src (src_stride apart; row i when index is
// null), or zeros where zero[i] is set (zero may be null). Enqueued on `stream`; no host
// synchronisation. The indices must lie in src's rows (they are not checked on the device).
// InputError, nothing launched, for a negative count, a stride below row_bytes or a null
// pointer with rows to copy. Its kernel is named dispatch_copy_epilogue_impl, as DeepEP's kernel
// of the same stage, for profiler-based benchmarks that time the stage by that name.
void copy_rows(void* dst, size_t dst_stride, const void* src, size_t src_stride,
               size_t row_bytes, int64_t rows, const int64_t* index, const bool* zero,
               cudaStream_t stream);

// One object per rank of an in-process world; cfg.rank and cfg.world_size are set per rank.
// `launch` entries left at 0 are chosen per world and shape; explicit values above a rank's SM
// budget throw ConfigError (they could not all be resident and would hang).
std::vector<std::unique_ptr<All2All>> make_all2all_group(Backend backend, EpConfig cfg,
                                                         const InProcessWorld& world,
                                                         LaunchConfigs launch = {});

// This process's object of an IpcWorld (one process per rank). Collective: every rank of the
// world calls it with the same backend and cfg (cfg.rank and cfg.world_size are taken from the
// world), and it returns once every rank has mapped every peer's buffer. Before allocating
// anything the ranks compare their epx version, backend and configuration
// (check_fingerprints): a difference throws ConfigError on every rank, naming the first
// differing field. `launch` as for make_all2all_group, against world.sm_budget() (the ranks
// that share this rank's GPU share its multiprocessors). A rank that fails during creation
// makes the others throw PeerError (or TimeoutError), never hang.
// Destroy the objects of all ranks together, after a barrier (world.bootstrap().barrier()) that
// follows each rank's last synchronize(): a peer may still be reading this rank's buffer, and
// with IpcHandles::kCudaIpc the memory goes away with its exporting rank.
std::unique_ptr<All2All> make_all2all(Backend backend, EpConfig cfg, IpcWorld& world,
                                      LaunchConfigs launch = {});

// This process's object of an NcclWorld: as for an IpcWorld, with the symmetric buffer from an
// NCCL window (SymmetricBuffer::create_nccl). Destroy it before the world.
std::unique_ptr<All2All> make_all2all(Backend backend, EpConfig cfg, NcclWorld& world,
                                      LaunchConfigs launch = {});

}  // namespace epx
