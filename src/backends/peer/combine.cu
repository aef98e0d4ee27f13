// The peer engine's combine kernel (every backend: naive, allgather_reducescatter, low_latency).
//
// One kernel serves one or several ranks (an in-process group sharing a GPU launches once); on
// each rank, in two phases:
//   A. publish: when the expert stage wrote its partials into combine_buffer(), block 0 tells
//               every rank at once that they are ready; otherwise the partials are copied in (or
//               folded from expert rows in f32) first and the last block tells them. Push mode
//               (Shape::push) writes each row's partial into its token's rank instead, and the
//               last block tells every rank that its partials are there.
//   B. pull:    once every rank has published, one warp per (token, column chunk) reads the
//               partial of each rank that got the token, in rank order, sums in f32 and writes
//               bf16 (push mode: from this rank's own memory). The naive backend instead
//               all-reduces every row over the ranks and takes its own tokens' rows.
// LogFMT (Shape::logfmt, low_latency): A encodes each row's partial (token-major: as the expert
// stage wrote it; expert-major: folded in f32 and rounded to bf16 first) into the encoded area,
// or (push) into its token's rank; B decodes each rank's row and adds the values in the same
// rank order. src/core/logfmt.hpp is the format, shared with the reference bit for bit.
// A is the send half, B the receive half (Half): launched apart, compute may run between them.
// Combine serves the round whose rows its buffer slot holds (RoundState, written by that round's
// dispatch): its flags carry that round, so a combine needs no state of its own. Every wait is
// bounded (WaitContext).

#include <cuda_bf16.h>

#include <type_traits>

#include "backends/peer/kernels.hpp"
#include "backends/peer/peer_device.cuh"
#include "core/logfmt.hpp"
#include "core/sync_device.cuh"
#include "epx/cuda_check.hpp"

namespace epx::peer {
namespace {

// Columns of one pull work item: 4 vectors of 8 elements per lane.
constexpr int kChunkVecs = kWarpSize * 4;

// What every phase of one combine call on one block knows. Kept small (kernels of 1024 threads
// have 64 registers each): what derives from the launch arguments is recomputed where used.
struct CombineCall {
  const CombineParams& p;
  const CombineRank& me;
  uint8_t* const* peers;  // every rank's buffer (block-shared)
  uint32_t round;         // the dispatch this combine serves (1 = the first)
  int b, nb;              // this block among the rank's nb blocks
  int M;                  // rows the last dispatch received: the partials' rows
  int N;                  // tokens of the last dispatch: y's rows

  __device__ __forceinline__ int rank() const { return me.rank; }
  __device__ __forceinline__ uint8_t* local() const { return me.local; }  // this rank's buffer
  __device__ __forceinline__ State* state() const {
    return at<State>(me.local, p.common.layout.state);
  }
  __device__ __forceinline__ dev::WaitContext wait() const {
    dev::WaitContext w = make_wait(me.local, me.host_status, me.rank, p.common);
    w.call = round;
    return w;
  }
};

// Tells every rank (flags[s] = round in each rank's buffer at offset `flags`) that this rank's
// stage of the round is done. One thread per destination.
__device__ __forceinline__ void tell_all(const CombineCall& c, size_t flags) {
  const int W = c.p.common.shape.world;
  for (int d = threadIdx.x; d < W; d += blockDim.x) {
    dev::fence_acq_rel_sys();
    dev::st_release_sys(at<int32_t>(c.peers[d], flags) + c.rank(), int32_t(c.round));
  }
}

// Waits, bounded, until every rank has told this one (flags[q] = round or later). False if a wait
// failed.
__device__ inline bool wait_all(const CombineCall& c, size_t flags) {
  __shared__ int32_t failed_wait;
  if (threadIdx.x == 0) failed_wait = 0;
  __syncthreads();
  const int32_t* mine = at<int32_t>(c.local(), flags);
  for (int q = threadIdx.x; q < c.p.common.shape.world; q += blockDim.x) {
    const dev::PeerWait got = dev::peer_wait(
        c.wait(), Phase::kCombineReady, q, c.round,
        [&] { return dev::epoch_reached(uint32_t(dev::ld_acquire_sys(mine + q)), c.round); },
        [&] { return int64_t(dev::ld_acquire_sys(mine + q)); });
    if (got == dev::PeerWait::kFailed) failed_wait = 1;  // (a masked peer is left out of the sums)
  }
  __syncthreads();
  return failed_wait == 0;
}

// The last block of this rank to arrive at `ticket` tells every rank; then every block waits
// for every rank. False if a wait failed.
__device__ inline bool publish_and_wait_all(const CombineCall& c, int32_t* ticket, size_t flags) {
  if (dev::last_block(ticket, c.nb)) tell_all(c, flags);  // last_block synchronises the block first
  return wait_all(c, flags);
}

// ---- A. publish ------------------------------------------------------------------------------

// Push mode: where rank `rank`'s partial of token n of rank `owner` goes, in the owner's buffer
// (Layout::pushed, [W][max_tokens][H]).
template <typename PartialT>
__device__ __forceinline__ PartialT* pushed_row(const CombineCall& c, uint8_t* owner_buf, int rank,
                                                int n) {
  const Shape& S = c.p.common.shape;
  return at<PartialT>(owner_buf, c.p.common.layout.pushed) +
         (size_t(rank) * S.max_tokens + n) * S.hidden;
}

// Push mode, token-major: one warp per row copies the partial to its token's rank, 4 vectors
// per lane loaded before any is stored. (Push excludes rank masking: every rank is live.)
__device__ __forceinline__ void push_rows(const CombineCall& c, const int4* src) {
  const Layout& L = c.p.common.layout;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int vecs = c.p.common.shape.hidden / 8;
  const int32_t* src_rank = at<int32_t>(c.local(), L.recv_src_rank);
  const int32_t* src_idx = at<int32_t>(c.local(), L.recv_src_idx);
  for (int j = c.b * num_warps + warp; j < c.M; j += c.nb * num_warps) {
    const int owner = src_rank[j];
    int4* dst = reinterpret_cast<int4*>(
        pushed_row<__nv_bfloat16>(c, c.peers[owner], c.rank(), src_idx[j]));
    const int4* row = src + size_t(j) * vecs;
    for (int v0 = lane; v0 < vecs; v0 += 4 * kWarpSize) {
      int4 t[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int v = v0 + u * kWarpSize;
        if (v < vecs) t[u] = __ldcg(row + v);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int v = v0 + u * kWarpSize;
        if (v < vecs) dst[v] = t[u];
      }
    }
  }
}

// ---- LogFMT ----------------------------------------------------------------------------------

// Bytes of one encoded row in an area.
__device__ __forceinline__ size_t logfmt_stride(const Shape& S) {
  return size_t(logfmt::row_stride(S.hidden));
}

// Push mode, LogFMT: where rank `rank`'s encoded partial of token n of `owner` goes.
__device__ __forceinline__ uint8_t* pushed_logfmt_row(const CombineCall& c, uint8_t* owner_buf,
                                                      int rank, int n) {
  const Shape& S = c.p.common.shape;
  return owner_buf + c.p.common.layout.pushed + (size_t(rank) * S.max_tokens + n) * logfmt_stride(S);
}

// One warp encodes one row of H values into the LogFMT row at `dst`: lane l takes group
// g0 + l of 16 values (values16(g, x) gives their bf16 bits), the 8 lanes of a 128-value block
// agree on its metadata word by shuffles (the max and min of |x|, as logfmt::block_meta), and
// each lane packs its group as logfmt::encode_row does.
template <typename Values16>
__device__ __forceinline__ void logfmt_encode_row(const Values16& values16, int H, uint8_t* dst) {
  constexpr int kLanesPerBlock = logfmt::kBlockValues / logfmt::kGroupValues;  // 8
  const int lane = threadIdx.x % kWarpSize;
  const int groups = H / logfmt::kGroupValues;  // a multiple of 8: blocks never straddle steps
  for (int g0 = 0; g0 < groups; g0 += kWarpSize) {
    const int g = g0 + lane;
    const bool active = g < groups;
    uint16_t x[logfmt::kGroupValues];
    if (active) {
      values16(g, x);
    } else {
#pragma unroll
      for (int j = 0; j < logfmt::kGroupValues; ++j) x[j] = 0;
    }
    uint32_t hi = 0, lo = 0x7FFF;
#pragma unroll
    for (int j = 0; j < logfmt::kGroupValues; ++j) {
      const uint32_t a = x[j] & 0x7FFFu;  // |x|: bit order = magnitude order
      hi = a > hi ? a : hi;
      lo = a < lo ? a : lo;
    }
#pragma unroll
    for (int off = 1; off < kLanesPerBlock; off <<= 1) {
      hi = max(hi, __shfl_xor_sync(kFullWarp, hi, off));
      lo = min(lo, __shfl_xor_sync(kFullWarp, lo, off));
    }
    if (!active) continue;
    const uint32_t meta = logfmt::pack_meta(uint16_t(hi), uint16_t(lo));
    if (lane % kLanesPerBlock == 0)
      *reinterpret_cast<uint32_t*>(dst + (g / kLanesPerBlock) * logfmt::kMetaBytes) = meta;
    const logfmt::BlockScale s = logfmt::block_scale(meta);
    uint32_t codes[logfmt::kGroupValues];
    uint32_t signs = 0;
#pragma unroll
    for (int j = 0; j < logfmt::kGroupValues; ++j) {
      codes[j] = logfmt::encode_magnitude(uint16_t(x[j] & 0x7FFFu), s);
      signs |= uint32_t(x[j] >> 15) << j;
    }
    uint32_t w[logfmt::kGroupWords];
    logfmt::pack_group(codes, signs, w);
    uint32_t* out = reinterpret_cast<uint32_t*>(dst + logfmt::group_offset(H, g));
#pragma unroll
    for (int k = 0; k < logfmt::kGroupWords; ++k) out[k] = w[k];
  }
}

// A: every received row's partial encoded, here (pull) or at its token's rank (push); then every
// rank is (or, from the last block, will be) told.
template <typename PartialT>
__device__ __forceinline__ void publish_logfmt(const CombineCall& c) {
  const Shape& S = c.p.common.shape;
  const Layout& L = c.p.common.layout;
  const int K = S.topk, H = S.hidden, M = c.M;
  const int warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
  const int32_t* src_rank = at<int32_t>(c.local(), L.recv_src_rank);
  const int32_t* src_idx = at<int32_t>(c.local(), L.recv_src_idx);
  for (int j = c.b * num_warps + warp; j < M; j += c.nb * num_warps) {
    uint8_t* dst = S.push ? pushed_logfmt_row(c, c.peers[src_rank[j]], c.rank(), src_idx[j])
                          : c.local() + L.encoded + size_t(j) * logfmt_stride(S);
    if constexpr (sizeof(PartialT) == 2) {  // token-major: the expert stage's bf16 row
      const uint16_t* row = static_cast<const uint16_t*>(c.me.expert_out) + size_t(j) * H;
      logfmt_encode_row(
          [&](int g, uint16_t (&x)[logfmt::kGroupValues]) {
            const int4* v = reinterpret_cast<const int4*>(row + g * logfmt::kGroupValues);
            const int4 a = __ldcg(v), b = __ldcg(v + 1);
            memcpy(x, &a, 16);
            memcpy(x + 8, &b, 16);
          },
          H, dst);
    } else {  // expert-major: p = sum over k of fmaf(w_k, out, p), rounded to bf16 once
      const __nv_bfloat16* out = static_cast<const __nv_bfloat16*>(c.me.expert_out);
      const int32_t* row_slot = at<int32_t>(c.local(), L.row_expert_slot) + size_t(j) * K;
      const int32_t* rids = at<int32_t>(c.local(), L.recv_topk_ids) + size_t(j) * K;
      const float* rw = at<float>(c.local(), L.recv_topk_w) + size_t(j) * K;
      const int e0 = c.rank() * S.num_local;
      logfmt_encode_row(
          [&](int g, uint16_t (&x)[logfmt::kGroupValues]) {
            float acc[logfmt::kGroupValues] = {};
            for (int k = 0; k < K; ++k) {
              const int slot = row_slot[k];
              if (slot < 0) continue;
              const float w = rw[k];
              const __nv_bfloat16* from =
                  out + (size_t(rids[k] - e0) * S.capacity + slot) * H + g * logfmt::kGroupValues;
              float f[8];
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                load_bf16x8(from + 8 * h, f);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[8 * h + i] = fmaf(w, f[i], acc[8 * h + i]);
              }
            }
#pragma unroll
            for (int i = 0; i < logfmt::kGroupValues; ++i)
              x[i] = __bfloat16_as_ushort(__float2bfloat16_rn(acc[i]));
          },
          H, dst);
    }
  }
  if (S.push) {
    __syncthreads();
    if (threadIdx.x == 0) dev::fence_acq_rel_sys();
  }
  if (dev::last_block(&c.state()->combine_ready_ticket, c.nb)) tell_all(c, L.ready);
}

// B: one warp per (token, 32 groups of 16 values); lane l decodes group l of the chunk from the
// row of every rank that got the token, loads of up to kBatch ranks in flight before their adds,
// and adds them in rank order in f32; y is rounded once. Push mode reads this rank's own area.
__device__ __forceinline__ void pull_logfmt(const CombineCall& c) {
  constexpr int kBatch = 4;
  constexpr int kWords = 1 + logfmt::kGroupWords;  // the block's metadata word, the group's five
  const Shape& S = c.p.common.shape;
  const Layout& L = c.p.common.layout;
  const int W = S.world, H = S.hidden, N = c.N;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int groups = H / logfmt::kGroupValues;
  const int chunks = (groups + kWarpSize - 1) / kWarpSize;
  const int32_t* send_slot = at<int32_t>(c.local(), L.send_slot);
  __nv_bfloat16* y = static_cast<__nv_bfloat16*>(c.me.y);
  const uint64_t live = ~__shfl_sync(kFullWarp, dev::masked_ranks(c.wait()), 0);
  for (int item = c.b * num_warps + warp; item < N * chunks; item += c.nb * num_warps) {
    const int n = item / chunks, g = (item % chunks) * kWarpSize + lane;
    const bool active = g < groups;
    const RankSlots slots = load_rank_slots(send_slot, n, W, lane);
    uint64_t m = slots.ranks() & live;  // warp-uniform
    float acc[logfmt::kGroupValues] = {};
    while (m != 0) {
      uint32_t words[kBatch][kWords];
      int got = 0;
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (m != 0) {
          const int r = lowest_rank(m);
          m &= m - 1;
          const int slot = slots.of(r);
          if (active) {
            const uint8_t* row = S.push ? pushed_logfmt_row(c, c.local(), r, n)
                                        : c.peers[r] + L.encoded + size_t(slot) * logfmt_stride(S);
            words[i][0] = __ldcg(reinterpret_cast<const uint32_t*>(row) + g / 8);
            const uint32_t* grp = reinterpret_cast<const uint32_t*>(row + logfmt::group_offset(H, g));
#pragma unroll
            for (int k = 0; k < logfmt::kGroupWords; ++k) words[i][1 + k] = __ldcg(grp + k);
          }
          got = i + 1;
        }
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {  // rank order
        if (i >= got || !active) continue;
        const logfmt::BlockScale s = logfmt::block_scale(words[i][0]);
        uint32_t w[logfmt::kGroupWords];
#pragma unroll
        for (int k = 0; k < logfmt::kGroupWords; ++k) w[k] = words[i][1 + k];
        uint32_t codes[logfmt::kGroupValues];
        uint32_t signs = 0;
        logfmt::unpack_group(w, codes, signs);
#pragma unroll
        for (int j = 0; j < logfmt::kGroupValues; ++j) {
          const float mag = logfmt::decode_magnitude(codes[j], s);
          acc[j] += ((signs >> j) & 1u) != 0 ? -mag : mag;
        }
      }
    }
    if (active) {
      __nv_bfloat16* out = y + size_t(n) * H + g * logfmt::kGroupValues;
      float lo8[8], hi8[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        lo8[i] = acc[i];
        hi8[i] = acc[8 + i];
      }
      store_bf16x8(out, lo8);
      store_bf16x8(out + 8, hi8);
    }
  }
}

// Token-major: the caller's bf16 partials [M][H], copied into this rank's partials area unless
// the caller wrote them there (combine_buffer()). Expert-major: expert rows folded into one f32
// partial per token-major row, p = sum_k fmaf(w_k, out, p). After: this rank's partials [M][H]
// are complete (push mode: written into their tokens' ranks) and every rank has been (or, from
// the last block to finish, will be) told so.
template <typename PartialT>
__device__ __forceinline__ void publish_partials(const CombineCall& c) {
  const Shape& S = c.p.common.shape;
  const Layout& L = c.p.common.layout;
  const int K = S.topk, H = S.hidden, M = c.M;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int nb = c.nb, b = c.b;
  PartialT* partials = at<PartialT>(c.local(), L.partials);
  const int vecs = H / 8;  // 8 elements per lane step
  const bool push = c.p.common.shape.push;
  if constexpr (sizeof(PartialT) == 2) {
    if (push) {
      push_rows(c, static_cast<const int4*>(c.me.expert_out));
    } else if (c.me.expert_out == partials) {
      // The expert stage wrote them in place and finished before this kernel: publish now.
      if (b == 0) tell_all(c, L.ready);
      return;
    } else {
      const int4* src = static_cast<const int4*>(c.me.expert_out);
      int4* dst = reinterpret_cast<int4*>(partials);
      const size_t total = size_t(M) * vecs;
      for (size_t i = size_t(b) * blockDim.x + threadIdx.x; i < total; i += size_t(nb) * blockDim.x)
        dst[i] = src[i];
    }
  } else {
    const __nv_bfloat16* out = static_cast<const __nv_bfloat16*>(c.me.expert_out);
    const int32_t* row_slot = at<int32_t>(c.local(), L.row_expert_slot);
    const int32_t* rids = at<int32_t>(c.local(), L.recv_topk_ids);
    const float* rw = at<float>(c.local(), L.recv_topk_w);
    const int32_t* src_rank = at<int32_t>(c.local(), L.recv_src_rank);
    const int32_t* src_idx = at<int32_t>(c.local(), L.recv_src_idx);
    const int e0 = c.rank() * S.num_local;
    for (int j = b * num_warps + warp; j < M; j += nb * num_warps) {
      // This row's f32 partial: here, or (push) at its token's rank.
      PartialT* out_row =
          push ? pushed_row<PartialT>(c, c.peers[src_rank[j]], c.rank(), src_idx[j])
               : partials + size_t(j) * H;
      for (int v = lane; v < vecs; v += kWarpSize) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int k = 0; k < K; ++k) {
          const int slot = row_slot[size_t(j) * K + k];
          if (slot < 0) continue;
          const int e = rids[size_t(j) * K + k] - e0;
          const float w = rw[size_t(j) * K + k];
          float f[8];
          load_bf16x8(out + (size_t(e) * S.capacity + slot) * H + v * 8, f);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, f[i], acc[i]);
        }
        float4* dst = reinterpret_cast<float4*>(out_row + v * 8);
        dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
      }
    }
  }
  if (push) {
    // This block's rows went to other ranks' memory (other GPUs' too): ordered at system scope
    // before the ticket that lets the last block tell them.
    __syncthreads();
    if (threadIdx.x == 0) dev::fence_acq_rel_sys();
  }
  if (dev::last_block(&c.state()->combine_ready_ticket, c.nb)) tell_all(c, L.ready);
}

// ---- B. pull ---------------------------------------------------------------------------------

// One warp per (token, 1024-column chunk); each lane owns one 8-element vector at a time and
// issues the loads of up to kBatch ranks before it adds any of them (the adds stay in rank
// order), so several remote reads are in flight per lane instead of one. After: y[n] = the sum,
// in rank order, of the partials of the ranks that got token n (0 for a token sent nowhere).
// Push mode reads the same partials from this rank's own pushed area.
template <typename PartialT>
__device__ __forceinline__ void pull_partials(const CombineCall& c) {
  const Shape& S = c.p.common.shape;
  const Layout& L = c.p.common.layout;
  const int W = S.world, H = S.hidden, N = c.N;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int nb = c.nb, b = c.b;
  const int32_t* send_slot = at<int32_t>(c.local(), L.send_slot);
  __nv_bfloat16* y = static_cast<__nv_bfloat16*>(c.me.y);
  const int vecs = H / 8;
  const int chunks = (vecs + kChunkVecs - 1) / kChunkVecs;
  constexpr int kVecInts = sizeof(PartialT) / 2;  // int4 per 8 elements: bf16 1, f32 2
  constexpr int kBatch = 8 / kVecInts;
  // Masked ranks' partials are left out (their contribution is dropped).
  // (Read once per warp, so that every lane skips the same ranks.)
  const uint64_t live = ~__shfl_sync(kFullWarp, dev::masked_ranks(c.wait()), 0);
  const bool push = S.push;
  for (int item = b * num_warps + warp; item < N * chunks; item += nb * num_warps) {
    const int n = item / chunks, chunk = item % chunks;
    const RankSlots slots = load_rank_slots(send_slot, n, W, lane);
    uint64_t rmask = slots.ranks() & live;  // warp-uniform
#if EPX_MEASUREMENT
    if (S.ablate & kAblatePull) rmask = 0;
#endif
    for (int u = 0; u < 4; ++u) {
      const int v = chunk * kChunkVecs + u * kWarpSize + lane;
      const bool active = v < vecs;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      uint64_t m = rmask;
      while (m != 0) {
        int4 raw[kBatch][kVecInts] = {};
        int got = 0;
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          if (m != 0) {
            const int r = lowest_rank(m);
            m &= m - 1;
            const int slot = slots.of(r);
            if (active) {
              const PartialT* from =
                  push ? pushed_row<PartialT>(c, c.local(), r, n)
                       : at<PartialT>(c.peers[r], L.partials) + size_t(slot) * H;
              const int4* src = reinterpret_cast<const int4*>(from + v * 8);
#pragma unroll
              for (int t = 0; t < kVecInts; ++t)
                raw[i][t] = __ldcg(src + t);  // read once: not in L1
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
      if (active) store_bf16x8(y + size_t(n) * H + v * 8, acc);
    }
  }
}

// The naive backend: all-reduce of every row, then this rank's slice. Every rank holds the same
// M rows in the same order. After (true): y[n] = the sum over all ranks, in rank order, of row
// send_slot[n][s] (0 for a token sent nowhere). False when a wait failed.
__device__ __forceinline__ bool pull_all_reduced(const CombineCall& c) {
  const Shape& S = c.p.common.shape;
  const Layout& L = c.p.common.layout;
  const int W = S.world, s = c.rank(), H = S.hidden, M = c.M, N = c.N;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int nb = c.nb, b = c.b;
  const int vecs = H / 8;
  const int chunks = (vecs + kChunkVecs - 1) / kChunkVecs;
  // Reduce-scatter: rank s sums rows [r0, r1) over all ranks in rank order into its `reduced`
  // area ...
  const int per = (M + W - 1) / W;
  const int r0 = min(M, s * per), r1 = min(M, r0 + per);
  __nv_bfloat16* reduced = at<__nv_bfloat16>(c.local(), L.reduced);
  for (int item = b * num_warps + warp; item < (r1 - r0) * chunks; item += nb * num_warps) {
    const int j = r0 + item / chunks, chunk = item % chunks;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int v = chunk * kChunkVecs + u * kWarpSize + lane;
      if (v >= vecs) continue;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int q = 0; q < W; ++q) {
        float f[8];
        load_bf16x8(at<__nv_bfloat16>(c.peers[q], L.partials) + size_t(j) * H + v * 8, f);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += f[i];
      }
      store_bf16x8(reduced + size_t(j) * H + v * 8, acc);
    }
  }
  if (!publish_and_wait_all(c, &c.state()->combine_reduced_ticket, L.ready2)) return false;
  // ... all-gather: every rank copies all M reduced rows into its own partials area (every
  // peer has finished reading it: they published ready2 after their reduce-scatter) ...
  int4* gathered = at<int4>(c.local(), L.partials);
  const size_t total = size_t(M) * vecs;
  for (size_t i = size_t(b) * blockDim.x + threadIdx.x; i < total; i += size_t(nb) * blockDim.x) {
    const int j = int(i / vecs);
    gathered[i] = at<const int4>(c.peers[j / per], L.reduced)[i];
  }
  if (!dev::grid_barrier(&c.state()->barrier, nb, c.wait())) return false;
  // ... and takes its own tokens' rows.
  const int32_t* send_slot = at<int32_t>(c.local(), L.send_slot);
  int4* y = static_cast<int4*>(c.me.y);
  for (size_t i = size_t(b) * blockDim.x + threadIdx.x; i < size_t(N) * vecs;
       i += size_t(nb) * blockDim.x) {
    const int n = int(i / vecs), v = int(i % vecs);
    const int row = send_slot[size_t(n) * W + s];  // -1: an invalid token, sent nowhere
    y[i] = row >= 0 ? gathered[size_t(row) * vecs + v] : make_int4(0, 0, 0, 0);
  }
  return true;
}

// ---- the kernel ------------------------------------------------------------------------------

// PartialT: __nv_bfloat16 for token-major partials, float for expert-major (folded in f32).
template <typename PartialT>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    combine_kernel(const __grid_constant__ CombineParams p) {
  static_assert(std::is_same_v<PartialT, __nv_bfloat16> || std::is_same_v<PartialT, float>);
  __shared__ uint8_t* peers[kMaxRanks];
  const RankBlock rb = rank_block(p.common.num_ranks);
  const CombineRank& me = p.ranks[rb.slot];
  const RoundState* round = at<RoundState>(me.local, p.common.layout.round);
  if (dev::block_aborted(make_wait(me.local, me.host_status, me.rank, p.common))) return;
  const CombineCall c{.p = p,
                      .me = me,
                      .peers = peers,
                      .round = round->epoch,
                      .b = rb.b,
                      .nb = rb.nb,
                      .M = round->recv_count,
                      .N = round->num_tokens};
  for (int r = threadIdx.x; r < p.common.shape.world; r += blockDim.x) peers[r] = p.common.peers[r];
  __syncthreads();

  [[maybe_unused]] uint64_t clock0 = 0;  // the block's start: phase clock (EPX_PHASE_CLOCK)
#if EPX_MEASUREMENT
  clock0 = dev::globaltimer_ns();
  phase_started(p.common.clock, 1, clock0);
#endif
  const Half half = p.common.half;
  if (half != Half::kReceive) {
    if (p.common.shape.logfmt) {
      publish_logfmt<PartialT>(c);
    } else {
      publish_partials<PartialT>(c);
    }
    EPX_PHASE_MARK_SYNC(p.common, CombinePhase::kPublished, clock0);
    if (half == Half::kSend) return;
  }
  if (!wait_all(c, p.common.layout.ready)) return;
  EPX_PHASE_MARK(p.common, CombinePhase::kWaited, clock0);
  // Only token-major (bf16) partials are ever all-reduced (validate_for: expert-major is
  // low_latency's alone).
  constexpr bool kMayAllReduce = std::is_same_v<PartialT, __nv_bfloat16>;
  if (kMayAllReduce && p.common.shape.all_reduce) {
    (void)pull_all_reduced(c);
  } else if (p.common.shape.logfmt) {
    pull_logfmt(c);
  } else {
    pull_partials<PartialT>(c);
  }
  EPX_PHASE_MARK_SYNC(p.common, CombinePhase::kPulled, clock0);
}

}  // namespace

void load_combine_kernels() {
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, combine_kernel<__nv_bfloat16>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, combine_kernel<float>));
}

void launch_combine(const CombineParams& p, LaunchConfig lc, cudaStream_t stream) {
  const dim3 grid(lc.num_blocks * p.common.num_ranks), block(lc.warps_per_block * kWarpSize);
  if (p.common.shape.expert_major) {
    combine_kernel<float><<<grid, block, 0, stream>>>(p);
  } else {
    combine_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(p);
  }
  EPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epx::peer
