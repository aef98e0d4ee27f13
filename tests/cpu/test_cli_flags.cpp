// The CLI's flags module (apps/epx/flags.hpp) on the CPU: every parser on good and bad input,
// and the shape flags turned into an EpConfig by EpConfig::validate() alone, whose messages must
// name the flag, the value and the bound.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <climits>
#include <optional>
#include <string>
#include <vector>

#include "epx/error.hpp"
#include "scoped_env.hpp"
#include "flags.hpp"

namespace epx::cli {
namespace {

// Runs `f`, which must throw ConfigError; returns its message ("" when it did not throw).
template <typename F>
std::string config_error(F f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError";
  return "";
}

#define EXPECT_MESSAGE_HAS(message, part) \
  EXPECT_NE((message).find(part), std::string::npos) << (message)


// ---- values ------------------------------------------------------------------------------------

TEST(CliFlags, CheckRangeNamesFlagValueAndBound) {
  check_range("--iters", 50, 50, 100);
  EXPECT_MESSAGE_HAS(config_error([] { check_range("--iters", 10, 50, 100, "p90"); }),
                     "--iters = 10, expected in [50, 100] (p90)");
  EXPECT_MESSAGE_HAS(config_error([] { check_range("--n", -1, 0, INT64_MAX); }),
                     "--n = -1, expected at least 0");
}

TEST(CliFlags, IntListGoodInput) {
  EXPECT_EQ(parse_int_list("4,8,16", "--blocks", 1, 1024), (std::vector<int>{4, 8, 16}));
  EXPECT_EQ(parse_int_list("7", "--blocks", 1, 1024), (std::vector<int>{7}));
  EXPECT_EQ(parse_int_list("2,2", "--x", 1, 4, "", Repeats::kAllowed), (std::vector<int>{2, 2}));
}

TEST(CliFlags, IntListBadInput) {
  EXPECT_MESSAGE_HAS(config_error([] { parse_int_list("4,x", "--blocks", 1, 1024); }),
                     "--blocks: 'x' is not an integer, expected integers in [1, 1024]");
  EXPECT_MESSAGE_HAS(config_error([] { parse_int_list("4,2000", "--blocks", 1, 1024); }),
                     "--blocks = 2000, expected in [1, 1024]");
  EXPECT_MESSAGE_HAS(config_error([] { parse_int_list("4,4", "--blocks", 1, 1024); }),
                     "--blocks = '4,4' lists 4 twice, expected each value once");
  EXPECT_MESSAGE_HAS(config_error([] { parse_int_list("4,,8", "--blocks", 1, 1024); }),
                     "--blocks = '4,,8' has an empty item");
  EXPECT_MESSAGE_HAS(config_error([] { parse_int_list("4,", "--blocks", 1, 1024); }),
                     "--blocks = '4,', expected a non-empty comma list");
  EXPECT_MESSAGE_HAS(config_error([] { parse_int_list("", "--blocks", 1, 1024); }),
                     "--blocks = '', expected a non-empty comma list");
  EXPECT_MESSAGE_HAS(config_error([] { parse_int_list("4.5", "--blocks", 1, 1024); }),
                     "--blocks: '4.5' is not an integer");
}

TEST(CliFlags, TokenCountsPerRank) {
  EXPECT_EQ(parse_token_counts("0,7,128,128", "--tokens"), (std::vector<int>{0, 7, 128, 128}));
  EXPECT_EQ(tokens_per_rank({128}, 3, "--tokens", "128"), (std::vector<int>{128, 128, 128}));
  EXPECT_EQ(tokens_per_rank({0, 7}, 2, "--tokens", "0,7"), (std::vector<int>{0, 7}));
  EXPECT_MESSAGE_HAS(config_error([] { parse_token_counts("-1", "--tokens"); }),
                     "--tokens = -1, expected in [0, 65536] (tokens of one rank)");
  EXPECT_MESSAGE_HAS(config_error([] { parse_token_counts("70000", "--tokens"); }),
                     "--tokens = 70000, expected in [0, 65536]");
  EXPECT_MESSAGE_HAS(config_error([] { parse_token_counts("12a", "--tokens"); }),
                     "--tokens: '12a' is not an integer");
  EXPECT_MESSAGE_HAS(config_error([] {
                       tokens_per_rank({1, 2, 3}, 4, "--tokens", "1,2,3");
                     }),
                     "--tokens = '1,2,3' has 3 counts, expected one count or 4");
}

TEST(CliFlags, Routing) {
  EXPECT_EQ(parse_routing_flag("uniform"), ref::RoutingKind::kUniform);
  EXPECT_EQ(parse_routing_flag("skew"), ref::RoutingKind::kSkewed);
  EXPECT_EQ(parse_routing_flag("one-expert"), ref::RoutingKind::kOneExpert);
  EXPECT_EQ(parse_routing_flag("masked"), ref::RoutingKind::kMasked);
  EXPECT_MESSAGE_HAS(config_error([] { parse_routing_flag("zipf"); }),
                     "--routing = 'zipf', expected one of uniform, skew, one-expert, masked");
}

TEST(CliFlags, NamedValuesSpeakOfTheirFlag) {
  EXPECT_EQ(parse_backend_flag("naive", "--backends"), Backend::kNaive);
  EXPECT_MESSAGE_HAS(config_error([] { parse_backend_flag("fastest", "--backends"); }),
                     "--backends = \"fastest\", expected one of naive, allgather_reducescatter, "
                     "low_latency");
  EXPECT_EQ(parse_dtype_flag("bf16-to-fp8"), DispatchDtype::kBF16ToFP8);
  EXPECT_MESSAGE_HAS(config_error([] { parse_dtype_flag("fp4"); }),
                     "--dtype = \"fp4\", expected one of bf16, fp8, bf16-to-fp8");
  EXPECT_EQ(parse_layout_flag("expert"), OutputLayout::kExpertMajor);
  EXPECT_MESSAGE_HAS(config_error([] { parse_layout_flag("row"); }),
                     "--layout = \"row\", expected one of token, expert");
  EXPECT_EQ(parse_scale_layout_flag("column"), ScaleLayout::kColumnMajor);
  EXPECT_MESSAGE_HAS(config_error([] { parse_scale_layout_flag("token"); }),
                     "--scale-layout = \"token\", expected one of row, column");
}

TEST(CliFlags, BackendListInOrderEachOnce) {
  EXPECT_EQ(parse_backend_list("low_latency,naive", "--backends"),
            (std::vector<Backend>{Backend::kLowLatency, Backend::kNaive}));
  EXPECT_EQ(parse_backend_list("allgather_reducescatter", "--backends"),
            (std::vector<Backend>{Backend::kAllgatherReduceScatter}));
  EXPECT_MESSAGE_HAS(
      config_error([] { parse_backend_list("naive,low_latency,naive", "--backends"); }),
      "--backends = 'naive,low_latency,naive' lists naive twice, expected each "
      "backend once");
  EXPECT_MESSAGE_HAS(config_error([] { parse_backend_list("naive,fastest", "--backends"); }),
                     "--backends = \"fastest\", expected one of naive, allgather_reducescatter, "
                     "low_latency");
  EXPECT_MESSAGE_HAS(config_error([] { parse_backend_list("naive,", "--backends"); }),
                     "--backends = 'naive,', expected a non-empty comma list");
  EXPECT_MESSAGE_HAS(config_error([] { parse_backend_list("", "--backends"); }),
                     "--backends = '', expected a non-empty comma list");
}

TEST(CliFlags, BackendFromFlagThenEnvironment) {
  {
    ScopedEnv unset("EPX_BACKEND", nullptr);
    EXPECT_EQ(backend_or_env("", "--backend"), Backend::kLowLatency);
    EXPECT_EQ(backend_or_env("naive", "--backend"), Backend::kNaive);
  }
  ScopedEnv set("EPX_BACKEND", "allgather_reducescatter");
  EXPECT_EQ(backend_or_env("", "--backend"), Backend::kAllgatherReduceScatter);
  EXPECT_EQ(backend_or_env("low_latency", "--backend"), Backend::kLowLatency);
}

// `epx bench --combine-format bf16,logfmt`: each format once, in the order given.
TEST(CliFlags, CombineFormatList) {
  EXPECT_EQ(parse_combine_format_list("bf16", "--combine-format"),
            (std::vector<CombineFormat>{CombineFormat::kBF16}));
  EXPECT_EQ(parse_combine_format_list("logfmt,bf16", "--combine-format"),
            (std::vector<CombineFormat>{CombineFormat::kLogFMT, CombineFormat::kBF16}));
  EXPECT_MESSAGE_HAS(config_error([] { parse_combine_format_list("bf16,lgofmt", "--cf"); }),
                     "--cf = \"lgofmt\", expected one of bf16, logfmt");
  EXPECT_MESSAGE_HAS(config_error([] { parse_combine_format_list("logfmt,logfmt", "--cf"); }),
                     "--cf = 'logfmt,logfmt' lists logfmt twice, expected each format once");
  EXPECT_MESSAGE_HAS(config_error([] { parse_combine_format_list("bf16,", "--cf"); }),
                     "--cf = 'bf16,'");
}

TEST(CliFlags, OneSpellingPerWorldKind) {
  EXPECT_EQ(parse_world_kind("in-process"), WorldKind::kInProcess);
  EXPECT_EQ(parse_world_kind("ipc"), WorldKind::kIpc);
  EXPECT_EQ(parse_world_kind("nccl"), WorldKind::kNccl);
  for (WorldKind k : {WorldKind::kInProcess, WorldKind::kIpc, WorldKind::kNccl})
    EXPECT_EQ(parse_world_kind(to_string(k)), k);
  EXPECT_FALSE(one_process_per_rank(WorldKind::kInProcess));
  EXPECT_TRUE(one_process_per_rank(WorldKind::kIpc));
  EXPECT_MESSAGE_HAS(config_error([] { parse_world_kind("inproc"); }),
                     "--world-kind = 'inproc', expected one of in-process, ipc, nccl");
}

// ---- shape --------------------------------------------------------------------------------------

TEST(CliFlags, ShapeDefaultsAreDeepSeekR1OnEightRanks) {
  ScopedEnv unset("EPX_TIMEOUT_MS", nullptr);
  const ShapeFlags f;
  const EpConfig cfg = f.config(128);
  EXPECT_EQ(cfg.world_size, 8);
  EXPECT_EQ(cfg.hidden, 7168);
  EXPECT_EQ(cfg.num_experts, 256);
  EXPECT_EQ(cfg.topk, 8);
  EXPECT_EQ(cfg.max_tokens_per_rank, 128);
  EXPECT_EQ(cfg.dtype, DispatchDtype::kBF16ToFP8);
  EXPECT_EQ(cfg.layout, OutputLayout::kTokenMajor);
  EXPECT_EQ(cfg.scale_layout, ScaleLayout::kRowMajor);
  EXPECT_EQ(cfg.combine_format, CombineFormat::kBF16);
  EXPECT_EQ(cfg.timeout_ms, EpConfig{}.timeout_ms);
  EXPECT_EQ(f.devices(), (std::vector<int>{0}));
}

TEST(CliFlags, ShapeMaxTokensAndTimeout) {
  ShapeFlags f;
  f.max_tokens = 256;
  EXPECT_EQ(f.config(128).max_tokens_per_rank, 256);  // --max-tokens wins over the largest count
  {
    ScopedEnv env("EPX_TIMEOUT_MS", "1234");
    EXPECT_EQ(f.config(128).timeout_ms, 1234);
    f.timeout_ms = 99;
    EXPECT_EQ(f.config(128).timeout_ms, 99);  // --timeout-ms wins over EPX_TIMEOUT_MS
  }
  f.gpus = 2;
  EXPECT_EQ(f.devices(), (std::vector<int>{0, 1}));
}

// The messages come from EpConfig::validate(), in flag names.
TEST(CliFlags, ShapeErrorsNameFlagValueAndBound) {
  auto error_of = [](auto edit, int tokens = 128, const char* tokens_flag = "--tokens") {
    ShapeFlags f;
    edit(f);
    return config_error([&] { (void)f.config(tokens, tokens_flag); });
  };
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags& f) { f.experts = 100; }),
                     "--experts = 100, expected a multiple of --world = 8");
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags& f) { f.experts = 4; }),
                     "--experts = 4, expected >= --world = 8");
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags& f) { f.topk = 40; }),
                     "--topk = 40, expected in [1, min(kMaxTopk = 32, --experts = 256)] = [1, 32]");
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags& f) { f.world = 65; }),
                     "--world = 65, expected in [1, kMaxRanks = 64]");
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags& f) { f.hidden = 100; }),
                     "--hidden = 100, expected a multiple of 8");
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags& f) { f.hidden = 1000; }),
                     "--hidden = 1000, expected a multiple of kFp8BlockSize = 128 for --dtype "
                     "bf16-to-fp8");
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags& f) { f.timeout_ms = -5; }),
                     "--timeout-ms = -5, expected in [1, kMaxTimeoutMs = 86400000]");
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags& f) { f.dtype = "fp16"; }),
                     "--dtype = \"fp16\", expected one of bf16, fp8, bf16-to-fp8");
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags& f) { f.combine_format = "fp8"; }),
                     "--combine-format = \"fp8\", expected one of bf16, logfmt");
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags& f) {
                       f.dtype = "bf16";
                       f.hidden = 1000;
                       f.combine_format = "logfmt";
                     }),
                     "--combine-format = logfmt, expected bf16 with --hidden = 1000 (LogFMT "
                     "rows need --hidden a multiple of 128)");
  // max_tokens_per_rank is named after the flag it came from.
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags&) {}, 70000),
                     "--tokens = 70000, expected in [1, kMaxTokensPerRank = 65536]");
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags&) {}, 0, "--tokens (the largest)"),
                     "--tokens (the largest) = 0, expected in [1");
  EXPECT_MESSAGE_HAS(error_of([](ShapeFlags& f) { f.max_tokens = -3; }),
                     "--max-tokens = -3, expected in [1, kMaxTokensPerRank = 65536]");
  ShapeFlags f;
  f.gpus = 9;
  EXPECT_MESSAGE_HAS(config_error([&] { (void)f.devices(); }),
                     "--gpus = 9, expected in [1, 8] (at most one GPU per rank of --world)");
}

TEST(CliFlags, FieldNamesBecomeFlagsInOnePass) {
  EXPECT_EQ(in_flag_names("scale_layout = 3, expected one of row, column", "--tokens"),
            "--scale-layout = 3, expected one of row, column");
  EXPECT_EQ(in_flag_names("topk = 0, expected in [1, min(kMaxTopk = 32, num_experts = 8)]", "--t"),
            "--topk = 0, expected in [1, min(kMaxTopk = 32, --experts = 8)]");
  EXPECT_EQ(in_flag_names("max_tokens_per_rank = 0 (config.cpp:150)", "--max-tokens"),
            "--max-tokens = 0 (config.cpp:150)");
}

TEST(CliFlags, ShapeFlagsBindToCommandLine) {
  CLI::App app;
  ShapeFlags f;
  add_shape_flags(&app, f, MaxTokensFlag::kOffered);
  app.parse(
      "--world 4 --gpus 2 --hidden 2048 --experts 16 --topk 4 --max-tokens 64 --dtype fp8 "
      "--layout expert --scale-layout column --timeout-ms 500 --combine-format logfmt",
      false);
  const EpConfig cfg = f.config(7);
  EXPECT_EQ(cfg.world_size, 4);
  EXPECT_EQ(cfg.hidden, 2048);
  EXPECT_EQ(cfg.num_experts, 16);
  EXPECT_EQ(cfg.topk, 4);
  EXPECT_EQ(cfg.max_tokens_per_rank, 64);
  EXPECT_EQ(cfg.dtype, DispatchDtype::kFP8);
  EXPECT_EQ(cfg.layout, OutputLayout::kExpertMajor);
  EXPECT_EQ(cfg.scale_layout, ScaleLayout::kColumnMajor);
  EXPECT_EQ(cfg.timeout_ms, 500);
  EXPECT_EQ(cfg.combine_format, CombineFormat::kLogFMT);
  EXPECT_EQ(f.devices(), (std::vector<int>{0, 1}));

  CLI::App sweep_app;
  SweepFlags s;
  add_sweep_flags(&sweep_app, s);
  EXPECT_THROW(sweep_app.parse("--max-tokens 64", false), CLI::ExtrasError);
}

TEST(CliFlags, OneProcessPerRankTakesTheWorldFromTheEnvironment) {
  ScopedEnv rank("EPX_RANK", "1");
  ScopedEnv size("EPX_WORLD_SIZE", "4");
  ScopedEnv address("EPX_BOOTSTRAP", "@epx-cli-flags-test");
  ShapeFlags f;
  take_world_from_env(f, false, "epx check");  // --world left out: EPX_WORLD_SIZE
  EXPECT_EQ(f.world, 4);
  take_world_from_env(f, true, "epx check");  // given and equal
  EXPECT_EQ(f.world, 4);
  f.world = 8;
  EXPECT_MESSAGE_HAS(config_error([&] { take_world_from_env(f, true, "epx bench"); }),
                     "--world = 8, expected EPX_WORLD_SIZE = 4 with one process per rank (run "
                     "`epx launch -n 8 -- epx bench --world-kind ipc ...`, or leave --world out)");
}

TEST(CliFlags, SweepValidatesEveryTokenCount) {
  SweepFlags f;
  const Sweep s = make_sweep(f);
  EXPECT_EQ(s.tokens, (std::vector<int>{128, 4096}));
  EXPECT_EQ(s.cfg.max_tokens_per_rank, 4096);
  EXPECT_EQ(s.config_for(128).max_tokens_per_rank, 128);
  EXPECT_EQ(s.routing, ref::RoutingKind::kUniform);
  EXPECT_EQ(s.devices, (std::vector<int>{0}));
  f.tokens = "128,128";
  EXPECT_MESSAGE_HAS(config_error([&] { (void)make_sweep(f); }), "--tokens = '128,128' lists 128");
  f.tokens = "0";
  EXPECT_MESSAGE_HAS(config_error([&] { (void)make_sweep(f); }),
                     "--tokens = 0, expected in [1, 65536] (max_tokens_per_rank of its group)");
  f.tokens = "128";
  f.routing = "hot";
  EXPECT_MESSAGE_HAS(config_error([&] { (void)make_sweep(f); }), "--routing = 'hot'");
  f.routing = "skew";
  f.shape.experts = 12;
  EXPECT_MESSAGE_HAS(config_error([&] { (void)make_sweep(f); }),
                     "--experts = 12, expected a multiple of --world = 8");
}

// ---- environment -------------------------------------------------------------------------------

TEST(CliFlags, LaunchSourceSaysWhetherAFileGaveTheShapes) {
  {
    ScopedEnv unset("EPX_CONFIG_PATH", nullptr);
    const LaunchSource s = launch_from_env();
    EXPECT_FALSE(s.from_file);
    EXPECT_EQ(s.origin, "backend defaults");
    EXPECT_EQ(s.launch.dispatch.num_blocks, 0);
  }
  char path[] = "/tmp/epx_launch_XXXXXX";
  const int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  const std::string text = R"({"global": {"num_blocks": 8}})";
  ASSERT_EQ(::write(fd, text.data(), text.size()), ssize_t(text.size()));
  ::close(fd);
  {
    ScopedEnv set("EPX_CONFIG_PATH", path);
    const LaunchSource s = launch_from_env();
    EXPECT_TRUE(s.from_file);
    EXPECT_EQ(s.origin, std::string("EPX_CONFIG_PATH=") + path);
    EXPECT_EQ(s.launch.dispatch.num_blocks, 8);
  }
  ::unlink(path);
}

}  // namespace
}  // namespace epx::cli
