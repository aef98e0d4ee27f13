// What the worlds guarantee beside the data path: the links they require between GPUs (refusal
// through the injectable capability query), the caller's current device kept, buffers freed only
// once every GPU that reads them is done, complete peer tables, and pointers of the rank's own
// GPU. Tests that need two GPUs say so and skip on one.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "core/device_guard.hpp"
#include "epx/all2all.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "epx/symmetric.hpp"
#include "epx/world.hpp"
#include "gpu_group.hpp"
#include "transport/peer_links.hpp"

#define REQUIRE_GPUS(n)                                                            \
  do {                                                                             \
    if (epx::cuda_device_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs"; \
  } while (0)

namespace epx {
namespace {

using transport::PeerLink;
using transport::PeerLinkQuery;

// Installs a capability query for one test, and takes it out again.
class ScopedPeerLinkQuery {
 public:
  explicit ScopedPeerLinkQuery(PeerLinkQuery q) : before_(transport::set_peer_link_query(std::move(q))) {}
  ~ScopedPeerLinkQuery() { (void)transport::set_peer_link_query(before_); }
  ScopedPeerLinkQuery(const ScopedPeerLinkQuery&) = delete;
  ScopedPeerLinkQuery& operator=(const ScopedPeerLinkQuery&) = delete;

 private:
  PeerLinkQuery before_;
};

int current_device() {
  int d = -1;
  EPX_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

// Ranks that share a GPU need nothing of a link: the world never asks, however bad the answer
// would be, and it is made.
TEST(PeerLinks, RanksSharingOneGpuAreNeverAsked) {
  REQUIRE_GPU();
  int asked = 0;
  ScopedPeerLinkQuery q([&](int, int) {
    ++asked;
    return PeerLink{};  // no access, no atomics
  });
  EXPECT_NO_THROW({
    InProcessWorld world(4, {0});
    (void)world;
  });
  EXPECT_EQ(asked, 0);
}

// GPUs without native peer atomics (a PCIe pair, as the injected query says): refused up front,
// naming the pair, before any memory is handed out.
TEST(PeerLinks, InProcessWorldRefusesGpusWithoutNativeAtomics) {
  REQUIRE_GPUS(2);
  ScopedPeerLinkQuery q([](int a, int b) {
    return PeerLink{.access = true, .native_atomics = !((a == 0 && b == 1) || (a == 1 && b == 0))};
  });
  try {
    InProcessWorld world(2, {0, 1});
    FAIL() << "expected an UnsupportedError";
  } catch (const UnsupportedError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("InProcessWorld"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 0 (GPU 0) and rank 1 (GPU 1)"), std::string::npos) << m;
    EXPECT_NE(m.find("no native atomics"), std::string::npos) << m;
  }
}

// The caller's current device survives a world, a group, calls and teardown that visit every
// GPU; with one GPU there is nothing else to visit, so it needs two.
TEST(DeviceGuard, EpxCallsKeepTheCallersDevice) {
  REQUIRE_GPUS(2);
  const int n = cuda_device_count();
  const int mine = n - 1;
  EPX_CUDA_CHECK(cudaSetDevice(mine));
  EPX_CUDA_CHECK(cudaFree(nullptr));  // a context there, as a PyTorch process has
  std::vector<int> devices;
  for (int d = 0; d < n; ++d) devices.push_back(d);
  for (const Backend b : {Backend::kLowLatency, Backend::kHighThroughput}) {
    SCOPED_TRACE(to_string(b));
    EpConfig cfg = gpu_test::small_config();
    cfg.world_size = n;
    cfg.num_experts = 4 * n;
    cfg.worst_case_output = true;  // high_throughput: no host wait, every rank from this thread
    {
      InProcessWorld world(n, devices);
      EXPECT_EQ(current_device(), mine);
      auto group = make_all2all_group(b, cfg, world);
      EXPECT_EQ(current_device(), mine);
      std::vector<cudaStream_t> streams(size_t(n), nullptr);
      for (int r = 0; r < n; ++r) {
        EPX_CUDA_CHECK(cudaSetDevice(world.device_of(r)));
        EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[size_t(r)], cudaStreamNonBlocking));
      }
      EPX_CUDA_CHECK(cudaSetDevice(mine));
      // A round of zero-token ranks (they still take part), each on its own GPU's stream, called
      // from this thread with the caller's device current.
      for (int r = 0; r < n; ++r) (void)group[size_t(r)]->dispatch(DispatchInput{}, streams[size_t(r)]);
      EXPECT_EQ(current_device(), mine);
      for (int r = 0; r < n; ++r)
        group[size_t(r)]->combine(group[size_t(r)]->combine_buffer(), nullptr, streams[size_t(r)]);
      EXPECT_EQ(current_device(), mine);
      for (int r = 0; r < n; ++r) group[size_t(r)]->synchronize(streams[size_t(r)]);
      EXPECT_EQ(current_device(), mine);
      for (cudaStream_t st : streams) EPX_CUDA_CHECK(cudaStreamDestroy(st));
    }
    EXPECT_EQ(current_device(), mine);  // after every rank's teardown
  }
  {
    DeviceGuard g(0);
    EXPECT_EQ(current_device(), 0);
  }
  EXPECT_EQ(current_device(), mine);
}

// A buffer's teardown (and synchronize_devices) waits for every GPU of the world, not only its
// own: a host function that holds the last GPU's stream for 300 ms must have finished.
TEST(SymmetricBuffer, SynchronizeDevicesWaitsForEveryGpuOfTheWorld) {
  REQUIRE_GPU();
  const int n = cuda_device_count();
  std::vector<int> devices;
  for (int d = 0; d < n; ++d) devices.push_back(d);
  InProcessWorld world(n, devices);
  auto bufs = SymmetricBuffer::create_in_process(world, 4096);
  const int last = world.device_of(n - 1);
  EPX_CUDA_CHECK(cudaSetDevice(last));
  cudaStream_t s = nullptr;
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  static std::atomic<bool> done{false};
  done = false;
  EPX_CUDA_CHECK(cudaLaunchHostFunc(
      s,
      [](void*) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        done = true;
      },
      nullptr));
  EPX_CUDA_CHECK(cudaSetDevice(0));
  bufs[0].synchronize_devices();  // rank 0's buffer lives on GPU 0
  EXPECT_TRUE(done.load()) << "returned while GPU " << last << " was still busy";
  EXPECT_EQ(current_device(), 0);
  EPX_CUDA_CHECK(cudaStreamDestroy(s));
}

// Each device's peer table is complete when create_in_process returns, read from a stream of
// its own (a pageable copy may return before it lands; the world synchronises every device).
TEST(SymmetricBuffer, PeerTablesCompleteOnEveryDevice) {
  REQUIRE_GPU();
  const int n = cuda_device_count();
  std::vector<int> devices;
  for (int d = 0; d < n; ++d) devices.push_back(d);
  const int W = 8;
  InProcessWorld world(W, devices);
  auto bufs = SymmetricBuffer::create_in_process(world, 1 << 20);
  for (int r = 0; r < W; ++r) {
    EPX_CUDA_CHECK(cudaSetDevice(world.device_of(r)));
    cudaStream_t s = nullptr;
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<uint8_t*> table(W, nullptr);
    EPX_CUDA_CHECK(cudaMemcpyAsync(table.data(), bufs[r].device_handle().peers,
                                   sizeof(uint8_t*) * W, cudaMemcpyDeviceToHost, s));
    EPX_CUDA_CHECK(cudaStreamSynchronize(s));
    EPX_CUDA_CHECK(cudaStreamDestroy(s));
    for (int p = 0; p < W; ++p) EXPECT_EQ(table[p], bufs[p].local()) << "rank " << r << " peer " << p;
  }
}

// A pointer into another GPU's memory is refused by name before anything is launched.
TEST(PointerDevice, AnotherGpusMemoryIsRefusedNamingBothGpus) {
  REQUIRE_GPUS(2);
  gpu_test::Group g(gpu_test::small_config(), 1);  // rank 0 on GPU 0
  EPX_CUDA_CHECK(cudaSetDevice(1));
  void* other = nullptr;
  EPX_CUDA_CHECK(cudaMalloc(&other, 1 << 16));
  EPX_CUDA_CHECK(cudaSetDevice(0));
  DispatchInput in;
  in.num_tokens = 1;
  in.x = other;
  in.topk_ids = g.upload(std::vector<int32_t>{0, 1, 2, 3});
  in.topk_weights = g.upload(std::vector<float>(4, 0.25f));
  try {
    (void)g.a2a[0]->dispatch(in, g.streams[0]);
    ADD_FAILURE() << "expected an InputError";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("x = 0x"), std::string::npos) << m;
    EXPECT_NE(m.find("device memory on GPU 0, this rank's (this is memory of GPU 1)"),
              std::string::npos)
        << m;
  }
  (void)cudaFree(other);
}

}  // namespace
}  // namespace epx
