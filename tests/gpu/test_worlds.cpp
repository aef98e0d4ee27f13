// What the worlds guarantee beside the data path: the links they require between GPUs (refusal
// through the injectable capability query), the caller's current device kept, buffers freed only
// once every GPU that reads them is done, complete peer tables, and pointers of the rank's own
// GPU. Tests that need two GPUs say so and skip on one.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
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


// The copy epilogue (epx::copy_rows): every row of the result is the row its index names, or
// zeros where marked, in 16-, 4- and 1-byte words (row sizes and strides that allow each); bad
// arguments are refused by name before anything is launched.
TEST(CopyRows, GathersRowsAndZeroesMarkedOnesInEveryWordSize) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  EPX_CUDA_CHECK(cudaSetDevice(0));
  const int64_t src_rows = 7, rows = 9;
  const int64_t index[rows] = {6, 0, 3, 3, 1, 5, 2, 4, 0};
  const bool zero[rows] = {false, true, false, false, false, true, false, false, false};
  int64_t* d_index = nullptr;
  bool* d_zero = nullptr;
  EPX_CUDA_CHECK(cudaMalloc(&d_index, sizeof(index)));
  EPX_CUDA_CHECK(cudaMalloc(&d_zero, sizeof(zero)));
  EPX_CUDA_CHECK(cudaMemcpy(d_index, index, sizeof(index), cudaMemcpyHostToDevice));
  EPX_CUDA_CHECK(cudaMemcpy(d_zero, zero, sizeof(zero), cudaMemcpyHostToDevice));
  for (const size_t row_bytes : {size_t(7168), size_t(224), size_t(13)}) {  // 16, 4, 1 bytes
    const size_t src_stride = row_bytes + (row_bytes % 16 == 0 ? 32 : row_bytes % 4 == 0 ? 4 : 3);
    const size_t dst_stride = row_bytes;
    std::vector<uint8_t> src(size_t(src_rows) * src_stride);
    for (size_t i = 0; i < src.size(); ++i) src[i] = uint8_t(i * 131 + 7);
    uint8_t *d_src = nullptr, *d_dst = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&d_src, src.size()));
    EPX_CUDA_CHECK(cudaMalloc(&d_dst, size_t(rows) * dst_stride));
    EPX_CUDA_CHECK(cudaMemcpy(d_src, src.data(), src.size(), cudaMemcpyHostToDevice));
    EPX_CUDA_CHECK(cudaMemset(d_dst, 0xee, size_t(rows) * dst_stride));
    copy_rows(d_dst, dst_stride, d_src, src_stride, row_bytes, rows, d_index, d_zero, nullptr);
    std::vector<uint8_t> got(size_t(rows) * dst_stride);
    EPX_CUDA_CHECK(cudaMemcpy(got.data(), d_dst, got.size(), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < rows; ++i) {
      for (size_t b = 0; b < row_bytes; ++b) {
        const uint8_t want = zero[i] ? 0 : src[size_t(index[i]) * src_stride + b];
        ASSERT_EQ(got[size_t(i) * dst_stride + b], want)
            << "row_bytes " << row_bytes << ", row " << i << ", byte " << b;
      }
    }
    // No index and no marks: the first rows as they are.
    copy_rows(d_dst, dst_stride, d_src, src_stride, row_bytes, src_rows, nullptr, nullptr,
              nullptr);
    EPX_CUDA_CHECK(cudaMemcpy(got.data(), d_dst, got.size(), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < src_rows; ++i) {
      for (size_t b = 0; b < row_bytes; ++b) {
        ASSERT_EQ(got[size_t(i) * dst_stride + b], src[size_t(i) * src_stride + b])
            << "row_bytes " << row_bytes << ", row " << i << ", byte " << b;
      }
    }
    const auto refused = [&](auto call, const std::string& name) {
      try {
        call();
        ADD_FAILURE() << name << " was not refused";
      } catch (const InputError& e) {
        EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
      }
    };
    refused([&] { copy_rows(d_dst, dst_stride, d_src, src_stride, row_bytes, -1, d_index,
                            d_zero, nullptr); },
            "copy_rows rows = -1");
    refused([&] { copy_rows(d_dst, row_bytes - 1, d_src, src_stride, row_bytes, rows, d_index,
                            d_zero, nullptr); },
            "copy_rows dst_stride");
    refused([&] { copy_rows(d_dst, dst_stride, nullptr, src_stride, row_bytes, rows, d_index,
                            d_zero, nullptr); },
            "copy_rows src = null");
    EPX_CUDA_CHECK(cudaFree(d_src));
    EPX_CUDA_CHECK(cudaFree(d_dst));
  }
  EPX_CUDA_CHECK(cudaFree(d_index));
  EPX_CUDA_CHECK(cudaFree(d_zero));
}

}  // namespace
}  // namespace epx
