#include "backends/common/rank_status.hpp"

#include <atomic>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstring>
#include <optional>

#include "epx/cuda_check.hpp"
#include "epx/error.hpp"

namespace epx {

RankStatus::RankStatus(const EpConfig& cfg, int device) : cfg_(cfg), device_(device) {
  EPX_CUDA_CHECK(cudaSetDevice(device_));
  // A HostMirror: the status, then what masking did (&mirror->status == mirror_).
  EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&mirror_), sizeof(HostMirror),
                               cudaHostAllocMapped));
  std::memset(mirror_, 0, sizeof(HostMirror));
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mirror_dev_), mirror_, 0));
}

RankStatus::~RankStatus() {
  if (mirror_ != nullptr) (void)cudaFreeHost(mirror_);
}

uint64_t RankStatus::masked() const {
  return reinterpret_cast<const volatile HostMirror*>(mirror_)->masked;
}

uint64_t RankStatus::dropped() const {
  return reinterpret_cast<const volatile HostMirror*>(mirror_)->dropped;
}

void RankStatus::clear_masked() {
  auto* mirror = reinterpret_cast<volatile HostMirror*>(mirror_);
  mirror->masked = 0;
  mirror->dropped = 0;
}

void RankStatus::check_usable() const {
  if (failed_) {
    EPX_THROW(StateError, fmt::format("rank {}: this All2All refuses further calls after an "
                                      "earlier error; recreate it. The error was: {}",
                                      cfg_.rank, first_error_));
  }
}

void RankStatus::poll() {
  check_usable();
  const std::optional<DeviceStatus> recorded = recorded_status(*mirror_);
  if (!recorded) return;
  failed_ = true;
  try {
    raise(*recorded);
  } catch (const Error& e) {
    first_error_ = e.what();
    throw;
  }
}

void RankStatus::record_from_host(StatusCode code, Phase phase, int64_t expected, int64_t seen) {
  if (recorded_status(*mirror_)) return;
  DeviceStatus& m = *mirror_;
  if (std::atomic_ref<int32_t>(m.code).exchange(int32_t(code)) != int32_t(StatusCode::kNone))
    return;  // a kernel is recording its own
  m.phase = int32_t(phase);
  m.rank = cfg_.rank;
  m.peer = -1;
  m.expected = expected;
  m.seen = seen;
  m.token = -1;
  m.slot = -1;
  m.call = 0;
  std::atomic_ref<int32_t>(m.valid).store(1, std::memory_order_release);
}

void RankStatus::poll_fatal() {
  check_usable();
  const std::optional<DeviceStatus> recorded = recorded_status(*mirror_);
  if (recorded && StatusCode(recorded->code) != StatusCode::kInput) poll();
}

void RankStatus::raise(const DeviceStatus& s) const {
  const std::string where =
      s.call > 0 ? fmt::format("rank {} in {} (call {})", s.rank, to_string(Phase(s.phase)), s.call)
                 : fmt::format("rank {} in {}", s.rank, to_string(Phase(s.phase)));
  switch (StatusCode(s.code)) {
    case StatusCode::kTimeout:
      if (Phase(s.phase) == Phase::kGridBarrier) {
        EPX_THROW(TimeoutError,
                  fmt::format("{}: the blocks of this rank's own kernel did not all become "
                              "resident within {} ms (generation expected {}, seen {}); the "
                              "launch shape exceeds what the GPU can hold at once",
                              where, cfg_.timeout_ms, s.expected, s.seen));
      }
      if (Phase(s.phase) == Phase::kRingSpace) {
        EPX_THROW(TimeoutError,
                  fmt::format("{}: waited {} ms for rank {} to read a ring this rank writes "
                              "(position expected {}, saw {}); rank {} did not take part in this "
                              "call or failed",
                              where, cfg_.timeout_ms, s.peer, s.expected, s.seen, s.peer));
      }
      EPX_THROW(TimeoutError,
                fmt::format("{}: waited {} ms for rank {} (expected {}, saw {}); rank {} did "
                            "not take part in this call or failed",
                            where, cfg_.timeout_ms, s.peer, s.expected, s.seen, s.peer));
    case StatusCode::kInput:
      if (s.expected >= 0 && s.expected < cfg_.topk && s.seen >= 0 && s.seen < cfg_.num_experts) {
        EPX_THROW(InputError,
                  fmt::format("{}: topk_ids[{}][{}] = {} repeats the expert of slot {}; each "
                              "token must list distinct experts (the token was not sent)",
                              where, s.token, s.slot, s.seen, s.expected));
      }
      EPX_THROW(InputError,
                fmt::format("{}: topk_ids[{}][{}] = {}, expected -1 or an expert id in [0, {}) "
                            "(the token was not sent)",
                            where, s.token, s.slot, s.seen, cfg_.num_experts));
    case StatusCode::kPeer:
      EPX_THROW(PeerError,
                fmt::format("{}: rank {} sent its rows of this round into buffer slot {}, this "
                            "rank expected slot {}: the ranks' sequences of dispatches and "
                            "combines differ (a captured graph replayed where the eager calls "
                            "beside it would use the other slot?)",
                            where, s.peer, s.seen, s.expected));
    default:
      EPX_THROW(PeerError, fmt::format("{}: device error code {} (peer {}, expected {}, saw {})",
                                       where, s.code, s.peer, s.expected, s.seen));
  }
}

void RankStatus::check_ptr(const void* p, const char* name, size_t align) const {
  EPX_CHECK(p != nullptr, InputError, name, "nullptr", "a device pointer");
  EPX_CHECK(reinterpret_cast<uintptr_t>(p) % align == 0, InputError, name, p,
            std::to_string(align) + "-byte alignment");
  // A host pointer would fault inside the kernel and take every rank's context with it.
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    attr.type = cudaMemoryTypeUnregistered;
  }
  const bool on_device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  EPX_CHECK(on_device, InputError, name, p,
            fmt::format("device memory on GPU {} (this is {} memory)", device_,
                        attr.type == cudaMemoryTypeHost ? "pinned host" : "unregistered host"));
  // Another GPU's memory would be read through the link at best, or fault (without peer access)
  // and take every rank's context with it. Managed memory migrates: any GPU is fine.
  EPX_CHECK(attr.type == cudaMemoryTypeManaged || attr.device == device_, InputError, name, p,
            fmt::format("device memory on GPU {}, this rank's (this is memory of GPU {})", device_,
                        attr.device));
}

}  // namespace epx
