// make_all2all*: from a Backend to the engine that implements it. naive, allgather_reducescatter
// and low_latency run on the peer engine (src/backends/peer), which takes what distinguishes them
// as an Algorithm: each is a row of kPeerBackends. high_throughput has its own engine
// (src/backends/high_throughput): rings of fixed size instead of receive areas for every row.

#include <fmt/format.h>

#include <string>

#include "backends/collective/coll_all2all.hpp"
#include "backends/common/inputs.hpp"
#include "backends/common/rank_status.hpp"
#include "backends/high_throughput/ht_all2all.hpp"
#include "backends/peer/peer_all2all.hpp"
#include "core/device_guard.hpp"
#include "epx/all2all.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

namespace epx {

namespace {

constexpr peer::Algorithm kPeerBackends[] = {
    // naive: every rank broadcasts every token (with ids and weights) to every rank; combine is
    // an all-reduce of all rows' partials (reduce-scatter + all-gather over the peers' buffers),
    // after which each rank takes its own tokens' rows. The yardstick of vLLM's naive backend.
    {.backend = Backend::kNaive, .every_rank = true, .all_reduce = true},
    // allgather_reducescatter: dispatch all-gathers every token (with ids and weights) to every
    // rank; combine is a reduce-scatter: each rank pulls its own tokens' rows from every rank and
    // sums them in rank order. The yardstick of vLLM's allgather_reducescatter backend.
    {.backend = Backend::kAllgatherReduceScatter, .every_rank = true, .all_reduce = false},
    // low_latency: each token goes once to each rank that holds one of its experts
    // (deduplicated per rank), written straight into the peer's receive area; combine pulls the
    // partials of the ranks that got the token and sums them in rank order.
    {.backend = Backend::kLowLatency, .every_rank = false, .all_reduce = false},
};

const peer::Algorithm& algorithm_of(Backend backend) {
  for (const peer::Algorithm& algo : kPeerBackends) {
    if (algo.backend == backend) return algo;
  }
  EPX_THROW(ConfigError, "backend = " + std::to_string(int(backend)) + ", expected one of naive, "
                         "allgather_reducescatter, low_latency, high_throughput");
}

}  // namespace

void check_routing_by_ids(const DispatchInput& in, Backend backend) {
  const char* what = in.rank_mask != nullptr ? "rank_mask" : "expert_counts";
  EPX_CHECK(in.rank_mask == nullptr && in.expert_counts == nullptr, InputError, what, "set",
            fmt::format("null for backend {} (it routes by topk_ids; routing by a rank mask is "
                        "high_throughput's)",
                        to_string(backend)));
}

void check_high_throughput_routing(const RankStatus& status, const DispatchInput& in,
                                   const EpConfig& cfg) {
  const bool by_mask = in.rank_mask != nullptr;
  if (by_mask) {
    EPX_CHECK(in.topk_ids == nullptr && in.topk_weights == nullptr, InputError,
              in.topk_ids != nullptr ? "topk_ids" : "topk_weights", "set",
              "null with rank_mask (a round routes by top-k ids or by a rank mask)");
    status.check_ptr(in.expert_counts, "expert_counts", 4);
    EPX_CHECK(cfg.combine_order == CombineOrder::kRank, InputError, "rank_mask", "set",
              "null with combine_order highest_slot (the order follows the top-k ids)");
  } else {
    EPX_CHECK(in.expert_counts == nullptr, InputError, "expert_counts", "set",
              "null without rank_mask (with top-k ids the experts' rows are counted from them)");
  }
  if (in.num_tokens <= 0) return;
  if (by_mask) {
    status.check_ptr(in.rank_mask, "rank_mask", 1);
  } else {
    status.check_ptr(in.topk_ids, "topk_ids", in.ids_type == IdType::kInt64 ? 8 : 4);
    status.check_ptr(in.topk_weights, "topk_weights", 4);
  }
}

void check_not_capturing_counts(cudaStream_t stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  EPX_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  EPX_CHECK(capturing == cudaStreamCaptureStatusNone, StateError, "dispatch",
            "called on a capturing stream",
            "worst_case_output = true to capture high_throughput in a CUDA graph (without it "
            "dispatch reads the round's counts back on the host)");
}

void check_combine_extras(const RankStatus& status, const CombineExtras& extras, int tokens) {
  const bool weights = extras.topk_weights != nullptr;
  // (A rank without tokens sends its rows' weights back and gets none: its y_topk_weights, of no
  // rows, may be null.)
  EPX_CHECK(weights ? tokens == 0 || extras.y_topk_weights != nullptr
                    : extras.y_topk_weights == nullptr,
            InputError, weights ? "combine y_topk_weights" : "combine topk_weights", "null",
            std::string("set together with combine ") +
                (weights ? "topk_weights (null only where the call has no tokens)"
                         : "y_topk_weights"));
  if (weights) {
    status.check_ptr(extras.topk_weights, "combine topk_weights", 4);
    if (tokens > 0) status.check_ptr(extras.y_topk_weights, "combine y_topk_weights", 4);
  }
  for (int i = 0; i < 2; ++i) {
    if (extras.bias[i] != nullptr && tokens > 0)
      status.check_ptr(extras.bias[i], i == 0 ? "combine bias[0]" : "combine bias[1]", 16);
  }
}

void All2All::combine(const void* expert_out, void* y, const CombineExtras& extras,
                      cudaStream_t stream) {
  const char* what = extras.topk_weights != nullptr || extras.y_topk_weights != nullptr
                         ? "combine topk_weights"
                         : "combine bias";
  EPX_CHECK(extras.empty(), InputError, what, "set",
            fmt::format("none for backend {} (high_throughput's combine takes the top-k weights "
                        "and bias)",
                        to_string(backend())));
  combine(expert_out, y, stream);
}

std::vector<std::unique_ptr<All2All>> make_all2all_group(Backend backend, EpConfig cfg,
                                                         const InProcessWorld& world,
                                                         LaunchConfigs launch) {
  const DeviceGuard guard;  // creation visits every rank's GPU; the caller's stays current
  if (backend == Backend::kHighThroughput) return ht::make_in_process_group(cfg, world, launch);
  return peer::make_in_process_group(cfg, world, launch, algorithm_of(backend));
}

std::unique_ptr<All2All> make_all2all(Backend backend, EpConfig cfg, IpcWorld& world,
                                      LaunchConfigs launch) {
  const DeviceGuard guard;
  if (backend == Backend::kHighThroughput) return ht::make_ipc_rank(cfg, world, launch);
  return peer::make_ipc_rank(cfg, world, launch, algorithm_of(backend));
}

std::unique_ptr<All2All> make_all2all(Backend backend, EpConfig cfg, NcclWorld& world,
                                      LaunchConfigs launch) {
  const DeviceGuard guard;
  // Across nodes the ranks meet through NCCL's collectives: the collective engine.
  if (world.num_nodes() > 1) return coll::make_nccl_rank(backend, cfg, world);
  if (backend == Backend::kHighThroughput) return ht::make_nccl_rank(cfg, world, launch);
  return peer::make_nccl_rank(cfg, world, launch, algorithm_of(backend));
}

std::vector<DispatchResult> dispatch_group(std::span<All2All* const> ranks,
                                           std::span<const DispatchInput> inputs,
                                           cudaStream_t stream) {
  const DeviceGuard guard;
  if (!ranks.empty() && ht::is_rank(ranks[0])) return ht::dispatch_group(ranks, inputs, stream);
  return peer::dispatch_group(ranks, inputs, stream);
}

void combine_group(std::span<All2All* const> ranks, std::span<const void* const> expert_out,
                   std::span<void* const> y, cudaStream_t stream) {
  const DeviceGuard guard;
  if (!ranks.empty() && ht::is_rank(ranks[0])) return ht::combine_group(ranks, expert_out, y, stream);
  peer::combine_group(ranks, expert_out, y, stream);
}

size_t buffer_bytes(Backend backend, const EpConfig& cfg) {
  if (backend == Backend::kHighThroughput) return ht::buffer_bytes(cfg);
  return peer::buffer_bytes(cfg, algorithm_of(backend));
}

size_t low_latency_buffer_bytes(const EpConfig& cfg) {
  return peer::buffer_bytes(cfg, algorithm_of(Backend::kLowLatency));
}

}  // namespace epx
