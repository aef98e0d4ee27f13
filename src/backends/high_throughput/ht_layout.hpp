#pragma once
// The high_throughput backend's memory, derived from EpConfig and the launch shapes by
// make_ht_layout() alone (STYLE §4).
//
// Rows flow through rings: ring (q -> r, c) carries the rows that rank q's channel c sends to
// rank r, `ring_rows` slots in r's symmetric memory. Positions in a ring count rows since the
// object was created (never reset): the writer publishes how far it has written (tail, in the
// reader's memory), the reader how far it has read (head, in the writer's memory). The counts of
// a round travel first, so that every receiver knows where each (source, channel) segment of its
// rows begins: rows are ordered by (source rank, source index) on every call. In direct mode
// (an in-process group) there are no rings: each rank publishes where its receive area and its
// partials are, and the peers write and read them in place.

#include <cstddef>
#include <cstdint>

#include "epx/config.hpp"

namespace epx::ht {

inline constexpr int kMaxChannels = 64;

// Cross-call state of one rank, advanced by the kernels (DESIGN §5.1).
struct HtState {
  uint32_t epoch;          // the last dispatch whose counts are complete (1 = the first)
  int32_t num_tokens;      // its N
  int32_t recv_count;      // its M
  uint32_t combine_epoch;  // direct mode: the last combine (1 = the first)
};

// What a rank publishes for its peers in the direct mode (ranks in one address space): where its
// receive area of the round is, and where its partials are. Each pointer is written before its
// epoch word, which is released (DESIGN §5.3).
struct HtPublished {
  uint64_t area_epoch;  // the dispatch whose receive area `area` is
  uint64_t area;        // uint8_t*: the received rows' areas (rows_layout of area_rows)
  int64_t area_rows;
  uint64_t partials_epoch;  // the round whose combine reads `partials`
  uint64_t partials;        // const bf16*: [M][H], row j = received row j
  uint64_t weights;         // const f32*: [M][K] top-k weights that combine sums, or 0
};

struct HtLayout {
  int channels = 0;  // C: token ranges of a rank that move independently
  // Token ranges of a rank counted and laid out apart, one per count block: the C channels, or
  // in direct mode the 2C half channels that the transfer and combine blocks walk (so that the
  // count kernel has as many blocks as they do).
  int segments = 0;
  // Direct mode (in-process worlds: every rank's memory is addressable by every kernel): rows and
  // partials go straight to and from the receive areas at the offsets of the count exchange, no
  // rings (their sizes are 0).
  bool direct = false;
  int dispatch_ring = 0;     // rows per dispatch ring
  int combine_ring = 0;      // rows per combine ring
  size_t dispatch_slot = 0;  // bytes of one dispatch ring row: payload, scales, ids, weights, index
  // symmetric part
  size_t counts;  // uint64 [2][W][segments]: (epoch << 32 | rows) that q's segment c sends here
  size_t expert_rows;  // int32 [2][E/W]: (token, local expert) pairs of the round, by parity
  size_t dtail;        // uint64 [C][W]: rows sender q has written into ring (q -> this rank, c)
  size_t dhead;        // uint64 [C][W]: rows receiver r has read from ring (this rank -> r, c)
  size_t ctail;        // uint64 [C][W]: combine: rows rank q has written into (q -> this, c)
  size_t chead;        // uint64 [C][W]: combine: rows owner r has read from (this -> r, c)
  size_t dring;        // [C][W][dispatch_ring][dispatch_slot]: ring (q -> this, c) at [c][q]
  size_t cring;        // bf16 [C][W][combine_ring][H]: ring (q -> this, c) at [c][q]
  size_t cwring;       // f32 [C][W][combine_ring][K]: the top-k weights beside cring's rows
  size_t published;    // direct: HtPublished
  size_t arrived;      // direct: uint64 [W]: the last dispatch whose rows from rank q are written
  size_t read_done;    // direct: uint64 [W]: the last combine in which owner q read its partials
  size_t symmetric_end;
  // local part
  size_t state;          // HtState
  size_t status;         // DeviceStatus
  size_t token_mask;     // uint64 [max_tokens]: destination ranks of each token of the round
  size_t token_order;    // uint8 [max_tokens][K] (CombineOrder::kHighestSlot, else empty): the
                         // token's destination ranks in the order combine adds their partials
  size_t seg_offset;     // int32 [W][segments]: first received row of segment (q, c)
  size_t seg_count;      // int32 [W][segments]: rows of segment (q, c)
  size_t dsent;          // uint64 [C][W]: rows this rank has written into ring (this -> r, c)
  size_t drecv;          // uint64 [C][W]: rows this rank has read from ring (q -> this, c)
  size_t csent;          // uint64 [C][W]
  size_t crecv;          // uint64 [C][W]
  size_t expert_counts;  // int32 [E/W]
  size_t row_pos;        // direct: int32 [max_tokens][W]: token n's row within its segment at r
  size_t tickets;        // direct: int32 [3]: last-block tickets of dispatch and combine,
                         // the dispatch's next batch of tokens
  size_t total;
};

// Byte offsets of the received rows' areas in a separate local allocation of `rows` rows
// (worst case: world_size * max_tokens_per_rank; else sized per round).
struct HtRowsLayout {
  int rows = 0;
  size_t recv_x;         // [rows][wire_row_bytes]
  size_t recv_scales;    // f32 [rows][G] or [G][rows] (fp8 wires)
  size_t recv_src_rank;  // int32 [rows]
  size_t recv_src_idx;   // int32 [rows]
  size_t recv_topk_ids;  // int32 [rows][K]
  size_t recv_topk_w;    // f32 [rows][K]
  size_t partials;       // bf16 [rows][H]: the combine buffer
  size_t combine_w;      // f32 [rows][K]: direct mode, the top-k weights that combine sums
  size_t total;
};

// `channels`: blocks per rank of each op / 2 (a sending and a receiving block per channel).
// `direct`: no rings (their sizes are ignored), the direct mode's words instead.
HtLayout make_ht_layout(const EpConfig& cfg, int channels, int dispatch_ring, int combine_ring,
                        bool direct = false);
// (The received rows' areas: rows_layout() in ht_kernels.hpp, shared with the kernels.)

}  // namespace epx::ht
