#pragma once
// Collective error agreement for worlds of one process per rank (IpcWorld, NcclWorld): each
// rank runs a local step, then all ranks all-gather its outcome, so that a failure on one rank
// is an error on every rank instead of a hang.

#include <exception>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "epx/bootstrap.hpp"
#include "epx/error.hpp"

namespace epx::transport {

// The outcome of one rank's local step.
struct Step {
  std::exception_ptr error;
  std::string message;
};

template <typename Fn>
Step attempt(Fn&& fn) {
  try {
    fn();
    return {};
  } catch (const std::exception& e) {
    return {std::current_exception(), e.what()};
  }
}

// Collective: all-gathers each rank's status with `payload`. When any rank's step failed, every
// rank throws: the failing rank its own error, the others PeerError naming the first failing
// rank and its message. Returns every rank's payload.
inline std::vector<std::string> gather_checked(Bootstrap& b, const char* what, const Step& mine,
                                               const std::string& payload) {
  std::vector<std::string> all = b.all_gather(mine.error ? "E" + mine.message : "K" + payload);
  if (mine.error) std::rethrow_exception(mine.error);
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty() || all[r][0] != 'K') {
      EPX_THROW(PeerError,
                fmt::format("rank {} of {}: {} failed on rank {}: {}", b.rank(), b.size(), what, r,
                            all[r].empty() ? "(no report)" : all[r].substr(1)));
    }
    all[r].erase(0, 1);
  }
  return all;
}

// This process's GPU for a world of one process per rank: `device`, or the calling thread's
// current one when device < 0; made current. Returns its multiprocessor count in *num_sms.
// UnsupportedError without a GPU (naming `what`), InputError for a device outside the visible.
int select_world_device(int device, const char* what, int* num_sms);

// The rank and size a process world takes from its bootstrap: InputError for a null bootstrap or
// a size outside [1, kMaxRanks].
void bootstrap_rank_size(const Bootstrap* bootstrap, int* rank, int* size);

}  // namespace epx::transport
