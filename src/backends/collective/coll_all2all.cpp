// The collective engine's All2All (coll_all2all.hpp): NCCL's all-gather of fixed-size packs for
// dispatch; an all-gather (naive) or grouped send/recv (every other backend) of the partials'
// blocks for combine, folded in rank order at each token's rank. Every backend's token-major
// contract: the baselines get every valid token, low_latency and high_throughput the tokens routed
// to them (flat: each pack reaches every rank). Every size is fixed by the configuration, so
// nothing waits on the host and every call can be captured in a CUDA graph; except
// high_throughput without worst-case output, which reads its counts on the host once per dispatch
// and moves exact sizes: each token once per node it goes to, relayed there by the rail peer
// (docs/scale-out.md §1), and each partial straight back.

#include "backends/collective/coll_all2all.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/collective/coll_kernels.hpp"
#include "backends/common/carve.hpp"
#include "backends/common/inputs.hpp"
#include "backends/common/rank_status.hpp"
#include "core/device_guard.hpp"
#include "epx/bootstrap.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

namespace epx::coll {
namespace {

// One device allocation carved into the engine's areas.
struct Areas {
  size_t pack, gathered, status, pos, counts, offsets, recv_count, expert_counts;
  size_t back_pos, back_counts, back_offsets, send, meta, metas;
  size_t back_node_pos, back_node_counts, back_send_offsets, relayed, relay_chunk, relay_base,
      relay_rank_start;
  size_t recv_x, recv_scales, recv_src_rank, recv_src_idx, recv_topk_ids, recv_topk_w;
  size_t row_slot, expert_x, expert_scales, expert_src_rank, expert_src_idx, expert_topk_slot,
      expert_weight;
  size_t partials, blocks, blocks_w, received, received_w, total;
};

// `nodes`: the world's (ranks per node: world / nodes).
Areas make_areas(const EpConfig& cfg, Backend backend, int nodes) {
  const size_t W = cfg.world_size, T = cfg.max_tokens_per_rank, cap = cfg.capacity();
  const size_t H = cfg.hidden, K = cfg.topk;
  const size_t G = cfg.wire_fp8() ? size_t(cfg.num_scale_groups()) : 0;
  // Expert-major: rows per local expert, and f32 partials in the blocks (each rank's fmaf sum).
  const bool em = cfg.layout == OutputLayout::kExpertMajor;
  const size_t ecap = em ? size_t(cfg.num_local_experts()) * cap : 0;
  const size_t block_value = em ? sizeof(float) : 2;
  const bool exact = reads_counts_on_host(backend, cfg);  // the exact dispatch and combine
  const size_t local = W / size_t(nodes), nodes_n = size_t(nodes);
  const int places = exact ? int(local) : 0;
  const size_t slot = slot_bytes(cfg, places);
  size_t c = 0;
  Areas a{};
  a.pack = carve(c, pack_bytes(cfg, places));
  a.gathered = carve(c, W * pack_bytes(cfg, places));  // (the exact dispatch: <= W * T slots)
  a.status = carve(c, sizeof(DeviceStatus));
  a.pos = carve(c, W * T * sizeof(int32_t));
  a.counts = carve(c, W * sizeof(int32_t));
  a.offsets = carve(c, W * sizeof(int32_t));
  a.recv_count = carve(c, sizeof(int32_t));
  a.expert_counts = carve(c, size_t(cfg.num_local_experts()) * sizeof(int32_t));
  a.back_pos = carve(c, exact ? W * T * sizeof(int32_t) : 0);
  a.back_counts = carve(c, exact ? W * sizeof(int32_t) : 0);
  a.back_offsets = carve(c, exact ? W * sizeof(int32_t) : 0);
  // the exact dispatch: step A's slots by peer (at most local + nodes - 1 <= W peers' T each),
  // then step B's (at most local * (nodes - 1) sources' T); its meta and every rank's; the slots
  // it relays; the slots received land in `gathered`
  a.send = carve(c, exact ? W * T * slot : 0);
  a.meta = carve(c, exact ? meta_bytes(cfg) : 0);
  a.metas = carve(c, exact ? W * meta_bytes(cfg) : 0);
  a.back_node_pos = carve(c, exact ? nodes_n * T * sizeof(int32_t) : 0);
  a.back_node_counts = carve(c, exact ? nodes_n * sizeof(int32_t) : 0);
  a.back_send_offsets = carve(c, exact ? W * sizeof(int32_t) : 0);
  a.relayed = carve(c, exact ? (nodes_n - 1) * T * slot : 0);
  a.relay_chunk = carve(c, exact ? (nodes_n + 1) * sizeof(int32_t) : 0);
  a.relay_base = carve(c, exact ? nodes_n * local * sizeof(int32_t) : 0);
  a.relay_rank_start = carve(c, exact ? local * sizeof(int32_t) : 0);
  a.recv_x = carve(c, cap * size_t(cfg.wire_row_bytes()));
  a.recv_scales = carve(c, cap * G * sizeof(float));
  a.recv_src_rank = carve(c, cap * sizeof(int32_t));
  a.recv_src_idx = carve(c, cap * sizeof(int32_t));
  a.recv_topk_ids = carve(c, cap * K * sizeof(int32_t));
  a.recv_topk_w = carve(c, cap * K * sizeof(float));
  a.row_slot = carve(c, em ? cap * K * sizeof(int32_t) : 0);
  a.expert_x = carve(c, ecap * size_t(cfg.wire_row_bytes()));
  a.expert_scales = carve(c, ecap * G * sizeof(float));
  a.expert_src_rank = carve(c, ecap * sizeof(int32_t));
  a.expert_src_idx = carve(c, ecap * sizeof(int32_t));
  a.expert_topk_slot = carve(c, ecap * sizeof(int32_t));
  a.expert_weight = carve(c, ecap * sizeof(float));
  a.partials = carve(c, (em ? ecap : cap) * H * 2);  // the combine buffer
  // [W][T][H]: this rank's partials, by source (the exact combine sends them from expert_out)
  a.blocks = carve(c, exact ? 0 : W * T * H * block_value);
  // every other backend: every rank's block of this rank's tokens [W][T][H] (the exact combine:
  // the rows that exist, at most that); naive: every rank's blocks [W][W][T][H].
  a.received = carve(c, (backend == Backend::kNaive ? W : 1) * W * T * H * block_value);
  // high_throughput's top-k weights back (combine's extras): placed as the partial rows, and
  // without the exact combine first scattered into blocks by source as they are
  const bool ht = backend == Backend::kHighThroughput;
  a.blocks_w = carve(c, ht && !exact ? W * T * K * sizeof(float) : 0);
  a.received_w = carve(c, ht ? W * T * K * sizeof(float) : 0);
  a.total = c;
  return a;
}

// Bounds NCCL's collectives by EpConfig::timeout_ms (they have no bound of their own on the
// device): every eager collective is bracketed by two events; once the first has passed (the
// stream reached the collective), the second must pass within the timeout, or the watchdog
// aborts the world's communicator (NCCL's kernels end) and records a TimeoutError for poll().
// Collectives captured in a graph are not watched (their events cannot be queried).
class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;
  Watchdog(NcclWorld& world, RankStatus& status, int timeout_ms)
      : world_(world), status_(status), timeout_(std::chrono::milliseconds(timeout_ms)) {
    thread_ = std::thread([this] { run(); });
  }
  ~Watchdog() {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
    for (const Op& op : ops_) release(op);
    for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Enqueues `collective` on `stream` between two events and watches it.
  template <typename F>
  void run_watched(cudaStream_t stream, Phase phase, const F& collective) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    EPX_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    if (capturing != cudaStreamCaptureStatusNone) {
      collective();
      return;
    }
    Op op{.begin = take(), .end = take(), .phase = phase};
    EPX_CUDA_CHECK(cudaEventRecord(op.begin, stream));
    collective();
    EPX_CUDA_CHECK(cudaEventRecord(op.end, stream));
    {
      const std::lock_guard<std::mutex> lock(mu_);
      ops_.push_back(op);
    }
    cv_.notify_one();
  }

 private:
  struct Op {
    cudaEvent_t begin, end;
    Phase phase;
    Clock::time_point reached{};  // when `begin` was first seen passed
  };

  cudaEvent_t take() {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    EPX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void release(const Op& op) {
    free_.push_back(op.begin);
    free_.push_back(op.end);
  }

  void run() {
    (void)cudaSetDevice(world_.device());
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (ops_.empty()) {
        cv_.wait_for(lock, std::chrono::milliseconds(50));
        continue;
      }
      Op& op = ops_.front();
      const cudaError_t done = cudaEventQuery(op.end);
      if (done != cudaErrorNotReady) {  // passed (or the stream failed: its own error surfaces)
        if (done != cudaSuccess) (void)cudaGetLastError();
        release(op);
        ops_.pop_front();
        continue;
      }
      const auto now = Clock::now();
      if (op.reached == Clock::time_point{}) {
        const cudaError_t reached = cudaEventQuery(op.begin);
        if (reached == cudaSuccess) op.reached = now;
        else if (reached != cudaErrorNotReady) (void)cudaGetLastError();
      } else if (now - op.reached > timeout_) {
        status_.record_from_host(StatusCode::kTimeout, op.phase,
                                 std::chrono::duration_cast<std::chrono::milliseconds>(timeout_)
                                     .count(),
                                 std::chrono::duration_cast<std::chrono::milliseconds>(
                                     now - op.reached)
                                     .count());
        world_.abort();  // NCCL's kernels end; later calls throw
        for (const Op& o : ops_) release(o);
        ops_.clear();
        continue;
      }
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      lock.lock();
    }
  }

  NcclWorld& world_;
  RankStatus& status_;
  const Clock::duration timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> ops_;
  std::vector<cudaEvent_t> free_;
  bool stop_ = false;
  std::thread thread_;
};

class CollAll2All final : public All2All {
 public:
  CollAll2All(const EpConfig& cfg, Backend backend, NcclWorld& world)
      : cfg_(cfg), backend_(backend), world_(world), nodes_(world.num_nodes()),
        local_(cfg.world_size / world.num_nodes()),
        places_(reads_counts_on_host(backend, cfg) ? local_ : 0),
        areas_(make_areas(cfg, backend, nodes_)),
        status_(cfg, world.device()), watchdog_(world, status_, cfg.timeout_ms) {
    const DeviceGuard guard(world.device());
    EPX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&mem_), areas_.total));
    EPX_CUDA_CHECK(cudaMemset(mem_, 0, areas_.total));
    // (The zeros, the status word's among them, must be there before the caller's first call,
    // whatever its stream: a non-blocking stream does not wait for the legacy one.)
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    for (cudaEvent_t* e : {&dispatch_sent_, &combine_sent_})
      EPX_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    if (exact()) {
      EPX_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_metas_),
                                    size_t(cfg.world_size) * meta_bytes(cfg)));
      host_counts_.resize(2 * size_t(cfg.world_size));
    }
  }
  ~CollAll2All() override {
    const DeviceGuard guard(world_.device());
    for (cudaEvent_t e : {dispatch_sent_, combine_sent_}) (void)cudaEventDestroy(e);
    if (host_metas_ != nullptr) (void)cudaFreeHost(host_metas_);
    (void)cudaFree(mem_);
  }
  CollAll2All(const CollAll2All&) = delete;
  CollAll2All& operator=(const CollAll2All&) = delete;

  const EpConfig& config() const override { return cfg_; }
  Backend backend() const override { return backend_; }
  size_t symmetric_bytes() const override { return areas_.total; }
  uint64_t masked_ranks() const override { return 0; }
  uint64_t dropped_pairs() const override { return 0; }
  void clear_mask(cudaStream_t) override { status_.check_usable(); }
  void* combine_buffer() override { return mem_ + areas_.partials; }

  DispatchResult dispatch(const DispatchInput& in, cudaStream_t stream) override {
    dispatch_send(in, stream);
    return dispatch_recv(stream);
  }
  void dispatch_send(const DispatchInput& in, cudaStream_t stream) override {
    status_.poll();
    EPX_CHECK(pending_ == Pending::kNone, StateError, "dispatch", "called",
              "after the receive half of the last send half");
    const int N = in.num_tokens;
    EPX_CHECK(N >= 0 && N <= cfg_.max_tokens_per_rank, InputError, "num_tokens", N,
              "0..max_tokens_per_rank = " + std::to_string(cfg_.max_tokens_per_rank));
    if (backend_ == Backend::kHighThroughput) {  // by top-k ids or by a rank mask
      check_high_throughput_routing(status_, in, cfg_);
    } else {
      check_routing_by_ids(in, backend_);
      if (N > 0) {
        status_.check_ptr(in.topk_ids, "topk_ids", in.ids_type == IdType::kInt64 ? 8 : 4);
        status_.check_ptr(in.topk_weights, "topk_weights", 4);
      }
    }
    if (N > 0) {
      status_.check_ptr(in.x, "x", 16);
      if (cfg_.input_fp8()) status_.check_ptr(in.x_scales, "x_scales", 4);
    }
    if (exact()) check_not_capturing_counts(stream);  // nothing is launched before it
    const DeviceGuard guard(world_.device());
    dispatched_ = false;  // (the pack a combine folds by is overwritten from here on)
    CollShape S = shape();
    S.ids_int64 = in.ids_type == IdType::kInt64;
    launch_coll_pack(S, N, in.x, in.x_scales, in.topk_ids, in.topk_weights, in.rank_mask,
                     in.expert_counts, mem_ + areas_.pack,
                     CollStatus{reinterpret_cast<DeviceStatus*>(mem_ + areas_.status),
                                status_.device_mirror()},
                     stream);
    if (exact()) {
      launch_coll_back_place(S, mem_ + areas_.pack, back(), stream);
      exact_dispatch_send(S, stream);
    } else {
      watchdog_.run_watched(stream, Phase::kDispatchData, [&] {
        world_.all_gather(mem_ + areas_.pack, mem_ + areas_.gathered, pack_bytes(cfg_, places_),
                          stream);
      });
    }
    // The receive half may come on another stream: it waits for this point.
    EPX_CUDA_CHECK(cudaEventRecord(dispatch_sent_, stream));
    tokens_ = N;
    dispatched_ = true;
    pending_ = Pending::kDispatchReceive;
  }
  DispatchResult dispatch_recv(cudaStream_t stream) override {
    status_.check_usable();
    EPX_CHECK(pending_ == Pending::kDispatchReceive, StateError, "dispatch_recv", "called",
              "after dispatch_send");
    const DeviceGuard guard(world_.device());
    EPX_CUDA_CHECK(cudaStreamWaitEvent(stream, dispatch_sent_, 0));
    if (exact())
      launch_coll_exact_unpack(shape(), mem_ + areas_.gathered, rows(), stream);
    else
      launch_coll_unpack(shape(), mem_ + areas_.gathered, pack_bytes(cfg_, places_), rows(),
                         stream);
    if (expert_major()) launch_coll_expert_rows(shape(), rows(), stream);
    pending_ = Pending::kNone;
    return result();
  }

  void combine(const void* expert_out, void* y, cudaStream_t stream) override {
    combine_send(expert_out, stream);
    combine_recv(y, stream);
  }
  // high_throughput's extras: the top-k weights come back with the rows and are summed per slot
  // in the partials' order; bias rows start the sum. Refused by the base class for the others.
  void combine(const void* expert_out, void* y, const CombineExtras& extras,
               cudaStream_t stream) override {
    if (extras.empty() || backend_ != Backend::kHighThroughput) {
      All2All::combine(expert_out, y, extras, stream);
      return;
    }
    check_combine_extras(status_, extras, tokens_);
    extras_ = extras;
    try {
      combine_send(expert_out, stream);
      combine_recv(y, stream);
    } catch (...) {
      extras_ = {};
      throw;
    }
    extras_ = {};
  }
  void combine_send(const void* expert_out, cudaStream_t stream) override {
    status_.check_usable();
    EPX_CHECK(dispatched_, StateError, "combine", "called before any dispatch",
              "after a dispatch (combine returns the tokens of the last dispatch)");
    EPX_CHECK(pending_ == Pending::kNone, StateError, "combine", "called",
              "after the receive half of the last send half");
    status_.check_ptr(expert_out, "expert_out", 16);
    const DeviceGuard guard(world_.device());
    if (exact()) {
      exact_combine_send(expert_out, stream);
      return;
    }
    if (expert_major())
      launch_coll_scatter_experts(shape(), expert_out, rows(), mem_ + areas_.blocks, stream);
    else
      launch_coll_scatter(shape(), expert_out, rows(), mem_ + areas_.blocks,
                          extras_.topk_weights, reinterpret_cast<float*>(mem_ + areas_.blocks_w),
                          stream);
    const size_t W = cfg_.world_size;
    const size_t block = size_t(cfg_.max_tokens_per_rank) * cfg_.hidden * block_value();
    watchdog_.run_watched(stream, Phase::kCombineReady, [&] {
      if (backend_ == Backend::kNaive) {  // every rank's blocks to every rank
        world_.all_gather(mem_ + areas_.blocks, mem_ + areas_.received, W * block, stream);
      } else {  // block q to rank q
        std::vector<size_t> offsets(W), bytes(W, block);
        for (size_t q = 0; q < W; ++q) offsets[q] = q * block;
        world_.all_to_all(mem_ + areas_.blocks, offsets.data(), bytes.data(),
                          mem_ + areas_.received, offsets.data(), bytes.data(), stream);
        if (extras_.topk_weights != nullptr) {  // and the weights' blocks, [T][K] f32 each
          const size_t wblock = size_t(cfg_.max_tokens_per_rank) * cfg_.topk * sizeof(float);
          std::vector<size_t> woffsets(W), wbytes(W, wblock);
          for (size_t q = 0; q < W; ++q) woffsets[q] = q * wblock;
          world_.all_to_all(mem_ + areas_.blocks_w, woffsets.data(), wbytes.data(),
                            mem_ + areas_.received_w, woffsets.data(), wbytes.data(), stream);
        }
      }
    });
    EPX_CUDA_CHECK(cudaEventRecord(combine_sent_, stream));
    pending_ = Pending::kCombineReceive;
  }
  void combine_recv(void* y, cudaStream_t stream) override {
    status_.check_usable();
    EPX_CHECK(pending_ == Pending::kCombineReceive, StateError, "combine_recv", "called",
              "after combine_send");
    if (tokens_ > 0) status_.check_ptr(y, "y", 16);
    const DeviceGuard guard(world_.device());
    EPX_CUDA_CHECK(cudaStreamWaitEvent(stream, combine_sent_, 0));
    // The rows of this rank's tokens from rank r: block `rank` of rank r's blocks (naive), or
    // rank r's block (allgather_reducescatter).
    const size_t T = cfg_.max_tokens_per_rank, W = cfg_.world_size;
    const bool naive = backend_ == Backend::kNaive;
    const uint8_t* from = mem_ + areas_.received +
                          (naive ? size_t(cfg_.rank) * T * cfg_.hidden * block_value() : 0);
    const CollExtras ex{.bias0 = extras_.bias[0],
                        .bias1 = extras_.bias[1],
                        .recv_w = reinterpret_cast<const float*>(mem_ + areas_.received_w),
                        .y_w = extras_.y_topk_weights,
                        .highest_slot = cfg_.combine_order == CombineOrder::kHighestSlot};
    launch_coll_fold(shape(), tokens_, mem_ + areas_.pack, from, naive ? W * T : T,
                     expert_major(), exact() ? back() : CollBack{}, ex, y, stream);
    pending_ = Pending::kNone;
  }

  void poll() override { status_.poll(); }
  void synchronize(cudaStream_t stream) override {
    const DeviceGuard guard(world_.device());
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    poll();
  }

 private:
  enum class Pending { kNone, kDispatchReceive, kCombineReceive };

  bool expert_major() const { return cfg_.layout == OutputLayout::kExpertMajor; }
  // Where high_throughput reads its counts on the host, dispatch sends each token once per node
  // it goes to, and on to the ranks there it goes to, and combine moves each rank's rows of each
  // token's rank, in exact sizes, not fixed packs and blocks of max_tokens_per_rank rows
  // (docs/scale-out.md §4).
  bool exact() const { return reads_counts_on_host(backend_, cfg_); }
  CollBack back() const {
    auto p = [this](size_t off) { return reinterpret_cast<int32_t*>(mem_ + off); };
    return CollBack{.pos = p(areas_.back_pos),
                    .counts = p(areas_.back_counts),
                    .offsets = p(areas_.back_offsets),
                    .node_pos = p(areas_.back_node_pos),
                    .node_counts = p(areas_.back_node_counts),
                    .send_offsets = p(areas_.back_send_offsets)};
  }
  CollRelay relay() const {
    auto p = [this](size_t off) { return reinterpret_cast<int32_t*>(mem_ + off); };
    return CollRelay{.chunk_start = p(areas_.relay_chunk),
                     .base = p(areas_.relay_base),
                     .rank_start = p(areas_.relay_rank_start)};
  }

  // The metas on the host (high_throughput's one read per dispatch: the host waits for their
  // all-gather here), each count checked, and the rows this rank gets from each rank and the
  // rows each rank gets from it (combine's sizes).
  void read_metas(cudaStream_t stream) {
    const size_t W = cfg_.world_size, meta = meta_bytes(cfg_);
    EPX_CUDA_CHECK(cudaMemcpyAsync(host_metas_, mem_ + areas_.metas, W * meta,
                                   cudaMemcpyDeviceToHost, stream));
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    // A peer past the timeout (the watchdog's abort) surfaces here. Bad ids do not: the peers
    // count on this rank's rows and partials, so the round goes on (the next poll() raises them).
    status_.poll_fatal();
    for (size_t q = 0; q < W; ++q) {
      for (size_t i = 0; i < W + size_t(nodes_); ++i) {
        const int32_t c = meta_of(int(q))[kMetaSendsAt + i];  // sends [W], then node sends
        EPX_CHECK(c >= 0 && c <= cfg_.max_tokens_per_rank, PeerError,
                  fmt::format("slots rank {} sends {} {}", q, i < W ? "rank" : "node",
                              i < W ? i : i - W),
                  c, "0..max_tokens_per_rank = " + std::to_string(cfg_.max_tokens_per_rank));
      }
    }
    for (size_t q = 0; q < W; ++q) {
      host_counts_[q] = sends(int(q), cfg_.rank);
      host_counts_[W + q] = sends(cfg_.rank, int(q));
    }
  }
  const int32_t* meta_of(int q) const {
    return reinterpret_cast<const int32_t*>(host_metas_ + size_t(q) * meta_bytes(cfg_));
  }
  // From the host's metas: the slots rank q sends rank r, and those it sends node b.
  int32_t sends(int q, int r) const { return meta_of(q)[kMetaSendsAt + r]; }
  int32_t node_sends(int q, int b) const {
    return meta_of(q)[meta_node_sends_at(cfg_.world_size) + b];
  }

  // The exact dispatch: step A's slots by peer and this rank's meta, the metas all-gathered and
  // read on the host (high_throughput's one read per dispatch), step A by grouped send/recv (the
  // ranks of this node their slots, into `gathered`; the other nodes' rail peers theirs, into
  // `relayed`), step B's slots by rank of this node, and step B (into `gathered` after step
  // A's). Every size comes from the metas; the kernels place each slot by the same counts.
  void exact_dispatch_send(const CollShape& S, cudaStream_t stream) {
    const int W = cfg_.world_size, L = local_, me = cfg_.rank;
    const int node = me / L, local = me % L;
    const size_t slot = slot_bytes(cfg_, places_), meta = meta_bytes(cfg_);
    launch_coll_exact_send(S, mem_ + areas_.pack, back(), mem_ + areas_.send, mem_ + areas_.meta,
                           stream);
    watchdog_.run_watched(stream, Phase::kDispatchData, [&] {
      world_.all_gather(mem_ + areas_.meta, mem_ + areas_.metas, meta, stream);
    });
    launch_coll_exact_counts(S, mem_ + areas_.metas, meta, rows(), relay(), stream);
    read_metas(stream);
    // Byte places are from mem_ (the send and receive areas differ by step and peer).
    std::vector<size_t> send_at(W, 0), send_bytes(W, 0), recv_at(W, 0), recv_bytes(W, 0);
    size_t sent = 0, got = 0, relayed = 0;
    for (int p = 0; p < W; ++p) {
      size_t out = 0, in = 0;
      if (p / L == node) {
        out = size_t(sends(me, p));
        in = size_t(sends(p, me));
        recv_at[p] = areas_.gathered + got * slot;
        got += in;
      } else if (p % L == local) {
        out = size_t(node_sends(me, p / L));
        in = size_t(node_sends(p, node));
        recv_at[p] = areas_.relayed + relayed * slot;
        relayed += in;
      }
      send_at[p] = areas_.send + sent * slot;
      sent += out;
      send_bytes[p] = out * slot;
      recv_bytes[p] = in * slot;
    }
    watchdog_.run_watched(stream, Phase::kDispatchData, [&] {
      world_.all_to_all(mem_, send_at.data(), send_bytes.data(), mem_, recv_at.data(),
                        recv_bytes.data(), stream);
    });
    // Step B: the relayed slots to the ranks of this node (rank d's: those of the other nodes'
    // rail peers of this local index for d), and each rank's relay its slots of this one.
    launch_coll_exact_relay(S, mem_ + areas_.relayed, relay(), mem_ + areas_.send, stream);
    std::fill(send_bytes.begin(), send_bytes.end(), 0);
    std::fill(recv_bytes.begin(), recv_bytes.end(), 0);
    sent = 0;
    for (int d = 0; d < L; ++d) {
      const int p = node * L + d;
      size_t out = 0, in = 0;
      for (int a = 0; a < nodes_; ++a) {
        if (a == node) continue;
        out += size_t(sends(a * L + local, p));  // relayed by this rank to p
        in += size_t(sends(a * L + d, me));       // relayed by p to this rank
      }
      send_at[p] = areas_.send + sent * slot;
      sent += out;
      send_bytes[p] = out * slot;
      recv_at[p] = areas_.gathered + got * slot;
      got += in;
      recv_bytes[p] = in * slot;
    }
    if (nodes_ > 1) {
      watchdog_.run_watched(stream, Phase::kDispatchData, [&] {
        world_.all_to_all(mem_, send_at.data(), send_bytes.data(), mem_, recv_at.data(),
                          recv_bytes.data(), stream);
      });
    }
  }

  // Each rank's rows of this rank's partials (expert_out holds them in the received rows' order:
  // rank q's at q's first row) to q, and each rank's rows of this rank's tokens into the receive
  // area, in exact sizes.
  void exact_combine_send(const void* expert_out, cudaStream_t stream) {
    const size_t W = cfg_.world_size, row = size_t(cfg_.hidden) * 2;
    std::vector<size_t> send_at(W), send_bytes(W), recv_at(W), recv_bytes(W);
    size_t sent = 0, got = 0;
    for (size_t q = 0; q < W; ++q) {
      send_at[q] = sent * row;
      send_bytes[q] = size_t(host_counts_[q]) * row;
      sent += size_t(host_counts_[q]);
      recv_at[q] = got * row;
      recv_bytes[q] = size_t(host_counts_[W + q]) * row;
      got += size_t(host_counts_[W + q]);
    }
    watchdog_.run_watched(stream, Phase::kCombineReady, [&] {
      world_.all_to_all(expert_out, send_at.data(), send_bytes.data(), mem_ + areas_.received,
                        recv_at.data(), recv_bytes.data(), stream);
    });
    if (extras_.topk_weights != nullptr) {  // the rows' weights, the same places at K floats
      const size_t scale = size_t(cfg_.topk) * sizeof(float);
      for (auto* v : {&send_at, &send_bytes, &recv_at, &recv_bytes})
        for (size_t& x : *v) x = x / row * scale;
      watchdog_.run_watched(stream, Phase::kCombineReady, [&] {
        world_.all_to_all(extras_.topk_weights, send_at.data(), send_bytes.data(),
                          mem_ + areas_.received_w, recv_at.data(), recv_bytes.data(), stream);
      });
    }
    EPX_CUDA_CHECK(cudaEventRecord(combine_sent_, stream));
    pending_ = Pending::kCombineReceive;
  }
  // Bytes of one value of combine's blocks: bf16 partials, or expert-major's f32 sums.
  size_t block_value() const { return expert_major() ? sizeof(float) : 2; }

  CollShape shape() const {
    return CollShape{.world = cfg_.world_size,
                     .rank = cfg_.rank,
                     .hidden = cfg_.hidden,
                     .num_experts = cfg_.num_experts,
                     .num_local = cfg_.num_local_experts(),
                     .topk = cfg_.topk,
                     .max_tokens = cfg_.max_tokens_per_rank,
                     .groups = cfg_.wire_fp8() ? cfg_.num_scale_groups() : 0,
                     .wire_row_bytes = int32_t(cfg_.wire_row_bytes()),
                     .dtype = int32_t(cfg_.dtype),
                     .scale_col_major = cfg_.scale_layout == ScaleLayout::kColumnMajor,
                     .ids_int64 = 0,
                     .round_scale = cfg_.round_scale,
                     .slot_bytes = int32_t(slot_bytes(cfg_, places_)),
                     .counts_offset = int32_t(pack_counts_offset(cfg_, places_)),
                     .routed = !delivers_every_token(backend_),
                     .local = local_,
                     .timeout_ns = uint64_t(cfg_.timeout_ms) * 1000000ull};
  }
  CollRows rows() const {
    auto p = [this](size_t off) { return mem_ + off; };
    return CollRows{.recv_x = p(areas_.recv_x),
                    .recv_scales = reinterpret_cast<float*>(p(areas_.recv_scales)),
                    .recv_src_rank = reinterpret_cast<int32_t*>(p(areas_.recv_src_rank)),
                    .recv_src_idx = reinterpret_cast<int32_t*>(p(areas_.recv_src_idx)),
                    .recv_topk_ids = reinterpret_cast<int32_t*>(p(areas_.recv_topk_ids)),
                    .recv_topk_w = reinterpret_cast<float*>(p(areas_.recv_topk_w)),
                    .expert_counts = reinterpret_cast<int32_t*>(p(areas_.expert_counts)),
                    .recv_count = reinterpret_cast<int32_t*>(p(areas_.recv_count)),
                    .pos = reinterpret_cast<int32_t*>(p(areas_.pos)),
                    .counts = reinterpret_cast<int32_t*>(p(areas_.counts)),
                    .offsets = reinterpret_cast<int32_t*>(p(areas_.offsets)),
                    .row_slot = reinterpret_cast<int32_t*>(p(areas_.row_slot)),
                    .expert_x = p(areas_.expert_x),
                    .expert_scales = reinterpret_cast<float*>(p(areas_.expert_scales)),
                    .expert_src_rank = reinterpret_cast<int32_t*>(p(areas_.expert_src_rank)),
                    .expert_src_idx = reinterpret_cast<int32_t*>(p(areas_.expert_src_idx)),
                    .expert_topk_slot = reinterpret_cast<int32_t*>(p(areas_.expert_topk_slot)),
                    .expert_weight = reinterpret_cast<float*>(p(areas_.expert_weight))};
  }
  DispatchResult result() const {
    const CollRows r = rows();
    DispatchResult d;
    d.capacity = cfg_.capacity();
    d.combine_buffer = mem_ + areas_.partials;
    d.recv_count = r.recv_count;
    d.recv_x = r.recv_x;
    d.recv_scales = cfg_.wire_fp8() ? r.recv_scales : nullptr;
    d.recv_src_rank = r.recv_src_rank;
    d.recv_src_idx = r.recv_src_idx;
    d.recv_topk_ids = r.recv_topk_ids;
    d.recv_topk_weights = r.recv_topk_w;
    d.expert_counts = r.expert_counts;
    if (expert_major()) {
      d.expert_x = r.expert_x;
      d.expert_scales = cfg_.wire_fp8() ? r.expert_scales : nullptr;
      d.expert_src_rank = r.expert_src_rank;
      d.expert_src_idx = r.expert_src_idx;
      d.expert_topk_slot = r.expert_topk_slot;
      d.expert_weight = r.expert_weight;
    }
    return d;
  }

  EpConfig cfg_;
  Backend backend_;
  NcclWorld& world_;
  int nodes_;   // the world's nodes, of local_ ranks each
  int local_;
  int places_;  // a slot's places (CollShape::places)
  Areas areas_;
  RankStatus status_;
  Watchdog watchdog_;  // (after status_: destroyed before it)
  uint8_t* mem_ = nullptr;
  cudaEvent_t dispatch_sent_ = nullptr;  // the end of the last send half of each op
  cudaEvent_t combine_sent_ = nullptr;
  uint8_t* host_metas_ = nullptr;    // the exact dispatch: [W][meta_bytes] pinned (read_metas)
  std::vector<int32_t> host_counts_;  // [2W]: rows from each rank, rows each rank got from this
  CombineExtras extras_{};           // the extras of the combine in progress
  int tokens_ = 0;
  bool dispatched_ = false;
  Pending pending_ = Pending::kNone;
};

}  // namespace

std::unique_ptr<All2All> make_nccl_rank(Backend backend, const EpConfig& base, NcclWorld& world) {
  EpConfig cfg = base;
  cfg.world_size = world.size();
  cfg.rank = world.rank();
  cfg.validate();
  EPX_CHECK(cfg.layout == OutputLayout::kTokenMajor || backend == Backend::kLowLatency,
            ConfigError, "layout", to_string(cfg.layout),
            std::string("token for backend ") + to_string(backend) +
                " (expert-major rows are low_latency's)");
  EPX_CHECK(cfg.rounds_in_flight == 1, ConfigError, "rounds_in_flight", cfg.rounds_in_flight,
            "1 across nodes");
  EPX_CHECK(!cfg.mask_failed_ranks, ConfigError, "mask_failed_ranks", "true",
            "false across nodes (NCCL's collectives need every rank)");
  EPX_CHECK(cfg.combine != CombineMode::kPush, ConfigError, "combine", to_string(cfg.combine),
            "auto or pull across nodes (the partials move by NCCL's collectives)");
  EPX_CHECK(cfg.combine_format == CombineFormat::kBF16, ConfigError, "combine_format",
            to_string(cfg.combine_format),
            std::string("bf16 for backend ") + to_string(backend) +
                " (LogFMT combine is low_latency's)");
  EPX_CHECK(cfg.combine_order == CombineOrder::kRank || backend == Backend::kHighThroughput,
            ConfigError, "combine_order", to_string(cfg.combine_order),
            std::string("rank for backend ") + to_string(backend) +
                " (the highest-slot order is high_throughput's)");
  check_fingerprints(world.bootstrap(), cfg, backend);
  {
    const DeviceGuard guard(world.device());
    load_coll_kernels();
  }
  return std::make_unique<CollAll2All>(cfg, backend, world);
}

}  // namespace epx::coll
