// EpConfig::validate(), the JSON launch file, the EPX_* environment and the error helpers.

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <string>

#include "core/env.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "scoped_env.hpp"

namespace epx {
namespace {

// Runs fn, expects a ConfigError whose message contains every one of `parts`.
testing::AssertionResult throws_config_error(const std::function<void()>& fn,
                                             std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const ConfigError& e) {
    if (e.code() != ErrorCode::kConfig) return testing::AssertionFailure() << "wrong code";
    const std::string msg = e.what();
    for (const auto& p : parts) {
      if (msg.find(p) == std::string::npos) {
        return testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << p << "\"";
      }
    }
    return testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "threw something else: " << e.what();
  }
  return testing::AssertionFailure() << "did not throw";
}

EpConfig valid_config() {
  EpConfig c;
  c.rank = 3;
  c.world_size = 8;
  c.hidden = 7168;
  c.num_experts = 256;
  c.topk = 8;
  c.max_tokens_per_rank = 128;
  c.dtype = DispatchDtype::kBF16ToFP8;
  return c;
}

testing::AssertionResult invalid(std::function<void(EpConfig&)> change,
                                 std::initializer_list<std::string> parts) {
  EpConfig c = valid_config();
  change(c);
  return throws_config_error([&] { c.validate(); }, parts);
}

// ---- validate ---------------------------------------------------------------------------------

TEST(ConfigValidate, AcceptsDefaultsAndEdges) {
  EXPECT_NO_THROW(EpConfig{}.validate());
  EXPECT_NO_THROW(valid_config().validate());
  EpConfig c = valid_config();
  c.world_size = kMaxRanks;
  c.rank = kMaxRanks - 1;
  c.num_experts = kMaxRanks;
  c.topk = kMaxRanks / 2;
  EXPECT_NO_THROW(c.validate());
  c = valid_config();
  c.dtype = DispatchDtype::kBF16;
  c.hidden = 8;  // bf16 needs only 16-byte rows
  EXPECT_NO_THROW(c.validate());
  c.hidden = kMaxHidden;
  c.max_tokens_per_rank = kMaxTokensPerRank;
  c.timeout_ms = kMaxTimeoutMs;
  c.num_experts = 8;
  c.topk = 8;  // K == E is possible: every token uses every expert
  EXPECT_NO_THROW(c.validate());
  c = valid_config();
  c.world_size = 3;
  c.rank = 2;
  c.num_experts = 9;
  c.topk = 9;
  c.timeout_ms = 1;
  c.max_tokens_per_rank = 1;
  EXPECT_NO_THROW(c.validate());
}

TEST(ConfigValidate, WorldSize) {
  EXPECT_TRUE(invalid(
      [](EpConfig& c) {
        c.world_size = 0;
        c.rank = 0;
      },
      {"world_size = 0", "[1, kMaxRanks = 64]"}));
  EXPECT_TRUE(invalid([](EpConfig& c) { c.world_size = 65; }, {"world_size = 65", "64"}));
}

TEST(ConfigValidate, Rank) {
  EXPECT_TRUE(invalid([](EpConfig& c) { c.rank = -1; }, {"rank = -1", "[0, world_size = 8)"}));
  EXPECT_TRUE(invalid([](EpConfig& c) { c.rank = 8; }, {"rank = 8", "[0, world_size = 8)"}));
}

TEST(ConfigValidate, Hidden) {
  EXPECT_TRUE(invalid([](EpConfig& c) { c.hidden = 0; }, {"hidden = 0", "kMaxHidden = 65536"}));
  EXPECT_TRUE(invalid([](EpConfig& c) { c.hidden = kMaxHidden + 128; },
                      {"hidden = 65664", "[1, kMaxHidden = 65536]"}));
  EXPECT_TRUE(invalid(
      [](EpConfig& c) {
        c.dtype = DispatchDtype::kBF16;
        c.hidden = 100;
      },
      {"hidden = 100", "multiple of 8"}));
}

TEST(ConfigValidate, HiddenForFp8) {
  for (DispatchDtype d : {DispatchDtype::kFP8, DispatchDtype::kBF16ToFP8}) {
    EXPECT_TRUE(invalid(
        [d](EpConfig& c) {
          c.dtype = d;
          c.hidden = 1000;
        },
        {"hidden = 1000", "multiple of kFp8BlockSize = 128", to_string(d)}));
  }
  EpConfig c = valid_config();
  c.dtype = DispatchDtype::kBF16;
  c.hidden = 1000;
  EXPECT_NO_THROW(c.validate());
}

// LogFMT rows are blocks of 128 values, whatever the dispatch dtype asks of hidden.
TEST(ConfigValidate, HiddenForLogfmt) {
  EXPECT_TRUE(invalid(
      [](EpConfig& c) {
        c.dtype = DispatchDtype::kBF16;
        c.hidden = 1000;
        c.combine_format = CombineFormat::kLogFMT;
      },
      {"combine_format = logfmt", "bf16 with hidden = 1000", "a multiple of 128"}));
  EpConfig c = valid_config();
  c.dtype = DispatchDtype::kBF16;
  c.combine_format = CombineFormat::kLogFMT;
  c.hidden = 128;
  EXPECT_NO_THROW(c.validate());
  c.hidden = 7168;
  EXPECT_NO_THROW(c.validate());
  c.combine_format = CombineFormat::kBF16;
  c.hidden = 1000;
  EXPECT_NO_THROW(c.validate());
}

TEST(ConfigValidate, NumExperts) {
  EXPECT_TRUE(invalid([](EpConfig& c) { c.num_experts = 250; },
                      {"num_experts = 250", "a multiple of world_size = 8"}));
  EXPECT_TRUE(invalid(
      [](EpConfig& c) {
        c.num_experts = 4;
        c.topk = 2;
      },
      {"num_experts = 4", ">= world_size = 8"}));
  EXPECT_TRUE(invalid([](EpConfig& c) { c.num_experts = 0; }, {"num_experts = 0"}));
}

TEST(ConfigValidate, Topk) {
  EXPECT_TRUE(invalid([](EpConfig& c) { c.topk = 0; }, {"topk = 0", "[1, 32]"}));
  EXPECT_TRUE(invalid([](EpConfig& c) { c.topk = 33; }, {"topk = 33", "kMaxTopk = 32"}));
  EXPECT_TRUE(invalid(
      [](EpConfig& c) {
        c.num_experts = 16;
        c.topk = 17;
      },
      {"topk = 17", "num_experts = 16", "[1, 16]"}));
}

TEST(ConfigValidate, MaxTokens) {
  EXPECT_TRUE(invalid([](EpConfig& c) { c.max_tokens_per_rank = 0; },
                      {"max_tokens_per_rank = 0", "[1, kMaxTokensPerRank = 65536]"}));
  EXPECT_TRUE(invalid([](EpConfig& c) { c.max_tokens_per_rank = kMaxTokensPerRank + 1; },
                      {"max_tokens_per_rank = 65537", "65536"}));
}

TEST(ConfigValidate, Timeout) {
  EXPECT_TRUE(invalid([](EpConfig& c) { c.timeout_ms = 0; },
                      {"timeout_ms = 0", "[1, kMaxTimeoutMs = 86400000]"}));
  EXPECT_TRUE(invalid([](EpConfig& c) { c.timeout_ms = kMaxTimeoutMs + 1; },
                      {"timeout_ms = 86400001", "86400000"}));
}

TEST(ConfigValidate, EnumsOutOfRange) {
  EXPECT_TRUE(invalid([](EpConfig& c) { c.dtype = static_cast<DispatchDtype>(7); },
                      {"dtype = 7", "bf16, fp8, bf16-to-fp8"}));
  EXPECT_TRUE(invalid([](EpConfig& c) { c.scale_layout = static_cast<ScaleLayout>(5); },
                      {"scale_layout = 5", "row, column"}));
  EXPECT_TRUE(invalid([](EpConfig& c) { c.layout = static_cast<OutputLayout>(-1); },
                      {"layout = -1", "token, expert"}));
  EXPECT_TRUE(invalid([](EpConfig& c) { c.combine_format = static_cast<CombineFormat>(2); },
                      {"combine_format = 2", "bf16, logfmt"}));
  EXPECT_TRUE(invalid([](EpConfig& c) { c.combine_order = static_cast<CombineOrder>(3); },
                      {"combine_order = 3", "rank, highest_slot"}));
}

// The highest-slot order follows each token's top-k row: token-major rows only.
TEST(ConfigValidate, HighestSlotOrderIsTokenMajor) {
  EXPECT_TRUE(invalid(
      [](EpConfig& c) {
        c.layout = OutputLayout::kExpertMajor;
        c.combine_order = CombineOrder::kHighestSlot;
      },
      {"combine_order = highest_slot", "rank with layout expert"}));
  EpConfig c = valid_config();
  c.combine_order = CombineOrder::kHighestSlot;
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(parse_combine_order("highest_slot"), CombineOrder::kHighestSlot);
  EXPECT_STREQ(to_string(CombineOrder::kRank), "rank");
  EXPECT_EQ(EpConfig{}.combine_order, CombineOrder::kRank);
}

TEST(ConfigValidate, MessageCarriesLocation) {
  EXPECT_TRUE(invalid([](EpConfig& c) { c.world_size = 0; }, {"(config.cpp:"}));
}

// ---- derived sizes ------------------------------------------------------------------------

TEST(ConfigDerived, Sizes) {
  EpConfig c = valid_config();
  EXPECT_EQ(c.num_local_experts(), 32);
  EXPECT_EQ(c.num_scale_groups(), 56);
  EXPECT_EQ(c.capacity(), 1024);
  EXPECT_EQ(c.wire_row_bytes(), 7168);
  EXPECT_EQ(c.expert_rank(0), 0);
  EXPECT_EQ(c.expert_rank(31), 0);
  EXPECT_EQ(c.expert_rank(32), 1);
  EXPECT_EQ(c.expert_rank(255), 7);
  c.dtype = DispatchDtype::kBF16;
  EXPECT_EQ(c.wire_row_bytes(), 2 * 7168);
}

// ---- enum names -----------------------------------------------------------------------------

TEST(ConfigNames, RoundTrip) {
  for (Backend b : {Backend::kNaive, Backend::kAllgatherReduceScatter, Backend::kLowLatency,
                    Backend::kHighThroughput}) {
    EXPECT_EQ(parse_backend(to_string(b)), b);
  }
  EXPECT_STREQ(to_string(Backend::kHighThroughput), "high_throughput");
  EXPECT_TRUE(delivers_every_token(Backend::kNaive));
  EXPECT_TRUE(delivers_every_token(Backend::kAllgatherReduceScatter));
  EXPECT_FALSE(delivers_every_token(Backend::kLowLatency));
  EXPECT_FALSE(delivers_every_token(Backend::kHighThroughput));
  for (DispatchDtype d : {DispatchDtype::kBF16, DispatchDtype::kFP8, DispatchDtype::kBF16ToFP8}) {
    EXPECT_EQ(parse_dispatch_dtype(to_string(d)), d);
  }
  for (ScaleLayout s : {ScaleLayout::kRowMajor, ScaleLayout::kColumnMajor}) {
    EXPECT_EQ(parse_scale_layout(to_string(s)), s);
  }
  for (OutputLayout l : {OutputLayout::kTokenMajor, OutputLayout::kExpertMajor}) {
    EXPECT_EQ(parse_output_layout(to_string(l)), l);
  }
  EXPECT_STREQ(to_string(Backend::kAllgatherReduceScatter), "allgather_reducescatter");
  EXPECT_STREQ(to_string(DispatchDtype::kBF16ToFP8), "bf16-to-fp8");
  EXPECT_STREQ(to_string(ScaleLayout::kColumnMajor), "column");
  EXPECT_STREQ(to_string(OutputLayout::kExpertMajor), "expert");
  for (CombineFormat f : {CombineFormat::kBF16, CombineFormat::kLogFMT}) {
    EXPECT_EQ(parse_combine_format(to_string(f)), f);
  }
  EXPECT_STREQ(to_string(CombineFormat::kBF16), "bf16");
  EXPECT_STREQ(to_string(CombineFormat::kLogFMT), "logfmt");
  EXPECT_EQ(EpConfig{}.combine_format, CombineFormat::kBF16);
  EXPECT_STREQ(to_string(static_cast<Backend>(9)), "invalid");
}

TEST(ConfigNames, UnknownNamesListTheValidOnes) {
  EXPECT_TRUE(
      throws_config_error([] { parse_backend("deepep"); },
                          {"backend = \"deepep\"",
                           "naive, allgather_reducescatter, low_latency, high_throughput"}));
  EXPECT_TRUE(throws_config_error([] { parse_backend("Naive"); }, {"naive"}));
  EXPECT_TRUE(throws_config_error([] { parse_dispatch_dtype("e4m3"); },
                                  {"dtype = \"e4m3\"", "bf16, fp8, bf16-to-fp8"}));
  EXPECT_TRUE(throws_config_error([] { parse_scale_layout("diagonal"); }, {"row, column"}));
  EXPECT_TRUE(throws_config_error([] { parse_output_layout(""); }, {"token, expert"}));
  EXPECT_TRUE(throws_config_error([] { parse_combine_format("LogFMT"); },
                                  {"combine_format = \"LogFMT\"", "bf16, logfmt"}));
}

// ---- JSON launch files ------------------------------------------------------------------------

LaunchConfigs parse(const std::string& text) { return parse_launch_configs(text, "tune.json"); }

TEST(LaunchJson, DesignExample) {
  const LaunchConfigs c = parse(R"({ "global":   {"warps_per_block": 8,  "num_blocks": 64},
                                      "dispatch": {"warps_per_block": 16, "num_blocks": 64},
                                      "combine":  {"warps_per_block": 8} })");
  EXPECT_EQ(c.dispatch.num_blocks, 64);
  EXPECT_EQ(c.dispatch.warps_per_block, 16);
  EXPECT_EQ(c.combine.num_blocks, 64);  // from global
  EXPECT_EQ(c.combine.warps_per_block, 8);
}

TEST(LaunchJson, Aliases) {
  const LaunchConfigs c = parse(R"({"dispatch": {"block_num": 24, "warp_num_per_block": 32},
                                    "combine": {"block_num": 1, "warps_per_block": 1}})");
  EXPECT_EQ(c.dispatch.num_blocks, 24);
  EXPECT_EQ(c.dispatch.warps_per_block, 32);
  EXPECT_EQ(c.combine.num_blocks, 1);
  EXPECT_EQ(c.combine.warps_per_block, 1);
}

// high_throughput's ring rows: per op or from global, in [1, kMaxRingRows], no alias.
TEST(LaunchJson, RingRows) {
  LaunchConfigs c = parse(R"({"global": {"ring_rows": 64}, "combine": {"ring_rows": 256}})");
  EXPECT_EQ(c.dispatch.ring_rows, 64);
  EXPECT_EQ(c.combine.ring_rows, 256);
  EXPECT_EQ(c.dispatch.num_blocks, 0);
  EXPECT_TRUE(throws_config_error([] { parse(R"({"dispatch": {"ring_rows": 0}})"); },
                                  {"tune.json", "dispatch.ring_rows = 0", "[1, 16384]"}));
  EXPECT_TRUE(throws_config_error([] { parse(R"({"combine": {"ring_rows": 16385}})"); },
                                  {"combine.ring_rows = 16385", "[1, 16384]"}));
  EXPECT_TRUE(throws_config_error([] { parse(R"({"combine": {"ring_row": 8}})"); },
                                  {"combine.ring_row", "ring_rows"}));
  LaunchConfigs w;
  w.dispatch.ring_rows = 128;
  const LaunchConfigs back = parse(to_json(w));
  EXPECT_EQ(back.dispatch.ring_rows, 128);
  EXPECT_EQ(back.combine.ring_rows, 0);
}

TEST(LaunchJson, GlobalFillsOnlyWhatIsUnset) {
  LaunchConfigs c = parse(R"({"global": {"block_num": 32, "warps_per_block": 4},
                              "combine": {"num_blocks": 1024}})");
  EXPECT_EQ(c.dispatch.num_blocks, 32);
  EXPECT_EQ(c.dispatch.warps_per_block, 4);
  EXPECT_EQ(c.combine.num_blocks, 1024);
  EXPECT_EQ(c.combine.warps_per_block, 4);
  c = parse(R"({"global": {"num_blocks": 7}})");
  EXPECT_EQ(c.dispatch.num_blocks, 7);
  EXPECT_EQ(c.dispatch.warps_per_block, 0);  // 0 = choose
  EXPECT_EQ(c.combine.num_blocks, 7);
}

TEST(LaunchJson, EmptyMeansChoose) {
  for (const char* text : {"{}", R"({"dispatch": {}, "global": {}})"}) {
    const LaunchConfigs c = parse(text);
    EXPECT_EQ(c.dispatch.num_blocks, 0);
    EXPECT_EQ(c.dispatch.warps_per_block, 0);
    EXPECT_EQ(c.combine.num_blocks, 0);
    EXPECT_EQ(c.combine.warps_per_block, 0);
  }
}

TEST(LaunchJson, UnknownKeys) {
  EXPECT_TRUE(throws_config_error([] { parse(R"({"dispath": {"num_blocks": 4}})"); },
                                  {"tune.json", "dispath", "global, dispatch, combine"}));
  EXPECT_TRUE(throws_config_error([] { parse(R"({"combine": {"num_block": 4}})"); },
                                  {"tune.json", "combine.num_block", "num_blocks (alias block_num)",
                                   "warps_per_block (alias warp_num_per_block)"}));
  EXPECT_TRUE(
      throws_config_error([] { parse(R"({"global": {"num_sms": 4}})"); }, {"global.num_sms"}));
}

TEST(LaunchJson, WrongTypes) {
  EXPECT_TRUE(throws_config_error([] { parse(R"({"dispatch": 5})"); },
                                  {"tune.json", "dispatch", "number", "expected an object"}));
  EXPECT_TRUE(throws_config_error([] { parse(R"({"combine": [1, 2]})"); }, {"combine", "array"}));
  EXPECT_TRUE(throws_config_error([] { parse(R"([{"dispatch": {}}])"); },
                                  {"tune.json", "top level", "array"}));
  for (const char* value : {"\"8\"", "8.0", "8.5", "true", "null", "[8]", "{}"}) {
    const std::string text = std::string(R"({"dispatch": {"num_blocks": )") + value + "}}";
    EXPECT_TRUE(throws_config_error(
        [&] { parse(text); }, {"tune.json", "dispatch.num_blocks", "an integer in [1, 1024]"}))
        << value;
  }
}

TEST(LaunchJson, OutOfRange) {
  EXPECT_TRUE(throws_config_error([] { parse(R"({"dispatch": {"num_blocks": 0}})"); },
                                  {"tune.json", "dispatch.num_blocks = 0", "[1, 1024]"}));
  EXPECT_TRUE(throws_config_error([] { parse(R"({"dispatch": {"num_blocks": 1025}})"); },
                                  {"dispatch.num_blocks = 1025", "[1, 1024]"}));
  EXPECT_TRUE(throws_config_error([] { parse(R"({"combine": {"warps_per_block": 33}})"); },
                                  {"combine.warps_per_block = 33", "[1, 32]"}));
  EXPECT_TRUE(throws_config_error([] { parse(R"({"global": {"warp_num_per_block": -4}})"); },
                                  {"global.warp_num_per_block = -4", "[1, 32]"}));
  EXPECT_TRUE(
      throws_config_error([] { parse(R"({"global": {"block_num": 18446744073709551615}})"); },
                          {"global.block_num = 18446744073709551615", "[1, 1024]"}));
  EXPECT_TRUE(throws_config_error(
      [] { parse(R"({"global": {"block_num": -9223372036854775808}})"); }, {"[1, 1024]"}));
}

TEST(LaunchJson, DuplicateKeys) {
  EXPECT_TRUE(
      throws_config_error([] { parse(R"({"dispatch": {"num_blocks": 4, "block_num": 8}})"); },
                          {"tune.json", "dispatch", "num_blocks", "block_num"}));
  EXPECT_TRUE(throws_config_error(
      [] { parse(R"({"combine": {"warp_num_per_block": 4, "warps_per_block": 4}})"); },
      {"combine", "warps_per_block", "warp_num_per_block"}));
  EXPECT_TRUE(
      throws_config_error([] { parse(R"({"dispatch": {"num_blocks": 4, "num_blocks": 8}})"); },
                          {"tune.json", "duplicate key dispatch.num_blocks"}));
  EXPECT_TRUE(
      throws_config_error([] { parse(R"({"dispatch": {}, "combine": {}, "dispatch": {}})"); },
                          {"duplicate key dispatch"}));
}

// Peak resident memory of this process, in MiB.
long peak_rss_mib() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024;
}

// Deeply nested objects are refused by name, in memory proportional to the text: the duplicate
// check kept the dotted path of every open object, quadratic in the depth (found by fuzzing:
// 20000 levels, a 120 KB file, took a gigabyte).
TEST(LaunchJson, DeepNestingCostsLinearMemory) {
  const int depth = 20000;
  std::string text = R"({"global": )";
  for (int i = 0; i < depth; ++i) text += R"({"a": )";
  text += "1" + std::string(depth, '}') + "}";
  const long before = peak_rss_mib();
  EXPECT_TRUE(throws_config_error([&] { parse(text); }, {"tune.json", "unknown key global.a"}));
  EXPECT_LT(peak_rss_mib() - before, 64) << "MiB for a " << text.size() / 1024 << " KiB file";
  // A duplicate deep down is still named by its whole path.
  EXPECT_TRUE(throws_config_error([] { parse(R"({"global": {"x": {"y": {"a": 1, "a": 2}}}})"); },
                                  {"duplicate key global.x.y.a"}));
}

TEST(LaunchJson, InvalidJson) {
  for (const char* text : {"", "{", R"({"dispatch": {"num_blocks": 4},})", "{'global': {}}",
                           R"({"global": {"num_blocks": 4}} trailing)", "// comment\n{}"}) {
    EXPECT_TRUE(throws_config_error([&] { parse(text); }, {"tune.json", "invalid JSON"})) << text;
  }
}

class TempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        std::filesystem::temp_directory_path() / ("epx_test_config_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const auto path = dir_ / name;
    std::ofstream(path) << text;
    return path.string();
  }
  std::filesystem::path dir_;
};

using LaunchFile = TempDir;

TEST_F(LaunchFile, LoadsAValidFile) {
  const std::string path =
      write("ok.json", R"({"dispatch": {"block_num": 48, "warp_num_per_block": 12}})");
  const LaunchConfigs c = load_launch_configs(path);
  EXPECT_EQ(c.dispatch.num_blocks, 48);
  EXPECT_EQ(c.dispatch.warps_per_block, 12);
  EXPECT_EQ(c.combine.num_blocks, 0);
}

TEST_F(LaunchFile, ErrorsNameThePath) {
  const std::string path = write("bad.json", R"({"combine": {"num_blocks": 2000}})");
  EXPECT_TRUE(throws_config_error([&] { load_launch_configs(path); },
                                  {path, "combine.num_blocks = 2000", "[1, 1024]"}));
  const std::string broken = write("broken.json", "{\"global\": ");
  EXPECT_TRUE(throws_config_error([&] { load_launch_configs(broken); }, {broken, "invalid JSON"}));
}

TEST_F(LaunchFile, MissingFileAndDirectory) {
  const std::string missing = (dir_ / "nope.json").string();
  EXPECT_TRUE(
      throws_config_error([&] { load_launch_configs(missing); }, {missing, "does not exist"}));
  EXPECT_TRUE(throws_config_error([&] { load_launch_configs(dir_.string()); },
                                  {dir_.string(), "not a regular file"}));
  EXPECT_TRUE(throws_config_error([] { load_launch_configs(""); }, {"empty"}));
}

TEST_F(LaunchFile, ToJsonRoundTrips) {
  LaunchConfigs c;
  c.dispatch = {.num_blocks = 132, .warps_per_block = 16};
  c.combine = {.num_blocks = 0, .warps_per_block = 8};
  const std::string text = to_json(c);
  EXPECT_EQ(text.find("num_blocks\": 0"), std::string::npos) << text;
  const LaunchConfigs back = load_launch_configs(write("rt.json", text));
  EXPECT_EQ(back.dispatch.num_blocks, 132);
  EXPECT_EQ(back.dispatch.warps_per_block, 16);
  EXPECT_EQ(back.combine.num_blocks, 0);
  EXPECT_EQ(back.combine.warps_per_block, 8);
  const LaunchConfigs empty = parse(to_json(LaunchConfigs{}));
  EXPECT_EQ(empty.dispatch.num_blocks, 0);
  EXPECT_EQ(empty.combine.warps_per_block, 0);
}

// ---- environment ----------------------------------------------------------------------------

TEST(Env, UnsetIsEmpty) {
  const EnvSettings s = parse_env(nullptr, nullptr, nullptr);
  EXPECT_FALSE(s.backend.has_value());
  EXPECT_FALSE(s.timeout_ms.has_value());
  EXPECT_FALSE(s.config_path.has_value());
}

TEST(Env, GoodValues) {
  const EnvSettings s = parse_env("low_latency", "2500", "/etc/epx/tune.json");
  EXPECT_EQ(s.backend, Backend::kLowLatency);
  EXPECT_EQ(s.timeout_ms, 2500);
  EXPECT_EQ(s.config_path, "/etc/epx/tune.json");
  EXPECT_EQ(parse_env("naive", nullptr, nullptr).backend, Backend::kNaive);
  EXPECT_EQ(parse_env("allgather_reducescatter", nullptr, nullptr).backend,
            Backend::kAllgatherReduceScatter);
  EXPECT_EQ(parse_env(nullptr, "1", nullptr).timeout_ms, 1);
  EXPECT_EQ(parse_env(nullptr, "0010", nullptr).timeout_ms, 10);
  EXPECT_EQ(parse_env(nullptr, "86400000", nullptr).timeout_ms, kMaxTimeoutMs);
}

TEST(Env, BadBackend) {
  EXPECT_TRUE(throws_config_error(
      [] { parse_env("fast", nullptr, nullptr); },
      {"EPX_BACKEND = \"fast\"", "naive, allgather_reducescatter, low_latency"}));
  EXPECT_TRUE(throws_config_error([] { parse_env("", nullptr, nullptr); }, {"EPX_BACKEND"}));
  EXPECT_TRUE(
      throws_config_error([] { parse_env("low_latency ", nullptr, nullptr); }, {"EPX_BACKEND"}));
}

TEST(Env, BadTimeout) {
  for (const char* text : {"10s", "", "-1", "1e3", "0", " 5", "5 ", "+5", "0x10", "1.5", "86400001",
                           "99999999999999999999999"}) {
    EXPECT_TRUE(throws_config_error([&] { parse_env(nullptr, text, nullptr); },
                                    {"EPX_TIMEOUT_MS", "[1, 86400000]"}))
        << '"' << text << '"';
  }
}

TEST(Env, BadConfigPath) {
  EXPECT_TRUE(throws_config_error([] { parse_env(nullptr, nullptr, ""); }, {"EPX_CONFIG_PATH"}));
}

TEST(Env, ReadsTheProcessEnvironment) {
  ScopedEnv backend("EPX_BACKEND", "allgather_reducescatter");
  ScopedEnv timeout("EPX_TIMEOUT_MS", "1234");
  ScopedEnv config("EPX_CONFIG_PATH", nullptr);
  EnvSettings s = read_env();
  EXPECT_EQ(s.backend, Backend::kAllgatherReduceScatter);
  EXPECT_EQ(s.timeout_ms, 1234);
  EXPECT_FALSE(s.config_path.has_value());
  ScopedEnv bad_timeout("EPX_TIMEOUT_MS", "10s");
  EXPECT_TRUE(throws_config_error([] { read_env(); }, {"EPX_TIMEOUT_MS = \"10s\""}));
}

TEST(HardwareQueues, ParsesCudaDeviceMaxConnections) {
  EXPECT_EQ(hardware_queues_per_gpu(nullptr), 8);  // CUDA's default
  EXPECT_EQ(hardware_queues_per_gpu("1"), 1);
  EXPECT_EQ(hardware_queues_per_gpu("32"), 32);
  for (const char* bad : {"0", "33", "", "8x", "-4", "1000"}) {
    EXPECT_TRUE(throws_config_error([bad] { (void)hardware_queues_per_gpu(bad); },
                                    {"CUDA_DEVICE_MAX_CONNECTIONS = \"" + std::string(bad) + "\"",
                                     "1..32"}))
        << bad;
  }
}

TEST(Env, StrictDecimal) {
  EXPECT_EQ(env::parse_decimal("EPX_X", "0", 0, 10, "in [0, 10]"), 0);
  EXPECT_EQ(env::parse_decimal("EPX_X", "007", 0, 10, "in [0, 10]"), 7);
  EXPECT_EQ(env::parse_decimal("EPX_X", "10", 0, 10, "in [0, 10]"), 10);
  for (const char* text : {"11", "", "-1", "+1", " 1", "1 ", "1e1", "0x1", "1.0", "ten"}) {
    EXPECT_TRUE(throws_config_error([&] { env::parse_decimal("EPX_X", text, 0, 10, "in [0, 10]"); },
                                    {"EPX_X = \"" + std::string(text) + "\", expected in [0, 10]"}))
        << '"' << text << '"';
  }
  EXPECT_EQ(env::parse_timeout_ms("EPX_TIMEOUT_MS", "250"), 250);
  EXPECT_TRUE(throws_config_error([] { env::parse_timeout_ms("EPX_TIMEOUT_MS", "0"); },
                                  {"EPX_TIMEOUT_MS = \"0\"", "[1, 86400000]"}));
}

TEST(Env, NcclLibrary) {
  EXPECT_EQ(env::parse_nccl_library(nullptr), "libnccl.so.2");
  EXPECT_EQ(env::parse_nccl_library(""), "libnccl.so.2");
  EXPECT_EQ(env::parse_nccl_library("/opt/nccl/lib/libnccl.so.2"), "/opt/nccl/lib/libnccl.so.2");
}


TEST(Env, GettersReadTheProcessEnvironment) {
  {
    ScopedEnv timeout("EPX_TIMEOUT_MS", nullptr);
    ScopedEnv library("EPX_NCCL_LIBRARY", nullptr);
    ScopedEnv queues("CUDA_DEVICE_MAX_CONNECTIONS", nullptr);
    ScopedEnv ablate("EPX_ABLATE", nullptr);
    EXPECT_EQ(env::timeout_ms(), EpConfig{}.timeout_ms);
    EXPECT_EQ(env::nccl_library(), "libnccl.so.2");
    EXPECT_EQ(env::hardware_queues_per_gpu(), 8);
    EXPECT_EQ(env::ablate_text(), "");
  }
  {
    ScopedEnv timeout("EPX_TIMEOUT_MS", "4321");
    ScopedEnv library("EPX_NCCL_LIBRARY", "/x/libnccl.so");
    ScopedEnv queues("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    ScopedEnv ablate("EPX_ABLATE", "payload,pull");
    EXPECT_EQ(env::timeout_ms(), 4321);
    EXPECT_EQ(env::nccl_library(), "/x/libnccl.so");
    EXPECT_EQ(env::hardware_queues_per_gpu(), 32);
    EXPECT_EQ(env::ablate_text(), "payload,pull");
  }
  {
    ScopedEnv timeout("EPX_TIMEOUT_MS", "1s");
    ScopedEnv queues("CUDA_DEVICE_MAX_CONNECTIONS", "64");
    EXPECT_TRUE(throws_config_error([] { env::timeout_ms(); }, {"EPX_TIMEOUT_MS = \"1s\""}));
    EXPECT_TRUE(throws_config_error([] { env::hardware_queues_per_gpu(); },
                                    {"CUDA_DEVICE_MAX_CONNECTIONS = \"64\"", "1..32"}));
  }
}

// ---- errors ---------------------------------------------------------------------------------

TEST(Errors, CodeNames) {
  EXPECT_STREQ(to_string(ErrorCode::kOk), "ok");
  EXPECT_STREQ(to_string(ErrorCode::kConfig), "config");
  EXPECT_STREQ(to_string(ErrorCode::kInput), "input");
  EXPECT_STREQ(to_string(ErrorCode::kTimeout), "timeout");
  EXPECT_STREQ(to_string(ErrorCode::kPeer), "peer");
  EXPECT_STREQ(to_string(ErrorCode::kCuda), "cuda");
  EXPECT_STREQ(to_string(ErrorCode::kState), "state");
  EXPECT_STREQ(to_string(ErrorCode::kUnsupported), "unsupported");
  EXPECT_STREQ(to_string(static_cast<ErrorCode>(99)), "unknown");
}

TEST(Errors, LocatedKeepsOnlyTheFileName) {
  EXPECT_EQ(detail::located("boom", "/a/b/c/file.cpp", 42), "boom (file.cpp:42)");
  EXPECT_EQ(detail::located("boom", "file.cpp", 7), "boom (file.cpp:7)");
  EXPECT_EQ(detail::located("x", "C:\\src\\w.cpp", 1), "x (w.cpp:1)");
}

TEST(Errors, CheckMacroThrowsTheRequestedType) {
  const int tokens = 300;
  try {
    EPX_CHECK(tokens <= 256, InputError, "num_tokens", tokens, "<= max_tokens_per_rank = 256");
    FAIL() << "EPX_CHECK did not throw";
  } catch (const InputError& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInput);
    const std::string msg = e.what();
    EXPECT_EQ(
        msg.rfind("num_tokens = 300, expected <= max_tokens_per_rank = 256 (test_config.cpp:", 0),
        0u)
        << msg;
  }
  EXPECT_NO_THROW(EPX_CHECK(tokens > 0, InputError, "num_tokens", tokens, "> 0"));
  EXPECT_THROW(EPX_THROW(StateError, std::string("refused")), Error);
}

}  // namespace
}  // namespace epx
