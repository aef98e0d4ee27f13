#pragma once
// Byte layout of one rank's buffer, derived from EpConfig and the algorithm by make_layout() alone.
// The first part is symmetric (peers write counts, rows and flags into it and read partials
// from it); the rest is only touched by the owning rank but lives in the same allocation.

#include <cstddef>
#include <cstdint>

#include "core/sync_device_types.hpp"
#include "epx/config.hpp"

namespace epx::peer {

// What distinguishes the backends built on these kernels: one row per backend in
// src/backends/all2all.cpp.
struct Algorithm {
  Backend backend;
  bool every_rank;  // dispatch: every valid token to every rank (all-gather), not only routed
  bool all_reduce;  // combine: all-reduce of all rows, then this rank's slice (naive)
};

// Device-resident cross-call state of one rank (DESIGN §5.1: epochs advance on the device).
struct State {
  unsigned long long masked;   // bit r: rank r masked (EpConfig::mask_failed_ranks)
  unsigned long long dropped;  // (token, expert) pairs dropped for masked ranks
  uint32_t send_epoch;      // the round of the last dispatch send (a receive half serves it)
  int32_t send_tokens;      // N of that send
  GridBarrierWord barrier;
  int32_t dispatch_ticket;
  int32_t combine_ready_ticket;
  int32_t combine_reduced_ticket;
};

// What a completed dispatch leaves for its combine, one per buffer slot (rounds in flight).
struct RoundState {
  uint32_t epoch;      // the round (1 = the first dispatch) whose rows this slot holds
  int32_t num_tokens;  // its N (combine's output rows)
  int32_t recv_count;  // its M
};

// Areas marked "per slot" exist once per round in flight (EpConfig::rounds_in_flight): slot k's
// copy lies k * sym_slot_bytes (symmetric) or k * local_slot_bytes (local) after slot 0's. The
// host picks the slot of each call from the call sequence, the same on every rank
// (for_slot() gives the layout a launch uses); the synchronisation words are shared by all slots.
struct Layout {
  // symmetric part
  // Double-buffered by epoch parity: a sender may be one round ahead of its receiver.
  size_t sent;           // uint64 [2][W]: epoch whose rows sender q has finished writing here
  size_t next_row;       // int32 [2]: rows reserved here so far this round (senders' atomics)
  size_t expert_rows;    // int32 [2][E/W]: rows of this round using each local expert
  size_t count_matrix;   // uint64 [2][W][W]: ordered rows only: (epoch << 32 | rows) q sends r
  size_t ready;          // int32 [W]: round whose partials rank q has published
  size_t ready2;         // int32 [W]: all-reduce: round whose reduced chunk q published
  // symmetric, per slot
  size_t recv_x;         // [cap][wire_row_bytes]
  size_t recv_scales;    // f32 [cap][G] or [G][cap] (fp8 wires)
  size_t recv_src_rank;  // int32 [cap]
  size_t recv_src_idx;   // int32 [cap]
  size_t recv_topk_ids;  // int32 [cap][K]
  size_t recv_topk_w;    // f32 [cap][K]
  size_t partials;       // [cap][H] bf16 (token-major) or f32 (expert-major, folded)
  size_t pushed;         // push combine: [W][max_tokens][H] as partials: rank q's partial of
                         // this rank's token n at [q][n] (0 bytes for pull); LogFMT: encoded
                         // rows of logfmt::row_stride(H) bytes instead
  size_t encoded;        // LogFMT pull: [cap][logfmt::row_stride(H)] bytes, the partials as they
                         // cross (0 bytes otherwise)
  size_t reduced;        // all-reduce: bf16 [cap][H], rows of this rank's reduce-scatter chunk
  size_t sym_slot_bytes;
  size_t symmetric_end;
  // local part
  size_t state;            // State
  size_t status;           // DeviceStatus
  size_t block_counts;     // int32 [kMaxBlocks][W] rows per (block, destination)
  size_t block_expert_counts;  // expert-major: int32 [kMaxBlocks][E/W]
  // local, per slot
  size_t round;            // RoundState
  size_t send_slot;        // int32 [max_tokens][W] row of token n in rank r's recv area, or -1
  size_t expert_counts;    // int32 [E/W]
  // expert-major only (0 bytes otherwise)
  size_t row_expert_slot;      // int32 [cap][K] row of (recv row, k) in its expert, or -1
  size_t expert_x;             // [E/W][cap][wire_row_bytes]
  size_t expert_scales;        // f32 [E/W][cap][G] or [E/W][G][cap]
  size_t expert_src_rank;      // int32 [E/W][cap]
  size_t expert_src_idx;       // int32 [E/W][cap]
  size_t expert_topk_slot;     // int32 [E/W][cap]
  size_t expert_weight;        // f32 [E/W][cap]
  size_t expert_out;           // bf16 [E/W][cap][H]
  size_t local_slot_bytes;
  size_t total;

  // This layout with the per-slot areas of slot `slot` (0 .. rounds_in_flight - 1).
  Layout for_slot(int slot) const {
    Layout l = *this;
    const size_t s = size_t(slot) * sym_slot_bytes, t = size_t(slot) * local_slot_bytes;
    for (size_t* f : {&l.recv_x, &l.recv_scales, &l.recv_src_rank, &l.recv_src_idx,
                      &l.recv_topk_ids, &l.recv_topk_w, &l.partials, &l.pushed, &l.encoded,
                      &l.reduced})
      *f += s;
    for (size_t* f : {&l.round, &l.send_slot, &l.expert_counts, &l.row_expert_slot, &l.expert_x,
                      &l.expert_scales, &l.expert_src_rank, &l.expert_src_idx,
                      &l.expert_topk_slot, &l.expert_weight, &l.expert_out})
      *f += t;
    return l;
  }
};

// `push`: combine pushes the partials (the `pushed` area exists), see combine_pushes().
Layout make_layout(const EpConfig& cfg, const Algorithm& algo, bool push);

// Whether combine pushes: cfg.combine, with kAuto resolved by where the ranks' memory lives
// (`one_gpu`: every rank's on this rank's GPU, where pulling moves the fewest bytes). Never for
// the naive backend (its combine is an all-reduce) nor with mask_failed_ranks.
bool combine_pushes(const EpConfig& cfg, const Algorithm& algo, bool one_gpu);

}  // namespace epx::peer
