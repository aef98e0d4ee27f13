#include "report.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "epx/error.hpp"

#if EPX_HAVE_CUDA
#include "epx/cuda_check.hpp"
#endif

// Defined in the build tree (cmake/git_commit.cmake), refreshed at every build.
const char* epx_git_commit();

namespace epx::cli {

const char* git_commit() {
  return epx_git_commit();
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

std::string utc_timestamp() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

void progress(const std::string& line) {
  std::fputs(line.c_str(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string load_modules_eagerly(const std::string& set_by, const std::string& risk) {
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  if (loading == nullptr) {
    ::setenv("CUDA_MODULE_LOADING", "EAGER", 0);
    return fmt::format("CUDA_MODULE_LOADING=EAGER (set by {})", set_by);
  }
  std::string note = fmt::format("CUDA_MODULE_LOADING={} (from the environment)", loading);
  if (std::string(loading) != "EAGER") note += "; WARNING: not EAGER, " + risk;
  return note;
}

std::string mib(size_t bytes) {
  return fmt::format("{:.1f} MiB", double(bytes) / (1 << 20));
}

std::string one_line(std::string s, size_t max) {
  for (char& c : s)
    if (c == '\n') c = ' ';
  if (s.size() > max) s = s.substr(0, max - 3) + "...";
  return s;
}

nlohmann::json machine_json(const GpuInfo& gpu) {
  return {{"hostname", host_name()},
          {"gpu_name", gpu.name},
          {"sm_count", gpu.sm_count},
          {"gpu_count", gpu.gpu_count},
          {"cuda_runtime", gpu.runtime_version},
          {"cuda_driver", gpu.driver_version}};
}

#if EPX_HAVE_CUDA
GpuInfo gpu_info(int device) {
  GpuInfo g;
  cudaDeviceProp prop{};
  EPX_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  g.name = prop.name;
  g.sm_count = prop.multiProcessorCount;
  EPX_CUDA_CHECK(cudaGetDeviceCount(&g.gpu_count));
  EPX_CUDA_CHECK(cudaRuntimeGetVersion(&g.runtime_version));
  EPX_CUDA_CHECK(cudaDriverGetVersion(&g.driver_version));
  return g;
}

#endif

}  // namespace epx::cli
