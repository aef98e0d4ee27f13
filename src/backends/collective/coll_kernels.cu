// The collective engine's kernels (coll_kernels.hpp says what each does).

#include <cuda_bf16.h>

#include <cub/block/block_scan.cuh>

#include "backends/collective/coll_kernels.hpp"
#include "core/fp8.cuh"
#include "core/sync_device.cuh"
#include "core/vec_device.cuh"
#include "epx/cuda_check.hpp"

namespace epx::coll {
namespace {

using dev::kFullWarp;
using dev::kWarpSize;

constexpr int kThreads = 256;
constexpr int kBlocks = 132;

// The parts of slot n of a pack.
struct Slot {
  uint8_t* base;
  const CollShape& S;
  __device__ uint8_t* row() const { return base; }
  __device__ uint64_t* ranks() const { return reinterpret_cast<uint64_t*>(base + S.wire_row_bytes); }
  __device__ float* scales() const {
    return reinterpret_cast<float*>(base + S.wire_row_bytes + 8);
  }
  __device__ int32_t* ids() const {
    return reinterpret_cast<int32_t*>(base + S.wire_row_bytes + 8 + size_t(S.groups) * 4);
  }
  __device__ float* weights() const { return reinterpret_cast<float*>(ids() + S.topk); }
  __device__ int32_t* valid() const { return reinterpret_cast<int32_t*>(weights() + S.topk); }
  __device__ int32_t* index() const { return valid() + 1; }
  __device__ int32_t* source() const { return valid() + 2; }
  __device__ int32_t* place() const { return valid() + 3; }
  __device__ int32_t* places() const { return valid() + 4; }  // [S.local], the exact dispatch's
};
__device__ __forceinline__ Slot slot_of(const CollShape& S, uint8_t* pack, int n) {
  return Slot{pack + kPackHeader + size_t(n) * S.slot_bytes, S};
}

// The ranks a packed token goes to: those holding one of its experts, or its rank mask's.
__device__ __forceinline__ uint64_t token_ranks(const CollShape&, const Slot& s) {
  return *s.ranks();
}

__device__ __forceinline__ int64_t load_id(const CollShape& S, const void* ids, int n, int k) {
  const size_t i = size_t(n) * S.topk + k;
  return S.ids_int64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
}

// Token n's row (copied, or quantised for bf16-to-fp8) and scales into its slot: one warp.
__device__ __forceinline__ void copy_row(const CollShape& S, int n, const void* __restrict__ x,
                                         const float* __restrict__ x_scales, const Slot& s,
                                         int lane) {
  const int H = S.hidden;
  if (S.dtype == int32_t(DispatchDtype::kBF16ToFP8)) {
    // 16 values a lane, 8 lanes a 1x128 block; every lane takes part in each block's shuffles.
    const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(x) + size_t(n) * H;
    for (int v0 = 0; v0 < H; v0 += kWarpSize * 16) {
      const int v = v0 + lane * 16;
      float f[16];
      if (v < H) {
        float a[8], b[8];
        dev::load_bf16x8(src + v, a);
        dev::load_bf16x8(src + v + 8, b);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          f[i] = a[i];
          f[8 + i] = b[i];
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) f[i] = 0.f;
      }
      float scale;
      const uint4 q = dev::quantize_fp8_block<16>(f, scale, S.round_scale != 0);
      if (v < H) {
        *reinterpret_cast<uint4*>(s.row() + v) = q;
        if (lane % 8 == 0) s.scales()[v / kFp8BlockSize] = scale;
      }
    }
  } else {
    const int4* src = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(x) +
                                                    size_t(n) * S.wire_row_bytes);
    int4* dst = reinterpret_cast<int4*>(s.row());
    for (int v = lane; v < S.wire_row_bytes / 16; v += kWarpSize) dst[v] = __ldg(src + v);
    for (int g = lane; g < S.groups; g += kWarpSize)
      s.scales()[g] = x_scales[size_t(n) * S.groups + g];
  }
}

// One warp per token: ids checked (lane k holds id k), row copied or quantised, metadata written.
__global__ void __launch_bounds__(kThreads)
    coll_pack_kernel(const CollShape S, int N, const void* __restrict__ x,
                     const float* __restrict__ x_scales, const void* __restrict__ ids,
                     const float* __restrict__ weights, const uint8_t* __restrict__ rank_mask,
                     const int32_t* __restrict__ expert_counts, uint8_t* __restrict__ pack,
                     CollStatus st) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int warps = gridDim.x * (blockDim.x / kWarpSize);
  const bool by_mask = rank_mask != nullptr;
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      reinterpret_cast<int32_t*>(pack)[0] = N;
      reinterpret_cast<int32_t*>(pack)[1] = by_mask ? 1 : 0;
    }
    int32_t* counts = reinterpret_cast<int32_t*>(pack + S.counts_offset);
    for (int e = threadIdx.x; by_mask && e < S.num_experts; e += blockDim.x)
      counts[e] = expert_counts[e];
  }
  const dev::WaitContext w{st.status, st.host_status, S.timeout_ns, S.rank};
  const int K = S.topk;
  for (int n = warp; n < N; n += warps) {
    const Slot s = slot_of(S, pack, n);
    if (by_mask) {  // lanes r and r + 32 read mask bytes r and r + 32
      const uint8_t* m = rank_mask + size_t(n) * S.world;
      const uint32_t lo = __ballot_sync(kFullWarp, lane < S.world && m[lane] != 0);
      const uint32_t hi = __ballot_sync(kFullWarp, lane + 32 < S.world && m[lane + 32] != 0);
      if (lane < K) {
        s.ids()[lane] = -1;
        s.weights()[lane] = 0.f;
      }
      if (lane == 0) {
        *s.ranks() = uint64_t(hi) << 32 | lo;
        *s.valid() = 1;
        *s.index() = n;
        *s.source() = S.rank;
      }
      copy_row(S, n, x, x_scales, s, lane);
      continue;
    }
    // The ids: in [-1, E), no expert twice.
    const int64_t id = lane < K ? load_id(S, ids, n, lane) : -1;
    const bool out_of_range = lane < K && (id < -1 || id >= S.num_experts);
    if (out_of_range) dev::record_error(w, StatusCode::kInput, Phase::kDispatchRoute, -1,
                                        S.num_experts, id, n, lane);
    const bool expert = lane < K && id >= 0 && !out_of_range;
    const uint32_t key = expert ? uint32_t(id) : 0x80000000u | uint32_t(lane);
    const uint32_t same = __match_any_sync(kFullWarp, key);
    const bool repeated = expert && (same & dev::lanemask_lt()) != 0;
    if (repeated) dev::record_error(w, StatusCode::kInput, Phase::kDispatchRoute, -1,
                                    __ffs(same) - 1, id, n, lane);
    const bool valid = !__any_sync(kFullWarp, out_of_range || repeated);
    if (lane < K) {
      s.ids()[lane] = int32_t(id);
      s.weights()[lane] = weights[size_t(n) * K + lane];
    }
    // The ranks holding one of its experts (world <= 64: a rank's bit in one of two halves).
    const int owner = expert ? int(id / S.num_local) : -1;
    const uint32_t lo = __reduce_or_sync(kFullWarp, owner >= 0 && owner < 32 ? 1u << owner : 0u);
    const uint32_t hi = __reduce_or_sync(kFullWarp, owner >= 32 ? 1u << (owner - 32) : 0u);
    if (lane == 0) {
      *s.ranks() = uint64_t(hi) << 32 | lo;
      *s.valid() = valid ? 1 : 0;
      *s.index() = n;
      *s.source() = S.rank;
    }
    copy_row(S, n, x, x_scales, s, lane);
  }
}

// Each of a pack's tokens' place among its valid tokens (routed: those that go to one of the
// ranks in `targets`), in token order, or -1 at pos[n]; their number, the same in every thread
// of the block.
__device__ int32_t place_tokens(const CollShape& S, uint8_t* pack, bool routed, uint64_t targets,
                                int32_t* __restrict__ pos) {
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int N = min(max(*reinterpret_cast<const int32_t*>(pack), 0), S.max_tokens);
  int32_t run = 0;
  for (int n0 = 0; n0 < N; n0 += kThreads) {
    const int n = n0 + threadIdx.x;
    int32_t valid = n < N ? *slot_of(S, pack, n).valid() : 0;
    if (valid && routed) valid = int32_t((token_ranks(S, slot_of(S, pack, n)) & targets) != 0);
    int32_t before = 0, total = 0;
    Scan(tmp).ExclusiveSum(valid, before, total);
    if (n < N) pos[n] = valid ? run + before : -1;
    run += total;
    __syncthreads();  // tmp is reused
  }
  return run;
}

// One block per source rank q: each of its tokens' place among its valid tokens (S.routed: those
// routed to this rank), and their count.
__global__ void __launch_bounds__(kThreads)
    coll_place_kernel(const CollShape S, const uint8_t* __restrict__ gathered, size_t pack_bytes,
                      CollRows rows) {
  const int q = blockIdx.x;
  uint8_t* pack = const_cast<uint8_t*>(gathered) + size_t(q) * pack_bytes;
  const int32_t count =
      place_tokens(S, pack, S.routed, uint64_t(1) << S.rank, rows.pos + size_t(q) * S.max_tokens);
  if (threadIdx.x == 0) rows.counts[q] = count;
}

// One block: for each rank q, the place of each of this rank's tokens among those q receives
// (the order of the rows q sends back), their count, and where q's rows start in the exact
// combine's receive area (counts in rank order). With back.node_pos (the exact dispatch): the
// same for each other node (the tokens going to one of its ranks), and each peer's first slot in
// step A's send area (a rank of this node: its tokens; another node's rail peer: that node's).
__global__ void __launch_bounds__(kThreads)
    coll_back_place_kernel(const CollShape S, const uint8_t* __restrict__ own_pack,
                           CollBack back) {
  int32_t start = 0;
  for (int q = 0; q < S.world; ++q) {
    const int32_t count = place_tokens(S, const_cast<uint8_t*>(own_pack), true, uint64_t(1) << q,
                                       back.pos + size_t(q) * S.max_tokens);
    if (threadIdx.x == 0) {
      back.counts[q] = count;
      back.offsets[q] = start;
    }
    start += count;
  }
  const int nodes = S.world / S.local, node = S.rank / S.local;
  const uint64_t node_ranks = S.local == 64 ? ~uint64_t(0) : (uint64_t(1) << S.local) - 1;
  for (int b = 0; b < nodes; ++b) {
    const int32_t count =
        b == node ? 0
                  : place_tokens(S, const_cast<uint8_t*>(own_pack), true,
                                 node_ranks << (b * S.local), back.node_pos + size_t(b) * S.max_tokens);
    if (threadIdx.x == 0) back.node_counts[b] = count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t at = 0;
    for (int p = 0; p < S.world; ++p) {
      back.send_offsets[p] = at;
      if (p / S.local == node) at += back.counts[p];
      else if (p % S.local == S.rank % S.local) at += back.node_counts[p / S.local];
    }
  }
}

// One block: each source's first row, the round's row count, the expert counts started with
// those of the senders that route by a rank mask (dispatch_rows_kernel adds the ids').
__global__ void coll_offsets_kernel(const CollShape S, const uint8_t* __restrict__ gathered,
                                    size_t pack_bytes, CollRows rows) {
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (int q = 0; q < S.world; ++q) {
      rows.offsets[q] = run;
      run += rows.counts[q];
    }
    *rows.recv_count = run;
  }
  const int e0 = S.rank * S.num_local;
  for (int e = threadIdx.x; e < S.num_local; e += blockDim.x) {
    int32_t sum = 0;
    for (int q = 0; q < S.world; ++q) {
      const uint8_t* pack = gathered + size_t(q) * pack_bytes;
      if (reinterpret_cast<const int32_t*>(pack)[1] != 0)
        sum += reinterpret_cast<const int32_t*>(pack + S.counts_offset)[e0 + e];
    }
    rows.expert_counts[e] = sum;
  }
}

// One warp: slot s's row, scales and metadata (source q, index n) at token-major row `row`, the
// ids' expert counts of this rank's local experts added.
__device__ __forceinline__ void write_row(const CollShape& S, const Slot& s, int row, int q, int n,
                                          const CollRows& rows, int lane) {
  const int K = S.topk, cap = S.world * S.max_tokens, e0 = S.rank * S.num_local;
  const int4* src = reinterpret_cast<const int4*>(s.row());
  int4* dst = reinterpret_cast<int4*>(rows.recv_x + size_t(row) * S.wire_row_bytes);
  for (int v = lane; v < S.wire_row_bytes / 16; v += kWarpSize) dst[v] = src[v];
  for (int g = lane; g < S.groups; g += kWarpSize) {
    const size_t at = S.scale_col_major ? size_t(g) * cap + row : size_t(row) * S.groups + g;
    rows.recv_scales[at] = s.scales()[g];
  }
  if (lane < K) {
    const int32_t id = s.ids()[lane];
    rows.recv_topk_ids[size_t(row) * K + lane] = id;
    rows.recv_topk_w[size_t(row) * K + lane] = s.weights()[lane];
    if (id >= e0 && id < e0 + S.num_local) atomicAdd(rows.expert_counts + (id - e0), 1);
  }
  if (lane == 0) {
    rows.recv_src_rank[row] = q;
    rows.recv_src_idx[row] = n;
  }
}

// One warp per (source, token): a valid token's row, scales and metadata at its place. Named
// dispatch_*, and the only kernel of a round so named (the fold below: combine_*), so that
// profiler-based benchmarks that time an engine's dispatch and combine by those words in kernel
// names (DeepEP's tests) find one kernel for each.
__global__ void __launch_bounds__(kThreads)
    dispatch_rows_kernel(const CollShape S, const uint8_t* __restrict__ gathered,
                         size_t pack_bytes, CollRows rows) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int warps = gridDim.x * (blockDim.x / kWarpSize);
  const int T = S.max_tokens;
  for (int i = warp; i < S.world * T; i += warps) {
    const int q = i / T, n = i % T;
    const int32_t p = rows.pos[i];
    uint8_t* pack = const_cast<uint8_t*>(gathered) + size_t(q) * pack_bytes;
    const int N = min(max(*reinterpret_cast<const int32_t*>(pack), 0), T);
    if (n >= N || p < 0) continue;
    write_row(S, slot_of(S, pack, n), rows.offsets[q] + p, q, n, rows, lane);
  }
}

// ---- the exact dispatch (high_throughput without worst-case output) ----------------------------

// A meta's parts (coll_kernels.hpp: meta_bytes).
__device__ __forceinline__ int32_t* meta_sends(const CollShape&, uint8_t* meta) {
  return reinterpret_cast<int32_t*>(meta) + kMetaSendsAt;
}
__device__ __forceinline__ int32_t* meta_node_sends(const CollShape& S, uint8_t* meta) {
  return reinterpret_cast<int32_t*>(meta) + meta_node_sends_at(S.world);
}
__device__ __forceinline__ int32_t* meta_experts(const CollShape& S, uint8_t* meta) {
  return reinterpret_cast<int32_t*>(meta) + meta_experts_at(S.world);
}

// One warp copies a slot (lanes over its 16-byte words).
__device__ __forceinline__ void copy_slot(const CollShape& S, const uint8_t* from, uint8_t* to,
                                          int lane) {
  const int4* src = reinterpret_cast<const int4*>(from);
  int4* dst = reinterpret_cast<int4*>(to);
  for (int v = lane; v < S.slot_bytes / 16; v += kWarpSize) dst[v] = src[v];
  __syncwarp();
}

// Step A. One warp per (rank q of this node, token n going there): the slot at its place among
// q's, `place` set; one per (other node b, token n going there): the slot at its place among
// b's rail peer's, `places` set (its place at each rank of node b). Block 0 also writes this
// rank's meta.
__global__ void __launch_bounds__(kThreads)
    coll_exact_send_kernel(const CollShape S, const uint8_t* __restrict__ own_pack, CollBack back,
                           uint8_t* __restrict__ send, uint8_t* __restrict__ meta) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int warps = gridDim.x * (blockDim.x / kWarpSize);
  const int32_t* header = reinterpret_cast<const int32_t*>(own_pack);
  const int N = min(max(header[0], 0), S.max_tokens), T = S.max_tokens;
  const int nodes = S.world / S.local, node = S.rank / S.local, local = S.rank % S.local;
  if (blockIdx.x == 0) {
    if (threadIdx.x < 2) reinterpret_cast<int32_t*>(meta)[threadIdx.x] = header[threadIdx.x];
    for (int q = threadIdx.x; q < S.world; q += blockDim.x) {
      meta_sends(S, meta)[q] = back.counts[q];
      meta_node_sends(S, meta)[q] = q < nodes ? back.node_counts[q] : 0;
    }
    const int32_t* counts = reinterpret_cast<const int32_t*>(own_pack + S.counts_offset);
    for (int e = threadIdx.x; header[1] != 0 && e < S.num_experts; e += blockDim.x)
      meta_experts(S, meta)[e] = counts[e];
  }
  const uint8_t* pack = own_pack + kPackHeader;
  for (int i = warp; i < (S.local + nodes) * T; i += warps) {
    const int j = i / T, n = i % T;
    if (n >= N) continue;
    if (j < S.local) {  // rank q of this node
      const int q = node * S.local + j;
      const int32_t p = back.pos[size_t(q) * T + n];
      if (p < 0) continue;
      const Slot s{send + size_t(back.send_offsets[q] + p) * S.slot_bytes, S};
      copy_slot(S, pack + size_t(n) * S.slot_bytes, s.base, lane);
      if (lane == 0) *s.place() = p;
    } else {  // node b's rail peer
      const int b = j - S.local;
      const int32_t p = b == node ? -1 : back.node_pos[size_t(b) * T + n];
      if (p < 0) continue;
      const int peer = b * S.local + local;
      const Slot s{send + size_t(back.send_offsets[peer] + p) * S.slot_bytes, S};
      copy_slot(S, pack + size_t(n) * S.slot_bytes, s.base, lane);
      for (int d = lane; d < S.local; d += kWarpSize)
        s.places()[d] = back.pos[size_t(b * S.local + d) * T + n];
    }
  }
}

// One block: the slots each rank sends this one, their first rows (in rank order), the round's
// row count, the expert counts started with the rank-mask senders' (the ids' are added as the
// rows are laid out); and step B's bookkeeping (CollRelay).
__global__ void coll_exact_counts_kernel(const CollShape S, const uint8_t* __restrict__ metas,
                                         size_t meta_bytes, CollRows rows, CollRelay relay) {
  auto meta = [&](int q) { return const_cast<uint8_t*>(metas) + size_t(q) * meta_bytes; };
  const int nodes = S.world / S.local, node = S.rank / S.local, local = S.rank % S.local;
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (int q = 0; q < S.world; ++q) {
      const int32_t c = meta_sends(S, meta(q))[S.rank];  // (checked on the host: read_metas)
      rows.counts[q] = c;
      rows.offsets[q] = run;
      run += c;
    }
    *rows.recv_count = run;
    // Step B: the rail peer of node a (rank a * local + this local index) sent its slots for
    // this node, in node order.
    int32_t at = 0;
    for (int a = 0; a < nodes; ++a) {
      relay.chunk_start[a] = at;
      if (a != node) at += meta_node_sends(S, meta(a * S.local + local))[node];
    }
    relay.chunk_start[nodes] = at;
    int32_t start = 0;
    for (int d = 0; d < S.local; ++d) {
      relay.rank_start[d] = start;
      int32_t sum = 0;
      for (int a = 0; a < nodes; ++a) {
        relay.base[a * S.local + d] = sum;
        if (a != node) sum += meta_sends(S, meta(a * S.local + local))[node * S.local + d];
      }
      start += sum;
    }
  }
  const int e0 = S.rank * S.num_local;
  for (int e = threadIdx.x; e < S.num_local; e += blockDim.x) {
    int32_t sum = 0;
    for (int q = 0; q < S.world; ++q) {
      if (reinterpret_cast<const int32_t*>(meta(q))[1] != 0)
        sum += meta_experts(S, meta(q))[e0 + e];
    }
    rows.expert_counts[e] = sum;
  }
}

// Step B. One warp per (relayed slot i, rank d of this node it goes to): the slot at d's place,
// `place` set from its `places`.
__global__ void __launch_bounds__(kThreads)
    coll_exact_relay_kernel(const CollShape S, const uint8_t* __restrict__ relayed,
                            CollRelay relay, uint8_t* __restrict__ send) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int warps = gridDim.x * (blockDim.x / kWarpSize);
  const int nodes = S.world / S.local, node = S.rank / S.local;
  const int R = relay.chunk_start[nodes];
  for (int i = warp; i < R * S.local; i += warps) {
    const int j = i / S.local, d = i % S.local;
    const Slot from{const_cast<uint8_t*>(relayed) + size_t(j) * S.slot_bytes, S};
    if (((*from.ranks() >> (node * S.local + d)) & 1) == 0) continue;
    int a = 0;
    while (a + 1 < nodes && relay.chunk_start[a + 1] <= j) ++a;
    const int32_t p = from.places()[d];
    const Slot to{send + size_t(relay.rank_start[d] + relay.base[a * S.local + d] + p) *
                             S.slot_bytes,
                  S};
    copy_slot(S, from.base, to.base, lane);
    if (lane == 0) *to.place() = p;
  }
}

// One warp per received slot (any order): its row, scales and metadata at row
// offsets[source] + place. Named dispatch_*, as dispatch_rows_kernel, whose place it takes in a
// round of the exact dispatch.
__global__ void __launch_bounds__(kThreads)
    dispatch_exact_rows_kernel(const CollShape S, const uint8_t* __restrict__ slots,
                               CollRows rows) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int warps = gridDim.x * (blockDim.x / kWarpSize);
  const int M = *rows.recv_count;
  for (int i = warp; i < M; i += warps) {
    const Slot s{const_cast<uint8_t*>(slots) + size_t(i) * S.slot_bytes, S};
    const int q = *s.source(), p = *s.place();
    // (every slot's source and place come from the ranks' own kernels: a slot outside its
    // source's rows would be a bug of this engine, and is dropped rather than written anywhere)
    if (q < 0 || q >= S.world || p < 0 || p >= rows.counts[q]) continue;
    write_row(S, s, rows.offsets[q] + p, q, *s.index(), rows, lane);
  }
}

// One block per local expert e: row j's slot k (ids[k] = e's global id) gets its place among the
// rows using e, in row order; expert_counts[e] = their number.
__global__ void __launch_bounds__(kThreads) coll_expert_place_kernel(const CollShape S, CollRows rows) {
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int e = blockIdx.x, id = S.rank * S.num_local + e, K = S.topk;
  const int M = *rows.recv_count;
  int32_t run = 0;
  for (int j0 = 0; j0 < M; j0 += kThreads) {
    const int j = j0 + threadIdx.x;
    int k_here = -1;
    for (int k = 0; j < M && k < K; ++k)
      if (rows.recv_topk_ids[size_t(j) * K + k] == id) k_here = k;
    int32_t before = 0, total = 0;
    Scan(tmp).ExclusiveSum(int32_t(k_here >= 0), before, total);
    if (k_here >= 0) rows.row_slot[size_t(j) * K + k_here] = run + before;
    run += total;
    __syncthreads();  // tmp is reused
  }
  if (threadIdx.x == 0) rows.expert_counts[e] = run;
}

// Every row's slots -1 (the place kernel then fills those of local experts).
__global__ void __launch_bounds__(kThreads) coll_expert_clear_kernel(const CollShape S, CollRows rows) {
  const int M = *rows.recv_count, K = S.topk;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size_t(M) * K;
       i += size_t(gridDim.x) * blockDim.x)
    rows.row_slot[i] = -1;
}

// One warp per row j: the row, its scales and metadata at each of its local experts' places.
__global__ void __launch_bounds__(kThreads) coll_expert_rows_kernel(const CollShape S, CollRows rows) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int warps = gridDim.x * (blockDim.x / kWarpSize);
  const int M = *rows.recv_count, K = S.topk, cap = S.world * S.max_tokens;
  const int e0 = S.rank * S.num_local;
  for (int j = warp; j < M; j += warps) {
    for (int k = 0; k < K; ++k) {
      const int slot = rows.row_slot[size_t(j) * K + k];
      if (slot < 0) continue;
      const int e = rows.recv_topk_ids[size_t(j) * K + k] - e0;
      const size_t erow = size_t(e) * cap + slot;
      const int4* src = reinterpret_cast<const int4*>(rows.recv_x + size_t(j) * S.wire_row_bytes);
      int4* dst = reinterpret_cast<int4*>(rows.expert_x + erow * S.wire_row_bytes);
      for (int v = lane; v < S.wire_row_bytes / 16; v += kWarpSize) dst[v] = src[v];
      float* esc = rows.expert_scales + size_t(e) * cap * S.groups;
      for (int g = lane; g < S.groups; g += kWarpSize) {
        const size_t from = S.scale_col_major ? size_t(g) * cap + j : size_t(j) * S.groups + g;
        const size_t to = S.scale_col_major ? size_t(g) * cap + slot : size_t(slot) * S.groups + g;
        esc[to] = rows.recv_scales[from];
      }
      if (lane == 0) {
        rows.expert_src_rank[erow] = rows.recv_src_rank[j];
        rows.expert_src_idx[erow] = rows.recv_src_idx[j];
        rows.expert_topk_slot[erow] = k;
        rows.expert_weight[erow] = rows.recv_topk_w[size_t(j) * K + k];
      }
    }
  }
}

// One warp per row j: fmaf in slot order of its weights and its local experts' outputs, f32,
// into its source's block.
__global__ void __launch_bounds__(kThreads)
    coll_scatter_experts_kernel(const CollShape S, const __nv_bfloat16* __restrict__ out,
                                CollRows rows, float* __restrict__ blocks) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int warps = gridDim.x * (blockDim.x / kWarpSize);
  const int M = *rows.recv_count, K = S.topk, cap = S.world * S.max_tokens, H = S.hidden;
  const int e0 = S.rank * S.num_local;
  for (int j = warp; j < M; j += warps) {
    const int q = rows.recv_src_rank[j], n = rows.recv_src_idx[j];
    float* dst = blocks + (size_t(q) * S.max_tokens + n) * H;
    for (int v = lane; v < H / 8; v += kWarpSize) {
      float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k = 0; k < K; ++k) {
        const int slot = rows.row_slot[size_t(j) * K + k];
        if (slot < 0) continue;
        const int e = rows.recv_topk_ids[size_t(j) * K + k] - e0;
        const float w = rows.recv_topk_w[size_t(j) * K + k];
        float o[8];
        dev::load_bf16x8(out + (size_t(e) * cap + slot) * H + size_t(v) * 8, o);
#pragma unroll
        for (int i = 0; i < 8; ++i) p[i] = __fmaf_rn(w, o[i], p[i]);
      }
      float4* d = reinterpret_cast<float4*>(dst + size_t(v) * 8);
      d[0] = make_float4(p[0], p[1], p[2], p[3]);
      d[1] = make_float4(p[4], p[5], p[6], p[7]);
    }
  }
}

// One warp per received row: its partial (and its top-k weights, with topk_w) to its source's
// block.
__global__ void __launch_bounds__(kThreads)
    coll_scatter_kernel(const CollShape S, const int4* __restrict__ partials, CollRows rows,
                        int4* __restrict__ blocks, const float* __restrict__ topk_w,
                        float* __restrict__ blocks_w) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int warps = gridDim.x * (blockDim.x / kWarpSize);
  const int M = *rows.recv_count, vecs = S.hidden / 8;
  for (int j = warp; j < M; j += warps) {
    const int q = rows.recv_src_rank[j], n = rows.recv_src_idx[j];
    int4* dst = blocks + (size_t(q) * S.max_tokens + n) * vecs;
    const int4* src = partials + size_t(j) * vecs;
    for (int v = lane; v < vecs; v += kWarpSize) dst[v] = __ldg(src + v);
    if (topk_w != nullptr && lane < S.topk)
      blocks_w[(size_t(q) * S.max_tokens + n) * S.topk + lane] =
          topk_w[size_t(j) * S.topk + lane];
  }
}

// Whether slot k of a packed token is its rank's highest slot (no later slot on that rank).
__device__ __forceinline__ bool highest_slot_of_rank(const CollShape& S, const Slot& s, int k) {
  const int32_t id = s.ids()[k];
  if (id < 0) return false;
  for (int j = k + 1; j < S.topk; ++j) {
    const int32_t later = s.ids()[j];
    if (later >= 0 && later / S.num_local == id / S.num_local) return false;
  }
  return true;
}

// One thread per 8 values of a token: the bias rows, then the rows of the ranks that got it in
// rank order (or each at its highest top-k slot), f32, rounded once; the thread of the first 8
// values also sums the ranks' weights per slot, in the same order.
__global__ void __launch_bounds__(kThreads)
    combine_fold_kernel(const CollShape S, int N, const uint8_t* __restrict__ own_pack,
                        const void* __restrict__ from, size_t stride_rows, bool f32,
                        const CollBack back, const CollExtras ex, __nv_bfloat16* __restrict__ y) {
  const int vecs = S.hidden / 8, K = S.topk;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size_t(N) * vecs;
       i += size_t(gridDim.x) * blockDim.x) {
    const int n = int(i / vecs), v = int(i % vecs);
    const bool weights = ex.y_w != nullptr && v == 0;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float w[kMaxTopk];
    for (int k = 0; weights && k < K; ++k) w[k] = 0.f;
    for (const void* bias : {ex.bias0, ex.bias1}) {
      if (bias == nullptr) continue;
      float f[8];
      dev::load_bf16x8(static_cast<const __nv_bfloat16*>(bias) + size_t(n) * S.hidden +
                           size_t(v) * 8,
                       f);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += f[e];
    }
    const Slot own = slot_of(S, const_cast<uint8_t*>(own_pack), n);
    auto add = [&](int r) {
      const size_t row = back.pos != nullptr
                             ? size_t(back.offsets[r] + back.pos[size_t(r) * S.max_tokens + n])
                             : size_t(r) * stride_rows + n;
      const size_t at = row * S.hidden + size_t(v) * 8;
      float f[8];
      if (f32) {
        const float4* p4 = reinterpret_cast<const float4*>(static_cast<const float*>(from) + at);
        const float4 a = p4[0], b = p4[1];
        f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z,
        f[7] = b.w;
      } else {
        dev::load_bf16x8(static_cast<const __nv_bfloat16*>(from) + at, f);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += f[e];
      for (int k = 0; weights && k < K; ++k) w[k] += ex.recv_w[row * K + k];
    };
    if (*own.valid() != 0) {
      if (ex.highest_slot) {
        for (int k = 0; k < K; ++k)
          if (highest_slot_of_rank(S, own, k)) add(own.ids()[k] / S.num_local);
      } else {
        const uint64_t all = S.world == 64 ? ~uint64_t(0) : (uint64_t(1) << S.world) - 1;
        for (uint64_t m = S.routed ? token_ranks(S, own) : all; m != 0; m &= m - 1)
          add(__ffsll(static_cast<long long>(m)) - 1);
      }
    }
    dev::store_bf16x8(y + size_t(n) * S.hidden + size_t(v) * 8, acc);
    for (int k = 0; weights && k < K; ++k) ex.y_w[size_t(n) * K + k] = w[k];
  }
}

}  // namespace

void load_coll_kernels() {
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, coll_pack_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, coll_place_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, coll_back_place_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, coll_offsets_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_rows_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, coll_exact_send_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, coll_exact_counts_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, coll_exact_relay_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, dispatch_exact_rows_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, coll_scatter_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, combine_fold_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, coll_expert_clear_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, coll_expert_place_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, coll_expert_rows_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, coll_scatter_experts_kernel));
}

void launch_coll_pack(const CollShape& S, int num_tokens, const void* x, const float* x_scales,
                      const void* ids, const float* weights, const uint8_t* rank_mask,
                      const int32_t* expert_counts, uint8_t* pack, CollStatus st,
                      cudaStream_t stream) {
  coll_pack_kernel<<<kBlocks, kThreads, 0, stream>>>(S, num_tokens, x, x_scales, ids, weights,
                                                     rank_mask, expert_counts, pack, st);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_coll_unpack(const CollShape& S, const uint8_t* gathered, size_t pack_bytes,
                        const CollRows& rows, cudaStream_t stream) {
  coll_place_kernel<<<S.world, kThreads, 0, stream>>>(S, gathered, pack_bytes, rows);
  coll_offsets_kernel<<<1, kThreads, 0, stream>>>(S, gathered, pack_bytes, rows);
  dispatch_rows_kernel<<<kBlocks, kThreads, 0, stream>>>(S, gathered, pack_bytes, rows);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_coll_exact_send(const CollShape& S, const uint8_t* own_pack, const CollBack& back,
                            uint8_t* send, uint8_t* meta, cudaStream_t stream) {
  coll_exact_send_kernel<<<kBlocks, kThreads, 0, stream>>>(S, own_pack, back, send, meta);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_coll_exact_counts(const CollShape& S, const uint8_t* metas, size_t meta_bytes,
                              const CollRows& rows, const CollRelay& relay, cudaStream_t stream) {
  coll_exact_counts_kernel<<<1, kThreads, 0, stream>>>(S, metas, meta_bytes, rows, relay);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_coll_exact_relay(const CollShape& S, const uint8_t* relayed, const CollRelay& relay,
                             uint8_t* send, cudaStream_t stream) {
  coll_exact_relay_kernel<<<kBlocks, kThreads, 0, stream>>>(S, relayed, relay, send);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_coll_exact_unpack(const CollShape& S, const uint8_t* slots, const CollRows& rows,
                              cudaStream_t stream) {
  dispatch_exact_rows_kernel<<<kBlocks, kThreads, 0, stream>>>(S, slots, rows);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_coll_expert_rows(const CollShape& S, const CollRows& rows, cudaStream_t stream) {
  coll_expert_clear_kernel<<<kBlocks, kThreads, 0, stream>>>(S, rows);
  coll_expert_place_kernel<<<S.num_local, kThreads, 0, stream>>>(S, rows);
  coll_expert_rows_kernel<<<kBlocks, kThreads, 0, stream>>>(S, rows);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_coll_scatter_experts(const CollShape& S, const void* expert_out, const CollRows& rows,
                                 void* blocks, cudaStream_t stream) {
  coll_scatter_experts_kernel<<<kBlocks, kThreads, 0, stream>>>(
      S, static_cast<const __nv_bfloat16*>(expert_out), rows, static_cast<float*>(blocks));
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_coll_scatter(const CollShape& S, const void* partials, const CollRows& rows,
                         void* blocks, const float* topk_w, float* blocks_w,
                         cudaStream_t stream) {
  coll_scatter_kernel<<<kBlocks, kThreads, 0, stream>>>(S, static_cast<const int4*>(partials),
                                                        rows, static_cast<int4*>(blocks), topk_w,
                                                        blocks_w);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_coll_back_place(const CollShape& S, const uint8_t* own_pack, const CollBack& back,
                            cudaStream_t stream) {
  coll_back_place_kernel<<<1, kThreads, 0, stream>>>(S, own_pack, back);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_coll_fold(const CollShape& S, int num_tokens, const uint8_t* own_pack,
                      const void* from, size_t stride_rows, bool f32, const CollBack& back,
                      const CollExtras& ex, void* y, cudaStream_t stream) {
  if (num_tokens == 0) return;
  combine_fold_kernel<<<kBlocks, kThreads, 0, stream>>>(S, num_tokens, own_pack, from, stride_rows,
                                                        f32, back, ex,
                                                        static_cast<__nv_bfloat16*>(y));
  EPX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epx::coll
