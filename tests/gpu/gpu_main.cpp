// GPU test main: on a machine without a GPU every test reports itself skipped (visibly), and
// the run ends with the plain "N passed, N failed, N skipped" line that CI and the GPU script read.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "epx/cuda_check.hpp"

namespace {
class SummaryListener : public ::testing::EmptyTestEventListener {
  void OnTestProgramEnd(const ::testing::UnitTest& u) override {
    std::printf("gpu-suite: %d passed, %d failed, %d skipped\n", u.successful_test_count(),
                u.failed_test_count(), u.skipped_test_count());
  }
};
}  // namespace

int main(int argc, char** argv) {
  // As the epx CLI: one hardware queue per in-process rank (InProcessWorld), and room for graphs
  // with conditional nodes, which need more than one per rank; before any CUDA call.
  ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  ::testing::InitGoogleTest(&argc, argv);
  if (epx::cuda_device_count() == 0)
    std::printf("No NVIDIA GPU visible: every GPU test below is SKIPPED (they need an sm_90 GPU).\n");
  ::testing::UnitTest::GetInstance()->listeners().Append(new SummaryListener);
  return RUN_ALL_TESTS();
}
