#pragma once
// What every report of the epx commands carries: the source version, the machine, the time, and
// progress lines for long runs.

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstddef>
#include <string>

#include "json_file.hpp"

namespace epx::cli {

// Compile-time `git describe --always --dirty` of the source tree ("unknown" without git).
const char* git_commit();
std::string host_name();
std::string utc_timestamp();

// Progress line on stdout, flushed at once (long runs).
void progress(const std::string& line);

// Seconds from t0 to now.
double seconds_since(std::chrono::steady_clock::time_point t0);

// Sets CUDA_MODULE_LOADING=EAGER unless the environment gives a value; call it before any CUDA
// call of the process. Ranks that spin on each other need it: a lazily loaded kernel (cuBLASLt's)
// waits for the spinning ones. Returns the line that says which: "CUDA_MODULE_LOADING=EAGER (set
// by <set_by>)", or "CUDA_MODULE_LOADING=<value> (from the environment)" followed by
// "; WARNING: not EAGER, <risk>" when the value is not EAGER.
std::string load_modules_eagerly(const std::string& set_by, const std::string& risk);

// "12.3 MiB": `bytes` in MiB with one decimal.
std::string mib(size_t bytes);

// `s` on one line (newlines become spaces), cut to `max` characters with "..." at the end.
std::string one_line(std::string s, size_t max = 160);

struct GpuInfo {
  std::string name;
  int sm_count = 0;
  int gpu_count = 0;
  int runtime_version = 0;
  int driver_version = 0;
};
// The "machine" object of the bench and serve-bench JSON.
nlohmann::json machine_json(const GpuInfo& gpu);
#if EPX_HAVE_CUDA
GpuInfo gpu_info(int device);
#endif

}  // namespace epx::cli
