#include "backends/peer/peer_all2all.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <iterator>
#include <optional>
#if EPX_MEASUREMENT
#include <sstream>

#include "core/env.hpp"
#endif

#include "backends/common/carve.hpp"
#include "backends/common/inputs.hpp"
#include "backends/common/phase_clock.hpp"
#include "backends/common/rank_status.hpp"
#include "backends/peer/kernels.hpp"
#include "backends/peer/layout.hpp"
#include "core/device_guard.hpp"
#include "core/logfmt.hpp"
#include "epx/bootstrap.hpp"
#include "epx/cuda_check.hpp"
#include "epx/symmetric.hpp"
#include "epx/world.hpp"

namespace epx {
namespace peer {


bool combine_pushes(const EpConfig& cfg, const Algorithm& algo, bool one_gpu) {
  if (algo.all_reduce || cfg.mask_failed_ranks) return false;
  return cfg.combine == CombineMode::kPush || (cfg.combine == CombineMode::kAuto && !one_gpu);
}

Layout make_layout(const EpConfig& cfg, const Algorithm& algo, bool push) {
  const size_t W = cfg.world_size, K = cfg.topk, H = cfg.hidden, cap = cfg.capacity();
  const size_t G = cfg.wire_fp8() ? size_t(cfg.num_scale_groups()) : 0;
  const size_t row = cfg.wire_row_bytes();
  const size_t Le = cfg.num_local_experts();
  const bool em = cfg.layout == OutputLayout::kExpertMajor;
  Layout L{};
  size_t c = 0;
  L.sent = carve(c, 2 * W * sizeof(uint64_t));
  L.next_row = carve(c, 2 * sizeof(int32_t));
  L.expert_rows = carve(c, 2 * Le * sizeof(int32_t));
  L.count_matrix = carve(c, 2 * W * W * sizeof(uint64_t));
  L.ready = carve(c, W * sizeof(int32_t));
  L.ready2 = carve(c, W * sizeof(int32_t));
  const size_t R = size_t(cfg.rounds_in_flight);
  const size_t sym_slot0 = c;
  L.recv_x = carve(c, cap * row);
  L.recv_scales = carve(c, cap * G * sizeof(float));
  L.recv_src_rank = carve(c, cap * sizeof(int32_t));
  L.recv_src_idx = carve(c, cap * sizeof(int32_t));
  L.recv_topk_ids = carve(c, cap * K * sizeof(int32_t));
  L.recv_topk_w = carve(c, cap * K * sizeof(float));
  // (expert-major push folds each row straight into its token's rank: no partials here; with
  // LogFMT an expert-major row is folded and encoded at once, and token-major partials stay
  // bf16 where the expert stage writes them, encoded on their way out)
  const bool lf = cfg.combine_format == CombineFormat::kLogFMT;
  const size_t lf_row = size_t(logfmt::row_stride(cfg.hidden));
  L.partials = carve(c, em && (push || lf) ? 0 : cap * H * (em ? sizeof(float) : sizeof(uint16_t)));
  L.pushed = carve(c, !push ? 0 : lf ? cap * lf_row : cap * H * (em ? sizeof(float) : sizeof(uint16_t)));
  L.encoded = carve(c, lf && !push ? cap * lf_row : 0);
  L.reduced = carve(c, algo.all_reduce ? cap * H * sizeof(uint16_t) : 0);
  L.sym_slot_bytes = c - sym_slot0;
  c += (R - 1) * L.sym_slot_bytes;
  L.symmetric_end = c;
  L.state = carve(c, sizeof(State));
  L.status = carve(c, sizeof(DeviceStatus));
  L.block_counts = carve(c, size_t(kMaxBlocks) * W * sizeof(int32_t));
  L.block_expert_counts = carve(c, em ? size_t(kMaxBlocks) * Le * sizeof(int32_t) : 0);
  const size_t local_slot0 = c;
  L.round = carve(c, sizeof(RoundState));
  L.send_slot = carve(c, size_t(cfg.max_tokens_per_rank) * W * sizeof(int32_t));
  L.expert_counts = carve(c, Le * sizeof(int32_t));
  const size_t em_rows = em ? Le * cap : 0;
  L.row_expert_slot = carve(c, em ? cap * K * sizeof(int32_t) : 0);
  L.expert_x = carve(c, em_rows * row);
  L.expert_scales = carve(c, em_rows * G * sizeof(float));
  L.expert_src_rank = carve(c, em_rows * sizeof(int32_t));
  L.expert_src_idx = carve(c, em_rows * sizeof(int32_t));
  L.expert_topk_slot = carve(c, em_rows * sizeof(int32_t));
  L.expert_weight = carve(c, em_rows * sizeof(float));
  L.expert_out = carve(c, em_rows * H * sizeof(uint16_t));
  L.local_slot_bytes = c - local_slot0;
  c += (R - 1) * L.local_slot_bytes;
  L.total = c;
  return L;
}

namespace {

class PeerAll2All final : public All2All {
 public:
  enum class Pending { kNone, kDispatchReceive, kCombineReceive };

  PeerAll2All(const EpConfig& cfg, const Algorithm& algo, bool push, SymmetricBuffer buf,
              LaunchConfigs launch)
      : cfg_(cfg), algo_(algo), push_(push), layout_(make_layout(cfg, algo, push)),
        buf_(std::move(buf)), launch_(launch), status_(cfg, buf_.device()),
        host_status_dev_(status_.device_mirror()) {
#if EPX_MEASUREMENT
    clock_ = make_phase_clock(buf_.device());
#endif
  }
  ~PeerAll2All() override {
#if EPX_MEASUREMENT
    if (clock_ != nullptr) {
      print_phase_clock();
      (void)cudaFree(clock_);
    }
#endif
  }

#if EPX_MEASUREMENT
  // EPX_PHASE_CLOCK: the mean time from a block's start at which each phase of each op ended,
  // over every block of every launch this object's launches served (stderr, at destruction).
  void print_phase_clock() const noexcept {
    PhaseClock h{};
    if (!read_phase_clock(clock_, buf_.device(), &h)) return;
    static constexpr const char* kDispatch[] = {"routed", "placed", "metadata", "payload",
                                                "signalled", "received", "done"};
    static constexpr const char* kCombine[] = {"published", "waited", "pulled"};
    static_assert(std::size(kDispatch) == size_t(DispatchPhase::kCount) &&
                  std::size(kCombine) == size_t(CombinePhase::kCount));
    print_phase_line(cfg_.rank, "dispatch",
                     phase_entries(h, 0, kDispatch) + start_entries(h, 0));
    print_phase_line(cfg_.rank, "combine", phase_entries(h, 1, kCombine) + start_entries(h, 1));
  }
#endif

  const EpConfig& config() const override { return cfg_; }
  Backend backend() const override { return algo_.backend; }
  size_t symmetric_bytes() const override { return buf_.bytes(); }

  uint64_t masked_ranks() const override { return status_.masked(); }
  uint64_t dropped_pairs() const override { return status_.dropped(); }
  void clear_mask(cudaStream_t stream) override {
    check_usable();
    const DeviceGuard guard(buf_.device());
    // State's first two words: masked, dropped.
    static_assert(offsetof(State, masked) == 0 && offsetof(State, dropped) == 8);
    EPX_CUDA_CHECK(cudaMemsetAsync(buf_.local() + layout_.state, 0, 16, stream));
    status_.clear_masked();
  }

  void* combine_buffer() override { return combine_buffer_of(next_combine_slot()); }

  DispatchResult dispatch(const DispatchInput& in, cudaStream_t stream) override {
    launch_dispatch_half(Half::kWhole, &in, stream);
    return result(due_.back());
  }

  using All2All::combine;  // (with extras: refused by the base class)
  void combine(const void* expert_out, void* y, cudaStream_t stream) override {
    launch_combine_half(Half::kWhole, expert_out, y, stream);
  }

  void dispatch_send(const DispatchInput& in, cudaStream_t stream) override {
    launch_dispatch_half(Half::kSend, &in, stream);
  }

  DispatchResult dispatch_recv(cudaStream_t stream) override {
    launch_dispatch_half(Half::kReceive, nullptr, stream);
    return result(due_.back());
  }

  void combine_send(const void* expert_out, cudaStream_t stream) override {
    launch_combine_half(Half::kSend, expert_out, nullptr, stream);
  }

  void combine_recv(void* y, cudaStream_t stream) override {
    launch_combine_half(Half::kReceive, nullptr, y, stream);
  }

  // One launch of dispatch (whole or a half) for this rank alone; `in` for the sending parts.
  void launch_dispatch_half(Half half, const DispatchInput* in, cudaStream_t stream) {
    DispatchParams p{};
    if (half == Half::kReceive) {
      check_usable();
      expect_receive(Pending::kDispatchReceive, "dispatch_recv", "dispatch_send");
      p.ranks[0] = DispatchRank{
          .local = buf_.local(), .host_status = host_status_dev_, .rank = cfg_.rank};
    } else {
      p.ids_int64 = in->ids_type == IdType::kInt64;
      p.ranks[0] = prepare_dispatch(*in);
    }
    p.common = launch_common(half, due_.back());
    pending_ = half == Half::kSend ? Pending::kDispatchReceive : Pending::kNone;
    const DeviceGuard guard(buf_.device());
    launch_dispatch(p, cfg_.dtype, launch_for(half, launch_.dispatch, true), stream);
  }

  // One launch of combine (whole or a half) for this rank alone.
  void launch_combine_half(Half half, const void* expert_out, void* y, cudaStream_t stream) {
    CombineParams p{};
    if (half == Half::kReceive) {
      check_usable();
      expect_receive(Pending::kCombineReceive, "combine_recv", "combine_send");
      if (slot_tokens_[combined_slot_] > 0) check_ptr(y, "y", 16);
      p.ranks[0] = CombineRank{
          .local = buf_.local(), .host_status = host_status_dev_, .rank = cfg_.rank, .y = y};
    } else {
      p.ranks[0] = prepare_combine(expert_out, y, half == Half::kWhole);
    }
    p.common = launch_common(half, combined_slot_);
    pending_ = half == Half::kSend ? Pending::kCombineReceive : Pending::kNone;
    const DeviceGuard guard(buf_.device());
    launch_combine(p, launch_for(half, launch_.combine, false), stream);
  }

  // A receive half needs its send half first (host-side order; captures follow it too).
  void expect_receive(Pending want, const char* call, const char* first) const {
    EPX_CHECK(pending_ == want, StateError, call, "called",
              fmt::format("after {} (each send half is followed by its receive half before the "
                          "next op)",
                          first));
  }

  // The launch shape of one part: dispatch's token-major receive half is block 0's alone.
  LaunchConfig launch_for(Half half, LaunchConfig lc, bool dispatch) const {
    if (dispatch && half == Half::kReceive && cfg_.layout == OutputLayout::kTokenMajor)
      lc.num_blocks = 1;
    return lc;
  }

  // This rank's part of a dispatch launch, after the host checks (nothing is launched when they
  // throw).
  DispatchRank prepare_dispatch(const DispatchInput& in) {
    poll();
    check_usable();
    EPX_CHECK(pending_ != Pending::kDispatchReceive, StateError, "dispatch", "called",
              "after dispatch_recv: the last dispatch_send's receive half is still due");
    const int N = in.num_tokens;
    EPX_CHECK(N >= 0 && N <= cfg_.max_tokens_per_rank, InputError, "num_tokens", N,
              "0..max_tokens_per_rank = " + std::to_string(cfg_.max_tokens_per_rank));
    check_routing_by_ids(in, algo_.backend);
    if (N > 0) {
      check_ptr(in.x, "x", 16);
      check_ptr(in.topk_ids, "topk_ids", in.ids_type == IdType::kInt64 ? 8 : 4);
      check_ptr(in.topk_weights, "topk_weights", 4);
      if (cfg_.input_fp8()) check_ptr(in.x_scales, "x_scales", 4);
    }
    // The round's buffer slot: a free one; with every slot due, the oldest round is abandoned
    // (its outputs are overwritten, its combine is no longer due).
    if (int(due_.size()) == cfg_.rounds_in_flight) due_.pop_front();
    int slot = 0;
    while (std::find(due_.begin(), due_.end(), slot) != due_.end()) ++slot;
    due_.push_back(slot);
    slot_tokens_[slot] = N;
    dispatched_ = true;
    return DispatchRank{.local = buf_.local(),
                        .host_status = host_status_dev_,
                        .rank = cfg_.rank,
                        .num_tokens = N,
                        .x = in.x,
                        .x_scales = in.x_scales,
                        .topk_ids = in.topk_ids,
                        .topk_weights = in.topk_weights};
  }

  // This rank's part of a combine launch. No poll() here: a bad-input error recorded by this
  // round's dispatch must not keep this rank out of the round's combine (its peers would wait
  // for it); it surfaces at synchronize() or the next dispatch.
  CombineRank prepare_combine(const void* expert_out, void* y, bool whole) {
    check_usable();
    EPX_CHECK(dispatched_, StateError, "combine", "called before any dispatch",
              "after a dispatch (combine returns the tokens of the last dispatch)");
    EPX_CHECK(pending_ != Pending::kDispatchReceive, StateError, "combine", "called",
              "after dispatch_recv: the last dispatch_send's receive half is still due");
    check_ptr(expert_out, "expert_out", 16);
    const int slot = next_combine_slot();
    // A rank without tokens writes no y: any pointer (null, or one past the end of the caller's
    // buffer, as a chunked forward's empty chunks pass) is fine.
    if (whole && slot_tokens_[slot] > 0) check_ptr(y, "y", 16);
    if (!due_.empty()) due_.pop_front();
    combined_slot_ = slot;
    return CombineRank{.local = buf_.local(),
                       .host_status = host_status_dev_,
                       .rank = cfg_.rank,
                       .expert_out = expert_out,
                       .y = y};
  }

  // The slot the next combine serves: the oldest round whose combine is due, else (every round
  // combined) the last one combined again.
  int next_combine_slot() const { return due_.empty() ? combined_slot_ : due_.front(); }
  // The slot of the last dispatch, and of the last combine (a receive half's).
  int dispatched_slot() const { return due_.back(); }
  int combined_slot() const { return combined_slot_; }

  void* combine_buffer_of(int slot) const {
    const Layout L = layout_.for_slot(slot);
    return buf_.local() + (cfg_.layout == OutputLayout::kExpertMajor ? L.expert_out : L.partials);
  }

  // What every rank of a launch shares.
  LaunchCommon launch_common(Half half, int slot) const {
    return LaunchCommon{.peers = buf_.device_handle().peers,
                        .layout = layout_.for_slot(slot),
                        .slot = slot,
                        .shape = shape(),
                        .timeout_ns = uint64_t(cfg_.timeout_ms) * 1000000ull,
                        .num_ranks = 1,
                        .half = half,
#if EPX_MEASUREMENT
                        .clock = clock_,
#endif
    };
  }

  // Ranks that may share one launch: the same in-process group, GPU, configuration and launch
  // shapes. Empty for ranks of process worlds.
  const std::shared_ptr<const void>& launch_group() const { return launch_group_; }
  void set_launch_group(std::shared_ptr<const void> g) { launch_group_ = std::move(g); }
  int device() const { return buf_.device(); }
  const LaunchConfigs& launch_configs() const { return launch_; }
  DispatchResult dispatch_result() const { return result(due_.back()); }
  void clear_pending() { pending_ = Pending::kNone; }

  void poll() override { status_.poll(); }

  void synchronize(cudaStream_t stream) override {
    const DeviceGuard guard(buf_.device());
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
    poll();
  }

 private:
  void check_usable() const { status_.check_usable(); }
  void check_ptr(const void* p, const char* name, size_t align) const {
    status_.check_ptr(p, name, align);
  }
  Shape shape() const {
    return Shape{.world = cfg_.world_size,
                 .hidden = cfg_.hidden,
                 .num_experts = cfg_.num_experts,
                 .num_local = cfg_.num_local_experts(),
                 .topk = cfg_.topk,
                 .max_tokens = cfg_.max_tokens_per_rank,
                 .capacity = cfg_.capacity(),
                 .groups = cfg_.num_scale_groups(),
                 .expert_major = cfg_.layout == OutputLayout::kExpertMajor,
                 .scale_col_major = cfg_.scale_layout == ScaleLayout::kColumnMajor,
                 .wire_row_bytes = int32_t(cfg_.wire_row_bytes()),
                 .every_rank = algo_.every_rank,
                 .all_reduce = algo_.all_reduce,
                 // the naive all-reduce needs every rank to hold the same rows in the same order
                 .ordered = cfg_.deterministic || algo_.all_reduce,
                 .mask_failed = cfg_.mask_failed_ranks,
                 .push = push_,
                 .round_scale = cfg_.round_scale,
                 .logfmt = cfg_.combine_format == CombineFormat::kLogFMT,
#if EPX_MEASUREMENT
                 .ablate = ablate_,
#endif
    };
  }
  DispatchResult result(int slot) const {
    uint8_t* b = buf_.local();
    const Layout L = layout_.for_slot(slot);
    DispatchResult r;
    r.capacity = cfg_.capacity();
    r.combine_buffer = combine_buffer_of(slot);
    r.recv_count = reinterpret_cast<const int32_t*>(b + L.round + offsetof(RoundState, recv_count));
    r.recv_x = b + L.recv_x;
    r.recv_scales = cfg_.wire_fp8() ? reinterpret_cast<const float*>(b + L.recv_scales) : nullptr;
    r.recv_src_rank = reinterpret_cast<const int32_t*>(b + L.recv_src_rank);
    r.recv_src_idx = reinterpret_cast<const int32_t*>(b + L.recv_src_idx);
    r.recv_topk_ids = reinterpret_cast<const int32_t*>(b + L.recv_topk_ids);
    r.recv_topk_weights = reinterpret_cast<const float*>(b + L.recv_topk_w);
    r.expert_counts = reinterpret_cast<const int32_t*>(b + L.expert_counts);
    if (cfg_.layout == OutputLayout::kExpertMajor) {
      r.expert_x = b + L.expert_x;
      r.expert_scales = cfg_.wire_fp8() ? reinterpret_cast<const float*>(b + L.expert_scales) : nullptr;
      r.expert_src_rank = reinterpret_cast<const int32_t*>(b + L.expert_src_rank);
      r.expert_src_idx = reinterpret_cast<const int32_t*>(b + L.expert_src_idx);
      r.expert_topk_slot = reinterpret_cast<const int32_t*>(b + L.expert_topk_slot);
      r.expert_weight = reinterpret_cast<const float*>(b + L.expert_weight);
    }
    return r;
  }

  EpConfig cfg_;
  Algorithm algo_;
  bool push_;  // combine pushes (combine_pushes())
  Layout layout_;
  SymmetricBuffer buf_;
  LaunchConfigs launch_;
  RankStatus status_;
  DeviceStatus* host_status_dev_;  // status_'s mirror as kernels address it
  bool dispatched_ = false;  // a dispatch was enqueued (combine has a round to serve)
  std::deque<int> due_;      // buffer slots of the rounds whose combine is due, oldest first
  int combined_slot_ = 0;    // the slot of the last combine
  int slot_tokens_[kMaxRoundsInFlight] = {};  // num_tokens of each slot's round (y's rows)
  std::shared_ptr<const void> launch_group_;
  Pending pending_ = Pending::kNone;  // the receive half this rank owes (host-side call order)
#if EPX_MEASUREMENT
  int32_t ablate_ = ablate_from_env();
  PhaseClock* clock_ = nullptr;  // EPX_PHASE_CLOCK
#endif
};

// Default warps per dispatch block. Measured on an H200 (8 in-process ranks, DeepSeek-R1 shape,
// 4096 tokens/rank, 16 blocks): 32 warps 637 us, 16 warps 654 us, 8 warps 916 us; the payload
// items of one warp have few loads in flight, so more warps per block keep HBM busier.
constexpr int kDefaultDispatchWarps = 32;
// Default warps per combine block. Measured by `epx tune` on an H200 (same world and shape, 16
// blocks): 32 warps 53.3 us vs 16 warps 59.6 us at 128 tokens/rank, 832 us vs 859 us at 4096.
constexpr int kDefaultCombineWarps = 32;

// Default blocks per op and rank: at most 16 SMs, so that a rank with a GPU of its own leaves the
// rest to the compute that overlaps its communication (MoeLayer::forward_pair, an engine's other
// micro-batch). 8 ranks sharing an H200 get 16 each from their budget anyway (132 / 8), the shape
// every figure of docs/perf-notes.md was measured with. EPX_CONFIG_PATH sets more.
constexpr int kDefaultMaxBlocks = 16;

LaunchConfig resolve(LaunchConfig lc, int budget, const char* op, int rank, int world_size,
                     int default_warps) {
  if (lc.warps_per_block == 0) lc.warps_per_block = default_warps;
  if (lc.num_blocks == 0) lc.num_blocks = std::min(budget, kDefaultMaxBlocks);
  EPX_CHECK(lc.num_blocks >= 1 && lc.num_blocks <= budget, ConfigError,
            fmt::format("{}.num_blocks (rank {})", op, rank), lc.num_blocks,
            fmt::format("1..{}: the SM budget of one rank when {} ranks share the GPU (more "
                        "blocks could not all be resident and the ranks would wait forever)",
                        budget, world_size));
  EPX_CHECK(lc.warps_per_block >= 1 && lc.warps_per_block <= kMaxWarpsPerBlock, ConfigError,
            fmt::format("{}.warps_per_block", op), lc.warps_per_block,
            "1.." + std::to_string(kMaxWarpsPerBlock));
  return lc;
}

// The checks shared by every world (cfg.rank and cfg.world_size already set).
void validate_for(const EpConfig& cfg, const Algorithm& algo) {
  cfg.validate();
  // Expert-major expansion keeps one counter per local expert in shared memory.
  EPX_CHECK(cfg.layout != OutputLayout::kExpertMajor || cfg.num_local_experts() <= kMaxExpertMajorLocal,
            ConfigError, "num_experts / world_size", cfg.num_local_experts(),
            fmt::format("at most {} for the expert-major layout", kMaxExpertMajorLocal));
  // The naive combine is an all-reduce over every rank's rows: nothing to push.
  EPX_CHECK(cfg.combine != CombineMode::kPush || !algo.all_reduce, ConfigError, "combine",
            to_string(cfg.combine), "auto or pull with backend naive (its combine is an all-reduce)");
  // A masked sender's reserved rows may carry no metadata (it stopped mid-round): push would
  // write their stale partials into live ranks. Masking pulls.
  EPX_CHECK(cfg.combine != CombineMode::kPush || !cfg.mask_failed_ranks, ConfigError, "combine",
            to_string(cfg.combine), "auto or pull with mask_failed_ranks = true");
  // The naive all-reduce orders its rows (every rank must hold the same rows): no masking.
  EPX_CHECK(!cfg.mask_failed_ranks || algo.backend != Backend::kNaive, ConfigError,
            "mask_failed_ranks", "true", "false with backend naive (its rows are ordered)");
  // LogFMT rows are encoded where the partials leave and decoded in the pull's rank-order sum:
  // low_latency's combine. (The baselines' combines stand for vLLM's bf16 collectives.)
  EPX_CHECK(cfg.combine_format == CombineFormat::kBF16 || takes_logfmt_combine(algo.backend),
            ConfigError, "combine_format", "logfmt",
            std::string("bf16 for backend ") + to_string(algo.backend) +
                " (LogFMT combine is low_latency's)");
  EPX_CHECK(cfg.combine_order == CombineOrder::kRank || takes_highest_slot_order(algo.backend),
            ConfigError, "combine_order", to_string(cfg.combine_order),
            std::string("rank for backend ") + to_string(algo.backend) +
                " (the highest-slot order is high_throughput's)");
  // The baselines deliver every token of every rank in the token-major layout only.
  EPX_CHECK(algo.backend == Backend::kLowLatency || cfg.layout == OutputLayout::kTokenMajor,
            ConfigError, "layout", to_string(cfg.layout),
            std::string("token (backend ") + to_string(algo.backend) +
                " has no expert-major output; use low_latency)");
}

}  // namespace

namespace {

// The ranks of one launch, checked: distinct ranks of one in-process group on one GPU, with the
// same launch shape. The first rank's peer table serves all (an in-process group's tables are
// identical: plain device pointers).
std::vector<PeerAll2All*> launch_ranks(std::span<All2All* const> ranks, size_t num_args,
                                       const char* op) {
  EPX_CHECK(!ranks.empty() && ranks.size() <= size_t(kMaxLaunchRanks), InputError,
            fmt::format("{} ranks", op), ranks.size(),
            fmt::format("1..{} ranks of one GPU", kMaxLaunchRanks));
  EPX_CHECK(num_args == ranks.size(), InputError, fmt::format("{} arguments", op), num_args,
            fmt::format("one per rank ({})", ranks.size()));
  std::vector<PeerAll2All*> out;
  uint64_t seen = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    auto* r = dynamic_cast<PeerAll2All*>(ranks[i]);
    EPX_CHECK(r != nullptr && r->launch_group() != nullptr, InputError,
              fmt::format("{} ranks[{}]", op, i), "not a rank of make_all2all_group()",
              "ranks of one in-process group");
    const PeerAll2All& first = out.empty() ? *r : *out.front();
    EPX_CHECK(r->launch_group() == first.launch_group(), InputError,
              fmt::format("{} ranks[{}]", op, i), "a rank of another group",
              "ranks of one in-process group");
    EPX_CHECK(r->device() == first.device(), InputError, fmt::format("{} ranks[{}] GPU", op, i),
              r->device(), fmt::format("GPU {} (one launch serves one GPU)", first.device()));
    const LaunchConfigs& a = r->launch_configs();
    const LaunchConfigs& b = first.launch_configs();
    EPX_CHECK(a.dispatch.num_blocks == b.dispatch.num_blocks &&
                  a.dispatch.warps_per_block == b.dispatch.warps_per_block &&
                  a.combine.num_blocks == b.combine.num_blocks &&
                  a.combine.warps_per_block == b.combine.warps_per_block,
              InputError, fmt::format("{} ranks[{}] launch shape", op, i), r->config().rank,
              "the launch shape of ranks[0]");
    const int rank = r->config().rank;
    EPX_CHECK(((seen >> rank) & 1) == 0, InputError, fmt::format("{} ranks[{}]", op, i), rank,
              "distinct ranks (given twice)");
    seen |= uint64_t(1) << rank;
    out.push_back(r);
  }
  return out;
}

// The ranks of one launch serve the same round slot: their sequences of dispatches and combines
// agree (they do unless a caller mixed per-rank calls and group calls differently).
void check_same_slot(int slot, int first, size_t i, const char* op) {
  EPX_CHECK(slot == first, StateError, fmt::format("{} ranks[{}] buffer slot", op, i), slot,
            fmt::format("slot {} of ranks[0]: every rank's calls must follow the same sequence of "
                        "dispatches and combines",
                        first));
}

}  // namespace

std::vector<DispatchResult> dispatch_group(std::span<All2All* const> ranks,
                                           std::span<const DispatchInput> inputs,
                                           cudaStream_t stream) {
  const std::vector<PeerAll2All*> rs = launch_ranks(ranks, inputs.size(), "dispatch_group");
  const bool int64_ids = inputs[0].ids_type == IdType::kInt64;
  for (size_t i = 0; i < inputs.size(); ++i) {
    EPX_CHECK((inputs[i].ids_type == IdType::kInt64) == int64_ids, InputError,
              fmt::format("inputs[{}].ids_type", i), int64_ids ? "int32" : "int64",
              "the id type of inputs[0]");
  }
  DispatchParams p{};
  p.ids_int64 = int64_ids;
  for (size_t i = 0; i < rs.size(); ++i) {
    p.ranks[i] = rs[i]->prepare_dispatch(inputs[i]);
    rs[i]->clear_pending();
    check_same_slot(rs[i]->dispatched_slot(), rs[0]->dispatched_slot(), i, "dispatch_group");
  }
  p.common = rs[0]->launch_common(Half::kWhole, rs[0]->dispatched_slot());
  p.common.num_ranks = int32_t(rs.size());
  const DeviceGuard guard(rs[0]->device());
  launch_dispatch(p, rs[0]->config().dtype, rs[0]->launch_configs().dispatch, stream);
  std::vector<DispatchResult> out;
  for (PeerAll2All* r : rs) out.push_back(r->dispatch_result());
  return out;
}

void combine_group(std::span<All2All* const> ranks, std::span<const void* const> expert_out,
                   std::span<void* const> y, cudaStream_t stream) {
  const std::vector<PeerAll2All*> rs = launch_ranks(ranks, expert_out.size(), "combine_group");
  EPX_CHECK(y.size() == rs.size(), InputError, "combine_group y", y.size(),
            fmt::format("one per rank ({})", rs.size()));
  CombineParams p{};
  for (size_t i = 0; i < rs.size(); ++i) {
    p.ranks[i] = rs[i]->prepare_combine(expert_out[i], y[i], true);
    rs[i]->clear_pending();
    check_same_slot(rs[i]->combined_slot(), rs[0]->combined_slot(), i, "combine_group");
  }
  p.common = rs[0]->launch_common(Half::kWhole, rs[0]->combined_slot());
  p.common.num_ranks = int32_t(rs.size());
  const DeviceGuard guard(rs[0]->device());
  launch_combine(p, rs[0]->launch_configs().combine, stream);
}

void preload_kernels(int device) {
  const DeviceGuard guard(device);
  load_dispatch_kernels();
  load_combine_kernels();
}

std::vector<std::unique_ptr<All2All>> make_in_process_group(const EpConfig& base,
                                                            const InProcessWorld& world,
                                                            const LaunchConfigs& launch,
                                                            const Algorithm& algo) {
  EpConfig cfg = base;
  cfg.world_size = world.size();
  cfg.rank = 0;
  validate_for(cfg, algo);
  bool one_gpu = true;
  for (int r = 1; r < world.size(); ++r) one_gpu = one_gpu && world.device_of(r) == world.device_of(0);
  const bool push = combine_pushes(cfg, algo, one_gpu);
  const Layout L = make_layout(cfg, algo, push);
  for (int r = 0; r < world.size(); ++r) preload_kernels(world.device_of(r));
  auto bufs = SymmetricBuffer::create_in_process(world, L.total);
  // Identity of this group for launches that serve several of its ranks.
  const auto group = std::make_shared<const int>(0);
  std::vector<std::unique_ptr<All2All>> out;
  for (int r = 0; r < world.size(); ++r) {
    EpConfig rc = cfg;
    rc.rank = r;
    const int budget = world.sm_budget(r);
    // Defaults measured on an H200 with 8 ranks sharing it (docs/perf-notes.md): combine is
    // bound by the latency of remote reads and gains from more warps in flight.
    LaunchConfigs lc{resolve(launch.dispatch, budget, "dispatch", r, world.size(), kDefaultDispatchWarps),
                     resolve(launch.combine, budget, "combine", r, world.size(), kDefaultCombineWarps)};
    auto rank = std::make_unique<PeerAll2All>(rc, algo, push, std::move(bufs[r]), lc);
    rank->set_launch_group(group);
    out.push_back(std::move(rank));
  }
  return out;
}

namespace {

SymmetricBuffer create_buffer(IpcWorld& world, size_t bytes) {
  return SymmetricBuffer::create_ipc(world, bytes);
}
SymmetricBuffer create_buffer(NcclWorld& world, size_t bytes) {
  return SymmetricBuffer::create_nccl(world, bytes);
}

// One process per rank (IpcWorld, NcclWorld): the same steps, the worlds differ only in how the
// symmetric buffer is shared.
template <typename World>
std::unique_ptr<All2All> make_process_rank(const EpConfig& base, World& world,
                                           const LaunchConfigs& launch, const Algorithm& algo) {
  EpConfig cfg = base;
  cfg.world_size = world.size();
  cfg.rank = world.rank();
  validate_for(cfg, algo);
  // Every rank must build the same object: compare before anything is allocated, so that a
  // mismatch is one ConfigError on every rank rather than a size error or a hang later.
  check_fingerprints(world.bootstrap(), cfg, algo.backend);
  // Ranks that share a GPU run concurrently (time-sliced between processes): the same SM
  // budget as an in-process world, and the same defaults (docs/perf-notes.md). Resolved before
  // the collective allocation, so that a shape this GPU cannot hold fails here, on this rank,
  // and its peers hear of it from the allocation (PeerError) instead of waiting in a kernel.
  const int budget = world.sm_budget();
  const int sharing = world.ranks_on_device();
  LaunchConfigs lc{resolve(launch.dispatch, budget, "dispatch", cfg.rank, sharing, kDefaultDispatchWarps),
                   resolve(launch.combine, budget, "combine", cfg.rank, sharing, kDefaultCombineWarps)};
  // Every rank sees the same: all ranks on one GPU or not.
  const bool push = combine_pushes(cfg, algo, world.ranks_on_device() == world.size());
  const Layout L = make_layout(cfg, algo, push);
  preload_kernels(world.device());
  SymmetricBuffer buf = create_buffer(world, L.total);
  return std::make_unique<PeerAll2All>(cfg, algo, push, std::move(buf), lc);
}

}  // namespace

std::unique_ptr<All2All> make_ipc_rank(const EpConfig& cfg, IpcWorld& world,
                                       const LaunchConfigs& launch, const Algorithm& algo) {
  return make_process_rank(cfg, world, launch, algo);
}

std::unique_ptr<All2All> make_nccl_rank(const EpConfig& cfg, NcclWorld& world,
                                        const LaunchConfigs& launch, const Algorithm& algo) {
  return make_process_rank(cfg, world, launch, algo);
}

#if EPX_MEASUREMENT
int32_t ablate_from_env() {
  const std::string env = env::ablate_text();
  if (env.empty()) return 0;
  int32_t bits = 0;
  std::string item;
  std::stringstream ss(env);
  while (std::getline(ss, item, ',')) {
    if (item == "payload") {
      bits |= kAblatePayload;
    } else if (item == "pull") {
      bits |= kAblatePull;
    } else {
      EPX_THROW(ConfigError, fmt::format("EPX_ABLATE = '{}': '{}' is not a stage; expected a comma "
                                         "list of payload, pull (measuring aid only)",
                                         env, item));
    }
  }
  return bits;
}
#endif

size_t buffer_bytes(const EpConfig& cfg, const Algorithm& algo) {
  return make_layout(cfg, algo, combine_pushes(cfg, algo, true)).total;
}

}  // namespace peer
}  // namespace epx
