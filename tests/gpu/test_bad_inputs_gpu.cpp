// The GPU half of the bad-input catalogue (bad_inputs_gpu_cases.hpp, docs/reliability.md): every
// case's scenario on in-process worlds of one GPU, each raising its error with a message that
// names the argument, the value and the bound. The list and the scenarios are matched by id, both
// ways, so neither can grow alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "../cpu/scoped_env.hpp"
#include "bad_inputs_gpu_cases.hpp"
#include "gpu_group.hpp"
#include "epx/all2all.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

namespace epx {
namespace {

using bad_inputs::GpuCase;

constexpr int kHidden = 2048;
constexpr int kTopk = 4;

using gpu_test::small_config;

static_assert(kHidden == 2048 && kTopk == 4, "the shape of gpu_test::small_config()");

// The shared group, with the inputs and outputs these cases upload.
struct Group : gpu_test::Group {
  using gpu_test::Group::Group;
  // Tokens of 1.0 with these expert ids (kTopk per token) and weights 1/kTopk, on the device.
  DispatchInput input(const std::vector<int32_t>& ids) {
    const int n = int(ids.size()) / kTopk;
    DispatchInput in;
    in.num_tokens = n;
    in.x = upload(std::vector<uint16_t>(size_t(n) * kHidden, 0x3f80));
    in.topk_ids = upload(ids);
    in.topk_weights = upload(std::vector<float>(ids.size(), 1.0f / kTopk));
    return in;
  }
  void* output(int tokens) {
    return upload(std::vector<uint16_t>(size_t(std::max(tokens, 1)) * kHidden, 0));
  }
};

const std::vector<int32_t> kTwoTokens = {0, 1, 2, 3, 4, 5, 6, 7};

const void* offset(const void* p, size_t bytes) {
  return static_cast<const char*>(p) + bytes;
}

// A single rank whose token 0 names expert -2: dispatch, combine, synchronize.
void dispatch_id_minus_two(Group& g) {
  const DispatchInput in = g.input({0, 1, 2, -2, 4, 5, 6, 7});
  g.a2a[0]->dispatch(in, g.streams[0]);
  g.a2a[0]->combine(g.a2a[0]->combine_buffer(), g.output(2), g.streams[0]);
  g.a2a[0]->synchronize(g.streams[0]);
}

// Each scenario throws its case's error (or returns, which fails the case).
std::map<std::string, std::function<void()>> scenarios() {
  std::map<std::string, std::function<void()>> s;
  s["gpu.dispatch.num_tokens_above_max"] = [] {
    Group g(small_config(), 1);
    DispatchInput in;
    in.num_tokens = 9;
    g.a2a[0]->dispatch(in, g.streams[0]);
  };
  s["gpu.dispatch.num_tokens_negative"] = [] {
    Group g(small_config(), 1);
    DispatchInput in;
    in.num_tokens = -1;
    g.a2a[0]->dispatch(in, g.streams[0]);
  };
  s["gpu.dispatch.null_x"] = [] {
    Group g(small_config(), 1);
    DispatchInput in = g.input(kTwoTokens);
    in.x = nullptr;
    g.a2a[0]->dispatch(in, g.streams[0]);
  };
  s["gpu.dispatch.null_topk_ids"] = [] {
    Group g(small_config(), 1);
    DispatchInput in = g.input(kTwoTokens);
    in.topk_ids = nullptr;
    g.a2a[0]->dispatch(in, g.streams[0]);
  };
  s["gpu.dispatch.null_topk_weights"] = [] {
    Group g(small_config(), 1);
    DispatchInput in = g.input(kTwoTokens);
    in.topk_weights = nullptr;
    g.a2a[0]->dispatch(in, g.streams[0]);
  };
  s["gpu.dispatch.null_x_scales_fp8"] = [] {
    EpConfig cfg = small_config();
    cfg.dtype = DispatchDtype::kFP8;
    Group g(cfg, 1);
    DispatchInput in = g.input(kTwoTokens);  // the bytes of x do not matter here
    in.x_scales = nullptr;
    g.a2a[0]->dispatch(in, g.streams[0]);
  };
  s["gpu.dispatch.misaligned_x"] = [] {
    Group g(small_config(), 1);
    DispatchInput in = g.input(kTwoTokens);
    in.x = offset(in.x, 2);
    g.a2a[0]->dispatch(in, g.streams[0]);
  };
  s["gpu.dispatch.misaligned_ids_int64"] = [] {
    Group g(small_config(), 1);
    DispatchInput in = g.input(kTwoTokens);
    in.ids_type = IdType::kInt64;
    in.topk_ids = offset(g.upload(std::vector<int64_t>(kTwoTokens.size() + 1, 0)), 4);
    g.a2a[0]->dispatch(in, g.streams[0]);
  };
  s["gpu.dispatch.host_x"] = [] {
    Group g(small_config(), 1);
    DispatchInput in = g.input(kTwoTokens);
    const std::vector<uint16_t> host_x(2 * kHidden, 0x3f80);
    in.x = host_x.data();
    g.a2a[0]->dispatch(in, g.streams[0]);
  };
  s["gpu.dispatch.pinned_host_weights"] = [] {
    Group g(small_config(), 1);
    DispatchInput in = g.input(kTwoTokens);
    void* pinned = nullptr;
    EPX_CUDA_CHECK(cudaMallocHost(&pinned, kTwoTokens.size() * sizeof(float)));
    std::unique_ptr<void, void (*)(void*)> free_pinned(pinned,
                                                       [](void* p) { (void)cudaFreeHost(p); });
    in.topk_weights = static_cast<const float*>(pinned);
    g.a2a[0]->dispatch(in, g.streams[0]);
  };
  s["gpu.dispatch.expert_id_out_of_range"] = [] {
    // Rank 0 is fine and completes the round (nobody waits in vain); rank 1 reports its id.
    Group g(small_config(), 2);
    const std::vector<int32_t> good = {0, 5, 9, 13, 1, 2, 3, 4, -1, -1, 8, -1, 15, 14, 13, 12};
    std::vector<int32_t> bad = good;
    bad[2 * kTopk + 1] = 16;
    for (int r = 0; r < 2; ++r) g.a2a[r]->dispatch(g.input(r == 1 ? bad : good), g.streams[r]);
    for (int r = 0; r < 2; ++r) {
      g.a2a[r]->combine(g.a2a[r]->combine_buffer(), g.output(4), g.streams[r]);
    }
    g.a2a[0]->synchronize(g.streams[0]);
    g.a2a[1]->synchronize(g.streams[1]);
  };
  s["gpu.dispatch.expert_id_below_minus_one"] = [] {
    Group g(small_config(), 1);
    dispatch_id_minus_two(g);
  };
  s["gpu.dispatch.repeated_expert"] = [] {
    Group g(small_config(), 1);
    g.a2a[0]->dispatch(g.input({0, 1, 2, 3, 4, 5, 4, -1}), g.streams[0]);
    g.a2a[0]->combine(g.a2a[0]->combine_buffer(), g.output(2), g.streams[0]);
    g.a2a[0]->synchronize(g.streams[0]);
  };
  s["gpu.dispatch.after_device_error"] = [] {
    Group g(small_config(), 1);
    try {
      dispatch_id_minus_two(g);
    } catch (const InputError&) {
      // reported once; the object now refuses calls
    }
    g.a2a[0]->dispatch(g.input(kTwoTokens), g.streams[0]);
  };
  s["gpu.dispatch.rank_mask_low_latency"] = [] {
    Group g(small_config(), 1);
    DispatchInput in = g.input(kTwoTokens);
    in.rank_mask = g.upload(std::vector<uint8_t>(2, 1));
    in.expert_counts = g.upload(std::vector<int32_t>(16, 0));
    g.a2a[0]->dispatch(in, g.streams[0]);
  };
  s["gpu.dispatch.rank_mask_with_ids_ht"] = [] {
    Group g(small_config(), 1, Backend::kHighThroughput);
    DispatchInput in = g.input(kTwoTokens);
    in.rank_mask = g.upload(std::vector<uint8_t>(2, 1));
    in.expert_counts = g.upload(std::vector<int32_t>(16, 0));
    g.a2a[0]->dispatch(in, g.streams[0]);
  };
  s["gpu.combine.bias_low_latency"] = [] {
    Group g(small_config(), 1);
    g.a2a[0]->dispatch(g.input(kTwoTokens), g.streams[0]);
    CombineExtras ex;
    ex.bias[0] = g.output(2);
    g.a2a[0]->combine(g.a2a[0]->combine_buffer(), g.output(2), ex, g.streams[0]);
  };
  s["gpu.combine.weights_without_output_ht"] = [] {
    EpConfig cfg = small_config();
    cfg.worst_case_output = true;
    Group g(cfg, 1, Backend::kHighThroughput);
    g.a2a[0]->dispatch(g.input(kTwoTokens), g.streams[0]);
    CombineExtras ex;
    ex.topk_weights = g.upload(std::vector<float>(size_t(cfg.capacity()) * cfg.topk, 0.0f));
    g.a2a[0]->combine(g.a2a[0]->combine_buffer(), g.output(2), ex, g.streams[0]);
  };
  s["gpu.combine.before_dispatch"] = [] {
    Group g(small_config(), 1);
    g.a2a[0]->combine(g.a2a[0]->combine_buffer(), g.output(2), g.streams[0]);
    g.a2a[0]->synchronize(g.streams[0]);
  };
  s["gpu.combine.null_y"] = [] {
    Group g(small_config(), 1);
    g.a2a[0]->dispatch(g.input(kTwoTokens), g.streams[0]);
    g.a2a[0]->combine(g.a2a[0]->combine_buffer(), nullptr, g.streams[0]);
  };
  s["gpu.combine.null_expert_out"] = [] {
    Group g(small_config(), 1);
    g.a2a[0]->dispatch(g.input(kTwoTokens), g.streams[0]);
    g.a2a[0]->combine(nullptr, g.output(2), g.streams[0]);
  };
  s["gpu.combine.misaligned_expert_out"] = [] {
    Group g(small_config(), 1);
    g.a2a[0]->dispatch(g.input(kTwoTokens), g.streams[0]);
    g.a2a[0]->combine(offset(g.a2a[0]->combine_buffer(), 2), g.output(2), g.streams[0]);
  };
  s["gpu.combine.pinned_host_expert_out_ht"] = [] {
    // Rank 0's combine is refused on the host; the round completes first (worst-case areas: no
    // host wait, so both ranks' dispatches go from this thread), so that nobody waits in vain.
    EpConfig cfg = small_config();
    cfg.worst_case_output = true;
    Group g(cfg, 2, Backend::kHighThroughput);
    for (int r = 0; r < 2; ++r) g.a2a[r]->dispatch(g.input(kTwoTokens), g.streams[r]);
    g.a2a[1]->combine(g.a2a[1]->combine_buffer(), g.output(2), g.streams[1]);
    void* pinned = nullptr;
    EPX_CUDA_CHECK(cudaMallocHost(&pinned, size_t(cfg.capacity()) * kHidden * 2));
    std::unique_ptr<void, void (*)(void*)> free_pinned(pinned,
                                                       [](void* p) { (void)cudaFreeHost(p); });
    try {
      g.a2a[0]->combine(pinned, g.output(2), g.streams[0]);
    } catch (const InputError&) {
      // rank 1 still waits for rank 0's partials: give them, then finish both
      g.a2a[0]->combine(g.a2a[0]->combine_buffer(), g.output(2), g.streams[0]);
      for (int r = 0; r < 2; ++r) g.a2a[r]->synchronize(g.streams[r]);
      throw;
    }
  };
  s["gpu.launch.dispatch_blocks_over_budget"] = [] {
    InProcessWorld world(8);
    LaunchConfigs lc;
    lc.dispatch.num_blocks = world.sm_budget(0) + 1;
    (void)make_all2all_group(Backend::kLowLatency, small_config(), world, lc);
  };
  s["gpu.launch.combine_blocks_over_budget"] = [] {
    InProcessWorld world(8);
    LaunchConfigs lc;
    lc.combine.num_blocks = world.sm_budget(0) + 1;
    (void)make_all2all_group(Backend::kLowLatency, small_config(), world, lc);
  };
  s["gpu.launch.warps_above_32"] = [] {
    InProcessWorld world(1);
    LaunchConfigs lc;
    lc.combine.warps_per_block = 33;
    (void)make_all2all_group(Backend::kLowLatency, small_config(), world, lc);
  };
  s["gpu.group.invalid_config"] = [] {
    EpConfig cfg = small_config();
    cfg.dtype = DispatchDtype::kBF16ToFP8;
    cfg.hidden = 1000;
    InProcessWorld world(1);
    (void)make_all2all_group(Backend::kLowLatency, cfg, world);
  };
  s["gpu.group.baseline_expert_major"] = [] {
    EpConfig cfg = small_config();
    cfg.layout = OutputLayout::kExpertMajor;
    InProcessWorld world(2);
    (void)make_all2all_group(Backend::kNaive, cfg, world);
  };
  s["gpu.world.device_out_of_range"] = [] { InProcessWorld world(2, {99}); };
  s["gpu.world.ranks_above_64"] = [] { InProcessWorld world(65); };
  s["gpu.world.ranks_above_hardware_queues"] = [] {
    // The world reads the variable when it is made; CUDA keeps the value of its context.
    ScopedEnv connections("CUDA_DEVICE_MAX_CONNECTIONS", "2");
    InProcessWorld world(3);
  };
  return s;
}

struct Observed {
  bool epx_error = false;
  ErrorCode code = ErrorCode::kOk;
  std::string message;
};

Observed observe(const std::function<void()>& scenario) {
  Observed o;
  try {
    scenario();
    o.message = "(returned normally)";
  } catch (const Error& e) {
    o.epx_error = true;
    o.code = e.code();
    o.message = e.what();
  } catch (const std::exception& e) {
    o.message = std::string("not an epx error: ") + e.what();
  }
  return o;
}

::testing::AssertionResult meets(const GpuCase& c, ErrorCode code,
                                 const std::vector<std::string>& words, const Observed& o) {
  if (!o.epx_error || o.code != code) {
    return ::testing::AssertionFailure()
           << c.id << ": " << (o.epx_error ? to_string(o.code) : "no epx error") << ", expected "
           << to_string(code) << ": " << o.message;
  }
  for (const std::string& w : words) {
    if (o.message.find(w) == std::string::npos) {
      return ::testing::AssertionFailure() << c.id << ": message lacks \"" << w << "\":\n"
                                           << o.message;
    }
  }
  return ::testing::AssertionSuccess();
}

// Needs no GPU: the list and the scenarios name the same cases.
TEST(BadInputsGpu, EveryCaseHasOneScenario) {
  const auto s = scenarios();
  std::set<std::string> listed;
  for (const GpuCase& c : bad_inputs::gpu_cases()) {
    listed.insert(c.id);
    EXPECT_EQ(s.count(c.id), 1u) << "no scenario for " << c.id;
  }
  for (const auto& entry : s)
    EXPECT_EQ(listed.count(entry.first), 1u) << "unlisted " << entry.first;
}

class BadInputGpu : public ::testing::TestWithParam<GpuCase> {};

// The case's error and words; then the same observation against expectations it must not meet
// (another error code, a word it lacks), so that no case passes whatever happens.
TEST_P(BadInputGpu, RaisesItsErrorNamingArgumentValueAndBound) {
  REQUIRE_GPU();
  const GpuCase& c = GetParam();
  const auto all = scenarios();
  const auto it = all.find(c.id);
  ASSERT_NE(it, all.end()) << "no scenario for " << c.id;
  const Observed o = observe(it->second);
  EXPECT_TRUE(meets(c, c.code, c.words, o));
  EXPECT_FALSE(
      meets(c, c.code == ErrorCode::kConfig ? ErrorCode::kInput : ErrorCode::kConfig, c.words, o));
  std::vector<std::string> more = c.words;
  more.push_back("a word no message holds");
  EXPECT_FALSE(meets(c, c.code, more, o));
}

INSTANTIATE_TEST_SUITE_P(Catalogue, BadInputGpu, ::testing::ValuesIn(bad_inputs::gpu_cases()),
                         [](const ::testing::TestParamInfo<GpuCase>& i) {
                           std::string name = i.param.id;
                           std::replace(name.begin(), name.end(), '.', '_');
                           return name;
                         });

}  // namespace
}  // namespace epx
