// The peer engine's dispatch kernel (every backend: naive, allgather_reducescatter, low_latency).
//
// One kernel serves one or several ranks (an in-process group sharing a GPU launches once); on
// each rank s's blocks:
//   1. route:   the block's warps walk its tokens, several per step (one lane per top-k entry):
//               each token's destination ranks (deduplicated), its position among the block's
//               rows for each destination (ballots, so rows keep source order within a block),
//               and one count per (token, expert) added at the expert's rank.
//   2. place:   each block reserves its rows in each destination's receive area with one atomic
//               per destination (sender-picked slots, no exchange). With ordered rows
//               (EpConfig::deterministic, and the naive backend) the ranks instead exchange
//               their counts first, after a barrier over the rank's blocks.
//   3. send:    one warp per token writes the row (quantised on the fly for bf16-to-fp8) and its
//               metadata straight into each destination rank's receive area, once per rank.
//   4. signal:  the last block of s to finish tells each destination that s's rows are written
//               (one release per destination, tagged with the round's epoch).
//   5. receive: s waits once for every sender's signal; then per-local-expert counts
//               (token-major) or the expansion into expert rows (expert-major), and the round's
//               State. Buffers touched by senders are double-buffered by epoch parity: a sender
//               is at most one round ahead of any receiver (it waits for every rank's rows of
//               its own round first).
// 1-4 are the send half, 5 the receive half (Half): launched apart, compute may run between them.
// Every wait is bounded (WaitContext); epochs live in State and are advanced by the kernel.

#include <cuda_bf16.h>

#include "backends/peer/kernels.hpp"
#include "backends/common/expert_pairs.cuh"
#include "backends/peer/peer_device.cuh"
#include "epx/cuda_check.hpp"
#include "core/fp8.cuh"
#include "core/sync_device.cuh"

namespace epx::peer {
namespace {

// What every phase of one dispatch call on one block knows. Kept small (kernels of 1024 threads
// have 64 registers each): what derives from the launch arguments is recomputed where used.
struct DispatchCall {
  const DispatchParams& p;
  const DispatchRank& me;
  uint32_t epoch;  // this call (1 = the first)
  int b, nb;       // this block among the rank's nb blocks
  int t0, t1;      // this block's tokens [t0, t1)
  int per_warp;    // tokens of each warp's chunk of [t0, t1) in route

  __device__ __forceinline__ int rank() const { return me.rank; }
  __device__ __forceinline__ uint8_t* local() const { return me.local; }  // this rank's buffer
  __device__ __forceinline__ State* state() const { return at<State>(me.local, p.common.layout.state); }
  // Epoch parity: the half of the double-buffered words this call uses.
  __device__ __forceinline__ int par() const { return int(epoch & 1); }
  __device__ __forceinline__ dev::WaitContext wait() const {
    dev::WaitContext w = make_wait(me.local, me.host_status, me.rank, p.common);
    w.call = epoch;
    return w;
  }
};

// Block-shared values of one dispatch call.
struct DispatchShared {
  uint8_t* peers[kMaxRanks];  // every rank's buffer
  int32_t count[kMaxRanks];   // this block's rows for rank r
  int32_t base[kMaxRanks];    // row in rank r's receive area of this block's first row for r
  int32_t total[kMaxRanks];   // ordered: rows this rank sends to r (block 0 only)
  int32_t warp_base[kMaxWarpsPerBlock][kMaxRanks];  // first row of warp w's chunk for r, in block
  int32_t expert_sums[dev::kMaxBlockExperts];  // route: the block's (token, expert) pairs
  int32_t recv_total;         // rows every rank sends to this rank: M
  int32_t failed;             // a wait of this block failed
};

__device__ __forceinline__ int64_t load_topk_id(const DispatchCall& c, int n, int k) {
  const size_t i = size_t(n) * c.p.common.shape.topk + k;
  return c.p.ids_int64 ? static_cast<const int64_t*>(c.me.topk_ids)[i]
                       : static_cast<const int32_t*>(c.me.topk_ids)[i];
}

// ---- 1. route --------------------------------------------------------------------------------

// Every warp walks its chunk of the block's tokens [t0, t1) in order; bad ids are recorded in the
// status word and their token is sent nowhere. After: send_slot[n][r] = position of token n among
// its warp's rows for rank r, or -1; sh.warp_base[w][r] = rows of warps < w for r; sh.count[r] =
// the block's rows for r; each destination's expert_rows counts this block's (token, expert)
// pairs of its local experts. Before: sh.expert_sums cleared (ExpertPairs::clear).
__device__ __forceinline__ void route(const DispatchCall& c, DispatchShared& sh) {
  const Shape& S = c.p.common.shape;
  const Layout& L = c.p.common.layout;
  const int W = S.world, K = S.topk;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  int32_t* send_slot = at<int32_t>(c.local(), L.send_slot);
  // Lanes in groups of G >= K: group g handles token c + g, lane k of the group its k-th id,
  // so a token's ids arrive in one load and are checked with warp intrinsics.
  int G = 1;
  while (G < K) G <<= 1;
  const int per_step = kWarpSize / G, sub = lane / G, k = lane % G;
  const uint32_t lt = dev::lanemask_lt();
  const uint64_t all_ranks = W == 64 ? ~uint64_t(0) : (uint64_t(1) << W) - 1;
  // Masked ranks get nothing: their (token, expert) pairs are dropped and counted.
  // (Read once per warp: a peer masked meanwhile by another block waits for the next call.)
  const uint64_t masked = __shfl_sync(kFullWarp, dev::masked_ranks(c.wait()), 0);
  const int w0 = min(c.t1, c.t0 + warp * c.per_warp), w1 = min(c.t1, w0 + c.per_warp);
  const dev::ExpertPairs pairs{sh.expert_sums, S.num_experts, (c.t1 - c.t0) * K};
  auto counter = [&](int e) {  // expert e's counter at its rank
    const int r = e / S.num_local;
    return at<int32_t>(sh.peers[r], L.expert_rows) + c.par() * S.num_local + (e - r * S.num_local);
  };
  int cnt_lo = 0, cnt_hi = 0;  // lane l holds the warp's count for ranks l and l + 32
  for (int first = w0; first < w1; first += per_step) {
    const int n = first + sub;
    const bool tok = n < w1;
    const bool has = tok && k < K;
    const int64_t id = has ? load_topk_id(c, n, k) : -1;
    int bad = 0;
    if (has && (id < -1 || id >= S.num_experts)) {
      dev::record_error(c.wait(), StatusCode::kInput, Phase::kDispatchRoute, -1, S.num_experts, id, n,
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
      dev::record_error(c.wait(), StatusCode::kInput, Phase::kDispatchRoute, -1,
                        (__ffs(same) - 1) - sub * G, id, n, k);
      bad = 1;
    }
    uint64_t bits = expert && !bad ? uint64_t(1) << (id / S.num_local) : 0;
    for (int off = G / 2; off >= 1; off >>= 1) {
      bits |= __shfl_xor_sync(kFullWarp, bits, off);
      bad |= __shfl_xor_sync(kFullWarp, bad, off);
    }
    if (expert && !bad) {
      const int r = int(id / S.num_local);
      if ((masked >> r) & 1) {
        atomicAdd(&c.state()->dropped, 1ull);
      } else {
        pairs.add(int(id), counter);
      }
    }
    // The group's first lane carries the token; invalid tokens are sent nowhere.
    const bool leader = tok && k == 0;
    const uint64_t mask = leader && !bad ? (S.every_rank ? all_ranks : bits) & ~masked : 0;
    for (int r = 0; r < W; ++r) {
      const bool bit = (mask >> r) & 1;
      const uint32_t bal = __ballot_sync(kFullWarp, bit);
      const int before = __shfl_sync(kFullWarp, r < 32 ? cnt_lo : cnt_hi, r & 31);
      if (leader) send_slot[size_t(n) * W + r] = bit ? before + __popc(bal & lt) : -1;
      if (lane == (r & 31)) (r < 32 ? cnt_lo : cnt_hi) += __popc(bal);
    }
  }
  if (lane < W) sh.warp_base[warp][lane] = cnt_lo;
  if (lane + 32 < W) sh.warp_base[warp][lane + 32] = cnt_hi;
  __syncthreads();
  pairs.flush(counter);
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    int32_t run = 0;
    for (int w = 0; w < num_warps; ++w) {
      const int32_t v = sh.warp_base[w][r];
      sh.warp_base[w][r] = run;
      run += v;
    }
    sh.count[r] = run;
  }
  __syncthreads();
}

// ---- 2. place --------------------------------------------------------------------------------

// Sender-picked rows: one atomic per destination reserves this block's rows there. After:
// sh.base[r] = row in r's receive area of this block's first row for r.
__device__ __forceinline__ void reserve_rows(const DispatchCall& c, DispatchShared& sh) {
  const Layout& L = c.p.common.layout;
  for (int r = threadIdx.x; r < c.p.common.shape.world; r += blockDim.x) {
    const int32_t rows = sh.count[r];
    sh.base[r] =
        rows > 0 ? dev::atomic_add_relaxed_sys(at<int32_t>(sh.peers[r], L.next_row) + c.par(), rows)
                 : 0;
  }
  __syncthreads();
}

// Ordered rows: the block's counts go to block_counts, then (after a barrier over the rank's
// blocks) this rank posts its row count per destination to every rank and reads the full matrix.
// Sums use one load per thread and shared atomics (no serial chains of global loads). After
// (true): sh.base[r] = row in r's receive area of this block's first row for r, sh.recv_total = M.
// False when a wait failed.
__device__ __forceinline__ bool exchange_counts(const DispatchCall& c, DispatchShared& sh) {
  const Layout& L = c.p.common.layout;
  const int W = c.p.common.shape.world, s = c.rank();
  int32_t* block_counts = at<int32_t>(c.local(), L.block_counts);  // [nb][W]
  for (int r = threadIdx.x; r < W; r += blockDim.x) block_counts[c.b * W + r] = sh.count[r];
  if (!dev::grid_barrier(&c.state()->barrier, c.nb, c.wait())) return false;
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    sh.total[r] = 0;
    sh.base[r] = 0;
  }
  if (threadIdx.x == 0) sh.recv_total = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < c.nb * W; i += blockDim.x) {
    const int32_t v = block_counts[i];
    const int bb = i / W, r = i % W;
    if (c.b == 0) atomicAdd(&sh.total[r], v);
    if (bb < c.b) atomicAdd(&sh.base[r], v);
  }
  __syncthreads();
  if (c.b == 0) {
    for (int i = threadIdx.x; i < W * W; i += blockDim.x) {
      const int d = i / W, r = i % W;
      uint64_t* dst =
          at<uint64_t>(sh.peers[d], L.count_matrix) + size_t(c.par()) * W * W + size_t(s) * W + r;
      dev::st_release_sys(dst, (uint64_t(c.epoch) << 32) | uint32_t(sh.total[r]));
    }
  }
  // base[r] += rows that ranks < s send to r; recv_total = rows every rank sends to s.
  const uint64_t* matrix = at<uint64_t>(c.local(), L.count_matrix) + size_t(c.par()) * W * W;  // [q][r]
  for (int i = threadIdx.x; i < W * W; i += blockDim.x) {
    const int q = i / W, r = i % W;
    const uint64_t* word = matrix + i;
    uint64_t seen = 0;
    const bool ok = dev::bounded_wait(
        c.wait(), Phase::kDispatchCounts, q, c.epoch,
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

// Ordered rows, receive half: M of the round from the count matrix its send half completed
// (every entry of this epoch was seen there). After (true): sh.recv_total = M.
__device__ __forceinline__ bool recount_ordered(const DispatchCall& c, DispatchShared& sh) {
  const int W = c.p.common.shape.world, s = c.rank();
  const uint64_t* matrix =
      at<uint64_t>(c.local(), c.p.common.layout.count_matrix) + size_t(c.par()) * W * W;
  if (threadIdx.x == 0) sh.recv_total = 0;
  __syncthreads();
  for (int q = threadIdx.x; q < W; q += blockDim.x) {
    const uint64_t seen = dev::ld_acquire_sys(matrix + size_t(q) * W + s);
    if (uint32_t(seen >> 32) != c.epoch) {
      // the send half of this round did not run (or a newer one did): a call-order error
      dev::record_error(c.wait(), StatusCode::kTimeout, Phase::kDispatchCounts, q, c.epoch,
                        int64_t(seen >> 32));
      sh.failed = 1;
    } else {
      atomicAdd(&sh.recv_total, int32_t(uint32_t(seen)));
    }
  }
  __syncthreads();
  return sh.failed == 0;
}

// ---- 3. send ---------------------------------------------------------------------------------

// 16-byte vectors per lane that one payload item loads before its stores (all in flight).
constexpr int kMaxVecs = 4;

// 16-byte input vectors a lane takes per step: bf16 quantised to fp8 takes two (16 values, one
// 16-byte fp8 store), the others one (16 bytes in, 16 bytes out).
template <DispatchDtype kDtype>
inline constexpr int kVecsPerStep = kDtype == DispatchDtype::kBF16ToFP8 ? 2 : 1;
// Input elements a lane takes per step.
template <DispatchDtype kDtype>
inline constexpr int kElemsPerStep = kDtype == DispatchDtype::kFP8 ? 16 : 8 * kVecsPerStep<kDtype>;
// Steps of one payload item.
template <DispatchDtype kDtype>
inline constexpr int kStepsPerItem = kMaxVecs / kVecsPerStep<kDtype>;

// One item of token n's payload: columns [step0, step0 + nsteps) x kWarpSize x kElemsPerStep,
// sent to the ranks of `slots`. Each lane first loads all its vectors of the item, then stores
// them to every destination, 16 bytes at a time. The item with step0 == 0 also sends the token's
// fp8 scales. Called by one whole warp.
template <DispatchDtype kDtype>
__device__ __forceinline__ void send_payload(const DispatchCall& c, uint8_t* const* peers, int n,
                                             const RankSlots& slots, uint64_t dmask, int lane,
                                             int step0, int nsteps) {
  const Shape& S = c.p.common.shape;
  const Layout& L = c.p.common.layout;
  const int H = S.hidden;
  constexpr int kPer = kElemsPerStep<kDtype>;
  constexpr int kVecs = kVecsPerStep<kDtype>;
  constexpr int kSteps = kStepsPerItem<kDtype>;
  constexpr int kInBytes = kDtype == DispatchDtype::kFP8 ? 1 : 2;
  const uint8_t* src = static_cast<const uint8_t*>(c.me.x) + size_t(n) * H * kInBytes;
  // A lane's kPer columns lie within one row (H is a multiple of kPer: 128 for fp8 output, 8 for
  // bf16) and within one 1x128 block.
  int4 v[kSteps][kVecs];
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    const int col = ((step0 + u) * kWarpSize + lane) * kPer;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      v[u][k] = make_int4(0, 0, 0, 0);
      if (u < nsteps && col < H)
        v[u][k] = __ldg(reinterpret_cast<const int4*>(src + size_t(col) * kInBytes) + k);
    }
  }
  if constexpr (kDtype != DispatchDtype::kBF16ToFP8) {
    constexpr int kOutBytes = kInBytes;
    for (uint64_t m = dmask; m; m &= m - 1) {
      const int r = lowest_rank(m);
      uint8_t* dst = peers[r] + L.recv_x + size_t(slots.of(r)) * H * kOutBytes;
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const int col = ((step0 + u) * kWarpSize + lane) * kPer;
        if (u < nsteps && col < H)
          *reinterpret_cast<int4*>(dst + size_t(col) * kOutBytes) = v[u][0];
      }
    }
    if (kDtype == DispatchDtype::kFP8 && step0 == 0) {
      for (uint64_t m = dmask; m; m &= m - 1) {
        const int r = lowest_rank(m);
        const int slot = slots.of(r);
        float* dst = at<float>(peers[r], L.recv_scales);
        for (int g = lane; g < S.groups; g += kWarpSize)
          dst[scale_index(S, slot, g, S.capacity)] = __ldg(c.me.x_scales + size_t(n) * S.groups + g);
      }
    }
  } else {
    // Quantised in place: 16 bf16 -> 16 fp8 per lane, a 1x128 block per 8 lanes sharing a scale.
    constexpr int kLanesPerBlock = kFp8BlockSize / kPer;
    uint4 q[kSteps];
    float sc[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      float f[kPer];
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        float g[8];
        bf16x8_to_float(v[u][k], g);  // zeros where nothing was loaded
#pragma unroll
        for (int i = 0; i < 8; ++i) f[8 * k + i] = g[i];
      }
      q[u] = make_uint4(0, 0, 0, 0);
      sc[u] = 0.f;
      if (u < nsteps)  // (u < nsteps: warp-uniform)
        q[u] = dev::quantize_fp8_block<kPer>(f, sc[u], S.round_scale != 0);
    }
    for (uint64_t m = dmask; m; m &= m - 1) {
      const int r = lowest_rank(m);
      const int slot = slots.of(r);
      uint8_t* dst = peers[r] + L.recv_x + size_t(slot) * H;
      float* dsc = at<float>(peers[r], L.recv_scales);
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const int col = ((step0 + u) * kWarpSize + lane) * kPer;
        if (u < nsteps && col < H) {
          *reinterpret_cast<uint4*>(dst + col) = q[u];
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
  const Layout& L = c.p.common.layout;
  const int W = c.p.common.shape.world, s = c.rank(), K = c.p.common.shape.topk;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  int32_t* send_slot = at<int32_t>(c.local(), L.send_slot);
  for (int n = c.t0 + warp; n < c.t1; n += num_warps) {
    const int w = (n - c.t0) / c.per_warp;  // the warp whose chunk holds n in route
    RankSlots slots{-1, -1};
    if (lane < W) {
      slots.lo = send_slot[size_t(n) * W + lane];
      if (slots.lo >= 0) slots.lo += sh.base[lane] + sh.warp_base[w][lane];
      send_slot[size_t(n) * W + lane] = slots.lo;
    }
    if (lane + 32 < W) {
      slots.hi = send_slot[size_t(n) * W + lane + 32];
      if (slots.hi >= 0) slots.hi += sh.base[lane + 32] + sh.warp_base[w][lane + 32];
      send_slot[size_t(n) * W + lane + 32] = slots.hi;
    }
    const uint64_t dmask = slots.ranks();
    if (dmask == 0) continue;
    int32_t my_id = -1;
    float my_w = 0.f;
    if (lane < K) {
      my_id = int32_t(load_topk_id(c, n, lane));
      my_w = __ldg(c.me.topk_weights + size_t(n) * K + lane);
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
  const int W = c.p.common.shape.world;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int32_t* send_slot = at<int32_t>(c.local(), c.p.common.layout.send_slot);
  constexpr int kPer = kElemsPerStep<kDtype>;
  const int steps = (c.p.common.shape.hidden + kWarpSize * kPer - 1) / (kWarpSize * kPer);
  const int parts = (steps + kStepsPerItem<kDtype> - 1) / kStepsPerItem<kDtype>;
  const int per_part = (steps + parts - 1) / parts;
  const int items = (c.t1 - c.t0) * parts;
  for (int it = warp; it < items; it += num_warps) {
    const int n = c.t0 + it / parts, part = it % parts;
    const RankSlots slots = load_rank_slots(send_slot, n, W, lane);
    const uint64_t dmask = slots.ranks();
    if (dmask == 0) continue;
    const int step0 = part * per_part;
    send_payload<kDtype>(c, sh.peers, n, slots, dmask, lane, step0, min(per_part, steps - step0));
  }
}

// After: this block's rows, scales and metadata are written into their destinations' receive
// areas (not yet announced), and send_slot[n][r] holds absolute rows. `clock0`: the block's
// start (phase clock of a measurement build).
template <DispatchDtype kDtype>
__device__ __forceinline__ void send(const DispatchCall& c, const DispatchShared& sh,
                                     [[maybe_unused]] uint64_t clock0) {
  send_metadata(c, sh);
  __syncthreads();
  EPX_PHASE_MARK(c.p.common, DispatchPhase::kMetadata, clock0);
#if EPX_MEASUREMENT
  if (c.p.common.shape.ablate & kAblatePayload) return;
#endif
  send_payloads<kDtype>(c, sh);
  EPX_PHASE_MARK_SYNC(c.p.common, DispatchPhase::kPayload, clock0);
}

// ---- 4. signal -------------------------------------------------------------------------------

// The last of this rank's blocks to finish sending tells every destination that this rank's rows
// of this round are written (each block fences its writes first; the ticket makes them visible
// to the last block, whose release makes them visible to the receivers).
__device__ __forceinline__ void signal_sent(const DispatchCall& c, const DispatchShared& sh) {
  const Layout& L = c.p.common.layout;
  const int W = c.p.common.shape.world;
  __syncthreads();
  if (threadIdx.x == 0) dev::fence_acq_rel_sys();
  if (!dev::last_block(&c.state()->dispatch_ticket, c.nb)) return;
  // Every block of this call read send_epoch before reaching the ticket.
  if (threadIdx.x == 0) {
    c.state()->send_epoch = c.epoch;
    c.state()->send_tokens = c.me.num_tokens;
    if (c.p.common.shape.mask_failed && c.me.host_status != nullptr) {
      reinterpret_cast<volatile HostMirror*>(c.me.host_status)->dropped = c.state()->dropped;
    }
  }
  // The word carries the round's buffer slot too, so that a receiver whose call sequence put
  // the round elsewhere reports the disagreement instead of reading the wrong rows.
  const uint64_t word = (uint64_t(uint32_t(c.p.common.slot)) << 32) | c.epoch;
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    dev::fence_acq_rel_sys();
    dev::st_release_sys(at<uint64_t>(sh.peers[r], L.sent) + size_t(c.par()) * W + c.rank(), word);
  }
}

// ---- 5. receive ------------------------------------------------------------------------------

// Waits, once, until every sender has signalled this round. After (true): rows [0, M) of this
// rank's receive area and the round's expert_rows are complete, and sh.recv_total = M. False
// when a wait failed or a sender put the round into another buffer slot (recorded as kPeer).
__device__ __forceinline__ bool await_senders(const DispatchCall& c, DispatchShared& sh) {
  const Layout& L = c.p.common.layout;
  const int W = c.p.common.shape.world;
  const uint64_t* sent = at<uint64_t>(c.local(), L.sent) + size_t(c.par()) * W;
  for (int q = threadIdx.x; q < W; q += blockDim.x) {
    const dev::PeerWait got = dev::peer_wait(
        c.wait(), Phase::kDispatchData, q, c.epoch,
        [&] { return dev::epoch_reached(uint32_t(dev::ld_acquire_sys(sent + q)), c.epoch); },
        [&] { return int64_t(uint32_t(dev::ld_acquire_sys(sent + q))); });
    if (got == dev::PeerWait::kMasked) continue;  // gone: whatever it wrote is not waited for
    if (got == dev::PeerWait::kFailed) {
      sh.failed = 1;
    } else if (const uint32_t slot = uint32_t(dev::ld_acquire_sys(sent + q) >> 32);
               slot != uint32_t(c.p.common.slot)) {
      dev::record_error(c.wait(), StatusCode::kPeer, Phase::kDispatchData, q, c.p.common.slot, slot);
      sh.failed = 1;
    }
  }
  __syncthreads();
  if (sh.failed) return false;
  // Ordered rows: M came with the count exchange. Reserved rows: every reservation of the round
  // precedes its sender's signal.
  if (!c.p.common.shape.ordered && threadIdx.x == 0)
    sh.recv_total = dev::ld_acquire_sys(at<int32_t>(c.local(), L.next_row) + c.par());
  __syncthreads();
  return true;
}

// Expert-major: expansion of the received rows into expert rows, ordered by token-major row.
// After (true): expert e's rows [0, expert_rows[e]) of expert_x,
// expert_scales and the expert_* metadata are complete, and row_expert_slot[j][k] = the row of
// (received row j, its k-th expert) in that expert, or -1. False when the grid barrier failed.
template <DispatchDtype kDtype>
__device__ __forceinline__ bool expand_to_experts(const DispatchCall& c, int M) {
  extern __shared__ int32_t expert_scratch[];  // [E/W]: counts, then this block's first slots
  const Shape& S = c.p.common.shape;
  const Layout& L = c.p.common.layout;
  const int K = S.topk, num_local = S.num_local, e0 = c.rank() * num_local;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int nb = c.nb, b = c.b;
  uint8_t* local = c.local();
  const int32_t* rids = at<int32_t>(local, L.recv_topk_ids);
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
  if (!dev::grid_barrier(&c.state()->barrier, nb, c.wait())) return false;
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    int32_t acc = 0;
    for (int bb = 0; bb < b; ++bb) acc += bec[bb * num_local + e];
    expert_scratch[e] = acc;
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

// Block 0, once the round's rows are in place (and, expert-major, every block has read M). After:
// expert_counts holds the round's rows per local expert, the double-buffered words of this
// parity are ready for the round after next, and the slot's RoundState holds this call's M, N
// and epoch (the call is complete).
__device__ __forceinline__ void finish_round(const DispatchCall& c, int M) {
  const Layout& L = c.p.common.layout;
  const int num_local = c.p.common.shape.num_local;
  int32_t* rows = at<int32_t>(c.local(), L.expert_rows) + c.par() * num_local;
  int32_t* expert_counts = at<int32_t>(c.local(), L.expert_counts);
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    expert_counts[e] = rows[e];
    rows[e] = 0;
  }
  if (threadIdx.x == 0) {
    at<int32_t>(c.local(), L.next_row)[c.par()] = 0;
    RoundState* round = at<RoundState>(c.local(), L.round);
    round->recv_count = M;
    round->num_tokens = c.state()->send_tokens;  // released with this rank's own signal
    round->epoch = c.epoch;
  }
}

// ---- the kernel ------------------------------------------------------------------------------

template <DispatchDtype kDtype>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    dispatch_kernel(const __grid_constant__ DispatchParams p) {
  __shared__ DispatchShared sh;
  const RankBlock rb = rank_block(p.common.num_ranks);
  const DispatchRank& me = p.ranks[rb.slot];
  const State* state = at<State>(me.local, p.common.layout.state);
  // An earlier call timed out: the peers' state is unknown.
  if (dev::block_aborted(make_wait(me.local, me.host_status, me.rank, p.common))) return;
  [[maybe_unused]] uint64_t clock0 = 0;  // the block's start: phase clock (EPX_PHASE_CLOCK)
#if EPX_MEASUREMENT
  clock0 = dev::globaltimer_ns();
  phase_started(p.common.clock, 0, clock0);
#endif
  const Half half = p.common.half;
  // A receive half serves the round its send half began.
  const uint32_t epoch = state->send_epoch + (half == Half::kReceive ? 0 : 1);
  // Block b owns tokens [t0, t1); each of its warps a chunk of per_warp of them in route.
  const int N = half == Half::kReceive ? 0 : me.num_tokens;
  const int per_block = (N + rb.nb - 1) / rb.nb;
  const int t0 = min(N, rb.b * per_block), t1 = min(N, t0 + per_block);
  const int num_warps = blockDim.x / kWarpSize;
  const DispatchCall c{.p = p,
                       .me = me,
                       .epoch = epoch,
                       .b = rb.b,
                       .nb = rb.nb,
                       .t0 = t0,
                       .t1 = t1,
                       .per_warp = max(1, (t1 - t0 + num_warps - 1) / num_warps)};
  for (int r = threadIdx.x; r < p.common.shape.world; r += blockDim.x)
    sh.peers[r] = p.common.peers[r];
  if (threadIdx.x == 0) sh.failed = 0;
  dev::ExpertPairs{sh.expert_sums, p.common.shape.num_experts, (t1 - t0) * p.common.shape.topk}
      .clear();
  __syncthreads();

  if (half != Half::kReceive) {
    route(c, sh);
    EPX_PHASE_MARK(p.common, DispatchPhase::kRouted, clock0);
    if (p.common.shape.ordered) {
      if (!exchange_counts(c, sh)) return;
    } else {
      reserve_rows(c, sh);
    }
    EPX_PHASE_MARK(p.common, DispatchPhase::kPlaced, clock0);
    send<kDtype>(c, sh, clock0);
    signal_sent(c, sh);
    EPX_PHASE_MARK(p.common, DispatchPhase::kSignalled, clock0);
    if (half == Half::kSend) return;
  } else if (p.common.shape.ordered) {
    // M of an ordered round came with the count exchange of the send half: read it again.
    if (!recount_ordered(c, sh)) return;
  }
  const bool expert_major = p.common.shape.expert_major;
  if (!expert_major && rb.b != 0) return;  // token-major: block 0 receives for the rank
  if (!await_senders(c, sh)) return;
  EPX_PHASE_MARK(p.common, DispatchPhase::kReceived, clock0);
  const int M = sh.recv_total;
  if (expert_major && !expand_to_experts<kDtype>(c, M)) return;
  if (rb.b == 0) finish_round(c, M);
  EPX_PHASE_MARK_SYNC(p.common, DispatchPhase::kDone, clock0);
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
  const dim3 grid(lc.num_blocks * p.common.num_ranks), block(lc.warps_per_block * kWarpSize);
  // expert-major: one counter per local expert (validate_for bounds E/W by kMaxExpertMajorLocal)
  const size_t smem =
      p.common.shape.expert_major ? size_t(p.common.shape.num_local) * sizeof(int32_t) : 0;
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
