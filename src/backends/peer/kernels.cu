// low_latency dispatch and combine kernels.
//
// Dispatch, on every rank s, one kernel:
//   1. route:   warp 0 of each block walks the block's tokens in order, several tokens per
//               step (one lane per top-k entry); for each destination rank r it gives the token
//               its position among the block's tokens sent to r (ballots), so rows end up
//               ordered by (source rank, source index).
//   2. counts:  block 0 posts s's per-destination row counts into every rank's count matrix;
//               every block then waits for the full W x W matrix (this exchange is also the
//               barrier that makes it safe to overwrite the peers' receive areas).
//   3. send:    one warp per token writes the row (quantised on the fly for bf16-to-fp8) and its
//               metadata straight into each destination rank's receive area, once per rank.
//   4. arrive:  each block adds the rows it sent to r to r's arrival counter (release); each
//               rank waits until every sender's rows have arrived.
//   5. finish:  per-local-expert counts (token-major) or expansion into expert rows
//               (expert-major); the last block resets the arrival counters and bumps the epoch.
// Combine, on every rank:
//   A. publish: partials (copied in, or folded from expert rows in f32) are ready; the last
//               block tells every rank so.
//   B. pull:    one warp per (token, column chunk) reads the partial of each rank that got the
//               token, in rank order, sums in f32 and writes bf16.
// Every wait is bounded (WaitContext); epochs live in State and are advanced by the kernels.

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "backends/peer/kernels.hpp"
#include "core/cuda_check.hpp"
#include "core/fp8.cuh"
#include "core/sync_device.cuh"

namespace epx::peer {
namespace {

using dev::WaitContext;

constexpr int kWarp = 32;

struct Ctx {
  const Layout& L;
  const Shape& S;
  uint8_t* local;
  State* state;
  WaitContext wait;
};

__device__ __forceinline__ WaitContext make_wait(const SymmetricHandle& sym, const Layout& L,
                                                 const Waits& w) {
  return WaitContext{reinterpret_cast<DeviceStatus*>(sym.local + L.status), w.host_status,
                     w.timeout_ns, sym.rank};
}

template <typename T>
__device__ __forceinline__ T* at(uint8_t* base, size_t off) {
  return reinterpret_cast<T*>(base + off);
}

__device__ __forceinline__ size_t scale_index(const Shape& S, int row, int group, int rows) {
  return S.scale_col_major ? size_t(group) * rows + row : size_t(row) * S.groups + group;
}

// ---- payload movement ----------------------------------------------------------------------

// Loads 8 bf16 as floats.
__device__ __forceinline__ void bf16x8_to_float(const int4 v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

// 16-byte vectors per lane that one payload item loads before its stores (all in flight).
constexpr int kMaxSteps = 4;

// One item of token n's payload: columns [step0, step0 + nsteps) x kWarp x (elements per
// 16-byte vector), sent to the destinations in `dmask` (bits = ranks; slot of rank r in lane r%32
// of slot_lo / slot_hi). Each lane first loads all its vectors of the item, then stores them to
// every destination. The item with step0 == 0 also sends the token's fp8 scales. Called by one
// whole warp.
template <DispatchDtype kDtype>
__device__ __forceinline__ void send_payload(const DispatchParams& p, uint8_t* const* peers,
                                             int n, uint64_t dmask, int slot_lo, int slot_hi,
                                             int lane, int step0, int nsteps) {
  const Shape& S = p.shape;
  const Layout& L = p.layout;
  const int H = S.hidden;
  auto slot_of = [&](int r) {
    return __shfl_sync(0xffffffffu, r < 32 ? slot_lo : slot_hi, r & 31);
  };
  constexpr int kPer = kDtype == DispatchDtype::kFP8 ? 16 : 8;  // elements per vector
  constexpr int kInBytes = kDtype == DispatchDtype::kFP8 ? 1 : 2;
  const uint8_t* src = static_cast<const uint8_t*>(p.x) + size_t(n) * H * kInBytes;
  int4 v[kMaxSteps];
#pragma unroll
  for (int u = 0; u < kMaxSteps; ++u) {
    const int col = ((step0 + u) * kWarp + lane) * kPer;
    v[u] = make_int4(0, 0, 0, 0);
    if (u < nsteps && col < H) v[u] = __ldg(reinterpret_cast<const int4*>(src + size_t(col) * kInBytes));
  }
  if constexpr (kDtype != DispatchDtype::kBF16ToFP8) {
    constexpr int kOutBytes = kDtype == DispatchDtype::kFP8 ? 1 : 2;
    for (uint64_t m = dmask; m; m &= m - 1) {
      const int r = __ffsll(static_cast<long long>(m)) - 1;
      uint8_t* dst = peers[r] + L.recv_x + size_t(slot_of(r)) * H * kOutBytes;
#pragma unroll
      for (int u = 0; u < kMaxSteps; ++u) {
        const int col = ((step0 + u) * kWarp + lane) * kPer;
        if (u < nsteps && col < H) *reinterpret_cast<int4*>(dst + size_t(col) * kOutBytes) = v[u];
      }
    }
    if (kDtype == DispatchDtype::kFP8 && step0 == 0) {
      for (uint64_t m = dmask; m; m &= m - 1) {
        const int r = __ffsll(static_cast<long long>(m)) - 1;
        const int slot = slot_of(r);
        float* dst = reinterpret_cast<float*>(peers[r] + L.recv_scales);
        for (int g = lane; g < S.groups; g += kWarp)
          dst[scale_index(S, slot, g, S.capacity)] = __ldg(p.x_scales + size_t(n) * S.groups + g);
      }
    }
  } else {
    // Quantised in place: 8 bf16 -> 8 fp8 per lane, the half-warp's 1x128 block sharing a scale.
    uint2 q[kMaxSteps];
    float sc[kMaxSteps];
#pragma unroll
    for (int u = 0; u < kMaxSteps; ++u) {
      float f[8];
      bf16x8_to_float(v[u], f);  // zeros where nothing was loaded
      q[u] = make_uint2(0, 0);
      sc[u] = 0.f;
      if (u < nsteps) q[u] = dev::quantize_fp8_block<8>(f, sc[u]);  // u < nsteps is warp-uniform
    }
    for (uint64_t m = dmask; m; m &= m - 1) {
      const int r = __ffsll(static_cast<long long>(m)) - 1;
      const int slot = slot_of(r);
      uint8_t* dst = peers[r] + L.recv_x + size_t(slot) * H;
      float* dsc = reinterpret_cast<float*>(peers[r] + L.recv_scales);
#pragma unroll
      for (int u = 0; u < kMaxSteps; ++u) {
        const int col = ((step0 + u) * kWarp + lane) * kPer;
        if (u < nsteps && col < H) {
          *reinterpret_cast<uint2*>(dst + col) = q[u];
          if (lane % (kFp8BlockSize / kPer) == 0)  // the block's first lane
            dsc[scale_index(S, slot, col / kFp8BlockSize, S.capacity)] = sc[u];
        }
      }
    }
  }
}

// ---- dispatch ------------------------------------------------------------------------------

template <DispatchDtype kDtype>
__global__ void __launch_bounds__(1024) dispatch_kernel(const DispatchParams p) {
  const Shape& S = p.shape;
  const Layout& L = p.layout;
  const int W = S.world, s = S.rank, K = S.topk;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int num_warps = blockDim.x / kWarp;
  const int nb = gridDim.x, b = blockIdx.x;
  uint8_t* local = p.sym.local;
  State* state = at<State>(local, L.state);
  WaitContext wait = make_wait(p.sym, L, p.waits);

  __shared__ uint8_t* peers[kMaxRanks];
  __shared__ int32_t base[kMaxRanks];
  __shared__ int32_t recv_total;
  __shared__ int32_t failed;
  extern __shared__ int32_t expert_scratch[];  // [E/W], expert-major expansion

  if (dev::aborted(wait)) return;  // an earlier call timed out: the peers' state is unknown
  const uint32_t epoch = state->dispatch_epoch + 1;
  const int par = epoch & 1;
  wait.call = epoch;
  for (int r = threadIdx.x; r < W; r += blockDim.x) peers[r] = p.sym.peers[r];
  if (threadIdx.x == 0) failed = 0;

  int32_t* block_counts = at<int32_t>(local, L.block_counts);
  int32_t* send_slot = at<int32_t>(local, L.send_slot);
  int32_t* expert_counts = at<int32_t>(local, L.expert_counts);
  if (b == 0)
    for (int e = threadIdx.x; e < S.num_local; e += blockDim.x) expert_counts[e] = 0;

  // 1. route. Block b owns tokens [t0, t1).
  const int N = p.num_tokens;
  const int per_block = (N + nb - 1) / nb;
  const int t0 = min(N, b * per_block), t1 = min(N, t0 + per_block);
  const int experts_per_rank = S.num_local;
  if (warp == 0) {
    // Lanes in groups of G >= K: group g handles token c + g, lane k of the group its k-th id,
    // so a token's ids arrive in one load and are checked with warp intrinsics.
    int G = 1;
    while (G < K) G <<= 1;
    const int per_step = kWarp / G, sub = lane / G, k = lane % G;
    const uint32_t lt = dev::lanemask_lt();
    const uint64_t all_ranks = W == 64 ? ~uint64_t(0) : (uint64_t(1) << W) - 1;
    int cnt_lo = 0, cnt_hi = 0;  // lane l holds the block's count for ranks l and l + 32
    for (int c = t0; c < t1; c += per_step) {
      const int n = c + sub;
      const bool tok = n < t1;
      const bool has = tok && k < K;
      int64_t id = -1;
      if (has) {
        id = p.ids_int64 ? static_cast<const int64_t*>(p.topk_ids)[size_t(n) * K + k]
                         : static_cast<const int32_t*>(p.topk_ids)[size_t(n) * K + k];
      }
      int bad = 0;
      if (has && (id < -1 || id >= S.num_experts)) {
        dev::record_error(wait, StatusCode::kInput, Phase::kDispatchRoute, -1, S.num_experts, id, n, k);
        bad = 1;
      }
      const bool expert = has && id >= 0 && !bad;
      // A repeated expert: a lower lane of the same group holds the same id.
      const unsigned long long key = expert ? (uint64_t(uint32_t(sub)) << 32) | uint32_t(id)
                                            : (uint64_t(0xffffffffu) << 32) | uint32_t(lane);
      const uint32_t same = __match_any_sync(0xffffffffu, key);
      if (expert && (same & lt) != 0) {
        // expected = the earlier slot holding the same expert
        dev::record_error(wait, StatusCode::kInput, Phase::kDispatchRoute, -1, (__ffs(same) - 1) - sub * G, id, n, k);
        bad = 1;
      }
      uint64_t bits = expert && !bad ? uint64_t(1) << (id / experts_per_rank) : 0;
      for (int off = G / 2; off >= 1; off >>= 1) {
        bits |= __shfl_xor_sync(0xffffffffu, bits, off);
        bad |= __shfl_xor_sync(0xffffffffu, bad, off);
      }
      // The group's first lane carries the token; invalid tokens are sent nowhere.
      const bool leader = tok && k == 0;
      const uint64_t mask = leader && !bad ? (S.every_rank ? all_ranks : bits) : 0;
      for (int r = 0; r < W; ++r) {
        const bool bit = (mask >> r) & 1;
        const uint32_t bal = __ballot_sync(0xffffffffu, bit);
        const int before = __shfl_sync(0xffffffffu, r < 32 ? cnt_lo : cnt_hi, r & 31);
        if (leader) send_slot[size_t(n) * W + r] = bit ? before + __popc(bal & lt) : -1;
        if (lane == (r & 31)) (r < 32 ? cnt_lo : cnt_hi) += __popc(bal);
      }
    }
    if (lane < W) block_counts[b * W + lane] = cnt_lo;
    if (lane + 32 < W) block_counts[b * W + lane + 32] = cnt_hi;
  }
  if (!dev::grid_barrier(&state->barrier, wait)) return;

  // 2. counts: post this rank's row count per destination to every rank, then read the matrix.
  // Sums use one load per thread and shared atomics (no serial chains of global loads).
  __shared__ int32_t total[kMaxRanks];  // rows this rank sends to r
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    total[r] = 0;
    base[r] = 0;
  }
  if (threadIdx.x == 0) recv_total = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < nb * W; i += blockDim.x) {
    const int32_t v = block_counts[i];
    const int bb = i / W, r = i % W;
    if (b == 0) atomicAdd(&total[r], v);
    if (bb < b) atomicAdd(&base[r], v);
  }
  __syncthreads();
  uint64_t* matrix = at<uint64_t>(local, L.count_matrix) + size_t(par) * W * W;  // [q][r]
  if (b == 0) {
    for (int i = threadIdx.x; i < W * W; i += blockDim.x) {
      const int d = i / W, r = i % W;
      uint64_t* dst = at<uint64_t>(peers[d], L.count_matrix) + size_t(par) * W * W + size_t(s) * W + r;
      dev::st_release_sys(dst, (uint64_t(epoch) << 32) | uint32_t(total[r]));
    }
  }
  // base[r] += rows that ranks < s send to r; recv_total = rows every rank sends to s.
  for (int i = threadIdx.x; i < W * W; i += blockDim.x) {
    const int q = i / W, r = i % W;
    const uint64_t* word = matrix + i;
    uint64_t seen = 0;
    const bool ok = dev::bounded_wait(
        wait, Phase::kDispatchCounts, q, epoch,
        [&] {
          seen = dev::ld_acquire_sys(word);
          return uint32_t(seen >> 32) == epoch;
        },
        [&] { return int64_t(seen >> 32); });
    if (!ok) {
      failed = 1;
      continue;
    }
    const int32_t rows = int32_t(uint32_t(seen));
    if (q < s) atomicAdd(&base[r], rows);
    if (r == s) atomicAdd(&recv_total, rows);
  }
  __syncthreads();
  if (failed) return;

  // 3a. slots and metadata: one warp per token. The absolute rows are written back to
  // send_slot (read by 3b and by combine).
  for (int n = t0 + warp; n < t1; n += num_warps) {
    int slot_lo = -1, slot_hi = -1;
    if (lane < W) {
      slot_lo = send_slot[size_t(n) * W + lane];
      if (slot_lo >= 0) slot_lo += base[lane];
      send_slot[size_t(n) * W + lane] = slot_lo;
    }
    if (lane + 32 < W) {
      slot_hi = send_slot[size_t(n) * W + lane + 32];
      if (slot_hi >= 0) slot_hi += base[lane + 32];
      send_slot[size_t(n) * W + lane + 32] = slot_hi;
    }
    const uint64_t dmask = uint64_t(__ballot_sync(0xffffffffu, slot_lo >= 0)) |
                           (uint64_t(__ballot_sync(0xffffffffu, slot_hi >= 0)) << 32);
    if (dmask == 0) continue;
    // metadata: the token's full top-k row, its origin
    int32_t my_id = -1;
    float my_w = 0.f;
    if (lane < K) {
      my_id = p.ids_int64 ? int32_t(static_cast<const int64_t*>(p.topk_ids)[size_t(n) * K + lane])
                          : static_cast<const int32_t*>(p.topk_ids)[size_t(n) * K + lane];
      my_w = __ldg(p.topk_weights + size_t(n) * K + lane);
    }
    for (uint64_t m = dmask; m; m &= m - 1) {
      const int r = __ffsll(static_cast<long long>(m)) - 1;
      const int slot = __shfl_sync(0xffffffffu, r < 32 ? slot_lo : slot_hi, r & 31);
      uint8_t* peer = peers[r];
      if (lane == 0) {
        at<int32_t>(peer, L.recv_src_rank)[slot] = s;
        at<int32_t>(peer, L.recv_src_idx)[slot] = n;
      }
      if (lane < K) {
        at<int32_t>(peer, L.recv_topk_ids)[size_t(slot) * K + lane] = my_id;
        at<float>(peer, L.recv_topk_w)[size_t(slot) * K + lane] = my_w;
      }
    }
  }
  __syncthreads();

  // 3b. payload: one warp per (token, column range), so that every warp has loads in flight
  // even when the block owns fewer tokens than it has warps.
#if EPX_MEASUREMENT
  if (!(S.ablate & kAblatePayload))
#endif
  {
    constexpr int kPer = kDtype == DispatchDtype::kFP8 ? 16 : 8;
    const int steps = (S.hidden + kWarp * kPer - 1) / (kWarp * kPer);
    const int parts = (steps + kMaxSteps - 1) / kMaxSteps;
    const int per_part = (steps + parts - 1) / parts;
    const int items = (t1 - t0) * parts;
    for (int it = warp; it < items; it += num_warps) {
      const int n = t0 + it / parts, part = it % parts;
      const int slot_lo = lane < W ? send_slot[size_t(n) * W + lane] : -1;
      const int slot_hi = lane + 32 < W ? send_slot[size_t(n) * W + lane + 32] : -1;
      const uint64_t dmask = uint64_t(__ballot_sync(0xffffffffu, slot_lo >= 0)) |
                             (uint64_t(__ballot_sync(0xffffffffu, slot_hi >= 0)) << 32);
      if (dmask == 0) continue;
      const int step0 = part * per_part;
      send_payload<kDtype>(p, peers, n, dmask, slot_lo, slot_hi, lane, step0,
                           min(per_part, steps - step0));
    }
  }

  // 4. arrive: publish this block's rows per destination, then wait for every sender's rows.
  __syncthreads();
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    const int32_t rows = block_counts[b * W + r];
    if (rows > 0) {
      dev::fence_acq_rel_sys();
      dev::atomic_add_release_sys(at<int32_t>(peers[r], L.arrived) + par * W + s, rows);
    }
  }
  int32_t* arrived = at<int32_t>(local, L.arrived) + par * W;
  for (int q = threadIdx.x; q < W; q += blockDim.x) {
    const int32_t expected = int32_t(uint32_t(matrix[q * W + s]));
    const bool ok = dev::bounded_wait(
        wait, Phase::kDispatchData, q, expected,
        [&] { return dev::ld_acquire_sys(arrived + q) == expected; },
        [&] { return int64_t(dev::ld_acquire_sys(arrived + q)); });
    if (!ok) failed = 1;
  }
  __syncthreads();
  if (failed) return;

  // 5. finish on the receiving side. Rows [0, M) of the receive area are complete.
  const int M = recv_total;
  const int K_ = K;
  const int e0 = s * experts_per_rank;
  const int32_t* rids = at<int32_t>(local, L.recv_topk_ids);
  if (!S.expert_major) {
    for (int j = b * blockDim.x + threadIdx.x; j < M; j += nb * blockDim.x) {
      for (int k = 0; k < K_; ++k) {
        const int id = rids[size_t(j) * K_ + k];
        if (id >= e0 && id < e0 + experts_per_rank) atomicAdd(expert_counts + (id - e0), 1);
      }
    }
  } else {
    // Expansion into expert rows, ordered by token-major row (thus by source rank, index).
    int32_t* row_slot = at<int32_t>(local, L.row_expert_slot);
    int32_t* bec = at<int32_t>(local, L.block_expert_counts);
    const int rows_per_block = (M + nb - 1) / nb;
    const int j0 = min(M, b * rows_per_block), j1 = min(M, j0 + rows_per_block);
    for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) expert_scratch[e] = 0;
    __syncthreads();
    if (warp == 0) {
      // Rows in order, their top-k entries in parallel: a received row never repeats an expert
      // (the sender rejects such tokens), so the K lanes touch distinct counters.
      for (int j = j0; j < j1; ++j) {
        if (lane < K_) {
          const int id = rids[size_t(j) * K_ + lane];
          int slot = -1;
          if (id >= e0 && id < e0 + experts_per_rank) {
            slot = expert_scratch[id - e0];
            expert_scratch[id - e0] = slot + 1;
          }
          row_slot[size_t(j) * K_ + lane] = slot;
        }
        __syncwarp();
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x)
      bec[b * experts_per_rank + e] = expert_scratch[e];
    if (!dev::grid_barrier(&state->barrier, wait)) return;
    for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
      int32_t acc = 0, total = 0;
      for (int bb = 0; bb < nb; ++bb) {
        const int32_t v = bec[bb * experts_per_rank + e];
        if (bb < b) acc += v;
        total += v;
      }
      expert_scratch[e] = acc;
      if (b == 0) expert_counts[e] = total;
    }
    __syncthreads();
    const int H = S.hidden;
    const int row_bytes = S.wire_row_bytes;
    const int cap = S.capacity;
    const uint8_t* rx = local + L.recv_x;
    const float* rsc = at<float>(local, L.recv_scales);
    const float* rw = at<float>(local, L.recv_topk_w);
    for (int j = j0 + warp; j < j1; j += num_warps) {
      int my_slot = -1, my_e = -1;
      if (lane < K_) {
        my_slot = row_slot[size_t(j) * K_ + lane];
        if (my_slot >= 0) {
          my_e = rids[size_t(j) * K_ + lane] - e0;
          my_slot += expert_scratch[my_e];
          row_slot[size_t(j) * K_ + lane] = my_slot;
        }
      }
      const uint32_t kmask = __ballot_sync(0xffffffffu, my_slot >= 0);
      for (uint32_t m = kmask; m; m &= m - 1) {
        const int k = __ffs(m) - 1;
        const int slot = __shfl_sync(0xffffffffu, my_slot, k);
        const int e = __shfl_sync(0xffffffffu, my_e, k);
        const size_t erow = size_t(e) * cap + slot;
        const int4* src = reinterpret_cast<const int4*>(rx + size_t(j) * row_bytes);
        int4* dst = reinterpret_cast<int4*>(local + L.expert_x + erow * row_bytes);
        for (int v = lane; v < row_bytes / 16; v += kWarp) dst[v] = src[v];
        if (S.groups > 0 && kDtype != DispatchDtype::kBF16) {
          float* esc = at<float>(local, L.expert_scales) + size_t(e) * cap * S.groups;
          for (int g = lane; g < S.groups; g += kWarp)
            esc[scale_index(S, slot, g, cap)] = rsc[scale_index(S, j, g, cap)];
        }
        if (lane == 0) {
          at<int32_t>(local, L.expert_src_rank)[erow] = at<int32_t>(local, L.recv_src_rank)[j];
          at<int32_t>(local, L.expert_src_idx)[erow] = at<int32_t>(local, L.recv_src_idx)[j];
          at<int32_t>(local, L.expert_topk_slot)[erow] = k;
          at<float>(local, L.expert_weight)[erow] = rw[size_t(j) * K_ + k];
        }
      }
    }
    (void)H;
  }

  // Last block out: reset the arrival counters of this parity and advance the epoch.
  if (dev::last_block(&state->dispatch_ticket)) {
    for (int q = threadIdx.x; q < W; q += blockDim.x) arrived[q] = 0;
    if (threadIdx.x == 0) {
      state->recv_count = M;
      state->num_tokens = N;
      state->dispatch_epoch = epoch;
    }
  }
}

// ---- combine -------------------------------------------------------------------------------

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&f)[8]) {
  bf16x8_to_float(*reinterpret_cast<const int4*>(p), f);
}

// Combine's flag round: the last block of this rank to arrive at `ticket` tells every rank
// (flags[s] = epoch in each rank's buffer at offset `flags`) that this rank's stage is done; then
// every block waits, bounded, until every rank has said so. False if a wait failed.
__device__ inline bool publish_and_wait_all(int32_t* ticket, uint8_t* const* peers, size_t flags,
                                            uint8_t* local, int W, int s, uint32_t epoch,
                                            const WaitContext& wait) {
  __shared__ int32_t failed_wait;
  if (threadIdx.x == 0) failed_wait = 0;
  if (dev::last_block(ticket)) {  // last_block synchronises the block first
    for (int d = threadIdx.x; d < W; d += blockDim.x) {
      dev::fence_acq_rel_sys();
      dev::st_release_sys(at<int32_t>(peers[d], flags) + s, int32_t(epoch));
    }
  }
  const int32_t* mine = at<int32_t>(local, flags);
  for (int q = threadIdx.x; q < W; q += blockDim.x) {
    const bool ok = dev::bounded_wait(
        wait, Phase::kCombineReady, q, epoch,
        [&] { return dev::ld_acquire_sys(mine + q) == int32_t(epoch); },
        [&] { return int64_t(dev::ld_acquire_sys(mine + q)); });
    if (!ok) failed_wait = 1;
  }
  __syncthreads();
  return failed_wait == 0;
}

// Rounds 8 f32 sums to bf16 once each and stores them as one 16-byte vector.
__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* dst, const float (&acc)[8]) {
  int4 o;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  *reinterpret_cast<int4*>(dst) = o;
}

template <typename PartialT>
__global__ void __launch_bounds__(1024) combine_kernel(const CombineParams p) {
  const Shape& S = p.shape;
  const Layout& L = p.layout;
  const int W = S.world, s = S.rank, K = S.topk, H = S.hidden;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int num_warps = blockDim.x / kWarp;
  const int nb = gridDim.x, b = blockIdx.x;
  uint8_t* local = p.sym.local;
  State* state = at<State>(local, L.state);
  WaitContext wait = make_wait(p.sym, L, p.waits);

  __shared__ uint8_t* peers[kMaxRanks];
  if (dev::aborted(wait)) return;
  const uint32_t epoch = state->combine_epoch + 1;
  wait.call = epoch;
  const int M = state->recv_count;
  const int N = state->num_tokens;
  for (int r = threadIdx.x; r < W; r += blockDim.x) peers[r] = p.sym.peers[r];
  __syncthreads();

  // A. make this rank's partials available at L.partials.
  PartialT* partials = at<PartialT>(local, L.partials);
  const int vecs = H / 8;  // 8 elements per lane step
  if constexpr (sizeof(PartialT) == 2) {
    if (p.expert_out != partials) {
      const int4* src = static_cast<const int4*>(p.expert_out);
      int4* dst = reinterpret_cast<int4*>(partials);
      const size_t total = size_t(M) * vecs;
      for (size_t i = size_t(b) * blockDim.x + threadIdx.x; i < total; i += size_t(nb) * blockDim.x)
        dst[i] = src[i];
    }
  } else {
    // Fold expert rows into one f32 partial per token-major row: p = sum_k fmaf(w_k, out, p).
    const __nv_bfloat16* out = static_cast<const __nv_bfloat16*>(p.expert_out);
    const int32_t* row_slot = at<int32_t>(local, L.row_expert_slot);
    const int32_t* rids = at<int32_t>(local, L.recv_topk_ids);
    const float* rw = at<float>(local, L.recv_topk_w);
    const int e0 = s * S.num_local;
    for (int j = b * num_warps + warp; j < M; j += nb * num_warps) {
      for (int v = lane; v < vecs; v += kWarp) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int k = 0; k < K; ++k) {
          const int slot = row_slot[size_t(j) * K + k];
          if (slot < 0) continue;
          const int e = rids[size_t(j) * K + k] - e0;
          const float w = rw[size_t(j) * K + k];
          float f[8];
          load8(out + (size_t(e) * S.capacity + slot) * H + v * 8, f);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, f[i], acc[i]);
        }
        float4* dst = reinterpret_cast<float4*>(partials + size_t(j) * H + v * 8);
        dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
      }
    }
  }
  // B. once every rank's partials are published, pull and reduce in rank order.
  if (!publish_and_wait_all(&state->combine_ready_ticket, peers, L.ready, local, W, s, epoch,
                            wait)) {
    return;
  }

  const int32_t* send_slot = at<int32_t>(local, L.send_slot);
  __nv_bfloat16* y = static_cast<__nv_bfloat16*>(p.y);
  constexpr int kChunkVecs = kWarp * 4;  // 1024 columns per work item
  const int chunks = (vecs + kChunkVecs - 1) / kChunkVecs;
  if constexpr (sizeof(PartialT) == 2) {
    if (S.all_reduce) {
      // All-reduce of every row, then this rank's slice (the naive baseline). Every rank holds
      // the same M rows in the same order. Reduce-scatter: rank s sums rows [r0, r1) over all
      // ranks in rank order into its `reduced` area ...
      const int per = (M + W - 1) / W;
      const int r0 = min(M, s * per), r1 = min(M, r0 + per);
      __nv_bfloat16* reduced = at<__nv_bfloat16>(local, L.reduced);
      for (int item = b * num_warps + warp; item < (r1 - r0) * chunks; item += nb * num_warps) {
        const int j = r0 + item / chunks, chunk = item % chunks;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int v = chunk * kChunkVecs + u * kWarp + lane;
          if (v >= vecs) continue;
          float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
          for (int q = 0; q < W; ++q) {
            float f[8];
            load8(at<PartialT>(peers[q], L.partials) + size_t(j) * H + v * 8, f);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] += f[i];
          }
          store_bf16x8(reduced + size_t(j) * H + v * 8, acc);
        }
      }
      if (!publish_and_wait_all(&state->combine_reduced_ticket, peers, L.ready2, local, W, s,
                                epoch, wait)) {
        return;
      }
      // ... all-gather: every rank copies all M reduced rows into its own partials area (every
      // peer has finished reading it: they published ready2 after their reduce-scatter) ...
      int4* gathered = reinterpret_cast<int4*>(partials);
      const size_t total = size_t(M) * vecs;
      for (size_t i = size_t(b) * blockDim.x + threadIdx.x; i < total; i += size_t(nb) * blockDim.x) {
        const int j = int(i / vecs);
        gathered[i] = reinterpret_cast<const int4*>(at<__nv_bfloat16>(peers[j / per], L.reduced))[i];
      }
      if (!dev::grid_barrier(&state->barrier, wait)) return;
      // ... and takes its own tokens' rows.
      for (size_t i = size_t(b) * blockDim.x + threadIdx.x; i < size_t(N) * vecs; i += size_t(nb) * blockDim.x) {
        const int n = int(i / vecs), v = int(i % vecs);
        const int row = send_slot[size_t(n) * W + s];  // -1: an invalid token, sent nowhere
        reinterpret_cast<int4*>(y)[i] = row >= 0 ? gathered[size_t(row) * vecs + v] : make_int4(0, 0, 0, 0);
      }
      if (dev::last_block(&state->combine_ticket)) {
        if (threadIdx.x == 0) state->combine_epoch = epoch;
      }
      return;
    }
  }

  // One warp per (token, 1024-column chunk); each lane owns one 8-element vector at a time and
  // issues the loads of up to kBatch ranks before it adds any of them (the adds stay in rank
  // order), so several remote reads are in flight per lane instead of one.
  constexpr int kVecInts = sizeof(PartialT) / 2;  // int4 per 8 elements: bf16 1, f32 2
  constexpr int kBatch = 8 / kVecInts;
  for (int item = b * num_warps + warp; item < N * chunks; item += nb * num_warps) {
    const int n = item / chunks, chunk = item % chunks;
    int slot_lo = -1, slot_hi = -1;
    if (lane < W) slot_lo = send_slot[size_t(n) * W + lane];
    if (lane + 32 < W) slot_hi = send_slot[size_t(n) * W + lane + 32];
    const uint64_t rmask = uint64_t(__ballot_sync(0xffffffffu, slot_lo >= 0)) |
                           (uint64_t(__ballot_sync(0xffffffffu, slot_hi >= 0)) << 32);
    for (int u = 0; u < 4; ++u) {
      const int v = chunk * kChunkVecs + u * kWarp + lane;
      const bool active = v < vecs;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      uint64_t m = rmask;  // warp-uniform
#if EPX_MEASUREMENT
      if (S.ablate & kAblatePull) m = 0;
#endif
      while (m != 0) {
        int4 raw[kBatch][kVecInts] = {};
        int got = 0;
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          if (m != 0) {
            const int r = __ffsll(static_cast<long long>(m)) - 1;
            m &= m - 1;
            const int slot = __shfl_sync(0xffffffffu, r < 32 ? slot_lo : slot_hi, r & 31);
            if (active) {
              const int4* src = reinterpret_cast<const int4*>(
                  at<PartialT>(peers[r], L.partials) + size_t(slot) * H + v * 8);
#pragma unroll
              for (int t = 0; t < kVecInts; ++t) raw[i][t] = src[t];
            }
            got = i + 1;
          }
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          if (i < got) {
            float f[8];
            if constexpr (kVecInts == 1) {
              bf16x8_to_float(raw[i][0], f);
            } else {
              const float* pf = reinterpret_cast<const float*>(&raw[i][0]);
#pragma unroll
              for (int e = 0; e < 8; ++e) f[e] = pf[e];
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] += f[e];
          }
        }
      }
      if (active) {
        store_bf16x8(y + size_t(n) * H + v * 8, acc);
      }
    }
  }

  if (dev::last_block(&state->combine_ticket)) {
    if (threadIdx.x == 0) state->combine_epoch = epoch;
  }
}

}  // namespace

void preload_kernels(int device) {
  // With lazy module loading (the CUDA default), the first launch of a kernel loads its module
  // and waits for the work already running on the device: if that work is another rank's
  // kernel spinning on this one, the two wait for each other. Load everything up front.
  int prev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&prev));
  EPX_CUDA_CHECK(cudaSetDevice(device));
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_kernel<DispatchDtype::kBF16>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_kernel<DispatchDtype::kFP8>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_kernel<DispatchDtype::kBF16ToFP8>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, combine_kernel<__nv_bfloat16>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, combine_kernel<float>));
  EPX_CUDA_CHECK(cudaSetDevice(prev));
}

void launch_dispatch(const DispatchParams& p, DispatchDtype dtype, LaunchConfig lc,
                     cudaStream_t stream) {
  const dim3 grid(lc.num_blocks), block(lc.warps_per_block * kWarp);
  const size_t smem = p.shape.expert_major ? size_t(p.shape.num_local) * sizeof(int32_t) : 0;
  switch (dtype) {
    case DispatchDtype::kBF16:
      dispatch_kernel<DispatchDtype::kBF16><<<grid, block, smem, stream>>>(p);
      break;
    case DispatchDtype::kFP8:
      dispatch_kernel<DispatchDtype::kFP8><<<grid, block, smem, stream>>>(p);
      break;
    case DispatchDtype::kBF16ToFP8:
      dispatch_kernel<DispatchDtype::kBF16ToFP8><<<grid, block, smem, stream>>>(p);
      break;
  }
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_combine(const CombineParams& p, LaunchConfig lc, cudaStream_t stream) {
  const dim3 grid(lc.num_blocks), block(lc.warps_per_block * kWarp);
  if (p.shape.expert_major) {
    combine_kernel<float><<<grid, block, 0, stream>>>(p);
  } else {
    combine_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(p);
  }
  EPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epx::peer
