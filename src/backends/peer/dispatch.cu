// The peer engine's dispatch kernel (every backend: naive, allgather_reducescatter, low_latency).
//
// One kernel on every rank s, in five phases:
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
// Every wait is bounded (WaitContext); epochs live in State and are advanced by the kernel.

#include <cuda_bf16.h>

#include "backends/peer/kernels.hpp"
#include "backends/peer/peer_device.cuh"
#include "epx/cuda_check.hpp"
#include "core/fp8.cuh"
#include "core/sync_device.cuh"

namespace epx::peer {
namespace {

// What every phase of one dispatch call on one block knows.
struct DispatchCall {
  const DispatchParams& p;
  uint8_t* local;  // this rank's buffer
  State* state;
  dev::WaitContext wait;
  uint32_t epoch;  // this call (1 = the first)
  int par;         // epoch parity: the half of the double-buffered words this call uses
  int t0, t1;      // this block's tokens [t0, t1)
};

// Block-shared values of one dispatch call.
struct DispatchShared {
  uint8_t* peers[kMaxRanks];  // every rank's buffer
  int32_t base[kMaxRanks];    // row in rank r's receive area of this block's first row for r
  int32_t total[kMaxRanks];   // rows this rank sends to r (block 0 only)
  int32_t recv_total;         // rows every rank sends to this rank: M
  int32_t failed;             // a wait of this block failed
};

__device__ __forceinline__ int64_t load_topk_id(const DispatchParams& p, int n, int k) {
  const size_t i = size_t(n) * p.shape.topk + k;
  return p.ids_int64 ? static_cast<const int64_t*>(p.topk_ids)[i]
                     : static_cast<const int32_t*>(p.topk_ids)[i];
}

// ---- 1. route --------------------------------------------------------------------------------

// Warp 0 of the block; bad ids are recorded in the status word and their token is sent nowhere.
// After: send_slot[n][r] = position of token n among this block's rows for rank r, or -1;
// block_counts[b][r] = this block's rows for rank r.
__device__ __forceinline__ void route(const DispatchCall& c) {
  const DispatchParams& p = c.p;
  const Shape& S = p.shape;
  const int W = S.world, K = S.topk;
  const int lane = threadIdx.x % kWarpSize;
  int32_t* send_slot = at<int32_t>(c.local, p.layout.send_slot);
  // Lanes in groups of G >= K: group g handles token c + g, lane k of the group its k-th id,
  // so a token's ids arrive in one load and are checked with warp intrinsics.
  int G = 1;
  while (G < K) G <<= 1;
  const int per_step = kWarpSize / G, sub = lane / G, k = lane % G;
  const uint32_t lt = dev::lanemask_lt();
  const uint64_t all_ranks = W == 64 ? ~uint64_t(0) : (uint64_t(1) << W) - 1;
  int cnt_lo = 0, cnt_hi = 0;  // lane l holds the block's count for ranks l and l + 32
  for (int first = c.t0; first < c.t1; first += per_step) {
    const int n = first + sub;
    const bool tok = n < c.t1;
    const bool has = tok && k < K;
    const int64_t id = has ? load_topk_id(p, n, k) : -1;
    int bad = 0;
    if (has && (id < -1 || id >= S.num_experts)) {
      dev::record_error(c.wait, StatusCode::kInput, Phase::kDispatchRoute, -1, S.num_experts, id, n,
                        k);
      bad = 1;
    }
    const bool expert = has && id >= 0 && !bad;
    // A repeated expert: a lower lane of the same group holds the same id.
    const unsigned long long key = expert ? (uint64_t(uint32_t(sub)) << 32) | uint32_t(id)
                                          : (uint64_t(0xffffffffu) << 32) | uint32_t(lane);
    const uint32_t same = __match_any_sync(kFullWarp, key);
    if (expert && (same & lt) != 0) {
      // expected = the earlier slot holding the same expert
      dev::record_error(c.wait, StatusCode::kInput, Phase::kDispatchRoute, -1,
                        (__ffs(same) - 1) - sub * G, id, n, k);
      bad = 1;
    }
    uint64_t bits = expert && !bad ? uint64_t(1) << (id / S.num_local) : 0;
    for (int off = G / 2; off >= 1; off >>= 1) {
      bits |= __shfl_xor_sync(kFullWarp, bits, off);
      bad |= __shfl_xor_sync(kFullWarp, bad, off);
    }
    // The group's first lane carries the token; invalid tokens are sent nowhere.
    const bool leader = tok && k == 0;
    const uint64_t mask = leader && !bad ? (S.every_rank ? all_ranks : bits) : 0;
    for (int r = 0; r < W; ++r) {
      const bool bit = (mask >> r) & 1;
      const uint32_t bal = __ballot_sync(kFullWarp, bit);
      const int before = __shfl_sync(kFullWarp, r < 32 ? cnt_lo : cnt_hi, r & 31);
      if (leader) send_slot[size_t(n) * W + r] = bit ? before + __popc(bal & lt) : -1;
      if (lane == (r & 31)) (r < 32 ? cnt_lo : cnt_hi) += __popc(bal);
    }
  }
  int32_t* block_counts = at<int32_t>(c.local, p.layout.block_counts) + blockIdx.x * W;
  if (lane < W) block_counts[lane] = cnt_lo;
  if (lane + 32 < W) block_counts[lane + 32] = cnt_hi;
}

// ---- 2. counts -------------------------------------------------------------------------------

// Posts this rank's row count per destination to every rank, then reads the full matrix. Sums
// use one load per thread and shared atomics (no serial chains of global loads). After (true):
// sh.base[r] = row in r's receive area of this block's first row for r, sh.recv_total = M, and
// the count matrix of this parity holds every rank's counts. False when a wait failed.
__device__ __forceinline__ bool exchange_counts(const DispatchCall& c, DispatchShared& sh) {
  const Layout& L = c.p.layout;
  const int W = c.p.shape.world, s = c.p.shape.rank;
  const int b = blockIdx.x;
  const int32_t* block_counts = at<int32_t>(c.local, L.block_counts);
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    sh.total[r] = 0;
    sh.base[r] = 0;
  }
  if (threadIdx.x == 0) sh.recv_total = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < int(gridDim.x) * W; i += blockDim.x) {
    const int32_t v = block_counts[i];
    const int bb = i / W, r = i % W;
    if (b == 0) atomicAdd(&sh.total[r], v);
    if (bb < b) atomicAdd(&sh.base[r], v);
  }
  __syncthreads();
  if (b == 0) {
    for (int i = threadIdx.x; i < W * W; i += blockDim.x) {
      const int d = i / W, r = i % W;
      uint64_t* dst =
          at<uint64_t>(sh.peers[d], L.count_matrix) + size_t(c.par) * W * W + size_t(s) * W + r;
      dev::st_release_sys(dst, (uint64_t(c.epoch) << 32) | uint32_t(sh.total[r]));
    }
  }
  // base[r] += rows that ranks < s send to r; recv_total = rows every rank sends to s.
  const uint64_t* matrix = at<uint64_t>(c.local, L.count_matrix) + size_t(c.par) * W * W;  // [q][r]
  for (int i = threadIdx.x; i < W * W; i += blockDim.x) {
    const int q = i / W, r = i % W;
    const uint64_t* word = matrix + i;
    uint64_t seen = 0;
    const bool ok = dev::bounded_wait(
        c.wait, Phase::kDispatchCounts, q, c.epoch,
        [&] {
          seen = dev::ld_acquire_sys(word);
          return uint32_t(seen >> 32) == c.epoch;
        },
        [&] { return int64_t(seen >> 32); });
    if (!ok) {
      sh.failed = 1;
      continue;
    }
    const int32_t rows = int32_t(uint32_t(seen));
    if (q < s) atomicAdd(&sh.base[r], rows);
    if (r == s) atomicAdd(&sh.recv_total, rows);
  }
  __syncthreads();
  return sh.failed == 0;
}

// ---- 3. send ---------------------------------------------------------------------------------

// 16-byte vectors per lane that one payload item loads before its stores (all in flight).
constexpr int kMaxSteps = 4;

// Elements of the input row per 16-byte vector.
template <DispatchDtype kDtype>
inline constexpr int kElemsPerVec = kDtype == DispatchDtype::kFP8 ? 16 : 8;

// One item of token n's payload: columns [step0, step0 + nsteps) x kWarpSize x (elements per
// 16-byte vector), sent to the ranks of `slots`. Each lane first loads all its vectors of the
// item, then stores them to every destination. The item with step0 == 0 also sends the token's
// fp8 scales. Called by one whole warp.
template <DispatchDtype kDtype>
__device__ __forceinline__ void send_payload(const DispatchParams& p, uint8_t* const* peers, int n,
                                             const RankSlots& slots, uint64_t dmask, int lane,
                                             int step0, int nsteps) {
  const Shape& S = p.shape;
  const Layout& L = p.layout;
  const int H = S.hidden;
  constexpr int kPer = kElemsPerVec<kDtype>;
  constexpr int kInBytes = kDtype == DispatchDtype::kFP8 ? 1 : 2;
  const uint8_t* src = static_cast<const uint8_t*>(p.x) + size_t(n) * H * kInBytes;
  int4 v[kMaxSteps];
#pragma unroll
  for (int u = 0; u < kMaxSteps; ++u) {
    const int col = ((step0 + u) * kWarpSize + lane) * kPer;
    v[u] = make_int4(0, 0, 0, 0);
    if (u < nsteps && col < H)
      v[u] = __ldg(reinterpret_cast<const int4*>(src + size_t(col) * kInBytes));
  }
  if constexpr (kDtype != DispatchDtype::kBF16ToFP8) {
    constexpr int kOutBytes = kInBytes;
    for (uint64_t m = dmask; m; m &= m - 1) {
      const int r = lowest_rank(m);
      uint8_t* dst = peers[r] + L.recv_x + size_t(slots.of(r)) * H * kOutBytes;
#pragma unroll
      for (int u = 0; u < kMaxSteps; ++u) {
        const int col = ((step0 + u) * kWarpSize + lane) * kPer;
        if (u < nsteps && col < H) *reinterpret_cast<int4*>(dst + size_t(col) * kOutBytes) = v[u];
      }
    }
    if (kDtype == DispatchDtype::kFP8 && step0 == 0) {
      for (uint64_t m = dmask; m; m &= m - 1) {
        const int r = lowest_rank(m);
        const int slot = slots.of(r);
        float* dst = at<float>(peers[r], L.recv_scales);
        for (int g = lane; g < S.groups; g += kWarpSize)
          dst[scale_index(S, slot, g, S.capacity)] = __ldg(p.x_scales + size_t(n) * S.groups + g);
      }
    }
  } else {
    // Quantised in place: 8 bf16 -> 8 fp8 per lane, a 1x128 block per half-warp sharing a scale.
    constexpr int kLanesPerBlock = kFp8BlockSize / kPer;
    uint2 q[kMaxSteps];
    float sc[kMaxSteps];
#pragma unroll
    for (int u = 0; u < kMaxSteps; ++u) {
      float f[kPer];
      bf16x8_to_float(v[u], f);  // zeros where nothing was loaded
      q[u] = make_uint2(0, 0);
      sc[u] = 0.f;
      if (u < nsteps) q[u] = dev::quantize_fp8_block<kPer>(f, sc[u]);  // u < nsteps: warp-uniform
    }
    for (uint64_t m = dmask; m; m &= m - 1) {
      const int r = lowest_rank(m);
      const int slot = slots.of(r);
      uint8_t* dst = peers[r] + L.recv_x + size_t(slot) * H;
      float* dsc = at<float>(peers[r], L.recv_scales);
#pragma unroll
      for (int u = 0; u < kMaxSteps; ++u) {
        const int col = ((step0 + u) * kWarpSize + lane) * kPer;
        if (u < nsteps && col < H) {
          *reinterpret_cast<uint2*>(dst + col) = q[u];
          if (lane % kLanesPerBlock == 0)  // the block's first lane
            dsc[scale_index(S, slot, col / kFp8BlockSize, S.capacity)] = sc[u];
        }
      }
    }
  }
}

// Slots and metadata, one warp per token: the absolute rows are written back to send_slot (read
// by the payload loop and by combine), the token's origin and full top-k row to each destination.
__device__ __forceinline__ void send_metadata(const DispatchCall& c, const DispatchShared& sh) {
  const DispatchParams& p = c.p;
  const Layout& L = p.layout;
  const int W = p.shape.world, s = p.shape.rank, K = p.shape.topk;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  int32_t* send_slot = at<int32_t>(c.local, L.send_slot);
  for (int n = c.t0 + warp; n < c.t1; n += num_warps) {
    RankSlots slots{-1, -1};
    if (lane < W) {
      slots.lo = send_slot[size_t(n) * W + lane];
      if (slots.lo >= 0) slots.lo += sh.base[lane];
      send_slot[size_t(n) * W + lane] = slots.lo;
    }
    if (lane + 32 < W) {
      slots.hi = send_slot[size_t(n) * W + lane + 32];
      if (slots.hi >= 0) slots.hi += sh.base[lane + 32];
      send_slot[size_t(n) * W + lane + 32] = slots.hi;
    }
    const uint64_t dmask = slots.ranks();
    if (dmask == 0) continue;
    int32_t my_id = -1;
    float my_w = 0.f;
    if (lane < K) {
      my_id = int32_t(load_topk_id(p, n, lane));
      my_w = __ldg(p.topk_weights + size_t(n) * K + lane);
    }
    for (uint64_t m = dmask; m; m &= m - 1) {
      const int r = lowest_rank(m);
      const int slot = slots.of(r);
      uint8_t* peer = sh.peers[r];
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
}

// Payload: one warp per (token, column range), so that every warp has loads in flight even when
// the block owns fewer tokens than it has warps.
template <DispatchDtype kDtype>
__device__ __forceinline__ void send_payloads(const DispatchCall& c, const DispatchShared& sh) {
  const DispatchParams& p = c.p;
  const int W = p.shape.world;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int32_t* send_slot = at<int32_t>(c.local, p.layout.send_slot);
  constexpr int kPer = kElemsPerVec<kDtype>;
  const int steps = (p.shape.hidden + kWarpSize * kPer - 1) / (kWarpSize * kPer);
  const int parts = (steps + kMaxSteps - 1) / kMaxSteps;
  const int per_part = (steps + parts - 1) / parts;
  const int items = (c.t1 - c.t0) * parts;
  for (int it = warp; it < items; it += num_warps) {
    const int n = c.t0 + it / parts, part = it % parts;
    const RankSlots slots = load_rank_slots(send_slot, n, W, lane);
    const uint64_t dmask = slots.ranks();
    if (dmask == 0) continue;
    const int step0 = part * per_part;
    send_payload<kDtype>(p, sh.peers, n, slots, dmask, lane, step0, min(per_part, steps - step0));
  }
}

// After: this block's rows, scales and metadata are written into their destinations' receive
// areas (not yet announced), and send_slot[n][r] holds absolute rows.
template <DispatchDtype kDtype>
__device__ __forceinline__ void send(const DispatchCall& c, const DispatchShared& sh) {
  send_metadata(c, sh);
  __syncthreads();
#if EPX_MEASUREMENT
  if (c.p.shape.ablate & kAblatePayload) return;
#endif
  send_payloads<kDtype>(c, sh);
}

// ---- 4. arrive -------------------------------------------------------------------------------

// Announces this block's rows to each destination, then waits for every sender's rows. After
// (true): rows [0, M) of this rank's receive area are complete. False when a wait failed.
__device__ __forceinline__ bool arrive(const DispatchCall& c, DispatchShared& sh) {
  const Layout& L = c.p.layout;
  const int W = c.p.shape.world, s = c.p.shape.rank;
  __syncthreads();
  const int32_t* block_counts = at<int32_t>(c.local, L.block_counts) + blockIdx.x * W;
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    const int32_t rows = block_counts[r];
    if (rows > 0) {
      dev::fence_acq_rel_sys();
      dev::atomic_add_release_sys(at<int32_t>(sh.peers[r], L.arrived) + c.par * W + s, rows);
    }
  }
  const uint64_t* matrix = at<uint64_t>(c.local, L.count_matrix) + size_t(c.par) * W * W;
  int32_t* arrived = at<int32_t>(c.local, L.arrived) + c.par * W;
  for (int q = threadIdx.x; q < W; q += blockDim.x) {
    const int32_t expected = int32_t(uint32_t(matrix[q * W + s]));
    const bool ok = dev::bounded_wait(
        c.wait, Phase::kDispatchData, q, expected,
        [&] { return dev::ld_acquire_sys(arrived + q) == expected; },
        [&] { return int64_t(dev::ld_acquire_sys(arrived + q)); });
    if (!ok) sh.failed = 1;
  }
  __syncthreads();
  return sh.failed == 0;
}

// ---- 5. finish -------------------------------------------------------------------------------

// Token-major. After: expert_counts[e] = received rows that use local expert e (atomics: every
// block adds to counters block 0 cleared before the first grid barrier).
__device__ __forceinline__ void count_local_experts(const DispatchCall& c, int M) {
  const Layout& L = c.p.layout;
  const int K = c.p.shape.topk, num_local = c.p.shape.num_local;
  const int e0 = c.p.shape.rank * num_local;
  const int32_t* rids = at<int32_t>(c.local, L.recv_topk_ids);
  int32_t* expert_counts = at<int32_t>(c.local, L.expert_counts);
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < M; j += gridDim.x * blockDim.x) {
    for (int k = 0; k < K; ++k) {
      const int id = rids[size_t(j) * K + k];
      if (id >= e0 && id < e0 + num_local) atomicAdd(expert_counts + (id - e0), 1);
    }
  }
}

// Expert-major: expansion of the received rows into expert rows, ordered by token-major row (thus
// by source rank, index). After (true): expert e's rows [0, expert_counts[e]) of expert_x,
// expert_scales and the expert_* metadata are complete, and row_expert_slot[j][k] = the row of
// (received row j, its k-th expert) in that expert, or -1. False when the grid barrier failed.
template <DispatchDtype kDtype>
__device__ __forceinline__ bool expand_to_experts(const DispatchCall& c, int M) {
  extern __shared__ int32_t expert_scratch[];  // [E/W]: counts, then this block's first slots
  const Shape& S = c.p.shape;
  const Layout& L = c.p.layout;
  const int K = S.topk, num_local = S.num_local, e0 = S.rank * num_local;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int nb = gridDim.x, b = blockIdx.x;
  uint8_t* local = c.local;
  const int32_t* rids = at<int32_t>(local, L.recv_topk_ids);
  int32_t* expert_counts = at<int32_t>(local, L.expert_counts);
  int32_t* row_slot = at<int32_t>(local, L.row_expert_slot);
  int32_t* bec = at<int32_t>(local, L.block_expert_counts);  // [block][E/W]
  const int rows_per_block = (M + nb - 1) / nb;
  const int j0 = min(M, b * rows_per_block), j1 = min(M, j0 + rows_per_block);
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) expert_scratch[e] = 0;
  __syncthreads();
  if (warp == 0) {
    // Rows in order, their top-k entries in parallel: a received row never repeats an expert
    // (the sender rejects such tokens), so the K lanes touch distinct counters.
    for (int j = j0; j < j1; ++j) {
      if (lane < K) {
        const int id = rids[size_t(j) * K + lane];
        int slot = -1;
        if (id >= e0 && id < e0 + num_local) {
          slot = expert_scratch[id - e0];
          expert_scratch[id - e0] = slot + 1;
        }
        row_slot[size_t(j) * K + lane] = slot;
      }
      __syncwarp();
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_local; e += blockDim.x)
    bec[b * num_local + e] = expert_scratch[e];
  if (!dev::grid_barrier(&c.state->barrier, c.wait)) return false;
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    int32_t acc = 0, total = 0;
    for (int bb = 0; bb < nb; ++bb) {
      const int32_t v = bec[bb * num_local + e];
      if (bb < b) acc += v;
      total += v;
    }
    expert_scratch[e] = acc;
    if (b == 0) expert_counts[e] = total;
  }
  __syncthreads();
  const int row_bytes = S.wire_row_bytes;
  const int cap = S.capacity;
  const uint8_t* rx = local + L.recv_x;
  const float* rsc = at<float>(local, L.recv_scales);
  const float* rw = at<float>(local, L.recv_topk_w);
  for (int j = j0 + warp; j < j1; j += num_warps) {
    int my_slot = -1, my_e = -1;
    if (lane < K) {
      my_slot = row_slot[size_t(j) * K + lane];
      if (my_slot >= 0) {
        my_e = rids[size_t(j) * K + lane] - e0;
        my_slot += expert_scratch[my_e];
        row_slot[size_t(j) * K + lane] = my_slot;
      }
    }
    const uint32_t kmask = __ballot_sync(kFullWarp, my_slot >= 0);
    for (uint32_t m = kmask; m; m &= m - 1) {
      const int k = __ffs(m) - 1;
      const int slot = __shfl_sync(kFullWarp, my_slot, k);
      const int e = __shfl_sync(kFullWarp, my_e, k);
      const size_t erow = size_t(e) * cap + slot;
      const int4* src = reinterpret_cast<const int4*>(rx + size_t(j) * row_bytes);
      int4* dst = reinterpret_cast<int4*>(local + L.expert_x + erow * row_bytes);
      for (int v = lane; v < row_bytes / 16; v += kWarpSize) dst[v] = src[v];
      if (S.groups > 0 && kDtype != DispatchDtype::kBF16) {
        float* esc = at<float>(local, L.expert_scales) + size_t(e) * cap * S.groups;
        for (int g = lane; g < S.groups; g += kWarpSize)
          esc[scale_index(S, slot, g, cap)] = rsc[scale_index(S, j, g, cap)];
      }
      if (lane == 0) {
        at<int32_t>(local, L.expert_src_rank)[erow] = at<int32_t>(local, L.recv_src_rank)[j];
        at<int32_t>(local, L.expert_src_idx)[erow] = at<int32_t>(local, L.recv_src_idx)[j];
        at<int32_t>(local, L.expert_topk_slot)[erow] = k;
        at<float>(local, L.expert_weight)[erow] = rw[size_t(j) * K + k];
      }
    }
  }
  return true;
}

// Last block out. After: the arrival counters of this parity are 0 again, and State holds this
// call's M and N and its epoch (the call is complete).
__device__ __forceinline__ void close_dispatch(const DispatchCall& c, int M) {
  if (!dev::last_block(&c.state->dispatch_ticket)) return;
  const int W = c.p.shape.world;
  int32_t* arrived = at<int32_t>(c.local, c.p.layout.arrived) + c.par * W;
  for (int q = threadIdx.x; q < W; q += blockDim.x) arrived[q] = 0;
  if (threadIdx.x == 0) {
    c.state->recv_count = M;
    c.state->num_tokens = c.p.num_tokens;
    c.state->dispatch_epoch = c.epoch;
  }
}

// ---- the kernel ------------------------------------------------------------------------------

template <DispatchDtype kDtype>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) dispatch_kernel(const DispatchParams p) {
  __shared__ DispatchShared sh;
  uint8_t* local = p.sym.local;
  State* state = at<State>(local, p.layout.state);
  dev::WaitContext wait = make_wait(p.sym, p.layout, p.waits);
  if (dev::aborted(wait)) return;  // an earlier call timed out: the peers' state is unknown
  const uint32_t epoch = state->dispatch_epoch + 1;
  wait.call = epoch;
  // Block b owns tokens [t0, t1).
  const int N = p.num_tokens, nb = gridDim.x, b = blockIdx.x;
  const int per_block = (N + nb - 1) / nb;
  const int t0 = min(N, b * per_block);
  const DispatchCall c{.p = p,
                       .local = local,
                       .state = state,
                       .wait = wait,
                       .epoch = epoch,
                       .par = int(epoch & 1),
                       .t0 = t0,
                       .t1 = min(N, t0 + per_block)};
  for (int r = threadIdx.x; r < p.shape.world; r += blockDim.x) sh.peers[r] = p.sym.peers[r];
  if (threadIdx.x == 0) sh.failed = 0;
  // Cleared before the first grid barrier, counted after it (token-major) or set by block 0.
  if (b == 0) {
    int32_t* expert_counts = at<int32_t>(local, p.layout.expert_counts);
    for (int e = threadIdx.x; e < p.shape.num_local; e += blockDim.x) expert_counts[e] = 0;
  }

  if (threadIdx.x < kWarpSize) route(c);
  if (!dev::grid_barrier(&state->barrier, wait)) return;
  if (!exchange_counts(c, sh)) return;
  send<kDtype>(c, sh);
  if (!arrive(c, sh)) return;
  const int M = sh.recv_total;
  if (!p.shape.expert_major) {
    count_local_experts(c, M);
  } else if (!expand_to_experts<kDtype>(c, M)) {
    return;
  }
  close_dispatch(c, M);
}

}  // namespace

void load_dispatch_kernels() {
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_kernel<DispatchDtype::kBF16>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_kernel<DispatchDtype::kFP8>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_kernel<DispatchDtype::kBF16ToFP8>));
}

void launch_dispatch(const DispatchParams& p, DispatchDtype dtype, LaunchConfig lc,
                     cudaStream_t stream) {
  const dim3 grid(lc.num_blocks), block(lc.warps_per_block * kWarpSize);
  // expert-major: one counter per local expert (validate_for bounds E/W by kMaxExpertMajorLocal)
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

}  // namespace epx::peer
