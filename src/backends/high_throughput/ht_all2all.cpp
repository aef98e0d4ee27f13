#include "backends/high_throughput/ht_all2all.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <exception>
#include <iterator>
#include <string>

#include "backends/common/carve.hpp"
#include "backends/common/inputs.hpp"
#include "backends/common/phase_clock.hpp"
#include "backends/common/rank_status.hpp"
#include "backends/high_throughput/ht_kernels.hpp"
#include "core/device_guard.hpp"
#include "epx/bootstrap.hpp"
#include "epx/cuda_check.hpp"
#include "epx/symmetric.hpp"
#include "epx/world.hpp"

namespace epx {
namespace ht {

HtLayout make_ht_layout(const EpConfig& cfg, int channels, int dispatch_ring, int combine_ring,
                        bool direct) {
  const size_t W = cfg.world_size, C = channels, K = cfg.topk, H = cfg.hidden;
  const size_t G = cfg.wire_fp8() ? size_t(cfg.num_scale_groups()) : 0;
  if (direct) dispatch_ring = combine_ring = 0;
  HtLayout L{};
  L.channels = channels;
  L.segments = direct ? 2 * channels : channels;
  L.direct = direct;
  L.dispatch_ring = dispatch_ring;
  L.combine_ring = combine_ring;
  // payload, f32 scales, int32 ids, f32 weights, int32 source index; 16-byte rows
  L.dispatch_slot = (size_t(cfg.wire_row_bytes()) + G * 4 + K * 8 + 4 + 15) / 16 * 16;
  size_t c = 0;
  L.counts = carve(c, 2 * W * size_t(L.segments) * sizeof(uint64_t));
  L.expert_rows = carve(c, 2 * size_t(cfg.num_local_experts()) * sizeof(int32_t));
  L.dtail = carve(c, C * W * sizeof(uint64_t));
  L.dhead = carve(c, C * W * sizeof(uint64_t));
  L.ctail = carve(c, C * W * sizeof(uint64_t));
  L.chead = carve(c, C * W * sizeof(uint64_t));
  L.dring = carve(c, C * W * size_t(dispatch_ring) * L.dispatch_slot);
  L.cring = carve(c, C * W * size_t(combine_ring) * H * 2);
  L.cwring = carve(c, C * W * size_t(combine_ring) * K * sizeof(float));
  L.published = carve(c, direct ? sizeof(HtPublished) : 0);
  L.arrived = carve(c, direct ? W * sizeof(uint64_t) : 0);
  L.read_done = carve(c, direct ? W * sizeof(uint64_t) : 0);
  L.symmetric_end = c;
  L.state = carve(c, sizeof(HtState));
  L.status = carve(c, sizeof(DeviceStatus));
  L.token_mask = carve(c, size_t(cfg.max_tokens_per_rank) * sizeof(uint64_t));
  L.token_order = carve(c, cfg.combine_order == CombineOrder::kHighestSlot
                               ? size_t(cfg.max_tokens_per_rank) * size_t(K)
                               : 0);
  L.seg_offset = carve(c, W * size_t(L.segments) * sizeof(int32_t));
  L.seg_count = carve(c, W * size_t(L.segments) * sizeof(int32_t));
  L.dsent = carve(c, C * W * sizeof(uint64_t));
  L.drecv = carve(c, C * W * sizeof(uint64_t));
  L.csent = carve(c, C * W * sizeof(uint64_t));
  L.crecv = carve(c, C * W * sizeof(uint64_t));
  L.expert_counts = carve(c, size_t(cfg.num_local_experts()) * sizeof(int32_t));
  L.row_pos = carve(c, direct ? size_t(cfg.max_tokens_per_rank) * W * sizeof(int32_t) : 0);
  L.tickets = carve(c, direct ? 3 * sizeof(uint32_t) : 0);
  L.total = c;
  return L;
}

namespace {

// Default launch shape. Blocks: at most 16 per rank (as the other backends), so that a rank with
// a GPU of its own leaves the rest to compute; half send, half receive. Rings: two batches of
// rows (one token per warp) in flight, at least 64 rows.
constexpr int kDefaultMaxBlocks = 16;
constexpr int kDefaultWarps = 32;
constexpr int kMinDefaultRingRows = 64;

// The launch shape of one rank, checked against its SM budget and the rings' rule. Dispatch and
// combine share the channels (combine returns the rows of the dispatch's segments).
struct HtShapeChoice {
  int channels;
  LaunchConfigs lc;
};

HtShapeChoice resolve(LaunchConfigs lc, int budget, int rank, int sharing) {
  EPX_CHECK(budget >= 2, ConfigError, fmt::format("SM budget of rank {}", rank), budget,
            fmt::format(">= 2 for high_throughput (a sending and a receiving block per channel; "
                        "{} ranks share the GPU)",
                        sharing));
  const int by_default = std::min(budget, kDefaultMaxBlocks) / 2 * 2;
  for (auto [op, name] : {std::pair{&lc.dispatch, "dispatch"}, std::pair{&lc.combine, "combine"}}) {
    // Combine returns the rows of the dispatch's channels: by default it has as many.
    if (op->num_blocks == 0)
      op->num_blocks = op == &lc.combine ? lc.dispatch.num_blocks : by_default;
    if (op->warps_per_block == 0) op->warps_per_block = kDefaultWarps;
    if (op->ring_rows == 0) op->ring_rows = std::max(kMinDefaultRingRows, 2 * op->warps_per_block);
    EPX_CHECK(op->num_blocks >= 2 && op->num_blocks <= budget && op->num_blocks % 2 == 0,
              ConfigError, fmt::format("{}.num_blocks (rank {})", name, rank), op->num_blocks,
              fmt::format("an even number in [2, {}]: a sending and a receiving block per channel, "
                          "all resident at once within the SM budget of a rank when {} ranks "
                          "share the GPU",
                          budget, sharing));
    EPX_CHECK(op->num_blocks / 2 <= kMaxChannels, ConfigError, fmt::format("{}.num_blocks", name),
              op->num_blocks, fmt::format("at most {} (2 x kMaxChannels)", 2 * kMaxChannels));
    EPX_CHECK(op->warps_per_block >= 1 && op->warps_per_block <= kMaxWarpsPerBlock, ConfigError,
              fmt::format("{}.warps_per_block", name), op->warps_per_block,
              "1.." + std::to_string(kMaxWarpsPerBlock));
    // A batch (one token per warp) must fit in a ring with room for the next one.
    EPX_CHECK(
        op->ring_rows >= 2 * op->warps_per_block && op->ring_rows <= kMaxRingRows, ConfigError,
        fmt::format("{}.ring_rows", name), op->ring_rows,
        fmt::format("in [2 x warps_per_block = {}, {}]", 2 * op->warps_per_block, kMaxRingRows));
  }
  EPX_CHECK(lc.combine.num_blocks == lc.dispatch.num_blocks, ConfigError, "combine.num_blocks",
            lc.combine.num_blocks,
            fmt::format("dispatch.num_blocks = {} for high_throughput (combine returns the rows "
                        "of the dispatch's channels)",
                        lc.dispatch.num_blocks));
  return HtShapeChoice{lc.dispatch.num_blocks / 2, lc};
}

void validate_for(const EpConfig& cfg) {
  cfg.validate();
  EPX_CHECK(cfg.layout == OutputLayout::kTokenMajor, ConfigError, "layout", to_string(cfg.layout),
            "token for backend high_throughput (its rows are token-major; use low_latency for "
            "expert-major rows)");
  EPX_CHECK(cfg.rounds_in_flight == 1, ConfigError, "rounds_in_flight", cfg.rounds_in_flight,
            "1 for backend high_throughput");
  EPX_CHECK(!cfg.mask_failed_ranks, ConfigError, "mask_failed_ranks", "true",
            "false for backend high_throughput (its rows are ordered: every rank's counts are "
            "needed)");
  EPX_CHECK(cfg.combine != CombineMode::kPush, ConfigError, "combine", to_string(cfg.combine),
            "auto or pull for backend high_throughput (its combine pulls in an in-process group "
            "and moves partials through its rings between processes)");
  EPX_CHECK(cfg.combine_format == CombineFormat::kBF16, ConfigError, "combine_format", "logfmt",
            "bf16 for backend high_throughput (LogFMT combine is low_latency's)");
}

class HtAll2All final : public All2All {
 public:
  // `direct`: every rank's memory is addressable by every rank's kernels (an in-process group):
  // no rings (HtLayout::direct).
  HtAll2All(const EpConfig& cfg, SymmetricBuffer buf, const HtShapeChoice& shape, bool direct)
      : cfg_(cfg),
        layout_(make_ht_layout(cfg, shape.channels, shape.lc.dispatch.ring_rows,
                               shape.lc.combine.ring_rows, direct)),
        buf_(std::move(buf)),
        launch_(shape.lc),
        status_(cfg, buf_.device()) {
    EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_rows_), sizeof(int32_t),
                                 cudaHostAllocDefault));
    if (!cfg_.worst_case_output) {
      // The receive areas' own pool, which keeps what it has mapped: returning memory to the
      // system (what the default pool does at every synchronisation) must not happen while
      // peers' kernels spin on this GPU.
      cudaMemPoolProps props{};
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = buf_.device();
      EPX_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
      uint64_t keep = UINT64_MAX;
      EPX_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep));
    } else {
      rows_cap_ = cfg_.capacity();
      EPX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&rows_), rows_bytes(rows_cap_)));
    }
#if EPX_MEASUREMENT
    clock_ = make_phase_clock(buf_.device());
#endif
  }
  ~HtAll2All() override {
    // No kernel reads or writes the areas any more: this rank's, nor (direct mode on several
    // GPUs) a peer's that may still run, e.g. after a timeout made this rank give up.
    buf_.synchronize_devices();
    const DeviceGuard guard;
    (void)cudaSetDevice(buf_.device());
#if EPX_MEASUREMENT
    if (clock_ != nullptr) {
      print_phase_clock();
      (void)cudaFree(clock_);
    }
#endif
    if (rows_ != nullptr && pool_ != nullptr) {
      (void)cudaFreeAsync(rows_, nullptr);
      (void)cudaStreamSynchronize(nullptr);
    } else if (rows_ != nullptr) {
      (void)cudaFree(rows_);
    }
    if (pool_ != nullptr) (void)cudaMemPoolDestroy(pool_);
    if (host_rows_ != nullptr) (void)cudaFreeHost(host_rows_);
  }

#if EPX_MEASUREMENT
  // EPX_PHASE_CLOCK: the mean time from a block's start at which each phase of each kernel
  // ended, over every block of every launch this object's launches served, and how long after
  // block 0 of a rank's count kernel block 0 of its transfer kernel started (stderr, at
  // destruction). With one launch per GPU the first rank's object serves the group.
  void print_phase_clock() const noexcept {
    PhaseClock h{};
    if (!read_phase_clock(clock_, buf_.device(), &h)) return;
    static constexpr const char* kCount[] = {"set_up", "ids_in",      "walked",  "routed",
                                             "counted", "placed", "counts_seen", "laid_out"};
    static constexpr const char* kTransfer[] = {"areas", "payload", "signalled", "arrived",
                                                "received"};
    static constexpr const char* kCombine[] = {"published", "partials_seen", "pulled", "all_read",
                                               "summed"};
    static_assert(std::size(kCount) == size_t(CountPhase::kCount) &&
                  std::size(kTransfer) == size_t(TransferPhase::kAfterCount) &&
                  size_t(TransferPhase::kAfterCount) + 1 == size_t(TransferPhase::kCount) &&
                  std::size(kCombine) == size_t(CombinePhase::kCount));
    print_phase_line(cfg_.rank, "ht_count", phase_entries(h, 0, kCount));
    std::string transfer = phase_entries(h, 1, kTransfer);
    const int gap = int(TransferPhase::kAfterCount);
    if (!transfer.empty() && h.count[1][gap] != 0) {
      transfer +=
          fmt::format("; block 0 started {:.2f} us after ht_count's block 0 ({} blocks)",
                      1e-3 * double(h.sum[1][gap]) / double(h.count[1][gap]), h.count[1][gap]);
    }
    print_phase_line(cfg_.rank, "ht_transfer", transfer);
    print_phase_line(cfg_.rank, "ht_combine", phase_entries(h, 2, kCombine));
  }
#endif

  const EpConfig& config() const override { return cfg_; }
  Backend backend() const override { return Backend::kHighThroughput; }
  size_t symmetric_bytes() const override { return buf_.bytes() + rows_bytes(rows_cap_); }
  uint64_t masked_ranks() const override { return 0; }
  uint64_t dropped_pairs() const override { return 0; }
  void clear_mask(cudaStream_t) override { status_.check_usable(); }

  void* combine_buffer() override {
    return rows_ == nullptr ? nullptr : rows_ + layout_of_rows().partials;
  }

  DispatchResult dispatch(const DispatchInput& in, cudaStream_t stream) override {
    HtDispatchParams p{};
    p.ranks[0] = prepare_dispatch(in, stream);
    p.common = common(1);
    const DeviceGuard guard(buf_.device());
    launch_ht_count(p, launch_.dispatch.warps_per_block, stream);
    if (!cfg_.worst_case_output) {
      read_rows_back(stream);
      EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
      size_rows(stream);
    }
    p.ranks[0].rows = rows_;
    p.ranks[0].area_rows = rows_cap_;
    launch_ht_transfer(p, cfg_.dtype, layout_.channels, launch_.dispatch.warps_per_block, stream);
    return result();
  }

  void combine(const void* expert_out, void* y, cudaStream_t stream) override {
    combine(expert_out, y, CombineExtras{}, stream);
  }
  void combine(const void* expert_out, void* y, const CombineExtras& extras,
               cudaStream_t stream) override {
    const DeviceGuard guard(buf_.device());
    HtCombineParams p{};
    p.ranks[0] = prepare_combine(expert_out, y, stream, extras);
    p.common = common(1);
    launch_ht_combine(p, layout_.channels, launch_.combine.warps_per_block, stream);
  }

  void dispatch_send(const DispatchInput&, cudaStream_t) override { no_halves("dispatch_send"); }
  DispatchResult dispatch_recv(cudaStream_t) override { no_halves("dispatch_recv"); }
  void combine_send(const void*, cudaStream_t) override { no_halves("combine_send"); }
  void combine_recv(void*, cudaStream_t) override { no_halves("combine_recv"); }

  void poll() override { status_.poll(); }
  void synchronize(cudaStream_t stream) override {
    const DeviceGuard guard(buf_.device());
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    poll();
  }

  // ---- the steps of a call, shared with the group launches ----------------------------------

  // The checks of a dispatch (nothing is launched when they throw) and this rank's arguments.
  HtDispatchRank prepare_dispatch(const DispatchInput& in, cudaStream_t stream) {
    poll();
    const int N = in.num_tokens;
    EPX_CHECK(N >= 0 && N <= cfg_.max_tokens_per_rank, InputError, "num_tokens", N,
              "0..max_tokens_per_rank = " + std::to_string(cfg_.max_tokens_per_rank));
    check_high_throughput_routing(status_, in, cfg_);
    if (N > 0) {
      status_.check_ptr(in.x, "x", 16);
      if (cfg_.input_fp8()) status_.check_ptr(in.x_scales, "x_scales", 4);
    }
    if (!cfg_.worst_case_output) check_not_capturing_counts(stream);
    ids_int64_ = in.ids_type == IdType::kInt64;
    tokens_ = N;
    dispatched_ = true;
    return HtDispatchRank{.local = buf_.local(),
                          .host_status = status_.device_mirror(),
                          .rank = cfg_.rank,
                          .num_tokens = N,
                          .x = in.x,
                          .x_scales = in.x_scales,
                          .topk_ids = in.topk_ids,
                          .topk_weights = in.topk_weights,
                          .rank_mask = in.rank_mask,
                          .expert_sums = in.expert_counts,
                          .rows = nullptr,
                          .area_rows = 0};
  }

  // Direct mode: the peers read the partials where this rank points them, so partials outside
  // the combine buffer are first copied into it (enqueued on `stream`, this rank's GPU current):
  // the caller's memory may be unreadable from the peers' GPUs (a stream-ordered pool, PyTorch's
  // expandable segments) or change after combine returns.
  HtCombineRank prepare_combine(const void* expert_out, void* y, cudaStream_t stream,
                                const CombineExtras& extras = {}) {
    status_.check_usable();
    EPX_CHECK(dispatched_, StateError, "combine", "called before any dispatch",
              "after a dispatch (combine returns the tokens of the last dispatch)");
    status_.check_ptr(expert_out, "expert_out", 16);
    // A rank without tokens writes no y: any pointer is fine (as for every backend).
    if (tokens_ > 0) status_.check_ptr(y, "y", 16);
    check_combine_extras(status_, extras, tokens_);
    const float* topk_w = extras.topk_weights;
    const int32_t* rows_now =
        reinterpret_cast<const int32_t*>(buf_.local() + layout_.state + offsetof(HtState, recv_count));
    if (layout_.direct && topk_w != nullptr) {
      // The peers read them where the rows area holds them, as the partials below.
      float* to = reinterpret_cast<float*>(rows_ + layout_of_rows().combine_w);
      if (topk_w != to) launch_ht_copy_words(topk_w, to, rows_now, cfg_.topk, stream);
      topk_w = to;
    }
    if (layout_.direct && expert_out != combine_buffer()) {
      launch_ht_copy_partials(expert_out, combine_buffer(), rows_now, cfg_.hidden, stream);
      expert_out = combine_buffer();
    }
    return HtCombineRank{.local = buf_.local(),
                         .host_status = status_.device_mirror(),
                         .rank = cfg_.rank,
                         .expert_out = expert_out,
                         .y = y,
                         .topk_w = topk_w,
                         .y_topk_w = extras.y_topk_weights,
                         .bias0 = extras.bias[0],
                         .bias1 = extras.bias[1]};
  }

  // Exact output sizes: the round's M into pinned host memory (the caller synchronises).
  void read_rows_back(cudaStream_t stream) {
    EPX_CUDA_CHECK(cudaMemcpyAsync(host_rows_,
                                   buf_.local() + layout_.state + offsetof(HtState, recv_count),
                                   sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  }

  // After read_rows_back and a synchronisation: the received rows' areas hold M rows. Grown in
  // stream order (no device-wide synchronisation, which would wait for the peers' kernels that
  // wait for this rank).
  void size_rows(cudaStream_t stream) {
    // A timeout in the count exchange surfaces here, before any transfer. Bad ids do not: the
    // peers count on this rank's rows and partials, so the round goes on (poll() raises them).
    status_.poll_fatal();
    const int M = *host_rows_;
    EPX_CHECK(M >= 0 && M <= cfg_.capacity(), PeerError, "received rows", M,
              fmt::format("0..world_size * max_tokens_per_rank = {}", cfg_.capacity()));
    if (M <= rows_cap_ && rows_ != nullptr) return;
    // Grow by a quarter at least, so that slowly rising counts reallocate rarely.
    const int want = std::min(cfg_.capacity(), std::max({M, rows_cap_ + rows_cap_ / 4, 256}));
    const DeviceGuard guard(buf_.device());
    if (rows_ != nullptr) EPX_CUDA_CHECK(cudaFreeAsync(rows_, stream));
    rows_ = nullptr;
    rows_cap_ = 0;
    EPX_CUDA_CHECK(
        cudaMallocFromPoolAsync(reinterpret_cast<void**>(&rows_), rows_bytes(want), pool_, stream));
    rows_cap_ = want;
  }

  HtCommon common(int num_ranks) const {
    return HtCommon{
        .peers = buf_.device_handle().peers,
        .layout = layout_,
        .shape = HtShape{.world = cfg_.world_size,
                         .hidden = cfg_.hidden,
                         .num_experts = cfg_.num_experts,
                         .num_local = cfg_.num_local_experts(),
                         .topk = cfg_.topk,
                         .groups = cfg_.wire_fp8() ? cfg_.num_scale_groups() : 0,
                         .wire_row_bytes = int32_t(cfg_.wire_row_bytes()),
                         .scale_col_major = cfg_.scale_layout == ScaleLayout::kColumnMajor,
                         .ids_int64 = ids_int64_,
                         .round_scale = cfg_.round_scale,
                         .highest_slot = cfg_.combine_order == CombineOrder::kHighestSlot},
        .timeout_ns = uint64_t(cfg_.timeout_ms) * 1000000ull,
        .num_ranks = num_ranks,
#if EPX_MEASUREMENT
        .clock = clock_,
#endif
    };
  }

  DispatchResult result() const {
    DispatchResult r;
    const HtRowsLayout RL = layout_of_rows();
    r.capacity = rows_cap_;
    r.combine_buffer = rows_ + RL.partials;
    r.recv_count = reinterpret_cast<const int32_t*>(buf_.local() + layout_.state +
                                                    offsetof(HtState, recv_count));
    r.recv_x = rows_ + RL.recv_x;
    r.recv_scales =
        cfg_.wire_fp8() ? reinterpret_cast<const float*>(rows_ + RL.recv_scales) : nullptr;
    r.recv_src_rank = reinterpret_cast<const int32_t*>(rows_ + RL.recv_src_rank);
    r.recv_src_idx = reinterpret_cast<const int32_t*>(rows_ + RL.recv_src_idx);
    r.recv_topk_ids = reinterpret_cast<const int32_t*>(rows_ + RL.recv_topk_ids);
    r.recv_topk_weights = reinterpret_cast<const float*>(rows_ + RL.recv_topk_w);
    r.expert_counts = reinterpret_cast<const int32_t*>(buf_.local() + layout_.expert_counts);
    return r;
  }

  // Direct mode on several GPUs: the receive areas' pool is readable and writable from the
  // peers' GPUs (allocations from a pool are not, by default, even with peer access).
  void share_areas_with(const std::vector<int>& devices) {
    if (pool_ == nullptr) return;
    for (int d : devices) {
      if (d == buf_.device()) continue;
      cudaMemAccessDesc desc{};
      desc.location.type = cudaMemLocationTypeDevice;
      desc.location.id = d;
      desc.flags = cudaMemAccessFlagsProtReadWrite;
      EPX_CUDA_CHECK(cudaMemPoolSetAccess(pool_, &desc, 1));
    }
  }

  int device() const { return buf_.device(); }
  const LaunchConfigs& launch_configs() const { return launch_; }
  const HtLayout& layout() const { return layout_; }
  uint8_t* rows() const { return rows_; }
  int rows_capacity() const { return rows_cap_; }
  const std::shared_ptr<const void>& launch_group() const { return launch_group_; }
  void set_launch_group(std::shared_ptr<const void> g) { launch_group_ = std::move(g); }

 private:
  [[noreturn]] void no_halves(const char* call) const {
    EPX_THROW(ConfigError, fmt::format("{}: backend high_throughput has no send and receive halves "
                                       "(its receive side drains rings while the send side fills "
                                       "them); call dispatch / combine, or use low_latency",
                                       call));
  }
  HtRowsLayout layout_of_rows() const {
    return rows_layout(rows_cap_, cfg_.wire_row_bytes(),
                       cfg_.wire_fp8() ? cfg_.num_scale_groups() : 0, cfg_.topk, cfg_.hidden);
  }
  size_t rows_bytes(int rows) const {
    return rows == 0
               ? 0
               : rows_layout(rows, cfg_.wire_row_bytes(),
                             cfg_.wire_fp8() ? cfg_.num_scale_groups() : 0, cfg_.topk, cfg_.hidden)
                     .total;
  }

  EpConfig cfg_;
  HtLayout layout_;
  SymmetricBuffer buf_;
  LaunchConfigs launch_;
  RankStatus status_;
  int32_t* host_rows_ = nullptr;  // pinned: the round's M, read back (exact output sizes)
  uint8_t* rows_ = nullptr;       // the received rows' areas (rows_layout of rows_cap_ rows)
  cudaMemPool_t pool_ = nullptr;  // exact sizes: where rows_ comes from
  int rows_cap_ = 0;
  int tokens_ = 0;
  bool ids_int64_ = false;
  bool dispatched_ = false;
  std::shared_ptr<const void> launch_group_;
#if EPX_MEASUREMENT
  PhaseClock* clock_ = nullptr;  // EPX_PHASE_CLOCK
#endif
};

std::vector<HtAll2All*> group_ranks(std::span<All2All* const> ranks, size_t num_args,
                                    const char* op) {
  EPX_CHECK(!ranks.empty() && ranks.size() <= size_t(kMaxLaunchRanks), InputError,
            fmt::format("{} ranks", op), ranks.size(),
            fmt::format("1..{} ranks of one GPU", kMaxLaunchRanks));
  EPX_CHECK(num_args == ranks.size(), InputError, fmt::format("{} arguments", op), num_args,
            fmt::format("one per rank ({})", ranks.size()));
  std::vector<HtAll2All*> out;
  uint64_t seen = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    auto* r = dynamic_cast<HtAll2All*>(ranks[i]);
    EPX_CHECK(r != nullptr && r->launch_group() != nullptr &&
                  (out.empty() || r->launch_group() == out.front()->launch_group()),
              InputError, fmt::format("{} ranks[{}]", op, i), "not a rank of this group",
              "ranks of one high_throughput make_all2all_group() result");
    EPX_CHECK(r->device() == (out.empty() ? r : out.front())->device(), InputError,
              fmt::format("{} ranks[{}] GPU", op, i), r->device(),
              "the GPU of ranks[0] (one launch serves one GPU)");
    const int rank = r->config().rank;
    EPX_CHECK(((seen >> rank) & 1) == 0, InputError, fmt::format("{} ranks[{}]", op, i), rank,
              "distinct ranks (given twice)");
    seen |= uint64_t(1) << rank;
    out.push_back(r);
  }
  return out;
}

}  // namespace

bool is_rank(const All2All* a) {
  return dynamic_cast<const HtAll2All*>(a) != nullptr;
}

std::vector<DispatchResult> dispatch_group(std::span<All2All* const> ranks,
                                           std::span<const DispatchInput> inputs,
                                           cudaStream_t stream) {
  const std::vector<HtAll2All*> rs = group_ranks(ranks, inputs.size(), "dispatch_group");
  for (size_t i = 0; i < inputs.size(); ++i) {
    EPX_CHECK(inputs[i].ids_type == inputs[0].ids_type, InputError,
              fmt::format("inputs[{}].ids_type", i),
              inputs[i].ids_type == IdType::kInt64 ? "int64" : "int32", "the id type of inputs[0]");
  }
  HtDispatchParams p{};
  for (size_t i = 0; i < rs.size(); ++i) {
    p.ranks[i] = rs[i]->prepare_dispatch(inputs[i], stream);
  }
  HtAll2All& first = *rs[0];
  p.common = first.common(int32_t(rs.size()));
  const int channels = first.layout().channels,
            warps = first.launch_configs().dispatch.warps_per_block;
  const DeviceGuard guard(first.device());
  launch_ht_count(p, warps, stream);
  if (!first.config().worst_case_output) {
    for (HtAll2All* r : rs) r->read_rows_back(stream);
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    // Every rank sized before any error is raised (a rank's error does not skip another's).
    std::exception_ptr first;
    for (HtAll2All* r : rs) {
      try {
        r->size_rows(stream);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }
  for (size_t i = 0; i < rs.size(); ++i) {
    p.ranks[i].rows = rs[i]->rows();
    p.ranks[i].area_rows = rs[i]->rows_capacity();
  }
  launch_ht_transfer(p, first.config().dtype, channels, warps, stream);
  std::vector<DispatchResult> out;
  for (HtAll2All* r : rs) out.push_back(r->result());
  return out;
}

void combine_group(std::span<All2All* const> ranks, std::span<const void* const> expert_out,
                   std::span<void* const> y, cudaStream_t stream) {
  const std::vector<HtAll2All*> rs = group_ranks(ranks, expert_out.size(), "combine_group");
  EPX_CHECK(y.size() == rs.size(), InputError, "combine_group y", y.size(),
            fmt::format("one per rank ({})", rs.size()));
  const DeviceGuard guard(rs[0]->device());
  HtCombineParams p{};
  for (size_t i = 0; i < rs.size(); ++i)
    p.ranks[i] = rs[i]->prepare_combine(expert_out[i], y[i], stream);
  HtAll2All& first = *rs[0];
  p.common = first.common(int32_t(rs.size()));
  launch_ht_combine(p, first.layout().channels, first.launch_configs().combine.warps_per_block,
                    stream);
}

namespace {
void preload(int device) {
  const DeviceGuard guard(device);
  load_ht_dispatch_kernels();
  load_ht_combine_kernels();
}

// The ring geometry every rank's buffer must share, appended to the start-up fingerprint.
std::string geometry(const HtShapeChoice& s) {
  return fmt::format("ht_channels={}\nht_dispatch_ring_rows={}\nht_combine_ring_rows={}\n",
                     s.channels, s.lc.dispatch.ring_rows, s.lc.combine.ring_rows);
}

SymmetricBuffer create_buffer(IpcWorld& world, size_t bytes) {
  return SymmetricBuffer::create_ipc(world, bytes);
}
SymmetricBuffer create_buffer(NcclWorld& world, size_t bytes) {
  return SymmetricBuffer::create_nccl(world, bytes);
}

template <typename World>
std::unique_ptr<All2All> make_process_rank(const EpConfig& base, World& world,
                                           const LaunchConfigs& launch) {
  EpConfig cfg = base;
  cfg.world_size = world.size();
  cfg.rank = world.rank();
  validate_for(cfg);
  const HtShapeChoice shape = resolve(launch, world.sm_budget(), cfg.rank, world.ranks_on_device());
  check_fingerprints(world.bootstrap(),
                     fingerprint(cfg, Backend::kHighThroughput) + geometry(shape));
  const HtLayout L =
      make_ht_layout(cfg, shape.channels, shape.lc.dispatch.ring_rows, shape.lc.combine.ring_rows);
  preload(world.device());
  SymmetricBuffer buf = create_buffer(world, L.total);
  return std::make_unique<HtAll2All>(cfg, std::move(buf), shape, false);
}
}  // namespace

std::vector<std::unique_ptr<All2All>> make_in_process_group(const EpConfig& base,
                                                            const InProcessWorld& world,
                                                            const LaunchConfigs& launch) {
  EpConfig cfg = base;
  cfg.world_size = world.size();
  cfg.rank = 0;
  validate_for(cfg);
  // One geometry for all (the rings must match): the tightest budget of the group decides.
  int budget = world.sm_budget(0);
  for (int r = 1; r < world.size(); ++r) budget = std::min(budget, world.sm_budget(r));
  const HtShapeChoice shape = resolve(launch, budget, 0, world.size());
  // One address space: rows and partials go straight between the ranks' areas, no rings, unless
  // the launch shapes size the rings.
  const bool direct = launch.dispatch.ring_rows == 0 && launch.combine.ring_rows == 0;
  const HtLayout L = make_ht_layout(cfg, shape.channels, shape.lc.dispatch.ring_rows,
                                    shape.lc.combine.ring_rows, direct);
  for (int r = 0; r < world.size(); ++r) preload(world.device_of(r));
  auto bufs = SymmetricBuffer::create_in_process(world, L.total);
  const auto group = std::make_shared<const int>(0);
  std::vector<int> devices;
  for (int r = 0; r < world.size(); ++r) devices.push_back(world.device_of(r));
  std::vector<std::unique_ptr<All2All>> out;
  for (int r = 0; r < world.size(); ++r) {
    EpConfig rc = cfg;
    rc.rank = r;
    auto rank = std::make_unique<HtAll2All>(rc, std::move(bufs[size_t(r)]), shape, direct);
    rank->share_areas_with(devices);
    rank->set_launch_group(group);
    out.push_back(std::move(rank));
  }
  return out;
}

std::unique_ptr<All2All> make_ipc_rank(const EpConfig& cfg, IpcWorld& world,
                                       const LaunchConfigs& launch) {
  return make_process_rank(cfg, world, launch);
}

std::unique_ptr<All2All> make_nccl_rank(const EpConfig& cfg, NcclWorld& world,
                                        const LaunchConfigs& launch) {
  return make_process_rank(cfg, world, launch);
}

size_t buffer_bytes(const EpConfig& cfg) {
  const HtShapeChoice s = resolve({}, kDefaultMaxBlocks, cfg.rank, 1);
  const size_t rings =
      make_ht_layout(cfg, s.channels, s.lc.dispatch.ring_rows, s.lc.combine.ring_rows).total;
  if (!cfg.worst_case_output) return rings;
  return rings + rows_layout(cfg.capacity(), cfg.wire_row_bytes(),
                             cfg.wire_fp8() ? cfg.num_scale_groups() : 0, cfg.topk, cfg.hidden)
                     .total;
}

}  // namespace ht
}  // namespace epx
