// The high_throughput dispatch: two kernels.
//
// count (one block per channel and rank): each warp walks its own contiguous chunk of the
//   channel's tokens in order, several tokens per step (a group of >= K lanes per token), and
//   reads their top-k ids once: it checks them (a bad or repeated id is recorded and its token
//   sent nowhere), keeps each token's destination ranks (token_mask), adds the round's (token,
//   expert) pairs at each expert's rank and counts, per destination, the rows of its chunk (no
//   block barrier inside the walk). One scan over the warps then gives each chunk's first row
//   per destination and the channel's rows per destination, which the block posts to every
//   rank. Block 0 then waits for every (source, channel) count of the round and lays out the
//   receive area: segment (q, c) starts at the sum of the segments before it in (source, channel)
//   order, so rows are ordered by (source rank, source index). The round's M and N, the
//   per-expert counts and the epoch go to HtState. (With exact output sizes the host reads M
//   here and sizes the receive area.)
// transfer (two blocks per channel and rank): the sending block walks its channel's tokens in
//   batches of one token per warp; it waits until each destination's ring has room for the
//   batch, writes each token's row (quantised on the fly for bf16-to-fp8), scales, ids, weights
//   and index once to each destination, then publishes the ring positions written (one release
//   per destination and batch). The receiving block polls the tails of its channel's W rings,
//   copies whatever has arrived into the receive area at its segment's place, and publishes how
//   far it has read. Every wait is bounded (no progress within the timeout records which peer).
// direct mode (an in-process group: every rank addresses every rank's memory): the count kernel
//   also places each token in its (source, channel) segment at each destination (row_pos, in
//   token order: its place within its warp's chunk, to which the chunk's first row is added
//   after the scan); the transfer kernel's blocks (all 2C sending) wait until each destination
//   has published its receive area of the round, then take the rank's tokens in batches, in
//   turn from a counter, staged in shared memory as they go on the wire, and write each batch's
//   rows by bulk copies, each destination's rows in one contiguous run (with scales and metadata);
//   the rank's last block tells every destination (arrived); block 0 returns once every rank's rows
//   are here. No rings.

#include <cuda_bf16.h>

#include <cub/warp/warp_scan.cuh>

#include "backends/common/expert_pairs.cuh"
#include "backends/high_throughput/ht_device.cuh"
#include "core/bulk_copy.cuh"
#include "core/fp8.cuh"
#include "epx/cuda_check.hpp"

namespace epx::ht {
namespace {

// Token n's k-th id; -1 for every slot when the round routes by a rank mask (no ids).
__device__ __forceinline__ int64_t load_id(const HtShape& S, const void* ids, int n, int k) {
  if (ids == nullptr) return -1;
  const size_t i = size_t(n) * S.topk + k;
  return S.ids_int64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
}
__device__ __forceinline__ float load_weight(const float* weights, size_t i) {
  return weights == nullptr ? 0.f : __ldg(weights + i);
}

// Routing by a rank mask: the walk of one warp's chunk [w0, w1), 32 tokens a step, lane j token
// first + j. Each token's destinations from its mask row, its place among the warp's rows for
// each (direct mode), and the warp's rows per destination in cnt.
__device__ __forceinline__ void walk_rank_mask(const HtDispatchRank& me, const HtLayout& L, int W,
                                               int w0, int w1, uint64_t* token_mask,
                                               int32_t* row_pos, int32_t* cnt) {
  const int lane = threadIdx.x % kWarpSize;
  const uint32_t lt = dev::lanemask_lt();
  for (int first = w0; first < w1; first += kWarpSize) {
    const int n = first + lane;
    uint64_t bits = 0;
    if (n < w1) {
      const uint8_t* row = me.rank_mask + size_t(n) * W;
      for (int r = 0; r < W; ++r) bits |= uint64_t(row[r] != 0) << r;
      token_mask[n] = bits;
    }
    for (int r = 0; r < W; ++r) {
      const bool to_r = ((bits >> r) & 1) != 0;
      const uint32_t rows = __ballot_sync(kFullWarp, to_r);
      const int32_t before = cnt[r];
      if (L.direct && n < w1) row_pos[size_t(n) * W + r] = to_r ? before + __popc(rows & lt) : -1;
      __syncwarp();  // every lane has read cnt[r]
      if (lane == 0) cnt[r] = before + __popc(rows);
      __syncwarp();
    }
  }
}

// ---- count -----------------------------------------------------------------------------------

// Steps of the walk whose top-k ids a lane has in flight (registers: two per id).
constexpr int kIdsAhead = 4;
using WarpSum = cub::WarpScan<int32_t>;

__global__ void __launch_bounds__(kMaxThreads)
    ht_count_kernel(const __grid_constant__ HtDispatchParams p) {
  __shared__ int32_t count[kMaxRanks];                         // rows this channel sends to rank r
  __shared__ int32_t warp_base[kMaxWarpsPerBlock][kMaxRanks];  // warp w's rows for r, then w's base
  __shared__ int32_t expert_sums[dev::kMaxBlockExperts];       // this block's pairs per expert
  __shared__ int32_t failed;
  const HtCommon& cm = p.common;
  const HtShape& S = cm.shape;
  const HtLayout& L = cm.layout;
  const HtBlock hb = ht_block(cm.num_ranks);
  const HtDispatchRank& me = p.ranks[hb.slot];
  const int c = hb.b, SEG = L.segments;
  HtState* st = at<HtState>(me.local, L.state);
  dev::WaitContext w = ht_wait(me.local, me.host_status, me.rank, cm);
  if (dev::block_aborted(w)) return;
#if EPX_MEASUREMENT
  phase_begin(cm);  // the phase clock (EPX_PHASE_CLOCK): the block's start
  if (c == 0) phase_count_started(cm, me.rank);
#endif
  // Every block reads the epoch before it posts its counts, and block 0 advances it only after
  // every block of this rank has posted: all blocks see the same value.
  const uint32_t epoch = st->epoch + 1;
  w.call = epoch;
  const int par = int(epoch & 1);
  const int W = S.world, K = S.topk, E = S.num_experts, num_local = S.num_local;
  const int N = me.num_tokens;
  const auto [t0, t1] = segment_tokens(N, L.channels, L.direct, c);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  if (threadIdx.x == 0) failed = 0;
  const dev::ExpertPairs pairs{expert_sums, E, (t1 - t0) * K};
  auto counter = [&](int e) {  // expert e's counter at its rank
    const int r = e / num_local;
    return at<int32_t>(cm.peers[r], L.expert_rows) + par * num_local + (e - r * num_local);
  };
  pairs.clear();
  __syncthreads();
  EPX_PHASE_MARK(cm, CountPhase::kSetUp);
  uint64_t* token_mask = at<uint64_t>(me.local, L.token_mask);
  uint8_t* token_order = me.local + L.token_order;      // S.highest_slot only
  int32_t* row_pos = at<int32_t>(me.local, L.row_pos);  // direct mode only
  // Each warp walks its chunk [w0, w1) of the channel's tokens in order. Lanes in groups of
  // G >= K: group `sub` reads token first + sub, lane k of the group its k-th id, so a token's ids
  // are checked with warp intrinsics and several tokens are read per step.
  const int per_warp = max(1, (t1 - t0 + num_warps - 1) / num_warps);
  const int w0 = min(t1, t0 + warp * per_warp), w1 = min(t1, w0 + per_warp);
  int G = 1;
  while (G < K) G <<= 1;
  const int per_step = kWarpSize / G, sub = lane / G, k = lane % G;
  const uint32_t lt = dev::lanemask_lt();
  uint32_t slot_k = 0;  // the lanes of slot k in every group: one lane a token of the step
  for (int g = 0; g < kWarpSize; g += G) slot_k |= 1u << (g + k);
  // An expert's rank: a shift where the experts per rank are a power of two (R1: 32).
  const bool local_pow2 = (num_local & (num_local - 1)) == 0;
  const int local_shift = __ffs(num_local) - 1;
  int32_t* cnt = warp_base[warp];  // the warp's rows so far for rank r
  for (int r = lane; r < W; r += kWarpSize) cnt[r] = 0;
  __syncwarp();
  // A lane's ids of the next kIdsAhead steps are in flight while it walks this one: the walk waits
  // for one load's latency, not one per step.
  auto id_at = [&](int step_first) {
    const int n = step_first + sub;
    return n < w1 && k < K ? load_id(S, me.topk_ids, n, k) : int64_t(-1);
  };
  int64_t ahead[kIdsAhead];
  const bool by_ids = me.rank_mask == nullptr;
#pragma unroll
  for (int a = 0; a < kIdsAhead; ++a) ahead[a] = by_ids ? id_at(w0 + a * per_step) : -1;
  if (!by_ids) walk_rank_mask(me, L, W, w0, w1, token_mask, row_pos, cnt);
#pragma unroll 1
  for (int first = w0; by_ids && first < w1; first += per_step) {
    const int n = first + sub;
    const bool has = n < w1 && k < K;
    const int64_t id = ahead[0];
#pragma unroll
    for (int a = 0; a + 1 < kIdsAhead; ++a) ahead[a] = ahead[a + 1];
    ahead[kIdsAhead - 1] = id_at(first + kIdsAhead * per_step);
    int bad = 0;
    if (has && (id < -1 || id >= E)) {
      dev::record_error(w, StatusCode::kInput, Phase::kDispatchRoute, -1, E, id, n, k);
      bad = 1;
    }
    if (first == w0) EPX_PHASE_MARK(cm, CountPhase::kIdsIn);  // (thread 0 alone marks)
    const bool expert = has && id >= 0 && !bad;
    // Distinct unless a lower lane of the same group holds the same expert.
    const unsigned long long key = expert ? (uint64_t(uint32_t(sub)) << 32) | uint32_t(id)
                                          : (uint64_t(1) << 40) | uint32_t(lane);
    const uint32_t same = __match_any_sync(kFullWarp, key);
    if (expert && (same & lt) != 0) {
      // expected = the earlier slot holding the same expert
      dev::record_error(w, StatusCode::kInput, Phase::kDispatchRoute, -1,
                        (__ffs(same) - 1) - sub * G, id, n, k);
      bad = 1;
    }
    // the expert's rank (0 <= id < E)
    const int dst = expert ? (local_pow2 ? int(id) >> local_shift : int(id) / num_local) : 0;
    uint64_t bits = expert && !bad ? uint64_t(1) << dst : 0;
    for (int off = G / 2; off >= 1; off >>= 1) {
      bits |= __shfl_xor_sync(kFullWarp, bits, off);
      bad |= __shfl_xor_sync(kFullWarp, bad, off);
    }
    if (bad) bits = 0;  // a token with a bad id goes nowhere
    if (expert && !bad) pairs.add(int(id), counter);
    if (n < w1 && k == 0) token_mask[n] = bits;
    if (S.highest_slot) {
      // Slot k is its rank's place in combine's order when no higher slot of the token holds an
      // expert of that rank; the places ascend with k.
      const bool routed = expert && !bad;
      const unsigned long long rkey = routed ? (uint64_t(uint32_t(sub)) << 32) | uint32_t(dst)
                                             : (uint64_t(1) << 40) | uint32_t(lane);
      const uint32_t same = __match_any_sync(kFullWarp, rkey);
      const bool highest = routed && (same >> lane) == 1u;
      const uint32_t group = (G == kWarpSize ? kFullWarp : (1u << G) - 1u) << (sub * G);
      const uint32_t places = __ballot_sync(kFullWarp, highest) & group & lt;
      if (highest) token_order[size_t(n) * K + __popc(places)] = uint8_t(dst);
    }
    // The step's tokens in order: lane (sub, k) places token first + sub among the warp's rows
    // for ranks k, k + G, ...: the rows before it are the warp's so far and those of the step's
    // earlier tokens (the lanes of slot k in lower groups). bits == 0 past w1.
    for (int r0 = 0; r0 < W; r0 += G) {
      const int r = r0 + k;
      const bool to_r = r < W && ((bits >> r) & 1) != 0;
      const uint32_t rows = __ballot_sync(kFullWarp, to_r) & slot_k;
      const int32_t before = r < W ? cnt[r] : 0;
      if (L.direct && r < W && n < w1)
        row_pos[size_t(n) * W + r] = to_r ? before + __popc(rows & lt) : -1;
      __syncwarp();  // every lane has read cnt[r]
      if (sub == 0 && r < W) cnt[r] = before + __popc(rows);
      __syncwarp();
    }
  }
  __syncthreads();
  EPX_PHASE_MARK(cm, CountPhase::kWalked);
  pairs.flush(counter);
  // Routing by a rank mask: the sender's own pair counts, added once (block 0) at each expert's
  // rank, ordered before block 0's counts like the pairs.
  if (!by_ids && c == 0) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const int32_t v = __ldg(me.expert_sums + e);
      if (v != 0) dev::red_add_relaxed_sys(counter(e), v);
    }
  }
  EPX_PHASE_MARK(cm, CountPhase::kRouted);
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    int32_t run = 0;
    for (int v = 0; v < num_warps; ++v) {
      const int32_t rows = warp_base[v][r];
      warp_base[v][r] = run;
      run += rows;
    }
    count[r] = run;
  }
  __syncthreads();
  // The expert pairs above are ordered before each count by the fence and the release.
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    dev::fence_acq_rel_sys();
    dev::st_release_sys(at<uint64_t>(cm.peers[r], L.counts) + (size_t(par) * W + me.rank) * SEG + c,
                        (uint64_t(epoch) << 32) | uint32_t(count[r]));
  }
  EPX_PHASE_MARK_SYNC(cm, CountPhase::kCounted);
  // Direct mode: the places within the warps' chunks become places within the segment (the
  // rows of the earlier warps' chunks come first). Warp 0's chunk starts the segment.
  if (L.direct && warp > 0) {
    const int32_t* base = warp_base[warp];
    const int step = kWarpSize % W;
    int r = lane % W;
    for (size_t i = size_t(w0) * W + lane; i < size_t(w1) * W; i += kWarpSize) {
      const int32_t pos = row_pos[i];
      if (pos >= 0) row_pos[i] = pos + base[r];
      r += step;
      if (r >= W) r -= W;
    }
  }
  EPX_PHASE_MARK_SYNC(cm, CountPhase::kPlaced);
  if (c != 0) return;

  // Block 0: every (source, segment) count of the round -> the receive area's segments.
  const uint64_t* counts = at<uint64_t>(me.local, L.counts) + size_t(par) * W * SEG;  // [q][c]
  int32_t* seg_count = at<int32_t>(me.local, L.seg_count);
  int32_t* seg_offset = at<int32_t>(me.local, L.seg_offset);
  for (int i = threadIdx.x; i < W * SEG; i += blockDim.x) {
    uint64_t seen = 0;
    const bool ok = dev::bounded_wait(
        w, Phase::kDispatchCounts, i / SEG, epoch,
        [&] {
          seen = dev::ld_acquire_sys(counts + i);
          return uint32_t(seen >> 32) == epoch;
        },
        [&] { return int64_t(seen >> 32); });
    if (!ok) {
      failed = 1;
    } else {
      seg_count[i] = int32_t(uint32_t(seen));
    }
  }
  __syncthreads();
  if (failed) return;
  EPX_PHASE_MARK(cm, CountPhase::kCountsSeen);
  int32_t* rows = at<int32_t>(me.local, L.expert_rows) + par * num_local;
  int32_t* expert_counts = at<int32_t>(me.local, L.expert_counts);
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    expert_counts[e] = rows[e];
    rows[e] = 0;  // ready for the round after next (same parity)
  }
  // Segment i starts at the sum of the segments before it: an exclusive sum over the block,
  // blockDim items at a time (one thread's serial sum of 128 segments took 3.5 us on an H200).
  __shared__ typename WarpSum::TempStorage scan_tmp[kMaxWarpsPerBlock];
  __shared__ int32_t warp_sum[kMaxWarpsPerBlock];
  int32_t run = 0;  // the rows of the items before this pass
  for (int pass = 0; pass < W * SEG; pass += blockDim.x) {
    const int i = pass + threadIdx.x;
    int32_t before = 0, in_warp = 0;
    WarpSum(scan_tmp[warp]).ExclusiveSum(i < W * SEG ? seg_count[i] : 0, before, in_warp);
    if (lane == 0) warp_sum[warp] = in_warp;
    __syncthreads();
    int32_t in_pass = 0;
    for (int v = 0; v < num_warps; ++v) {
      if (v == warp) before += run + in_pass;
      in_pass += warp_sum[v];
    }
    if (i < W * SEG) seg_offset[i] = before;
    run += in_pass;
    __syncthreads();  // warp_sum is rewritten by the next pass
  }
  if (threadIdx.x == 0) {
    st->recv_count = run;
    st->num_tokens = N;
    st->epoch = epoch;
  }
  EPX_PHASE_MARK_SYNC(cm, CountPhase::kLaidOut);
}

// The wait context of rank `me` in call `epoch`, built where a wait needs it.
__device__ __forceinline__ dev::WaitContext wait_ctx(const HtDispatchRank& me, const HtCommon& cm,
                                                     uint32_t epoch) {
  dev::WaitContext w = ht_wait(me.local, me.host_status, me.rank, cm);
  w.call = epoch;
  return w;
}

// ---- transfer: send --------------------------------------------------------------------------

// 16-byte row vectors a lane loads before it stores them (all in flight).
constexpr int kUnroll = 4;

// 16-byte input vectors a lane takes per piece: bf16 quantised to fp8 takes two (16 values, one
// 16-byte fp8 store), the others one (16 bytes in, 16 bytes out).
template <DispatchDtype kDtype>
inline constexpr int kVecsPerPiece = kDtype == DispatchDtype::kBF16ToFP8 ? 2 : 1;
// Input elements of one piece.
template <DispatchDtype kDtype>
inline constexpr int kElemsPerPiece =
    kDtype == DispatchDtype::kFP8 ? 16 : 8 * kVecsPerPiece<kDtype>;

// Pieces one lane holds at once, and a warp's chunk of a row: kPieces x kWarpSize pieces.
template <DispatchDtype kDtype>
inline constexpr int kPieces = kUnroll / kVecsPerPiece<kDtype>;
// Chunks of a row of `hidden` values (H % 128 == 0 where the wire is fp8).
template <DispatchDtype kDtype>
__device__ __forceinline__ int row_chunks(int hidden) {
  constexpr int kChunk = kPieces<kDtype> * kWarpSize * kElemsPerPiece<kDtype>;
  return (hidden + kChunk - 1) / kChunk;
}

// Chunk `chunk` of token n's payload (and its fp8 scales) to every rank r in `m` (the token's
// destinations, warp-uniform), at the places `sink.dest(r)` names: a ring row, or (direct mode)
// the row of the receiver's area. Called by one whole warp.
template <DispatchDtype kDtype, typename Sink>
__device__ __forceinline__ void write_chunk(const HtDispatchParams& p, const HtDispatchRank& me,
                                            int n, uint64_t m, const Sink& sink, int chunk) {
  const HtShape& S = p.common.shape;
  const int H = S.hidden, lane = threadIdx.x % kWarpSize;
  constexpr int kPer = kElemsPerPiece<kDtype>;
  constexpr int kVecs = kVecsPerPiece<kDtype>;
  constexpr int kHeld = kPieces<kDtype>;
  constexpr int kInBytes = kDtype == DispatchDtype::kFP8 ? 1 : 2;
  const int pieces = H / kPer;  // of the input row (H % 128 == 0 where the wire is fp8)
  const int4* src =
      reinterpret_cast<const int4*>(static_cast<const uint8_t*>(me.x) + size_t(n) * H * kInBytes);
  {
    const int v0 = chunk * kHeld * kWarpSize;
    int4 v[kHeld][kVecs];
#pragma unroll
    for (int u = 0; u < kHeld; ++u) {
      const int vi = v0 + u * kWarpSize + lane;
#pragma unroll
      for (int k = 0; k < kVecs; ++k)
        v[u][k] = vi < pieces ? __ldg(src + size_t(vi) * kVecs + k) : make_int4(0, 0, 0, 0);
    }
    if constexpr (kDtype != DispatchDtype::kBF16ToFP8) {
      for (uint64_t mm = m; mm; mm &= mm - 1) {
        int4* out = reinterpret_cast<int4*>(sink.dest(lowest_rank(mm)).payload());
#pragma unroll
        for (int u = 0; u < kHeld; ++u) {
          const int vi = v0 + u * kWarpSize + lane;
          if (vi < pieces) out[vi] = v[u][0];
        }
      }
    } else {
      // 16 bf16 -> 16 fp8 per lane; 8 lanes hold one 1x128 block (H % 128 == 0, so a block's
      // lanes are either wholly inside the row or wholly past it).
      constexpr int kLanesPerBlock = kFp8BlockSize / kPer;
      uint4 q[kHeld];
      float sc[kHeld];
#pragma unroll
      for (int u = 0; u < kHeld; ++u) {
        float f[kPer];
#pragma unroll
        for (int k = 0; k < kVecs; ++k) {
          float g[8];
          dev::bf16x8_to_float(v[u][k], g);
#pragma unroll
          for (int i = 0; i < 8; ++i) f[8 * k + i] = g[i];
        }
        q[u] = dev::quantize_fp8_block<kPer>(f, sc[u], S.round_scale != 0);
      }
      for (uint64_t mm = m; mm; mm &= mm - 1) {
        const auto d = sink.dest(lowest_rank(mm));
        uint4* out = reinterpret_cast<uint4*>(d.payload());
#pragma unroll
        for (int u = 0; u < kHeld; ++u) {
          const int vi = v0 + u * kWarpSize + lane;
          if (vi < pieces) {
            out[vi] = q[u];
            if (lane % kLanesPerBlock == 0) *d.scale(vi / kLanesPerBlock) = sc[u];
          }
        }
      }
    }
  }
}

// Token n's metadata (and its fp8 input's scales) to every rank r in `m`, as write_chunk.
template <DispatchDtype kDtype, typename Sink>
__device__ __forceinline__ void write_metadata(const HtDispatchParams& p, const HtDispatchRank& me,
                                               int n, uint64_t m, const Sink& sink) {
  const HtShape& S = p.common.shape;
  const int K = S.topk, lane = threadIdx.x % kWarpSize;
  int32_t id = -1;
  float weight = 0.f;
  if (lane < K) {
    id = int32_t(load_id(S, me.topk_ids, n, lane));
    weight = load_weight(me.topk_weights, size_t(n) * K + lane);
  }
  for (uint64_t mm = m; mm; mm &= mm - 1) {
    const auto d = sink.dest(lowest_rank(mm));
    if constexpr (kDtype == DispatchDtype::kFP8) {
      for (int g = lane; g < S.groups; g += kWarpSize)
        *d.scale(g) = __ldg(me.x_scales + size_t(n) * S.groups + g);
    }
    d.metadata(lane, K, id, weight, n);
  }
}

// Token n's whole row, scales and metadata, as write_chunk.
template <DispatchDtype kDtype, typename Sink>
__device__ __forceinline__ void write_token(const HtDispatchParams& p, const HtDispatchRank& me,
                                            int n, uint64_t m, const Sink& sink) {
  const int chunks = row_chunks<kDtype>(p.common.shape.hidden);
  for (int chunk = 0; chunk < chunks; ++chunk) write_chunk<kDtype>(p, me, n, m, sink, chunk);
  write_metadata<kDtype>(p, me, n, m, sink);
}

// Where a token's copies go: lane l holds the place at ranks l and l + 32, so that the warp
// learns each destination's place with one shuffle (no memory load on the way to the stores).
template <typename T>
__device__ __forceinline__ T lane_value(T lo, T hi, int r) {
  return __shfl_sync(kFullWarp, r < kWarpSize ? lo : hi, r % kWarpSize);
}

// A ring row (one slot: payload, then scales, ids, weights and the source index) per rank.
struct RingSink {
  uint8_t* const* ring;  // [W]: the first slot of the ring to rank r
  size_t slot_bytes;
  int slot_lo;  // lane l: the token's slot in the ring to rank l
  int slot_hi;  // ... and to rank l + 32
  SlotParts parts;
  struct Dest {
    uint8_t* slot;
    const SlotParts& parts;
    __device__ uint8_t* payload() const { return slot; }
    __device__ float* scale(int g) const {
      return reinterpret_cast<float*>(slot + parts.scales) + g;
    }
    __device__ void metadata(int lane, int K, int32_t id, float weight, int n) const {
      if (lane < K) {
        reinterpret_cast<int32_t*>(slot + parts.ids)[lane] = id;
        reinterpret_cast<float*>(slot + parts.weights)[lane] = weight;
      }
      if (lane == 0) *reinterpret_cast<int32_t*>(slot + parts.index) = n;
    }
  };
  // Called by the whole warp (r warp-uniform).
  __device__ Dest dest(int r) const {
    return Dest{ring[r] + size_t(lane_value(slot_lo, slot_hi, r)) * slot_bytes, parts};
  }
};

// Channel c of rank `me`: its tokens into the dispatch rings of their destinations (returns early
// when a wait failed: recorded in the status word).
template <DispatchDtype kDtype>
__device__ __forceinline__ void send_channel(const HtDispatchParams& p, const HtDispatchRank& me,
                                             uint32_t epoch, int c) {
  __shared__ uint64_t base[kMaxRanks];     // ring position of this batch's first row for r
  __shared__ uint32_t bal[kMaxRanks];      // bit i: token i of the batch goes to r
  __shared__ uint64_t mask_of[kWarpSize];  // destinations of token i of the batch
  __shared__ uint8_t* ring_to[kMaxRanks];  // first slot of ring (s -> r, c)
  __shared__ int32_t failed;
  const HtCommon& cm = p.common;
  const HtShape& S = cm.shape;
  const HtLayout& L = cm.layout;
  const int W = S.world, C = L.channels, s = me.rank, ring = L.dispatch_ring;
  const int N = me.num_tokens;
  const int t0 = channel_begin(N, C, c), t1 = channel_begin(N, C, c + 1);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  uint64_t* sent = at<uint64_t>(me.local, L.dsent) + size_t(c) * W;
  const uint64_t* head = at<uint64_t>(me.local, L.dhead) + size_t(c) * W;  // readers' progress
  const uint64_t* token_mask = at<uint64_t>(me.local, L.token_mask);
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    base[r] = sent[r];
    ring_to[r] = cm.peers[r] + L.dring + (size_t(c) * W + s) * ring * L.dispatch_slot;
  }
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  for (int t = t0; t < t1; t += num_warps) {
    const int t_end = min(t1, t + num_warps);
    if (warp == 0) batch_ballots(token_mask, t, t_end, W, mask_of, bal);
    __syncthreads();
    // Room for the batch in every destination's ring (its reader is at most `ring` rows behind).
    wait_batch(
        wait_ctx(me, cm, epoch), Phase::kRingSpace, base, bal, W, &failed,
        [&](int r, uint64_t need) {
          return need - dev::ld_acquire_sys(head + r) <= uint64_t(ring);
        },
        [&](int r) { return int64_t(dev::ld_acquire_sys(head + r)); });
    if (failed) return;
    if (t + warp < t_end) {
      const uint64_t m = mask_of[warp];
      if (m != 0) {
        // This token's row in ring (s -> r, c): after the batch's earlier tokens for r.
        const int hi = lane + kWarpSize;
        const uint32_t before = (1u << warp) - 1;
        const int slot_lo =
            lane < W ? int((base[lane] + __popc(bal[lane] & before)) % uint64_t(ring)) : 0;
        const int slot_hi =
            hi < W ? int((base[hi] + __popc(bal[hi] & before)) % uint64_t(ring)) : 0;
        write_token<kDtype>(p, me, t + warp, m,
                            RingSink{ring_to, L.dispatch_slot, slot_lo, slot_hi, slot_parts(S)});
      }
    }
    __syncthreads();
    // Publish: the batch's rows are written (the block's writes, then the release).
    publish_batch(base, bal, W,
                  [&](int r) { return at<uint64_t>(cm.peers[r], L.dtail) + size_t(c) * W + s; });
  }
  EPX_PHASE_MARK(cm, TransferPhase::kPayload);
  for (int r = threadIdx.x; r < W; r += blockDim.x) sent[r] = base[r];
}

// ---- transfer: receive -----------------------------------------------------------------------

// Ring row `src` (source q) into received row `row` of the receive area.
__device__ __forceinline__ void read_row(const HtShape& S, const HtDispatchRank& me,
                                         const HtRowsLayout& RL, const uint8_t* src, int row,
                                         int q) {
  const int lane = threadIdx.x % kWarpSize;
  const SlotParts parts = slot_parts(S);
  const int vecs = S.wire_row_bytes / 16;
  int4* out = reinterpret_cast<int4*>(me.rows + RL.recv_x + size_t(row) * S.wire_row_bytes);
  for (int v0 = 0; v0 < vecs; v0 += kUnroll * kWarpSize) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int vi = v0 + u * kWarpSize + lane;
      if (vi < vecs) v[u] = ld_ring(src + size_t(vi) * 16);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int vi = v0 + u * kWarpSize + lane;
      if (vi < vecs) out[vi] = v[u];
    }
  }
  float* scales = reinterpret_cast<float*>(me.rows + RL.recv_scales);
  for (int g = lane; g < S.groups; g += kWarpSize)
    scales[ht_scale_index(S, row, g, RL.rows)] =
        __ldcg(reinterpret_cast<const float*>(src + parts.scales) + g);
  if (lane < S.topk) {
    reinterpret_cast<int32_t*>(me.rows + RL.recv_topk_ids)[size_t(row) * S.topk + lane] =
        __ldcg(reinterpret_cast<const int32_t*>(src + parts.ids) + lane);
    reinterpret_cast<float*>(me.rows + RL.recv_topk_w)[size_t(row) * S.topk + lane] =
        __ldcg(reinterpret_cast<const float*>(src + parts.weights) + lane);
  }
  if (lane == 0) {
    reinterpret_cast<int32_t*>(me.rows + RL.recv_src_rank)[row] = q;
    reinterpret_cast<int32_t*>(me.rows + RL.recv_src_idx)[row] =
        __ldcg(reinterpret_cast<const int32_t*>(src + parts.index));
  }
}

// Channel c's rings into the receive area: segment (q, c) at seg_offset[q][c].
__device__ __forceinline__ void receive_channel(const HtDispatchParams& p, const HtDispatchRank& me,
                                                uint32_t epoch, int c) {
  __shared__ uint64_t consumed[kMaxRanks];  // ring position read so far, from source q
  __shared__ int32_t done[kMaxRanks];       // rows of segment (q, c) read this round
  __shared__ int32_t todo[kMaxRanks];       // rows of segment (q, c)
  __shared__ int32_t avail[kMaxRanks];      // rows readable now
  __shared__ int32_t first[kMaxRanks + 1];  // prefix of avail
  __shared__ int32_t finished, failed;
  __shared__ uint64_t idle_since;
  const HtCommon& cm = p.common;
  const HtShape& S = cm.shape;
  const HtLayout& L = cm.layout;
  const int W = S.world, C = L.channels, r = me.rank, ring = L.dispatch_ring;
  const int warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
  uint64_t* recvd = at<uint64_t>(me.local, L.drecv) + size_t(c) * W;
  const uint64_t* tail = at<uint64_t>(me.local, L.dtail) + size_t(c) * W;  // writers' progress
  const int32_t* seg_count = at<int32_t>(me.local, L.seg_count);
  const int32_t* seg_offset = at<int32_t>(me.local, L.seg_offset);
  const HtRowsLayout RL = rows_layout(me.area_rows, S.wire_row_bytes, S.groups, S.topk, S.hidden);
  const uint8_t* rings = me.local + L.dring;
  for (int q = threadIdx.x; q < W; q += blockDim.x) {
    consumed[q] = recvd[q];
    done[q] = 0;
    todo[q] = seg_count[q * C + c];
  }
  if (threadIdx.x == 0) {
    failed = 0;
    idle_since = 0;
  }
  __syncthreads();
  for (;;) {
    for (int q = threadIdx.x; q < W; q += blockDim.x) {
      int32_t a = 0;
      if (todo[q] > done[q]) {
        const uint64_t written = dev::ld_acquire_sys(tail + q);
        a = int32_t(min(written - consumed[q], uint64_t(todo[q] - done[q])));
      }
      avail[q] = a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int32_t run = 0;
      int waiting = -1;
      for (int q = 0; q < W; ++q) {
        first[q] = run;
        run += avail[q];
        if (todo[q] > done[q] && waiting < 0) waiting = q;
      }
      first[W] = run;
      finished = waiting < 0;
      if (run > 0 || waiting < 0) {
        idle_since = 0;
      } else if (idle_since == 0) {
        idle_since = dev::globaltimer_ns();
      } else if (dev::aborted(wait_ctx(me, cm, epoch))) {
        failed = 1;
      } else if (dev::globaltimer_ns() - idle_since > idle_limit_ns(cm.timeout_ns)) {
        dev::record_error(wait_ctx(me, cm, epoch), StatusCode::kTimeout, Phase::kDispatchData,
                          waiting, int64_t(consumed[waiting] + 1),
                          int64_t(dev::ld_acquire_sys(tail + waiting)));
        failed = 1;
      }
    }
    __syncthreads();
    if (finished || failed) break;
    const int total = first[W];
    if (total == 0) {
      __nanosleep(128);
      continue;
    }
    for (int j = warp; j < total; j += num_warps) {
      int q = 0;
      while (j >= first[q + 1]) ++q;
      const int i = j - first[q];
      const uint64_t pos = consumed[q] + uint64_t(i);
      const uint8_t* src =
          rings + ((size_t(c) * W + q) * ring + size_t(pos % uint64_t(ring))) * L.dispatch_slot;
      read_row(S, me, RL, src, seg_offset[q * C + c] + done[q] + i, q);
    }
    __syncthreads();
    // Publish how far this rank has read (the block's loads, then the release).
    for (int q = threadIdx.x; q < W; q += blockDim.x) {
      if (avail[q] == 0) continue;
      consumed[q] += uint64_t(avail[q]);
      done[q] += avail[q];
      dev::fence_acq_rel_sys();
      dev::st_release_sys(at<uint64_t>(cm.peers[q], L.dhead) + size_t(c) * W + r, consumed[q]);
    }
    __syncthreads();
  }
  if (failed) return;
  EPX_PHASE_MARK(cm, TransferPhase::kReceived);
  for (int q = threadIdx.x; q < W; q += blockDim.x) recvd[q] = consumed[q];
}

// ---- transfer: direct mode --------------------------------------------------------------------

// Direct mode: the rank's tokens in batches of T (ht_stage_tokens), which the rank's blocks take in
// turn from tickets[2] (the next batch; whichever block is free takes it, so that the blocks end
// together instead of waiting for the one whose tokens had the most rows). A batch's rows at a
// destination are consecutive whichever segments it spans (the rank's rows are in token order
// there). Each batch goes on the wire into shared memory (`stage`, ht_stage_bytes: rows, scales,
// lists, top-k ids and weights), the payload in (token, chunk of its row) items over all warps so
// that every warp has loads in flight; then each of its rows goes to each of its destinations as
// one bulk copy (TMA), and the block writes the rows' scales and metadata. The rows have two
// buffers where they fit (ht_stage_buffers): the next batch is loaded into one while the copies
// of this one read the other. After: every row of the block's tokens is in its receivers' areas.
template <DispatchDtype kDtype>
__device__ __forceinline__ void stage_and_write(const HtDispatchParams& p, const HtDispatchRank& me,
                                                uint8_t* const* area, const HtRowsLayout* rl,
                                                uint8_t* stage) {
  __shared__ int32_t run_rows[kMaxRanks];   // the batch's rows at rank r
  __shared__ int32_t run_first[kMaxRanks];  // ... from this row of its area
  __shared__ int32_t next;                  // the batch this block takes
  const HtCommon& cm = p.common;
  const HtShape& S = cm.shape;
  const HtLayout& L = cm.layout;
  const int W = S.world, G = S.groups, K = S.topk, H = S.hidden, s = me.rank;
  const int T = ht_stage_tokens(S), RB = S.wire_row_bytes, buffers = ht_stage_buffers(S);
  // [buffers][T][RB]
  float* scales = reinterpret_cast<float*>(stage + size_t(buffers) * T * RB);  // [T][G]
  int32_t* list = reinterpret_cast<int32_t*>(scales + size_t(T) * G);          // [W][T]
  int32_t* ids_s = list + size_t(W) * T;                                       // [T][K]
  float* weights_s = reinterpret_cast<float*>(ids_s + size_t(T) * K);          // [T][K]
  const uint64_t* token_mask = at<uint64_t>(me.local, L.token_mask);
  const int32_t* row_pos = at<int32_t>(me.local, L.row_pos);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  constexpr int kPer = kElemsPerPiece<kDtype>;
  constexpr int kVecs = kVecsPerPiece<kDtype>;
  constexpr int kHeld = kPieces<kDtype>;
  constexpr int kInBytes = kDtype == DispatchDtype::kFP8 ? 1 : 2;
  const int pieces = H / kPer;  // 16-byte wire vectors of a row: RB == pieces * 16
  const int chunks = row_chunks<kDtype>(H);
  int32_t* ticket = at<int32_t>(me.local, L.tickets) + 2;
  // The block's batches: each one's ticket is taken as the one before starts, so that the
  // atomic's round trip is not on the way to the batch's loads.
  if (threadIdx.x == 0) next = atomicAdd(ticket, 1);
  for (int k = 0;; ++k) {
    // The buffer of batch k (of this block) was last read by the copies of batch k - buffers:
    // each thread commits one group per batch, so those of its groups are done reading.
    if (buffers == 2) {
      dev::bulk_wait_read<1>();
    } else {
      dev::bulk_wait_read<0>();
    }
    uint8_t* rows = stage + size_t(k % buffers) * T * RB;  // [T][RB]
    __syncthreads();  // `next` as written before the previous batch's last barrier
    const int base = next * T;
    if (base >= me.num_tokens) break;
    int32_t ahead = 0;  // thread 0: the next batch's ticket, in flight through this batch
    if (threadIdx.x == 0) ahead = atomicAdd(ticket, 1);
    const int nt = min(T, me.num_tokens - base);
    // Which of the batch's tokens go to rank r, in token order, and the row of the first.
    for (int r = warp; r < W; r += num_warps) {
      const bool to_r = lane < nt && ((token_mask[base + lane] >> r) & 1);
      const uint32_t has = __ballot_sync(kFullWarp, to_r);
      if (to_r) list[r * T + __popc(has & dev::lanemask_lt())] = lane;
      if (lane == 0) run_rows[r] = __popc(has);
      if (has != 0 && lane == __ffs(has) - 1) {
        const int n = base + lane;
        const int32_t seg_first =
            dev::ld_acquire_sys(at<int32_t>(cm.peers[r], L.seg_offset) + s * L.segments +
                                segment_of(me.num_tokens, L.channels, n));
        run_first[r] = seg_first + row_pos[size_t(n) * W + r];
      }
    }
    // The batch's top-k ids and weights: loaded now, stored after the payload (their loads are
    // in flight meanwhile), so that writing them to each destination waits on no global load.
    const int nk = nt * K;
    int32_t id_pre = 0;
    float weight_pre = 0.f;
    if (threadIdx.x < nk) {
      id_pre = int32_t(load_id(S, me.topk_ids, base + int(threadIdx.x) / K, int(threadIdx.x) % K));
      weight_pre = load_weight(me.topk_weights, size_t(base) * K + threadIdx.x);
    }
    // The batch on the wire, in shared memory. (write_chunk's loads and quantisation, written
    // again: one helper for both made ptxas spill 16 / 20 bytes in the bf16-to-fp8 kernel.)
    for (int it = warp; it < nt * chunks; it += num_warps) {
      const int j = it / chunks, chunk = it % chunks, n = base + j;
      if (token_mask[n] == 0) continue;  // sent nowhere
      const int4* src = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(me.x) +
                                                      size_t(n) * H * kInBytes);
      int4* to = reinterpret_cast<int4*>(rows + size_t(j) * RB);
      const int v0 = chunk * kHeld * kWarpSize;
      int4 v[kHeld][kVecs];
#pragma unroll
      for (int u = 0; u < kHeld; ++u) {
        const int vi = v0 + u * kWarpSize + lane;
#pragma unroll
        for (int k = 0; k < kVecs; ++k)
          v[u][k] = vi < pieces ? __ldg(src + size_t(vi) * kVecs + k) : make_int4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kHeld; ++u) {
        const int vi = v0 + u * kWarpSize + lane;
        if constexpr (kDtype != DispatchDtype::kBF16ToFP8) {
          if (vi < pieces) to[vi] = v[u][0];
        } else {
          // 16 bf16 -> 16 fp8 per lane; the 8 lanes of a 1x128 block are all inside the row or
          // all past it (H % 128 == 0), and every lane takes part in the block's shuffles.
          float f[kPer];
#pragma unroll
          for (int k = 0; k < kVecs; ++k) {
            float g[8];
            dev::bf16x8_to_float(v[u][k], g);
#pragma unroll
            for (int i = 0; i < 8; ++i) f[8 * k + i] = g[i];
          }
          float sc;
          const uint4 q = dev::quantize_fp8_block<kPer>(f, sc, S.round_scale != 0);
          if (vi < pieces) {
            reinterpret_cast<uint4*>(to)[vi] = q;
            if (lane % (kFp8BlockSize / kPer) == 0)
              scales[j * G + vi / (kFp8BlockSize / kPer)] = sc;
          }
        }
      }
    }
    if constexpr (kDtype == DispatchDtype::kFP8) {  // the input's scales, as they are
      for (int i = threadIdx.x; i < nt * G; i += blockDim.x)
        scales[i] = __ldg(me.x_scales + size_t(base) * G + i);
    }
    if (threadIdx.x < nk) {
      ids_s[threadIdx.x] = id_pre;
      weights_s[threadIdx.x] = weight_pre;
    }
    for (int i = threadIdx.x + blockDim.x; i < nk; i += blockDim.x) {  // (more than one each)
      ids_s[i] = int32_t(load_id(S, me.topk_ids, base + i / K, i % K));
      weights_s[i] = load_weight(me.topk_weights, size_t(base) * K + i);
    }
    dev::fence_proxy_async();  // the stage's generic writes, before the copies that read it
    __syncthreads();
    // The rows: the batch's rows at rank r are rows [first, first + c) there, each one bulk copy
    // (TMA) issued by the thread of (r, row), so that no warp spends its time storing them.
    for (int i = threadIdx.x; i < W * T; i += blockDim.x) {
      const int r = i / T, j = i % T;
      if (j < run_rows[r])
        dev::bulk_copy_to_global(area[r] + rl[r].recv_x + size_t(run_first[r] + j) * RB,
                                 rows + size_t(list[r * T + j]) * RB, uint32_t(RB));
    }
    dev::bulk_commit();
    // Destination by destination: the scales and metadata of the rows [first, first + c).
    for (int r = 0; r < W; ++r) {
      const int c = run_rows[r];
      if (c == 0) continue;
      const int first = run_first[r];
      const int32_t* lr = list + r * T;
      uint8_t* a = area[r];
      if constexpr (kDtype != DispatchDtype::kBF16) {
        // (in the order of the receiver's layout, so that neighbouring threads write neighbours)
        float* out_sc = reinterpret_cast<float*>(a + rl[r].recv_scales);
        for (int i = threadIdx.x; i < c * G; i += blockDim.x) {
          const int j = S.scale_col_major ? i % c : i / G, g = S.scale_col_major ? i / c : i % G;
          out_sc[ht_scale_index(S, first + j, g, rl[r].rows)] = scales[lr[j] * G + g];
        }
      }
      int32_t* ids = reinterpret_cast<int32_t*>(a + rl[r].recv_topk_ids) + size_t(first) * K;
      float* weights = reinterpret_cast<float*>(a + rl[r].recv_topk_w) + size_t(first) * K;
      for (int i = threadIdx.x; i < c * K; i += blockDim.x) {
        const int at_s = lr[i / K] * K + i % K;
        ids[i] = ids_s[at_s];
        weights[i] = weights_s[at_s];
      }
      int32_t* src_rank = reinterpret_cast<int32_t*>(a + rl[r].recv_src_rank) + first;
      int32_t* src_idx = reinterpret_cast<int32_t*>(a + rl[r].recv_src_idx) + first;
      for (int i = threadIdx.x; i < c; i += blockDim.x) {
        src_rank[i] = s;
        src_idx[i] = base + lr[i];
      }
    }
    if (threadIdx.x == 0) next = ahead;
    __syncthreads();  // the lists are rewritten by the next batch
  }
  // The rows written (the copies complete), ordered before the generic release that follows.
  dev::bulk_wait_all();
  dev::fence_proxy_async();
}

// Direct mode, each of the rank's nb blocks: batches of the rank's tokens, written straight into
// the receivers' areas once each has published its area of this round; the rank's last block then
// tells every receiver that its rows are there.
template <DispatchDtype kDtype>
__device__ __forceinline__ void direct_send(const HtDispatchParams& p, const HtDispatchRank& me,
                                            const dev::WaitContext& w, int nb, uint32_t epoch) {
  __shared__ uint8_t* area[kMaxRanks];
  __shared__ HtRowsLayout rl[kMaxRanks];
  __shared__ int32_t failed;
  const HtCommon& cm = p.common;
  const HtShape& S = cm.shape;
  const HtLayout& L = cm.layout;
  const int W = S.world, s = me.rank;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    HtPublished* pub = at<HtPublished>(cm.peers[r], L.published);
    uint64_t ptr = 0;
    if (!read_published(w, Phase::kDispatchData, r, &pub->area_epoch, &pub->area, epoch, &ptr)) {
      failed = 1;
      continue;
    }
    area[r] = reinterpret_cast<uint8_t*>(ptr);
    const int rows = int(dev::ld_acquire_sys(reinterpret_cast<const uint64_t*>(&pub->area_rows)));
    rl[r] = rows_layout(rows, S.wire_row_bytes, S.groups, S.topk, S.hidden);
  }
  __syncthreads();
  if (failed) return;
  EPX_PHASE_MARK(cm, TransferPhase::kAreas);
  extern __shared__ __align__(16) uint8_t stage[];      // ht_stage_bytes(S), given at launch
  int32_t* tickets = at<int32_t>(me.local, L.tickets);  // [2]: the next batch
  stage_and_write<kDtype>(p, me, area, rl, stage);
  // Each block's rows (possibly on other GPUs) are ordered before the ticket at system scope;
  // the last block's release then makes all of them visible to the receivers.
  __syncthreads();
  EPX_PHASE_MARK(cm, TransferPhase::kPayload);
  if (threadIdx.x == 0) dev::fence_acq_rel_sys();
  if (dev::last_block(tickets, nb)) {
    // Every block has taken its last batch: the batches start again from 0 in the next call.
    if (threadIdx.x == 0) tickets[2] = 0;
    for (int r = threadIdx.x; r < W; r += blockDim.x) {
      dev::fence_acq_rel_sys();
      dev::st_release_sys(at<uint64_t>(cm.peers[r], L.arrived) + s, uint64_t(epoch));
    }
  }
  EPX_PHASE_MARK_SYNC(cm, TransferPhase::kSignalled);
}

// The transfer of the rows (after the count kernel). Named *dispatch_impl, as DeepEP's
// kernel of the same stage, so that DeepEP's profiler-based benchmark finds it.
template <DispatchDtype kDtype>
__global__ void __launch_bounds__(kMaxThreads)
    ht_dispatch_impl(const __grid_constant__ HtDispatchParams p) {
  const HtBlock hb = ht_block(p.common.num_ranks);
  const HtDispatchRank& me = p.ranks[hb.slot];
  dev::WaitContext w = ht_wait(me.local, me.host_status, me.rank, p.common);
  if (dev::block_aborted(w)) return;
#if EPX_MEASUREMENT
  phase_begin(p.common);  // the phase clock (EPX_PHASE_CLOCK): the block's start
  if (hb.b == 0) phase_after_count(p.common, me.rank);
#endif
  const HtLayout& L = p.common.layout;
  const uint32_t epoch = at<HtState>(me.local, L.state)->epoch;
  w.call = epoch;
  if (L.direct) {
    if (hb.b == 0 && threadIdx.x == 0) {
      HtPublished* pub = at<HtPublished>(me.local, L.published);
      publish_pointer(&pub->area_epoch, &pub->area, me.rows, &pub->area_rows, me.area_rows, epoch);
    }
    direct_send<kDtype>(p, me, w, hb.nb, epoch);
    // Block 0 returns when every rank's rows are here (the stream's next work reads them).
    if (hb.b == 0 && await_words(w, Phase::kDispatchData, at<uint64_t>(me.local, L.arrived),
                                 p.common.shape.world, epoch)) {
      EPX_PHASE_MARK(p.common, TransferPhase::kArrived);
    }
    return;
  }
  const int C = L.channels;
  if (hb.b < C) {
    send_channel<kDtype>(p, me, epoch, hb.b);
  } else {
    receive_channel(p, me, epoch, hb.b - C);
  }
}

}  // namespace

void load_ht_dispatch_kernels() {
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, ht_count_kernel));
  // The transfer kernels' staging (direct mode) may take more than the default 48 KiB.
  const auto allow_stage = [&attr](auto kernel) {
    EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    EPX_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxStageBytes));
  };
  allow_stage(ht_dispatch_impl<DispatchDtype::kBF16>);
  allow_stage(ht_dispatch_impl<DispatchDtype::kFP8>);
  allow_stage(ht_dispatch_impl<DispatchDtype::kBF16ToFP8>);
}

void launch_ht_count(const HtDispatchParams& p, int warps, cudaStream_t stream) {
  const dim3 grid(p.common.layout.segments * p.common.num_ranks);
  ht_count_kernel<<<grid, dim3(warps * kWarpSize), 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_ht_transfer(const HtDispatchParams& p, DispatchDtype dtype, int channels, int warps,
                        cudaStream_t stream) {
  const dim3 grid(2 * channels * p.common.num_ranks), block(warps * kWarpSize);
  const size_t smem = p.common.layout.direct ? ht_stage_bytes(p.common.shape) : 0;
  switch (dtype) {
    case DispatchDtype::kBF16:
      ht_dispatch_impl<DispatchDtype::kBF16><<<grid, block, smem, stream>>>(p);
      break;
    case DispatchDtype::kFP8:
      ht_dispatch_impl<DispatchDtype::kFP8><<<grid, block, smem, stream>>>(p);
      break;
    case DispatchDtype::kBF16ToFP8:
      ht_dispatch_impl<DispatchDtype::kBF16ToFP8><<<grid, block, smem, stream>>>(p);
      break;
  }
  EPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epx::ht
