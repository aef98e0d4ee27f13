#pragma once
// The collective engine's kernels (src/backends/collective): every backend's token-major contract
// over NCCL's host collectives, for worlds that span several nodes.
//
// Dispatch: each rank packs its tokens into fixed-size slots (one per possible token) behind a
// header holding its token count, NCCL all-gathers the packs, and every rank lays tokens of every
// rank out as token-major rows ordered by (source rank, source index): every valid token for the
// baselines (naive, allgather_reducescatter), only those routed to it for the routed backends
// (low_latency, high_throughput: a token goes to each rank holding one of its experts, once).
// Combine: each rank scatters its rows' partials into one block of max_tokens rows per source
// rank; naive all-gathers every block to every rank, the others send each block to its rank
// (grouped send/recv); the token's rank adds the rows of the ranks that got the token in rank
// order in f32 and rounds once.
// Expert-major (low_latency): the token-major rows are also laid out per local expert, in their
// order; combine's block rows are then f32: each rank's sum over its slots of the token, fmaf in
// slot order with the token's weights, which the token's rank adds in rank order.
// Fixed sizes everywhere: no host synchronisation, every step capturable in a CUDA graph; except
// high_throughput without worst-case output, which reads its counts on the host once per
// dispatch and moves exact sizes, each token once per node it goes to: each rank's meta (the
// slots it sends each rank and each node) all-gathered; then the slots by grouped send/recv,
// straight to the ranks of its own node and once per other node to its rail peer there (the
// rank of the same local index); that peer relays each to the ranks of its node it goes to.
// Combine sends each rank's rows back to their token's rank in exact sizes.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/device_status.hpp"
#include "epx/config.hpp"

namespace epx::coll {

struct CollShape {
  int32_t world;
  int32_t rank;
  int32_t hidden;
  int32_t num_experts;
  int32_t num_local;
  int32_t topk;
  int32_t max_tokens;      // T: slots per pack, rows per partials block
  int32_t groups;          // fp8 scale blocks per row (0: bf16 wire)
  int32_t wire_row_bytes;
  int32_t dtype;           // DispatchDtype
  int32_t scale_col_major;
  int32_t ids_int64;
  int32_t round_scale;
  int32_t slot_bytes;      // one packed token, 16-byte multiple
  int32_t counts_offset;   // the expert counts' place in a pack
  int32_t routed;          // 1: rows only where the token has an expert (low_latency,
                           // high_throughput); 0: every valid token everywhere (the baselines)
  int32_t local;           // ranks per node (rank = node * local + local index)
  uint64_t timeout_ns;
};

// A pack: kPackHeader bytes (int32 token count, int32 1 when the round routes by a rank mask),
// then T slots of [wire row | u64 ranks | f32 scales | int32 ids | f32 weights | int32 valid |
// int32 index | int32 source | int32 place | int32 places[P]], each slot_bytes long (ranks: bit
// r set when the token goes to rank r, from its ids or from the mask; index: the token's;
// source: its rank; place and places: filled in the exact dispatch, see below), then the
// sender's int32 expert counts [E] (routing by a rank mask: the caller's).
inline constexpr size_t kPackHeader = 16;
// `places` (P): the exact dispatch's (one per rank of a node), else 0.
constexpr size_t slot_bytes(const EpConfig& cfg, int places) {
  const size_t g = cfg.dtype == DispatchDtype::kBF16 ? 0 : size_t(cfg.hidden / kFp8BlockSize);
  const size_t row = cfg.dtype == DispatchDtype::kBF16 ? size_t(cfg.hidden) * 2 : size_t(cfg.hidden);
  return (row + 8 + g * 4 + size_t(cfg.topk) * 8 + 16 + size_t(places) * 4 + 15) / 16 * 16;
}
constexpr size_t pack_counts_offset(const EpConfig& cfg, int places) {
  return kPackHeader + size_t(cfg.max_tokens_per_rank) * slot_bytes(cfg, places);
}
constexpr size_t pack_bytes(const EpConfig& cfg, int places) {
  return pack_counts_offset(cfg, places) + (size_t(cfg.num_experts) * 4 + 15) / 16 * 16;
}
// The exact dispatch (high_throughput without worst-case output). A rank's meta, all-gathered
// before its slots move: int32 [4] (token count, routing by a rank mask), [W] the slots it sends
// each rank, [W] those it sends each node (the first `nodes` used), [E] its expert counts (by a
// rank mask).
constexpr size_t meta_bytes(const EpConfig& cfg) {
  return (size_t(4 + 2 * cfg.world_size + cfg.num_experts) * 4 + 15) / 16 * 16;
}
// Where a meta's parts start, in int32s.
inline constexpr int kMetaSendsAt = 4;
constexpr int meta_node_sends_at(int world) { return kMetaSendsAt + world; }
constexpr int meta_experts_at(int world) { return kMetaSendsAt + 2 * world; }
// Its slots move in two steps. Step A: a slot's copy to each rank of its node it goes to, at
// its place there (`place` set), and one copy per other node it goes to, to the rail peer there
// (`places` set: its place at each rank of that node, or -1), each peer's slots in token order
// (one send area, peers in rank order). Step B: each rail peer relays the slots it got (from the
// rail peers of the other nodes, in node order) to each rank of its node they go to, `place`
// set from `places`; a rank's relayed rows of one source in that source's token order.
// The slots received in both steps land in one area; each names its row by source and place.

// Where the dispatch's outputs and its bookkeeping live (device pointers).
struct CollRows {
  uint8_t* recv_x;          // [cap][wire_row_bytes]
  float* recv_scales;       // [cap][G] or [G][cap]
  int32_t* recv_src_rank;   // [cap]
  int32_t* recv_src_idx;    // [cap]
  int32_t* recv_topk_ids;   // [cap][K]
  float* recv_topk_w;       // [cap][K]
  int32_t* expert_counts;   // [E/W]
  int32_t* recv_count;      // [1]
  int32_t* pos;             // [W][T]: row of (source q, token n) among q's valid tokens, or -1
  int32_t* counts;          // [W]: valid tokens of each source
  int32_t* offsets;         // [W]: first row of each source
  // expert-major only (null otherwise)
  int32_t* row_slot;          // [cap][K]: row j's slot k in its local expert's list, or -1
  uint8_t* expert_x;          // [E/W][cap][wire_row_bytes]
  float* expert_scales;       // [E/W][cap][G] or [E/W][G][cap]
  int32_t* expert_src_rank;   // [E/W][cap]
  int32_t* expert_src_idx;    // [E/W][cap]
  int32_t* expert_topk_slot;  // [E/W][cap]
  float* expert_weight;       // [E/W][cap]
};

// The exact dispatch's and combine's bookkeeping at a token's rank (high_throughput without
// worst-case output): for each rank q, the place of each of this rank's tokens among those q receives (q
// sends their rows back in that order), their count, and where q's rows start in the receive
// area. pos null: the fixed blocks ([W][T][H], a token's row at its index).
struct CollBack {
  int32_t* pos;      // [W][T], or -1
  int32_t* counts;   // [W]
  int32_t* offsets;  // [W]
  // the exact dispatch's step A: each token's place among those sent to each other node's rail
  // peer (-1: none there, or this node), their count, and each rank's first slot in the send area
  int32_t* node_pos = nullptr;     // [nodes][T]
  int32_t* node_counts = nullptr;  // [nodes]
  int32_t* send_offsets = nullptr; // [W]
};

// The exact dispatch's step B at a rail peer, from the metas: where the slots of each other
// node's rail peer start among those it got in step A, and where it puts them for each rank of
// its node (that rank's first slot in the relay's send area, plus the slots of earlier sources).
struct CollRelay {
  int32_t* chunk_start;  // [nodes + 1]
  int32_t* base;         // [nodes][local]
  int32_t* rank_start;   // [local]
};

// Combine's extras at a token's rank (high_throughput): bias rows that start the
// sum, the top-k weights each rank sent back with its rows (summed per slot in the partials'
// order), and that order.
struct CollExtras {
  const void* bias0 = nullptr;    // [N][H] bf16, or null
  const void* bias1 = nullptr;    // [N][H] bf16, or null
  const float* recv_w = nullptr;  // [rows][K]: each partial row's weights, placed as that row
  float* y_w = nullptr;           // [N][K], or null
  bool highest_slot = false;      // each rank at its highest top-k slot of the token (V2's)
};

struct CollStatus {
  DeviceStatus* status;       // device word
  DeviceStatus* host_status;  // mapped host mirror
};

void load_coll_kernels();
// Packs this rank's N tokens into `pack` (quantised for bf16-to-fp8), checking their ids (a bad
// or repeated id is recorded as an input error and the token is sent nowhere). With `rank_mask`
// ([N][W] bytes; ids and weights null) token n goes to every rank r with a nonzero
// rank_mask[n][r], with ids -1 and weights 0, and `expert_counts` ([E]) travels with the pack.
void launch_coll_pack(const CollShape& S, int num_tokens, const void* x, const float* x_scales,
                      const void* ids, const float* weights, const uint8_t* rank_mask,
                      const int32_t* expert_counts, uint8_t* pack, CollStatus st,
                      cudaStream_t stream);
// The gathered packs [W][pack_bytes] -> the token-major rows (S.routed: those routed here);
// expert_counts: the ids' count of each local expert, plus the counts of the senders that route
// by a rank mask.
void launch_coll_unpack(const CollShape& S, const uint8_t* gathered, size_t pack_bytes,
                        const CollRows& rows, cudaStream_t stream);
// The exact dispatch's step A send side, after launch_coll_pack and launch_coll_back_place:
// `own_pack`'s slots by peer into `send` (see above), and this rank's meta (meta_bytes) at
// `meta`.
void launch_coll_exact_send(const CollShape& S, const uint8_t* own_pack, const CollBack& back,
                            uint8_t* send, uint8_t* meta, cudaStream_t stream);
// From the all-gathered metas [W][meta_bytes]: rows.counts, rows.offsets, *rows.recv_count, the
// rank-mask senders' expert counts and `relay`.
void launch_coll_exact_counts(const CollShape& S, const uint8_t* metas, size_t meta_bytes,
                              const CollRows& rows, const CollRelay& relay, cudaStream_t stream);
// Step B: the `relayed` slots (step A's, from the other nodes' rail peers) copied into `send`,
// each once per rank d of this node it goes to, at relay.rank_start[d] + relay.base[a][d] (a: its
// source's node) + its place there.
void launch_coll_exact_relay(const CollShape& S, const uint8_t* relayed, const CollRelay& relay,
                             uint8_t* send, cudaStream_t stream);
// The slots received in exact sizes (`slots`: *rows.recv_count of them, in any order; each at row
// rows.offsets[source] + place) -> the token-major rows, the ids' expert counts added.
void launch_coll_exact_unpack(const CollShape& S, const uint8_t* slots, const CollRows& rows,
                              cudaStream_t stream);
// The token-major rows (after launch_coll_unpack) laid out per local expert, in their order:
// rows.row_slot, the expert_* areas and expert_counts.
void launch_coll_expert_rows(const CollShape& S, const CollRows& rows, cudaStream_t stream);
// Row j's partial [H] bf16 -> blocks[src_rank][src_idx] ([W][T][H]), for j < *recv_count; with
// topk_w ([rows][K] f32), its weights -> blocks_w[src_rank][src_idx] ([W][T][K]).
void launch_coll_scatter(const CollShape& S, const void* partials, const CollRows& rows,
                         void* blocks, const float* topk_w, float* blocks_w,
                         cudaStream_t stream);
// Expert-major: row j's f32 partial, the fmaf in slot order of its weights and local experts'
// outputs (expert_out [E/W][cap][H] bf16) -> blocks[src_rank][src_idx] ([W][T][H] f32).
void launch_coll_scatter_experts(const CollShape& S, const void* expert_out, const CollRows& rows,
                                 void* blocks, cudaStream_t stream);
// This rank's pack (after launch_coll_pack) -> `back`: where each of its tokens goes (each rank,
// each other node: places and counts), step A's send offsets, and so what every rank will send
// back to it.
void launch_coll_back_place(const CollShape& S, const uint8_t* own_pack, const CollBack& back,
                            cudaStream_t stream);
// y[n] for n < N: the rows of this rank's tokens from every rank (S.routed: from the ranks holding
// one of its experts), `from` + (r * stride + n) * H bf16 (back.pos set: row back.offsets[r] +
// back.pos[r][n]), summed in rank order in f32 and rounded once; 0 for a token this rank's pack
// marked invalid (sent nowhere). `f32`: the rows are f32 (expert-major), else bf16. `ex`: the
// bias rows first (a token sent nowhere gets them alone), the weights summed alongside, the
// highest-slot order in place of rank order.
void launch_coll_fold(const CollShape& S, int num_tokens, const uint8_t* own_pack,
                      const void* from, size_t stride_rows, bool f32, const CollBack& back,
                      const CollExtras& ex, void* y, cudaStream_t stream);

}  // namespace epx::coll
