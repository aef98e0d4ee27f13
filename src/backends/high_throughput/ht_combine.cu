// The high_throughput combine: one kernel, two blocks per channel and rank.
//
// send (rank r, channel c): the rows r received from segment (s, c) go back, in order, through
//   combine ring (r -> s, c) as the partials the expert stage wrote for them. The block's warps
//   form groups; each ring has one group, which never waits on one ring while another of its
//   rings has room, so a receiver waiting for one ring can always be served.
// receive (owner s, channel c): tokens in batches of one per warp; once every ring holds the
//   batch's partials, each token's partials are summed in EpConfig::combine_order (rank order by
//   default) in f32 and rounded to bf16 once (0 for a token sent nowhere): the bits of every
//   other backend and of the reference.
//   Ring positions follow from the dispatch's token_mask: token n's partial from rank r is the
//   next one in ring (r -> s, c) after those of the earlier tokens of the channel sent to r.

#include <cuda_bf16.h>

#include "backends/high_throughput/ht_device.cuh"
#include "epx/cuda_check.hpp"

namespace epx::ht {
namespace {

constexpr int kMaxGroups = 15;  // named barriers 1..15 (0 is __syncthreads)
constexpr int kUnroll = 4;

__device__ __forceinline__ void group_sync(int group, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(threads) : "memory");
}

// Partial row `src` (this rank's expert output, H bf16) into ring row `dst`. One whole warp.
__device__ __forceinline__ void copy_partial(const uint8_t* src, uint8_t* dst, int H) {
  const int lane = threadIdx.x % kWarpSize, vecs = H / 8;
  for (int v0 = 0; v0 < vecs; v0 += kUnroll * kWarpSize) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int vi = v0 + u * kWarpSize + lane;
      if (vi < vecs) v[u] = __ldg(reinterpret_cast<const int4*>(src) + vi);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int vi = v0 + u * kWarpSize + lane;
      if (vi < vecs) reinterpret_cast<int4*>(dst)[vi] = v[u];
    }
  }
}

// The bias rows of token n (CombineExtras), null where not given.
struct BiasRows {
  const __nv_bfloat16* b0;
  const __nv_bfloat16* b1;
};
__device__ __forceinline__ BiasRows bias_rows(const HtCombineRank& me, int n, int H) {
  auto row = [&](const void* b) {
    return b == nullptr ? nullptr : static_cast<const __nv_bfloat16*>(b) + size_t(n) * H;
  };
  return BiasRows{row(me.bias0), row(me.bias1)};
}

// The ranks whose partials of a token combine adds, in the order it adds them: those of `mask`
// ascending, or (CombineOrder::kHighestSlot) the popcount(mask) ranks of `order`.
struct RankSeq {
  uint64_t mask;
  const uint8_t* order;  // null: rank order
  int i = 0;
  __device__ __forceinline__ bool more() const { return mask != 0; }
  __device__ __forceinline__ int next() {
    const int r = order != nullptr ? int(order[i++]) : lowest_rank(mask);
    mask &= mask - 1;
    return r;
  }
};
__device__ __forceinline__ RankSeq token_ranks(const HtShape& S, const HtLayout& L,
                                               const uint8_t* local, uint64_t mask, int n) {
  return RankSeq{mask, S.highest_slot ? local + L.token_order + size_t(n) * S.topk : nullptr};
}

// Token n's row of y: vector v (8 bf16) of the partials at `at(r, v)` of the ranks of `seq`,
// summed in its order in f32 (kBatch ranks' loads in flight before their adds) and rounded
// once; 0 for a token sent nowhere. The sum starts from +0 plus the bias rows, when given.
// One lane.
template <typename At>
__device__ __forceinline__ void sum_vector(RankSeq seq, int v, At at_of, __nv_bfloat16* y_row,
                                           BiasRows bias = {}) {
  constexpr int kBatch = 8;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (const __nv_bfloat16* b : {bias.b0, bias.b1}) {
    if (b == nullptr) continue;
    float f[8];
    dev::bf16x8_to_float(__ldg(reinterpret_cast<const int4*>(b) + v), f);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] += f[e];
  }
  while (seq.more()) {
    int4 raw[kBatch];
    int got = 0;
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (seq.more()) {
        raw[i] = ld_ring(at_of(seq.next(), v));
        got = i + 1;
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (i < got) {
        float f[8];
        dev::bf16x8_to_float(raw[i], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += f[e];  // seq's order
      }
    }
  }
  dev::store_bf16x8(y_row + size_t(v) * 8, acc);
}

// Token n's top-k weights back: lane k < K sums slot k of the rows at `w_of(r)` (f32 [K]) of
// the ranks of `seq`, in its order, into y_w (0 for a token sent nowhere). One warp.
template <typename WeightsOf>
__device__ __forceinline__ void sum_weights(RankSeq seq, int K, WeightsOf w_of, float* y_w) {
  const int lane = threadIdx.x % kWarpSize;
  if (lane >= K) return;
  float acc = 0.f;
  while (seq.more()) {
    const float* w = w_of(seq.next());
    if (w != nullptr) acc += __ldcg(w + lane);  // (null: that rank passed no weights)
  }
  y_w[lane] = acc;
}

__device__ __forceinline__ void send_partials(const HtCombineParams& p, const HtCombineRank& me,
                                              const dev::WaitContext& w, int c) {
  __shared__ uint64_t sent[kMaxRanks];        // ring position written so far, towards owner s
  __shared__ int32_t done[kMaxRanks];         // rows of segment (s, c) sent this round
  __shared__ int32_t group_rows[kMaxGroups];  // the group's next chunk: rows, or -1 done, -2 failed
  __shared__ int32_t group_dest[kMaxGroups];
  const HtCommon& cm = p.common;
  const HtShape& S = cm.shape;
  const HtLayout& L = cm.layout;
  const int W = S.world, C = L.channels, r = me.rank, ring = L.combine_ring, H = S.hidden;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int groups = min(min(W, num_warps), kMaxGroups);
  const int per_group = num_warps / groups;  // warps of a group
  const int g = warp / per_group, gw = warp % per_group;
  uint64_t* csent = at<uint64_t>(me.local, L.csent) + size_t(c) * W;
  const uint64_t* head = at<uint64_t>(me.local, L.chead) + size_t(c) * W;  // owners' progress
  const int32_t* seg_count = at<int32_t>(me.local, L.seg_count);
  const int32_t* seg_offset = at<int32_t>(me.local, L.seg_offset);
  for (int s = threadIdx.x; s < W; s += blockDim.x) {
    sent[s] = csent[s];
    done[s] = 0;
  }
  __syncthreads();
  if (g >= groups) return;  // warps left over by the division
  const bool leader = gw == 0 && lane == 0;
  const int chunk = 2 * per_group;  // rows per release
  int cursor = g;                   // the leader's round-robin position among its owners
  uint64_t idle_since = 0;
  const uint8_t* out = static_cast<const uint8_t*>(me.expert_out);
  for (;;) {
    if (leader) {
      int pick = -1, rows = 0, waiting = -1;
      for (int tried = 0, s = cursor; tried < (W - g + groups - 1) / groups; ++tried) {
        const int left = seg_count[s * C + c] - done[s];
        if (left > 0) {
          if (waiting < 0) waiting = s;
          const int room = ring - int(sent[s] - dev::ld_acquire_sys(head + s));
          if (room > 0) {
            pick = s;
            rows = min(min(left, room), chunk);
            break;
          }
        }
        s += groups;
        if (s >= W) s = g;
      }
      if (pick >= 0) {
        cursor = pick + groups < W ? pick + groups : g;
        idle_since = 0;
        group_rows[g] = rows;
        group_dest[g] = pick;
      } else if (waiting < 0) {
        group_rows[g] = -1;
      } else {
        group_rows[g] = 0;
        const uint64_t now = dev::globaltimer_ns();
        if (idle_since == 0) {
          idle_since = now;
        } else if (dev::aborted(w)) {
          group_rows[g] = -2;
        } else if (now - idle_since > idle_limit_ns(w.timeout_ns)) {
          dev::record_error(w, StatusCode::kTimeout, Phase::kRingSpace, waiting,
                            int64_t(sent[waiting] - ring + 1),
                            int64_t(dev::ld_acquire_sys(head + waiting)));
          group_rows[g] = -2;
        }
      }
    }
    group_sync(g, per_group * kWarpSize);
    const int rows = group_rows[g];
    if (rows < 0) break;
    if (rows > 0) {
      const int s = group_dest[g];
      for (int j = gw; j < rows; j += per_group) {
        const uint64_t pos = sent[s] + uint64_t(j);
        const int row = seg_offset[s * C + c] + done[s] + j;
        const size_t slot = (size_t(c) * W + r) * ring + size_t(pos % uint64_t(ring));
        copy_partial(out + size_t(row) * H * 2, cm.peers[s] + L.cring + slot * H * 2, H);
        // (always: a rank that passes no weights sends zeros, as direct mode reads them)
        if (lane < S.topk) {
          reinterpret_cast<float*>(cm.peers[s] + L.cwring)[slot * S.topk + lane] =
              me.topk_w != nullptr ? __ldg(me.topk_w + size_t(row) * S.topk + lane) : 0.f;
        }
      }
    } else {
      __nanosleep(128);
    }
    group_sync(g, per_group * kWarpSize);
    if (leader && rows > 0) {
      const int s = group_dest[g];
      sent[s] += uint64_t(rows);
      done[s] += rows;
      dev::fence_acq_rel_sys();
      dev::st_release_sys(at<uint64_t>(cm.peers[s], L.ctail) + size_t(c) * W + r, sent[s]);
    }
  }
  if (leader) {
    for (int s = g; s < W; s += groups) csent[s] = sent[s];
  }
}

__device__ __forceinline__ void receive_partials(const HtCombineParams& p, const HtCombineRank& me,
                                                 const dev::WaitContext& w, int c) {
  __shared__ uint64_t base[kMaxRanks];  // ring position of this batch's first partial from r
  __shared__ uint32_t bal[kMaxRanks];   // bit i: token i of the batch went to r
  __shared__ uint64_t mask_of[kWarpSize];
  __shared__ int32_t failed;
  const HtCommon& cm = p.common;
  const HtShape& S = cm.shape;
  const HtLayout& L = cm.layout;
  const int W = S.world, C = L.channels, s = me.rank, ring = L.combine_ring, H = S.hidden;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int N = at<HtState>(me.local, L.state)->num_tokens;
  const int t0 = channel_begin(N, C, c), t1 = channel_begin(N, C, c + 1);
  uint64_t* crecv = at<uint64_t>(me.local, L.crecv) + size_t(c) * W;
  const uint64_t* tail = at<uint64_t>(me.local, L.ctail) + size_t(c) * W;  // writers' progress
  const uint64_t* token_mask = at<uint64_t>(me.local, L.token_mask);
  const uint8_t* rings = me.local + L.cring;
  __nv_bfloat16* y = static_cast<__nv_bfloat16*>(me.y);
  for (int r = threadIdx.x; r < W; r += blockDim.x) base[r] = crecv[r];
#if EPX_MEASUREMENT
  phase_begin(cm);  // the phase clock (EPX_PHASE_CLOCK): the block's start
#endif
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const int vecs = H / 8;
  for (int t = t0; t < t1; t += num_warps) {
    const int t_end = min(t1, t + num_warps);
    if (warp == 0) batch_ballots(token_mask, t, t_end, W, mask_of, bal);
    __syncthreads();
    // The batch's partials in every ring it reads.
    wait_batch(
        w, Phase::kCombineReady, base, bal, W, &failed,
        [&](int r, uint64_t need) { return dev::ld_acquire_sys(tail + r) >= need; },
        [&](int r) { return int64_t(dev::ld_acquire_sys(tail + r)); });
    if (failed) return;
    const int n = t + warp;
    if (n < t_end) {
      const RankSeq m = token_ranks(S, L, me.local, mask_of[warp], n);
      auto slot_of = [&](int r) {
        const uint64_t pos = base[r] + __popc(bal[r] & ((1u << warp) - 1));
        return (size_t(c) * W + r) * ring + size_t(pos % uint64_t(ring));
      };
      auto at_of = [&](int r, int v) { return rings + slot_of(r) * H * 2 + size_t(v) * 16; };
      const BiasRows bias = bias_rows(me, n, H);
      for (int v = lane; v < vecs; v += kWarpSize)
        sum_vector(m, v, at_of, y + size_t(n) * H, bias);
      if (me.y_topk_w != nullptr) {
        const float* wring = reinterpret_cast<const float*>(me.local + L.cwring);
        sum_weights(
            m, S.topk, [&](int r) { return wring + slot_of(r) * S.topk; },
            me.y_topk_w + size_t(n) * S.topk);
      }
    }
    __syncthreads();
    // Publish how far this rank has read (the block's loads, then the release).
    publish_batch(base, bal, W,
                  [&](int r) { return at<uint64_t>(cm.peers[r], L.chead) + size_t(c) * W + s; });
  }
  EPX_PHASE_MARK(cm, CombinePhase::kSummed);
  for (int r = threadIdx.x; r < W; r += blockDim.x) crecv[r] = base[r];
}

// Block b of 2C (direct mode, owner s = this rank): half b % 2 of channel b / 2's tokens. Token
// n's partial from rank r is row seg_offset_r[s][c] + row_pos[n][r] of r's published partials;
// they are summed in combine_order in f32 and rounded once (0 for a token sent nowhere). The
// rank's last block then tells every rank that this owner has read its partials.
__device__ __forceinline__ void direct_pull(const HtCombineParams& p, const HtCombineRank& me,
                                            const dev::WaitContext& w, int b, int nb,
                                            uint32_t cepoch) {
  __shared__ const uint8_t* part[kMaxRanks];
  __shared__ const float* part_w[kMaxRanks];  // rank r's top-k weights back (y_topk_w)
  __shared__ int32_t seg_base[kMaxRanks];
  __shared__ int32_t failed;
  const HtCommon& cm = p.common;
  const HtShape& S = cm.shape;
  const HtLayout& L = cm.layout;
  const int W = S.world, C = L.channels, s = me.rank, H = S.hidden;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int N = at<HtState>(me.local, L.state)->num_tokens;
  const auto [t0, t1] = half_channel(N, C, b);
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    HtPublished* pub = at<HtPublished>(cm.peers[r], L.published);
    uint64_t ptr = 0;
    if (!read_published(w, Phase::kCombineReady, r, &pub->partials_epoch, &pub->partials, cepoch,
                        &ptr)) {
      failed = 1;
      continue;
    }
    part[r] = reinterpret_cast<const uint8_t*>(ptr);
    part_w[r] = reinterpret_cast<const float*>(dev::ld_acquire_sys(&pub->weights));
    seg_base[r] = dev::ld_acquire_sys(at<int32_t>(cm.peers[r], L.seg_offset) + s * L.segments + b);
  }
  __syncthreads();
  if (failed) return;
  EPX_PHASE_MARK(cm, CombinePhase::kPartialsSeen);
  const uint64_t* token_mask = at<uint64_t>(me.local, L.token_mask);
  const int32_t* row_pos = at<int32_t>(me.local, L.row_pos);
  __nv_bfloat16* y = static_cast<__nv_bfloat16*>(me.y);
  const int vecs = H / 8;
  for (int n = t0 + warp; n < t1; n += num_warps) {
    const int32_t* pos = row_pos + size_t(n) * W;
    auto at_of = [&](int r, int v) {
      return part[r] + (size_t(seg_base[r] + pos[r]) * H + size_t(v) * 8) * 2;
    };
    const BiasRows bias = bias_rows(me, n, H);
    for (int v = lane; v < vecs; v += kWarpSize)
      sum_vector(token_ranks(S, L, me.local, token_mask[n], n), v, at_of, y + size_t(n) * H,
                 bias);
    if (me.y_topk_w != nullptr) {
      sum_weights(
          token_ranks(S, L, me.local, token_mask[n], n), S.topk,
          [&](int r) {
            return part_w[r] == nullptr ? nullptr
                                        : part_w[r] + size_t(seg_base[r] + pos[r]) * S.topk;
          },
          me.y_topk_w + size_t(n) * S.topk);
    }
  }
  EPX_PHASE_MARK_SYNC(cm, CombinePhase::kPulled);
  if (dev::last_block(at<int32_t>(me.local, L.tickets) + 1, nb)) {
    for (int r = threadIdx.x; r < W; r += blockDim.x) {
      dev::fence_acq_rel_sys();
      dev::st_release_sys(at<uint64_t>(cm.peers[r], L.read_done) + s, uint64_t(cepoch));
    }
  }
}

// The kernel does both of the stages that DeepEP's kernels split (the rows' way back, the
// reduction with bias), and carries both of their names, combine_impl and
// combine_reduce_epilogue_impl: a profiler-based benchmark that times each stage by its name
// finds this one kernel for each, and reports its time twice.
__global__ void __launch_bounds__(kMaxThreads)
    ht_combine_impl_and_combine_reduce_epilogue_impl(const __grid_constant__ HtCombineParams p) {
  const HtBlock hb = ht_block(p.common.num_ranks);
  const HtCombineRank& me = p.ranks[hb.slot];
  dev::WaitContext w = ht_wait(me.local, me.host_status, me.rank, p.common);
  if (dev::block_aborted(w)) return;
  const HtLayout& L = p.common.layout;
  HtState* st = at<HtState>(me.local, L.state);
  w.call = st->epoch;
  if (L.direct) {
#if EPX_MEASUREMENT
    phase_begin(p.common);  // the phase clock (EPX_PHASE_CLOCK): the block's start
#endif
    // Every block reads the combine epoch before block 0 advances it: block 0 ends only after
    // every owner, this rank's blocks included, has read this rank's partials.
    const uint32_t cepoch = st->combine_epoch + 1;
    if (hb.b == 0 && threadIdx.x == 0) {
      HtPublished* pub = at<HtPublished>(me.local, L.published);
      pub->weights = reinterpret_cast<uint64_t>(me.topk_w);  // released with the partials
      publish_pointer(&pub->partials_epoch, &pub->partials, me.expert_out, nullptr, 0, cepoch);
      EPX_PHASE_MARK(p.common, CombinePhase::kPublished);
    }
    direct_pull(p, me, w, hb.b, hb.nb, cepoch);
    // Block 0 returns when every owner has read this rank's partials (the caller may then
    // overwrite them).
    if (hb.b == 0 && await_words(w, Phase::kCombineReady, at<uint64_t>(me.local, L.read_done),
                                 p.common.shape.world, cepoch)) {
      if (threadIdx.x == 0) st->combine_epoch = cepoch;
      EPX_PHASE_MARK(p.common, CombinePhase::kAllRead);
    }
    return;
  }
  const int C = L.channels;
  if (hb.b < C) {
    send_partials(p, me, w, hb.b);
  } else {
    receive_partials(p, me, w, hb.b - C);
  }
}

// dst[0, *rows * per_row) = src[...]: the rows the round received, however many, in units T
// (16 bytes for partials, 4 for top-k weights).
template <typename T>
__global__ void ht_copy_rows_kernel(const T* __restrict__ src, T* __restrict__ dst,
                                    const int32_t* rows, size_t per_row) {
  const size_t total = size_t(max(*rows, 0)) * per_row;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x)
    dst[i] = __ldg(src + i);
}

}  // namespace

void load_ht_combine_kernels() {
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, ht_combine_impl_and_combine_reduce_epilogue_impl));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, ht_copy_rows_kernel<int4>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, ht_copy_rows_kernel<uint32_t>));
}

void launch_ht_copy_words(const void* src, void* dst, const int32_t* rows, int row_words,
                          cudaStream_t stream) {
  constexpr int kThreads = 256, kBlocks = 32;  // [M][K] f32: small
  ht_copy_rows_kernel<<<kBlocks, kThreads, 0, stream>>>(
      static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), rows, size_t(row_words));
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_ht_copy_partials(const void* src, void* dst, const int32_t* rows, int hidden,
                             cudaStream_t stream) {
  constexpr int kThreads = 256, kBlocks = 264;  // enough to stream at HBM speed on an H100
  ht_copy_rows_kernel<<<kBlocks, kThreads, 0, stream>>>(
      static_cast<const int4*>(src), static_cast<int4*>(dst), rows, size_t(hidden) * 2 / 16);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_ht_combine(const HtCombineParams& p, int channels, int warps, cudaStream_t stream) {
  ht_combine_impl_and_combine_reduce_epilogue_impl<<<dim3(2 * channels * p.common.num_ranks),
                                                     dim3(warps * kWarpSize), 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epx::ht
