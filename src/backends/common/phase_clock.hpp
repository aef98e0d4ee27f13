#pragma once
// The phase clock of a measurement build (CMake EPX_MEASUREMENT_BUILD; a release build has none
// of it), shared by every engine. With EPX_PHASE_CLOCK=1 each block's thread 0 adds, at the end
// of each phase of a kernel, the time since the block started (globaltimer, ns) into these sums,
// so that the host can split an op's time into its phases (the mean over blocks and launches of
// when each phase ended). The device side is phase_clock.cuh; each engine names its ops and
// phases (peer: kernels.hpp, high_throughput: ht_kernels.hpp).

#include <cstdint>

#include "epx/config.hpp"

#if EPX_MEASUREMENT
#include <span>
#include <string>

namespace epx {

inline constexpr int kMaxPhaseOps = 3;      // ops (or kernels) one clock times
inline constexpr int kMaxPhases = 8;        // phases of one op
inline constexpr int kMaxClockBlocks = 1024;  // blocks of one launch whose start is kept

struct PhaseClock {
  unsigned long long sum[kMaxPhaseOps][kMaxPhases];    // [op][phase] ns
  unsigned long long count[kMaxPhaseOps][kMaxPhases];  // blocks that reached the phase
  // An op of several kernels: when block 0 of rank r's first kernel started (globaltimer ns), so
  // that the next kernel's block 0 can add the gap between the two starts.
  unsigned long long first_start[kMaxRanks];
  // [op][block]: when each block of the op's latest launch started (globaltimer ns), so that the
  // host can tell how far apart a launch's blocks began.
  unsigned long long block_start[kMaxPhaseOps][kMaxClockBlocks];
};

// EPX_PHASE_CLOCK set and not "0": a zeroed clock in the memory of `device` (cudaFree it), else
// nullptr.
PhaseClock* make_phase_clock(int device);
// The sums of `clock` once every kernel of `device` has finished; false where they cannot be read.
bool read_phase_clock(const PhaseClock* clock, int device, PhaseClock* out) noexcept;
// " NAME MEAN (N blocks)" for each phase of `op` that a block reached, in phase order, MEAN in us
// from the block's start; names[i] names phase i. Empty when no block reached any.
std::string phase_entries(const PhaseClock& h, int op, std::span<const char* const> names);
// "phase clock rank RANK WHAT, us from a block's start:ENTRIES" on stderr; nothing for no entries.
void print_phase_line(int rank, const char* what, const std::string& entries) noexcept;
// " started: span S us, mean M us after the first (N blocks)": how far apart the blocks of op's
// latest launch began. Empty when none was recorded.
std::string start_entries(const PhaseClock& h, int op);

}  // namespace epx
#endif
