#include "backends/common/phase_clock.hpp"

#if EPX_MEASUREMENT
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

#include "core/env.hpp"
#include "epx/cuda_check.hpp"

namespace epx {

PhaseClock* make_phase_clock(int device) {
  const std::string clock = env::phase_clock_text();
  if (clock.empty() || clock == "0") return nullptr;
  PhaseClock* p = nullptr;
  EPX_CUDA_CHECK(cudaSetDevice(device));
  EPX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), sizeof(PhaseClock)));
  EPX_CUDA_CHECK(cudaMemset(p, 0, sizeof(PhaseClock)));
  return p;
}

bool read_phase_clock(const PhaseClock* clock, int device, PhaseClock* out) noexcept {
  return cudaSetDevice(device) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess &&
         cudaMemcpy(out, clock, sizeof(*out), cudaMemcpyDeviceToHost) == cudaSuccess;
}

std::string phase_entries(const PhaseClock& h, int op, std::span<const char* const> names) {
  std::string line;
  for (size_t ph = 0; ph < names.size(); ++ph) {
    if (h.count[op][ph] == 0) continue;
    line += fmt::format(" {} {:.2f} ({} blocks)", names[ph],
                        1e-3 * double(h.sum[op][ph]) / double(h.count[op][ph]), h.count[op][ph]);
  }
  return line;
}

std::string start_entries(const PhaseClock& h, int op) {
  unsigned long long first = ~0ull, last = 0, n = 0;
  for (const unsigned long long t : h.block_start[op]) {
    if (t == 0) continue;
    first = std::min(first, t);
    last = std::max(last, t);
    ++n;
  }
  if (n == 0) return {};
  double after_first = 0;  // summed as offsets: a sum of raw globaltimer values overflows
  for (const unsigned long long t : h.block_start[op])
    if (t != 0) after_first += double(t - first);
  return fmt::format(" started: span {:.2f}, mean {:.2f} after the first ({} blocks)",
                     1e-3 * double(last - first), 1e-3 * after_first / double(n), n);
}

void print_phase_line(int rank, const char* what, const std::string& entries) noexcept {
  if (entries.empty()) return;
  std::fprintf(stderr, "phase clock rank %d %s, us from a block's start:%s\n", rank, what,
               entries.c_str());
}

}  // namespace epx
#endif
