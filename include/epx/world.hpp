#pragma once
// Worlds: how ranks reach each other (DESIGN §3). A world only produces peer tables and
// placement facts; the kernels are the same in every world.

#include <vector>

namespace epx {

// N ranks in one process, on 1..N GPUs. Rank r runs on devices[r % devices.size()]. Ranks that
// share a GPU run their kernels concurrently on their own streams, which only works while all of
// their blocks are resident together, so each rank may launch at most sm_budget(r) blocks per
// kernel (the GPU's multiprocessors divided by the ranks placed on it).
//
// Throws UnsupportedError when no GPU is visible, InputError for a bad rank count or device.
class InProcessWorld {
 public:
  explicit InProcessWorld(int num_ranks, std::vector<int> devices = {});

  int size() const { return num_ranks_; }
  int device_of(int rank) const;
  int ranks_on_device(int device) const;
  int num_sms(int rank) const;     // multiprocessors of the rank's GPU
  int sm_budget(int rank) const;   // blocks one kernel of this rank may use

 private:
  int num_ranks_;
  std::vector<int> devices_;
  std::vector<int> sms_;  // per entry of devices_
};

}  // namespace epx
