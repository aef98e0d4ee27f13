// What a dispatch-shaped scatter can reach on one GPU, with no synchronisation at all: every
// token's bf16 row is read once, quantised to fp8 with 1x128 block scales, and written to each of
// its destination ranks' receive areas at a precomputed row (uniform top-8 of 256 experts over 8
// ranks, deduplicated per rank: about 5.3 destinations per token). The variants differ only in how
// the bytes move, so their times, against the copy floor measured in the same run, say which
// store width, cache hints and copy engine a dispatch kernel should use. Every variant's output is
// compared byte for byte with the first one's.
//
// Build (where nvcc is; not part of the product build):
//   nvcc -arch=sm_90 -std=c++20 -O3 -Iinclude -Isrc -o build/scatter_probe
//   tools/diag/scatter_probe.cu
// Run: build/scatter_probe [tokens per rank ...]   (default 128 4096)
//
// Variants (one launch of 8 x 16 blocks x 32 warps, as low_latency's one launch on the H200):
//   v8        8 bf16 per lane and step (16-byte loads, 8-byte stores), 4 steps per item: the
//             layout of low_latency's payload loop
//   v8_cs     the same, stores with the evict-first hint (st.global.cs)
//   v8_ldcs   the same, loads evict-first too (ld.global.cs)
//   v16       16 bf16 per lane and step (two 16-byte loads, one 16-byte store), 2 steps per item
//   v16_cs    the same, stores evict-first
//   v8_s8     8 per lane, 8 steps per item (twice the loads in flight)
//   bulk      the item quantised into shared memory, then one bulk copy (cp.async.bulk, the copy
//             engine of TMA) per destination issued by one lane
// and what the byte mix itself allows (bytes not compared): `write` the bandwidth of a 1 GiB
// cudaMemset (writes only), and `stream` the same bytes as the dispatch read and written in order
// (each token's row read once with 16-byte loads, its first half written once per destination
// into consecutive rows of one output, one 16-byte store per lane, with its scales, no
// quantisation): the time no scatter design can beat on this byte mix. Two more split the gap
// between v16 and stream into its two causes: `v16_nq` (v16's scatter without the quantisation:
// the bytes mixed as stream mixes them) and `stream_q` (stream with v16's quantisation). And two
// say whether the cost of the scatter is in the kernel or in where its rows fall: `v16_ord` (v16
// with its rows renumbered so that they fall as stream's do: one area, a token's rows
// consecutive) and `v16_il` (v16 with the destinations' areas interleaved row by row: as many
// streams of rows per block as v16, but side by side). `stage8` and `stage24` quantise a batch
// of 8 or 24 of the block's tokens into shared memory, then write the batch one destination at a
// time: contiguous runs of rows instead of pieces of rows at each destination. `v16_rr8` and
// `v16_rr32`: v16 with the rank's blocks taking chunks of 8 or 32 tokens in turn, so that the
// writers of one (source, destination) pair stay near each other (same rows, same bytes).
// `v16_r8` and `v16_r32`: v16 with the rows at each destination ordered by round (8 or 32
// tokens of each block), source, block, token. `piped4/8/12`: staging in two buffers of 4, 8 or
// 12 tokens, the loads of one batch in flight while the block writes the one before. `sbulk8` and
// `sbulk24`: stage8 / stage24 with each row of a run written by one bulk copy (TMA's copy engine)
// instead of the block's stores; `pbulk8` and `pbulk12`: the same with two buffers, a batch loaded
// and quantised while the copies of the one before drain.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/fp8.cuh"
#include "core/vec_device.cuh"

#define CHECK(call)                                                                              \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

namespace {

constexpr int kRanks = 8, kHidden = 7168, kExperts = 256, kTopk = 8;
constexpr int kGroups = kHidden / 128;  // fp8 scale blocks per row
constexpr int kBlocksPerRank = 16, kWarps = 32;

struct Args {
  const __nv_bfloat16* x;  // [kRanks * N][kHidden]
  const int32_t* slot;     // [kRanks * N][kRanks] row at each destination, -1 none
  uint8_t* out;            // [kRanks][cap][kHidden] fp8
  float* scales;           // [kRanks][cap][kGroups]
  int n;                   // tokens per rank
  int cap;                 // rows of one receive area
};

enum class Hint { kNone, kStoreCs, kLoadStoreCs };

template <Hint kHint>
__device__ __forceinline__ int4 load16(const void* p) {
  if constexpr (kHint == Hint::kLoadStoreCs) return __ldcs(static_cast<const int4*>(p));
  return __ldg(static_cast<const int4*>(p));
}
template <Hint kHint, typename T>
__device__ __forceinline__ void store(T* p, T v) {
  if constexpr (kHint == Hint::kNone) {
    *p = v;
  } else {
    __stcs(p, v);
  }
}
// kPer bf16 values of one lane -> kPer fp8 bytes in kPer / 4 words; a 128-value block spans
// 128 / kPer lanes.
template <int kPer>
__device__ __forceinline__ void quantize(const float (&f)[kPer], uint32_t (&q)[kPer / 4],
                                         float& scale) {
  constexpr int kLanes = 128 / kPer;
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
  for (int off = kLanes / 2; off >= 1; off >>= 1)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const epx::dev::Fp8BlockScale s = epx::dev::fp8_block_scale(amax);
  scale = s.scale;
#pragma unroll
  for (int i = 0; i < kPer / 4; ++i) {
    const uint32_t lo = epx::dev::fp8x2_e4m3(f[4 * i] * s.inv, f[4 * i + 1] * s.inv);
    const uint32_t hi = epx::dev::fp8x2_e4m3(f[4 * i + 2] * s.inv, f[4 * i + 3] * s.inv);
    q[i] = lo | (hi << 16);
  }
}

// Register variants: one warp per (token, item of kSteps x 32 lanes x kPer values). !kQuant (16
// values per lane only): no quantisation, the two loaded vectors mixed into one (as stream_mix).
// kChunk > 0: the rank's blocks take chunks of kChunk tokens in turn instead of one contiguous
// range each (the rows still fall at the same places).
template <int kPer, int kSteps, Hint kHint, bool kQuant = true, int kChunk = 0>
__global__ void __launch_bounds__(kWarps * 32) scatter_registers(Args a) {
  static_assert(kQuant || kPer == 16, "unquantised rows: 16 values per lane");
  const int rank = blockIdx.x / kBlocksPerRank, b = blockIdx.x % kBlocksPerRank;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int per_block = kChunk > 0 ? (a.n + kBlocksPerRank * kChunk - 1) /
                                         (kBlocksPerRank * kChunk) * kChunk
                                   : (a.n + kBlocksPerRank - 1) / kBlocksPerRank;
  const int t0 = kChunk > 0 ? 0 : min(a.n, b * per_block);
  const int t1 = kChunk > 0 ? per_block : min(a.n, t0 + per_block);
  constexpr int kVecs = kPer / 8;  // 16-byte loads per lane and step
  constexpr int kItemValues = kSteps * 32 * kPer;
  constexpr int kItems = (kHidden + kItemValues - 1) / kItemValues;
  for (int it = warp; it < (t1 - t0) * kItems; it += kWarps) {
    int local = t0 + it / kItems;
    if constexpr (kChunk > 0) {
      local = (local / kChunk * kBlocksPerRank + b) * kChunk + local % kChunk;
      if (local >= a.n) continue;
    }
    const int n = rank * a.n + local, item = it % kItems;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(a.x + size_t(n) * kHidden);
    int4 v[kSteps][kVecs];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int col = (item * kSteps + u) * 32 * kPer + lane * kPer;
#pragma unroll
      for (int k = 0; k < kVecs; ++k)
        v[u][k] =
            col < kHidden ? load16<kHint>(src + size_t(col + 8 * k) * 2) : make_int4(0, 0, 0, 0);
    }
    const int my_slot = lane < kRanks ? a.slot[size_t(n) * kRanks + lane] : -1;
    const uint32_t dmask = __ballot_sync(0xffffffffu, my_slot >= 0);
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int col = (item * kSteps + u) * 32 * kPer + lane * kPer;
      float f[kPer];
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        float g[8];
        epx::dev::bf16x8_to_float(v[u][k], g);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[8 * k + i] = g[i];
      }
      uint32_t q[kPer / 4];
      float sc;
      if constexpr (kQuant) {
        quantize<kPer>(f, q, sc);
      } else {
        const int4 w = make_int4(v[u][0].x ^ v[u][1].x, v[u][0].y ^ v[u][1].y,
                                 v[u][0].z ^ v[u][1].z, v[u][0].w ^ v[u][1].w);
        q[0] = uint32_t(w.x), q[1] = uint32_t(w.y), q[2] = uint32_t(w.z), q[3] = uint32_t(w.w);
        sc = __int_as_float(w.x);
      }
      for (uint32_t m = dmask; m; m &= m - 1) {
        const int r = __ffs(m) - 1;
        const int row = __shfl_sync(0xffffffffu, my_slot, r);
        if (col >= kHidden) continue;
        uint8_t* dst = a.out + (size_t(r) * a.cap + row) * kHidden + col;
        if constexpr (kPer == 8) {
          store<kHint>(reinterpret_cast<uint2*>(dst), make_uint2(q[0], q[1]));
        } else {
          store<kHint>(reinterpret_cast<int4*>(dst),
                       make_int4(int(q[0]), int(q[1]), int(q[2]), int(q[3])));
        }
        if (lane % (128 / kPer) == 0)
          a.scales[(size_t(r) * a.cap + row) * kGroups + col / 128] = sc;
      }
    }
  }
}

// Staged variant: the block quantises a batch of kT of its tokens into shared memory (v16's
// quantisation), then writes the batch destination by destination: the batch's rows at one
// destination are consecutive (rows are in (source, token) order there), so all the block's
// warps write one contiguous run of rows at a time instead of a piece of each token's row at
// each of its destinations.
constexpr int kStageItem = 32 * 16;                 // values per warp item (16 per lane)
constexpr int kStageItems = kHidden / kStageItem;  // 14
static_assert(kHidden % kStageItem == 0, "whole items");
template <int kT>
__host__ __device__ constexpr size_t staged_smem_bytes() {
  return size_t(kT) * kHidden + size_t(kT) * kGroups * sizeof(float) +
         size_t(kRanks) * (kT + 2) * sizeof(int32_t);
}

// A batch in shared memory (staged_smem_bytes): [kT][kHidden] fp8 rows, f32 [kT][kGroups]
// scales, int32 [kRanks][kT] the batch's tokens at each destination in token order, [kRanks] the
// first's row there, [kRanks] how many.
template <int kT>
struct Stage {
  uint8_t* rows;
  float* sc;
  int32_t* list;
  int32_t* first;
  int32_t* count;
  __device__ explicit Stage(uint8_t* p)
      : rows(p),
        sc(reinterpret_cast<float*>(p + size_t(kT) * kHidden)),
        list(reinterpret_cast<int32_t*>(sc + size_t(kT) * kGroups)),
        first(list + kRanks * kT),
        count(first + kRanks) {}
};

// The lists of the batch [base, base + nt) of `rank`'s tokens (warp r: destination r).
template <int kT>
__device__ __forceinline__ void stage_lists(const Args& a, const Stage<kT>& st, int rank, int base,
                                            int nt) {
  const int lane = threadIdx.x % 32, r = threadIdx.x / 32;
  if (r >= kRanks) return;
  const int sl = lane < nt ? a.slot[size_t(rank * a.n + base + lane) * kRanks + r] : -1;
  const uint32_t has = __ballot_sync(0xffffffffu, sl >= 0);
  if (sl >= 0) st.list[r * kT + __popc(has & ((1u << lane) - 1))] = lane;
  if (lane == 0) st.count[r] = __popc(has);
  if (has != 0 && lane == __ffs(has) - 1) st.first[r] = sl;
}

// 16 bf16 of token t at column col (this lane's two loaded vectors) quantised into the stage.
template <int kT>
__device__ __forceinline__ void stage_piece(const Stage<kT>& st, int t, int col, int4 v0, int4 v1) {
  float f[16], g[8];
  epx::dev::bf16x8_to_float(v0, g);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = g[i];
  epx::dev::bf16x8_to_float(v1, g);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[8 + i] = g[i];
  uint32_t q[4];
  float scale;
  quantize<16>(f, q, scale);
  *reinterpret_cast<int4*>(st.rows + size_t(t) * kHidden + col) =
      make_int4(int(q[0]), int(q[1]), int(q[2]), int(q[3]));
  if (threadIdx.x % 8 == 0) st.sc[t * kGroups + col / 128] = scale;
}

// The batch to its destinations, one contiguous run of rows (and scales) at a time, all threads.
template <int kT>
__device__ __forceinline__ void write_stage(const Args& a, const Stage<kT>& st) {
  constexpr int kRowVecs = kHidden / 16;
  for (int r = 0; r < kRanks; ++r) {
    const int c = st.count[r];
    if (c == 0) continue;
    int4* out = reinterpret_cast<int4*>(a.out + (size_t(r) * a.cap + st.first[r]) * kHidden);
    for (int u = threadIdx.x; u < c * kRowVecs; u += blockDim.x) {
      const int j = u / kRowVecs, off = u % kRowVecs;
      out[u] = reinterpret_cast<const int4*>(st.rows + size_t(st.list[r * kT + j]) * kHidden)[off];
    }
    float* out_sc = a.scales + (size_t(r) * a.cap + st.first[r]) * kGroups;
    for (int u = threadIdx.x; u < c * kGroups; u += blockDim.x)
      out_sc[u] = st.sc[st.list[r * kT + u / kGroups] * kGroups + u % kGroups];
  }
}

// The batch [base, base + nt) of `rank`'s tokens into the stage: its lists, its rows quantised.
template <int kT>
__device__ __forceinline__ void stage_batch(const Args& a, const Stage<kT>& st, int rank, int base,
                                            int nt) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  stage_lists<kT>(a, st, rank, base, nt);
  for (int it = warp; it < nt * kStageItems; it += kWarps) {
    const int t = it / kStageItems, col = (it % kStageItems) * kStageItem + lane * 16;
    const int4* src =
        reinterpret_cast<const int4*>(a.x + size_t(rank * a.n + base + t) * kHidden + col);
    stage_piece<kT>(st, t, col, __ldg(src), __ldg(src + 1));
  }
}

template <int kT>
__global__ void __launch_bounds__(kWarps * 32) scatter_staged(Args a) {
  extern __shared__ __align__(16) uint8_t smem[];
  const Stage<kT> st(smem);
  const int rank = blockIdx.x / kBlocksPerRank, b = blockIdx.x % kBlocksPerRank;
  const int per_block = (a.n + kBlocksPerRank - 1) / kBlocksPerRank;
  const int t0 = min(a.n, b * per_block), t1 = min(a.n, t0 + per_block);
  for (int base = t0; base < t1; base += kT) {
    const int nt = min(kT, t1 - base);
    stage_batch<kT>(a, st, rank, base, nt);
    __syncthreads();
    write_stage<kT>(a, st);
    __syncthreads();
  }
}

// Pipelined staging: two batch buffers. In step k every warp issues the loads of its items of
// batch k, then helps write batch k - 1 (destination by destination, as scatter_staged) while
// those loads are in flight, then quantises batch k into the other buffer: reads and writes
// overlap inside the block, one __syncthreads per step.
template <int kT>
__host__ __device__ constexpr size_t piped_smem_bytes() {
  return 2 * staged_smem_bytes<kT>();
}

template <int kT>
__global__ void __launch_bounds__(kWarps * 32) scatter_piped(Args a) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int kItemsPerWarp = (kT * kStageItems + kWarps - 1) / kWarps;
  const int rank = blockIdx.x / kBlocksPerRank, b = blockIdx.x % kBlocksPerRank;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int per_block = (a.n + kBlocksPerRank - 1) / kBlocksPerRank;
  const int t0 = min(a.n, b * per_block), t1 = min(a.n, t0 + per_block);
  const int batches = (t1 - t0 + kT - 1) / kT;
  auto stage = [&](int k) { return Stage<kT>(smem + size_t(k % 2) * staged_smem_bytes<kT>()); };
  for (int k = 0; k <= batches; ++k) {
    // Loads of batch k.
    const int base = t0 + k * kT, nt = k < batches ? min(kT, t1 - base) : 0;
    int4 v[kItemsPerWarp][2];
#pragma unroll
    for (int i = 0; i < kItemsPerWarp; ++i) {
      const int it = warp + i * kWarps, t = it / kStageItems;
      const int col = (it % kStageItems) * kStageItem + lane * 16;
      if (t < nt) {
        const int4* src =
            reinterpret_cast<const int4*>(a.x + size_t(rank * a.n + base + t) * kHidden + col);
        v[i][0] = __ldg(src), v[i][1] = __ldg(src + 1);
      }
    }
    if (k > 0) write_stage<kT>(a, stage(k - 1));  // batch k - 1 while those loads are in flight
    if (k < batches) {  // batch k quantised into the other buffer, with its lists
      const Stage<kT> st = stage(k);
      stage_lists<kT>(a, st, rank, base, nt);
#pragma unroll
      for (int i = 0; i < kItemsPerWarp; ++i) {
        const int it = warp + i * kWarps, t = it / kStageItems;
        const int col = (it % kStageItems) * kStageItem + lane * 16;
        if (t < nt) stage_piece<kT>(st, t, col, v[i][0], v[i][1]);
      }
    }
    __syncthreads();
  }
}

// Bulk variant: the warp quantises its item into shared memory, then lane 0 issues one bulk copy
// per destination (and waits for the copies to have read shared memory before the next item).
constexpr int kBulkSteps = 4, kBulkItem = kBulkSteps * 32 * 8;  // 1024 values = 1 KiB of fp8
static_assert(kHidden % kBulkItem == 0, "whole items");

__device__ __forceinline__ void bulk_store(void* dst, const void* src_smem, uint32_t bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(src_smem));
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(s),
               "r"(bytes)
               : "memory");
}

__global__ void __launch_bounds__(kWarps * 32) scatter_bulk(Args a) {
  __shared__ alignas(128) uint8_t stage[kWarps][kBulkItem];
  const int rank = blockIdx.x / kBlocksPerRank, b = blockIdx.x % kBlocksPerRank;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int per_block = (a.n + kBlocksPerRank - 1) / kBlocksPerRank;
  const int t0 = min(a.n, b * per_block), t1 = min(a.n, t0 + per_block);
  constexpr int kItems = kHidden / kBulkItem;
  for (int it = warp; it < (t1 - t0) * kItems; it += kWarps) {
    const int n = rank * a.n + t0 + it / kItems, item = it % kItems;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(a.x + size_t(n) * kHidden);
    int4 v[kBulkSteps];
#pragma unroll
    for (int u = 0; u < kBulkSteps; ++u)
      v[u] = __ldg(reinterpret_cast<const int4*>(
          src + size_t((item * kBulkSteps + u) * 256 + lane * 8) * 2));
    const int my_slot = lane < kRanks ? a.slot[size_t(n) * kRanks + lane] : -1;
    const uint32_t dmask = __ballot_sync(0xffffffffu, my_slot >= 0);
    // The previous item's copies must have read the stage before it is written again.
    if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    __syncwarp();
    float sc[kBulkSteps];
#pragma unroll
    for (int u = 0; u < kBulkSteps; ++u) {
      float f[8];
      epx::dev::bf16x8_to_float(v[u], f);
      uint32_t q[2];
      quantize<8>(f, q, sc[u]);
      *reinterpret_cast<uint2*>(&stage[warp][u * 256 + lane * 8]) = make_uint2(q[0], q[1]);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> bulk reads
    __syncwarp();
    for (uint32_t m = dmask; m; m &= m - 1) {
      const int r = __ffs(m) - 1;
      const int row = __shfl_sync(0xffffffffu, my_slot, r);
      uint8_t* dst = a.out + (size_t(r) * a.cap + row) * kHidden + item * kBulkItem;
      if (lane == 0) bulk_store(dst, stage[warp], kBulkItem);
#pragma unroll
      for (int u = 0; u < kBulkSteps; ++u)
        if (lane % 16 == 0)
          a.scales[(size_t(r) * a.cap + row) * kGroups +
                   ((item * kBulkSteps + u) * 256 + lane * 8) / 128] = sc[u];
    }
    if (lane == 0) asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Staged batches written by bulk copies: as scatter_staged (kPiped: as scatter_piped, two
// buffers), but each row of a destination's run goes out as one bulk copy from shared memory (the
// copy engine of TMA), issued by the thread of (destination, row), so that the block's warps are
// free as soon as the copies are issued. kPiped: batch k is loaded and quantised into one buffer
// while the copies of batch k - 1 drain from the other; a buffer is written again only once its
// copies have read it (cp.async.bulk.wait_group.read: every thread commits one group per batch).
template <int kT>
__host__ __device__ constexpr size_t bulk_stage_bytes() {
  return (staged_smem_bytes<kT>() + 127) / 128 * 128;
}

template <int kT, bool kPiped>
__global__ void __launch_bounds__(kWarps * 32) scatter_staged_bulk(Args a) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int rank = blockIdx.x / kBlocksPerRank, b = blockIdx.x % kBlocksPerRank;
  const int per_block = (a.n + kBlocksPerRank - 1) / kBlocksPerRank;
  const int t0 = min(a.n, b * per_block), t1 = min(a.n, t0 + per_block);
  for (int k = 0, base = t0; base < t1; ++k, base += kT) {
    const int nt = min(kT, t1 - base);
    const Stage<kT> st(smem + (kPiped ? size_t(k % 2) * bulk_stage_bytes<kT>() : 0));
    // The copies that read this buffer last (batch k - 2 piped, k - 1 otherwise) are done.
    if constexpr (kPiped) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    } else {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
    __syncthreads();
    stage_batch<kT>(a, st, rank, base, nt);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> bulk reads
    __syncthreads();
    for (int i = threadIdx.x; i < kRanks * kT; i += blockDim.x) {
      const int r = i / kT, j = i % kT;
      if (j < st.count[r])
        bulk_store(a.out + (size_t(r) * a.cap + st.first[r] + j) * kHidden,
                   st.rows + size_t(st.list[r * kT + j]) * kHidden, kHidden);
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    for (int r = 0; r < kRanks; ++r) {
      const int c = st.count[r];
      float* out_sc = a.scales + (size_t(r) * a.cap + st.first[r]) * kGroups;
      for (int u = threadIdx.x; u < c * kGroups; u += blockDim.x)
        out_sc[u] = st.sc[st.list[r * kT + u / kGroups] * kGroups + u % kGroups];
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// The byte mix in order: warp per (token, item of 2 x 32 x 16 values), destinations' rows
// consecutive from first_row[n] (a.slot holds first_row, a.cap the number of destinations of token
// n in first_row[n + 1] - first_row[n]). kQuant: each lane's 16 values quantised as v16 does.
template <bool kQuant>
__global__ void __launch_bounds__(kWarps * 32) stream_mix(Args a) {
  const int rank = blockIdx.x / kBlocksPerRank, b = blockIdx.x % kBlocksPerRank;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int per_block = (a.n + kBlocksPerRank - 1) / kBlocksPerRank;
  const int t0 = min(a.n, b * per_block), t1 = min(a.n, t0 + per_block);
  constexpr int kItemValues = 2 * 32 * 16, kItems = kHidden / kItemValues;
  static_assert(kHidden % kItemValues == 0, "whole items");
  for (int it = warp; it < (t1 - t0) * kItems; it += kWarps) {
    const int n = rank * a.n + t0 + it / kItems, item = it % kItems;
    const int4* src = reinterpret_cast<const int4*>(a.x + size_t(n) * kHidden);
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = __ldg(src + (item * 2 + u / 2) * 64 + lane * 2 + u % 2);
    int4 w[2];
    float sc[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if constexpr (kQuant) {
        float f[16], g[8];
        epx::dev::bf16x8_to_float(v[2 * u], g);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = g[i];
        epx::dev::bf16x8_to_float(v[2 * u + 1], g);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[8 + i] = g[i];
        uint32_t q[4];
        quantize<16>(f, q, sc[u]);
        w[u] = make_int4(int(q[0]), int(q[1]), int(q[2]), int(q[3]));
      } else {
        w[u] = make_int4(v[2 * u].x ^ v[2 * u + 1].x, v[2 * u].y ^ v[2 * u + 1].y,
                         v[2 * u].z ^ v[2 * u + 1].z, v[2 * u].w ^ v[2 * u + 1].w);
        sc[u] = __int_as_float(w[u].x);
      }
    }
    const int row0 = a.slot[n], rows = a.slot[n + 1] - row0;
    for (int j = 0; j < rows; ++j) {
      uint8_t* dst = a.out + size_t(row0 + j) * kHidden + item * kItemValues;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        *reinterpret_cast<int4*>(dst + (u * 32 + lane) * 16) = w[u];
        if (lane % 8 == 0)
          a.scales[size_t(row0 + j) * kGroups + (item * kItemValues + (u * 32 + lane) * 16) / 128] =
              sc[u];
      }
    }
  }
}

// Where a variant's rows go: each destination's own area (the dispatch's layout), or the same
// kernel with its rows renumbered so that its writes fall as stream_mix's do (one area, a token's
// rows consecutive), or with the destinations' areas interleaved row by row.
enum class Rows { kAreas, kInOrder, kInterleaved, kRounds8, kRounds32 };

struct Variant {
  const char* name;
  void (*kernel)(Args);
  Rows rows = Rows::kAreas;
  size_t smem = 0;  // dynamic shared memory
};

// Sorted times in us of `iters` timed calls of launch() on the default stream, after `warmup`
// untimed ones.
template <typename Launch>
std::vector<float> time_us(const Launch& launch, int warmup, int iters, cudaEvent_t e0,
                           cudaEvent_t e1) {
  std::vector<float> us;
  for (int i = 0; i < warmup + iters; ++i) {
    CHECK(cudaEventRecord(e0));
    launch(i);
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (i >= warmup) us.push_back(t * 1e3f);
  }
  CHECK(cudaGetLastError());
  std::sort(us.begin(), us.end());
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atoi(argv[i]));
  if (sizes.empty()) sizes = {128, 4096};
  const Variant variants[] = {
      {"v8", scatter_registers<8, 4, Hint::kNone>},
      {"v8_cs", scatter_registers<8, 4, Hint::kStoreCs>},
      {"v8_ldcs", scatter_registers<8, 4, Hint::kLoadStoreCs>},
      {"v16", scatter_registers<16, 2, Hint::kNone>},
      {"v16_cs", scatter_registers<16, 2, Hint::kStoreCs>},
      {"v8_s8", scatter_registers<8, 8, Hint::kNone>},
      {"bulk", scatter_bulk},
      {"v16_nq", scatter_registers<16, 2, Hint::kNone, false>},
      {"v16_ord", scatter_registers<16, 2, Hint::kNone>, Rows::kInOrder},
      {"v16_il", scatter_registers<16, 2, Hint::kNone>, Rows::kInterleaved},
      {"v16_rr8", scatter_registers<16, 2, Hint::kNone, true, 8>},
      {"v16_rr32", scatter_registers<16, 2, Hint::kNone, true, 32>},
      {"v16_r8", scatter_registers<16, 2, Hint::kNone>, Rows::kRounds8},
      {"v16_r32", scatter_registers<16, 2, Hint::kNone>, Rows::kRounds32},
      {"stage8", scatter_staged<8>, Rows::kAreas, staged_smem_bytes<8>()},
      {"stage24", scatter_staged<24>, Rows::kAreas, staged_smem_bytes<24>()},
      {"piped4", scatter_piped<4>, Rows::kAreas, piped_smem_bytes<4>()},
      {"piped8", scatter_piped<8>, Rows::kAreas, piped_smem_bytes<8>()},
      {"piped12", scatter_piped<12>, Rows::kAreas, piped_smem_bytes<12>()},
      {"sbulk8", scatter_staged_bulk<8, false>, Rows::kAreas, bulk_stage_bytes<8>()},
      {"sbulk24", scatter_staged_bulk<24, false>, Rows::kAreas, bulk_stage_bytes<24>()},
      {"pbulk8", scatter_staged_bulk<8, true>, Rows::kAreas, 2 * bulk_stage_bytes<8>()},
      {"pbulk12", scatter_staged_bulk<12, true>, Rows::kAreas, 2 * bulk_stage_bytes<12>()},
  };
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "scatter_probe on %s (%d SMs): %d ranks x %d blocks x %d warps, H %d, top-%d of %d "
      "experts, bf16 -> fp8\n",
      prop.name, prop.multiProcessorCount, kRanks, kBlocksPerRank, kWarps, kHidden, kTopk,
      kExperts);
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  // Copy bandwidth (read + write) of a 1 GiB device-to-device copy, median of 10.
  double copy_gbs = 0;
  {
    const size_t bytes = size_t(1) << 30;
    void *s = nullptr, *d = nullptr;
    CHECK(cudaMalloc(&s, bytes));
    CHECK(cudaMalloc(&d, bytes));
    const std::vector<float> us = time_us(
        [&](int) { CHECK(cudaMemcpyAsync(d, s, bytes, cudaMemcpyDeviceToDevice)); }, 1, 10, e0, e1);
    copy_gbs = 2.0 * double(bytes) / (us[us.size() / 2] * 1e-6) / 1e9;
    CHECK(cudaFree(s));
    CHECK(cudaFree(d));
  }
  // Write bandwidth of a 1 GiB cudaMemset, median of 10.
  double write_gbs = 0;
  {
    const size_t bytes = size_t(1) << 30;
    void* d = nullptr;
    CHECK(cudaMalloc(&d, bytes));
    const std::vector<float> us =
        time_us([&](int i) { CHECK(cudaMemsetAsync(d, i, bytes)); }, 1, 10, e0, e1);
    write_gbs = double(bytes) / (us[us.size() / 2] * 1e-6) / 1e9;
    CHECK(cudaFree(d));
  }
  std::printf("copy bandwidth %.1f GB/s (read + write), write bandwidth %.1f GB/s (cudaMemset)\n",
              copy_gbs, write_gbs);
  for (const int n : sizes) {
    // Routing: uniform top-8 of 256 experts, deduplicated per rank; rows at each destination in
    // (source rank, token) order.
    std::mt19937 rng(1);
    const int rows_in = kRanks * n;
    std::vector<int32_t> slot(size_t(rows_in) * kRanks, -1);
    std::vector<int> next(kRanks, 0);
    size_t out_rows = 0;
    for (int t = 0; t < rows_in; ++t) {
      std::vector<int> e(kExperts);
      for (int i = 0; i < kExperts; ++i) e[i] = i;
      std::shuffle(e.begin(), e.end(), rng);
      uint32_t mask = 0;
      for (int k = 0; k < kTopk; ++k) mask |= 1u << (e[k] / (kExperts / kRanks));
      for (int r = 0; r < kRanks; ++r)
        if ((mask >> r) & 1) {
          slot[size_t(t) * kRanks + r] = next[r]++;
          ++out_rows;
        }
    }
    const int cap = *std::max_element(next.begin(), next.end());
    std::vector<__nv_bfloat16> hx(size_t(rows_in) * kHidden);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : hx) v = __float2bfloat16(nd(rng));
    Args a{};
    a.n = n;
    a.cap = cap;
    __nv_bfloat16* dx = nullptr;
    int32_t* dslot = nullptr;
    CHECK(cudaMalloc(&dx, hx.size() * sizeof(hx[0])));
    CHECK(cudaMalloc(&dslot, slot.size() * sizeof(int32_t)));
    CHECK(cudaMalloc(&a.out, size_t(kRanks) * cap * kHidden));
    CHECK(cudaMalloc(&a.scales, size_t(kRanks) * cap * kGroups * sizeof(float)));
    CHECK(cudaMemcpy(dx, hx.data(), hx.size() * sizeof(hx[0]), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dslot, slot.data(), slot.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    a.x = dx;
    a.slot = dslot;
    // Floor: each input row read once, each output row (bytes and scales) written once.
    const double bytes = double(rows_in) * kHidden * 2 + double(out_rows) * (kHidden + kGroups * 4);
    const double floor_us = bytes / (copy_gbs * 1e9) * 1e6;
    std::printf("\n%d tokens per rank: %.2f destinations per token, floor %.2f us\n", n,
                double(out_rows) / rows_in, floor_us);
    std::vector<uint8_t> first_out, first_sc;
    const size_t out_bytes = size_t(kRanks) * cap * kHidden;
    const size_t sc_bytes = size_t(kRanks) * cap * kGroups * sizeof(float);
    // The renumbered tables: entry = the row in one area of kRanks * cap rows; these variants
    // run with cap = 0 so that the kernel's r * cap adds nothing. (An entry must stay >= 0: the
    // kernels read a negative one as "not sent there".)
    std::vector<int32_t> in_order(slot.size(), -1), interleaved(slot.size(), -1);
    for (int t = 0, row = 0; t < rows_in; ++t)
      for (int r = 0; r < kRanks; ++r) {
        const int32_t s = slot[size_t(t) * kRanks + r];
        if (s < 0) continue;
        in_order[size_t(t) * kRanks + r] = row++;
        interleaved[size_t(t) * kRanks + r] = s * kRanks + r;
      }
    // Rows at each destination ordered by (round, source rank, block, token), a round being T
    // consecutive tokens of each block: the writers of one destination stay near each other.
    auto by_rounds = [&](int tokens_per_round) {
      std::vector<int32_t> table(slot.size(), -1);
      const int per_block = (n + kBlocksPerRank - 1) / kBlocksPerRank;
      for (int r = 0; r < kRanks; ++r) {
        std::vector<std::array<int, 4>> keys;  // round, source, block, global token
        for (int t = 0; t < rows_in; ++t) {
          if (slot[size_t(t) * kRanks + r] < 0) continue;
          const int s = t / n, local = t % n, b = local / per_block;
          keys.push_back({(local - b * per_block) / tokens_per_round, s, b, t});
        }
        std::sort(keys.begin(), keys.end());
        for (size_t i = 0; i < keys.size(); ++i) table[size_t(keys[i][3]) * kRanks + r] = int32_t(i);
      }
      return table;
    };
    const std::vector<int32_t> rounds8 = by_rounds(8), rounds32 = by_rounds(32);
    for (const Variant& v : variants) {
      if (v.smem > 0)
        CHECK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   int(v.smem)));
      const std::vector<int32_t>& table =
          v.rows == Rows::kInOrder       ? in_order
          : v.rows == Rows::kInterleaved ? interleaved
          : v.rows == Rows::kRounds8     ? rounds8
          : v.rows == Rows::kRounds32    ? rounds32
                                         : slot;
      CHECK(cudaMemcpy(dslot, table.data(), table.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
      Args va = a;
      if (v.rows == Rows::kInOrder || v.rows == Rows::kInterleaved) va.cap = 0;
      CHECK(cudaMemset(a.out, 0, out_bytes));
      CHECK(cudaMemset(a.scales, 0, sc_bytes));
      const std::vector<float> ms = time_us(
          [&](int) { v.kernel<<<kRanks * kBlocksPerRank, kWarps * 32, v.smem>>>(va); }, 10,
          n > 1024 ? 50 : 200, e0, e1);
      std::vector<uint8_t> out(out_bytes), sc(sc_bytes);
      CHECK(cudaMemcpy(out.data(), a.out, out_bytes, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(sc.data(), a.scales, sc_bytes, cudaMemcpyDeviceToHost));
      const char* same = "reference";
      if (std::strcmp(v.name, "v16_nq") == 0) {
        same = "(no quantisation: bytes not compared)";
      } else if (v.rows == Rows::kInOrder) {
        same = "(v16, rows renumbered in stream order)";
      } else if (v.rows == Rows::kRounds8 || v.rows == Rows::kRounds32) {
        same = "(v16, rows at each destination by round of 8 / 32 tokens per block)";
      } else if (v.rows == Rows::kInterleaved) {
        same = "(v16, the areas interleaved row by row)";
      } else if (first_out.empty()) {
        first_out = out;
        first_sc = sc;
      } else {
        same = out == first_out && sc == first_sc ? "same bytes" : "DIFFERENT BYTES";
      }
      const float med = ms[ms.size() / 2];
      std::printf("  %-8s median %9.2f us  p90 %9.2f us  %.3f x floor  %s\n", v.name, med,
                  ms[ms.size() * 9 / 10], med / floor_us, same);
    }
    CHECK(cudaMemcpy(dslot, slot.data(), slot.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    // The byte mix in order (stream_mix): the same reads and writes, no scatter.
    {
      std::vector<int32_t> first_row(size_t(rows_in) + 1, 0);
      for (int t = 0; t < rows_in; ++t) {
        int d = 0;
        for (int r = 0; r < kRanks; ++r) d += slot[size_t(t) * kRanks + r] >= 0;
        first_row[size_t(t) + 1] = first_row[size_t(t)] + d;
      }
      int32_t* dfirst = nullptr;
      uint8_t* out = nullptr;
      float* scales = nullptr;
      CHECK(cudaMalloc(&dfirst, first_row.size() * sizeof(int32_t)));
      CHECK(cudaMalloc(&out, out_rows * kHidden));
      CHECK(cudaMalloc(&scales, out_rows * kGroups * sizeof(float)));
      CHECK(cudaMemcpy(dfirst, first_row.data(), first_row.size() * sizeof(int32_t),
                       cudaMemcpyHostToDevice));
      Args m = a;
      m.slot = dfirst;
      m.out = out;
      m.scales = scales;
      for (const bool quant : {false, true}) {
        const std::vector<float> ms = time_us(
            [&](int) {
              if (quant) {
                stream_mix<true><<<kRanks * kBlocksPerRank, kWarps * 32>>>(m);
              } else {
                stream_mix<false><<<kRanks * kBlocksPerRank, kWarps * 32>>>(m);
              }
            },
            10, n > 1024 ? 50 : 200, e0, e1);
        const float med = ms[ms.size() / 2];
        std::printf("  %-8s median %9.2f us  p90 %9.2f us  %.3f x floor  (the byte mix in order%s)\n",
                    quant ? "stream_q" : "stream", med, ms[ms.size() * 9 / 10], med / floor_us,
                    quant ? ", quantised" : "");
      }
      const double write_only_us =
          double(out_rows) * (kHidden + kGroups * 4) / (write_gbs * 1e9) * 1e6;
      std::printf("  %-8s %.2f us of writes alone at the cudaMemset rate (%.3f x floor)\n", "write",
                  write_only_us, write_only_us / floor_us);
      CHECK(cudaFree(dfirst));
      CHECK(cudaFree(out));
      CHECK(cudaFree(scales));
    }
    CHECK(cudaFree(dx));
    CHECK(cudaFree(dslot));
    CHECK(cudaFree(a.out));
    CHECK(cudaFree(a.scales));
  }
  return 0;
}
