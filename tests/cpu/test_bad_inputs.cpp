// The catalogue of bad inputs (docs/reliability.md, "Bad inputs"): what users get wrong through
// each surface — the C++ API, JSON launch files, environment variables, the bootstrap, ranks that
// disagree, and the `epx` command line — each with the error it must raise and the words its
// message must hold (the argument, the value, the bound). Every CPU-side case runs here; the
// GPU-side cases (tests/gpu/bad_inputs_gpu_cases.hpp) run on a GPU and are counted and
// documented here. The doc's table is generated from this file and checked against it:
// EPX_WRITE_DOCS=1 rewrites it instead.

#include <gtest/gtest.h>

#include <climits>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../gpu/bad_inputs_gpu_cases.hpp"
#include "bootstrap_harness.hpp"
#include "epx/bootstrap.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "scoped_env.hpp"

#ifndef EPX_CLI_PATH
#error "EPX_CLI_PATH (the epx binary) must be defined by the build"
#endif
#ifndef EPX_SOURCE_DIR
#error "EPX_SOURCE_DIR (the repository, for docs/reliability.md) must be defined by the build"
#endif

namespace epx {
namespace {

enum class Surface { kApi, kJson, kEnv, kBootstrap, kRanks, kCli };

const char* to_string(Surface s) {
  switch (s) {
    case Surface::kApi:
      return "C++ API";
    case Surface::kJson:
      return "JSON file";
    case Surface::kEnv:
      return "environment";
    case Surface::kBootstrap:
      return "bootstrap";
    case Surface::kRanks:
      return "ranks disagree";
    case Surface::kCli:
      return "epx CLI";
  }
  return "?";
}

// What a case must do: throw an epx error of `code`, or (the CLI) exit with `exit_code`; either
// way with a message (stderr for the CLI) that contains every word.
struct Expect {
  ErrorCode code = ErrorCode::kOk;
  int exit_code = -1;  // CLI cases only
  std::vector<std::string> words;
};

// What a case did.
struct Observed {
  bool epx_error = false;  // threw an epx::Error (API) / ran to an exit (CLI)
  ErrorCode code = ErrorCode::kOk;
  int exit_code = -1;
  std::string message;
};

struct Case {
  std::string id;
  Surface surface;
  std::string input;  // as the doc shows it
  std::function<Observed()> run;
  Expect expect;
};

// ---- running --------------------------------------------------------------------------------

Observed observe(const std::function<void()>& call) {
  const Outcome o = run_rank(call, Clock::now());
  Observed out;
  out.epx_error = o.epx_error;
  out.code = o.code;
  out.message = o.message;
  if (o.ok) out.message = "(returned normally)";
  return out;
}

// The `epx` binary with these arguments and extra environment.
Observed run_cli(const std::vector<std::string>& args,
                 const std::vector<std::pair<std::string, std::string>>& env) {
  std::vector<std::string> argv = {EPX_CLI_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  const CommandResult r = run_command(argv, env);
  Observed out;
  out.epx_error = true;
  out.exit_code = exit_code(r);
  out.message = r.err;
  return out;
}

::testing::AssertionResult meets(const Case& c, const Expect& e, const Observed& o) {
  if (c.surface == Surface::kCli) {
    if (o.exit_code != e.exit_code) {
      return ::testing::AssertionFailure() << c.id << ": exit code " << o.exit_code << ", expected "
                                           << e.exit_code << "; stderr:\n"
                                           << o.message;
    }
  } else if (!o.epx_error || o.code != e.code) {
    return ::testing::AssertionFailure()
           << c.id << ": " << (o.epx_error ? to_string(o.code) : "no epx error") << ", expected "
           << to_string(e.code) << ": " << o.message;
  }
  for (const std::string& w : e.words) {
    if (o.message.find(w) == std::string::npos) {
      return ::testing::AssertionFailure() << c.id << ": message lacks \"" << w << "\":\n"
                                           << o.message;
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- the catalogue ----------------------------------------------------------------------------

using Env = std::vector<std::pair<std::string, std::string>>;

class Catalogue {
 public:
  Catalogue() { build(); }
  const std::vector<Case>& cases() const { return cases_; }

 private:
  void api(std::string id, std::string input, std::function<void()> call, ErrorCode code,
           std::vector<std::string> words, Surface surface = Surface::kApi) {
    cases_.push_back({std::move(id),
                      surface,
                      std::move(input),
                      [call = std::move(call)] { return observe(call); },
                      {code, -1, std::move(words)}});
  }
  void config(std::string id, std::string input, const std::function<void(EpConfig&)>& edit,
              std::vector<std::string> words) {
    EpConfig cfg;  // the DeepSeek-R1 shape on one rank of 8
    cfg.world_size = 8;
    edit(cfg);
    api(
        std::move(id), "EpConfig{" + input + "}.validate()", [cfg] { cfg.validate(); },
        ErrorCode::kConfig, std::move(words));
  }
  void json(std::string id, std::string text, std::vector<std::string> words) {
    api(
        std::move(id), text.empty() ? "(empty text)" : "`" + text + "`",
        [text] { (void)parse_launch_configs(text, "launch.json"); }, ErrorCode::kConfig,
        std::move(words), Surface::kJson);
  }
  void env(std::string id, std::string input, std::function<void()> call,
           std::vector<std::string> words) {
    api(std::move(id), std::move(input), std::move(call), ErrorCode::kConfig, std::move(words),
        Surface::kEnv);
  }
  // BootstrapOptions::parse_env(EPX_RANK, EPX_WORLD_SIZE, EPX_BOOTSTRAP, EPX_TIMEOUT_MS).
  void bootstrap_env(std::string id, const char* rank, const char* world, const char* address,
                     std::vector<std::string> words) {
    auto shown = [](const char* name, const char* v) {
      return v == nullptr ? std::string() : std::string(name) + "=" + v + " ";
    };
    std::string input =
        shown("EPX_RANK", rank) + shown("EPX_WORLD_SIZE", world) + shown("EPX_BOOTSTRAP", address);
    input.pop_back();
    const std::string r = rank ? rank : "", w = world ? world : "", a = address ? address : "";
    const bool has_r = rank, has_w = world, has_a = address;
    api(
        std::move(id), input,
        [=] {
          (void)BootstrapOptions::parse_env(has_r ? r.c_str() : nullptr,
                                            has_w ? w.c_str() : nullptr,
                                            has_a ? a.c_str() : nullptr, nullptr);
        },
        ErrorCode::kConfig, std::move(words), Surface::kEnv);
  }
  // Three ranks on a framework-style all-gather; vary(rank, cfg, backend) makes them differ.
  // Every rank must fail, each naming itself; the message is all three messages.
  void ranks(std::string id, std::string input, std::function<void(int, EpConfig&, Backend&)> vary,
             std::vector<std::string> words) {
    words.insert(words.end(), {"rank 0 of 3", "rank 1 of 3", "rank 2 of 3"});
    cases_.push_back({std::move(id),
                      Surface::kRanks,
                      std::move(input),
                      [vary = std::move(vary)] {
                        ThreadAllGather gather(3);
                        const std::vector<Outcome> outs = run_threads(3, [&](int r) {
                          CallbackBootstrap b(
                              r, 3, [&, r](const std::string& bytes) { return gather(r, bytes); });
                          EpConfig cfg = job_config();
                          cfg.rank = r;
                          Backend backend = Backend::kLowLatency;
                          vary(r, cfg, backend);
                          check_fingerprints(b, cfg, backend);
                        });
                        Observed o;
                        o.epx_error = true;
                        o.code = outs[0].code;
                        for (const Outcome& out : outs) {
                          if (!out.epx_error || out.code != o.code) o.epx_error = false;
                          o.message += out.message + "\n";
                        }
                        return o;
                      },
                      {ErrorCode::kConfig, -1, std::move(words)}});
  }
  // `shown_env` stands for `env` in the doc where a value differs from run to run (a path).
  void cli(std::string id, std::vector<std::string> args, std::vector<std::string> words,
           Env env = {}, int exit_code = 2, const std::string& shown_env = "") {
    std::string input = shown_env.empty() ? "" : shown_env + " ";
    if (shown_env.empty()) {
      for (const auto& [k, v] : env) input += k + "=" + v + " ";
    }
    input += "epx";
    for (const std::string& a : args) input += " " + (a.empty() ? std::string("''") : a);
    cases_.push_back({std::move(id),
                      Surface::kCli,
                      input,
                      [args = std::move(args), env = std::move(env)] { return run_cli(args, env); },
                      {ErrorCode::kOk, exit_code, std::move(words)}});
  }

  void build();

  TempDir dir_;
  std::vector<Case> cases_;
};

void Catalogue::build() {
  // ---- EpConfig::validate(): shapes, enums, bounds ------------------------------------------
  config("config.world_size_above_64", "world_size = 65", [](EpConfig& c) { c.world_size = 65; },
         {"world_size = 65", "[1, kMaxRanks = 64]"});
  config("config.world_size_zero", "world_size = 0", [](EpConfig& c) { c.world_size = 0; },
         {"world_size = 0", "[1, kMaxRanks = 64]"});
  config("config.rank_not_below_world", "rank = 8, world_size = 8", [](EpConfig& c) { c.rank = 8; },
         {"rank = 8", "[0, world_size = 8)"});
  config("config.rank_negative", "rank = -1", [](EpConfig& c) { c.rank = -1; },
         {"rank = -1", "[0, world_size = 8)"});
  config("config.hidden_fp8_not_multiple_of_128", "dtype = fp8, hidden = 7176",
         [](EpConfig& c) {
           c.dtype = DispatchDtype::kFP8;
           c.hidden = 7176;
         },
         {"hidden = 7176", "a multiple of kFp8BlockSize = 128 for dtype fp8"});
  config("config.hidden_quantised_not_multiple_of_128", "dtype = bf16-to-fp8, hidden = 1000",
         [](EpConfig& c) { c.hidden = 1000; },
         {"hidden = 1000", "a multiple of kFp8BlockSize = 128 for dtype bf16-to-fp8"});
  config("config.hidden_bf16_not_multiple_of_8", "dtype = bf16, hidden = 2050",
         [](EpConfig& c) {
           c.dtype = DispatchDtype::kBF16;
           c.hidden = 2050;
         },
         {"hidden = 2050", "a multiple of 8"});
  config("config.hidden_huge", "hidden = 2^20", [](EpConfig& c) { c.hidden = 1 << 20; },
         {"hidden = 1048576", "[1, kMaxHidden = 65536]"});
  config("config.hidden_int_max", "hidden = INT_MAX", [](EpConfig& c) { c.hidden = INT_MAX; },
         {"hidden = 2147483647", "kMaxHidden = 65536"});
  config("config.topk_above_experts", "num_experts = 8, topk = 9",
         [](EpConfig& c) {
           c.num_experts = 8;
           c.topk = 9;
         },
         {"topk = 9", "num_experts = 8", "= [1, 8]"});
  config("config.topk_above_32", "topk = 33", [](EpConfig& c) { c.topk = 33; },
         {"topk = 33", "kMaxTopk = 32"});
  config("config.topk_zero", "topk = 0", [](EpConfig& c) { c.topk = 0; }, {"topk = 0", "[1, 32]"});
  config("config.experts_not_divisible_by_world", "num_experts = 100, world_size = 8",
         [](EpConfig& c) { c.num_experts = 100; },
         {"num_experts = 100", "a multiple of world_size = 8"});
  config("config.experts_below_world", "num_experts = 4, world_size = 8",
         [](EpConfig& c) { c.num_experts = 4; }, {"num_experts = 4", ">= world_size = 8"});
  config("config.too_many_tokens", "max_tokens_per_rank = 65537",
         [](EpConfig& c) { c.max_tokens_per_rank = 65537; },
         {"max_tokens_per_rank = 65537", "[1, kMaxTokensPerRank = 65536]"});
  config("config.no_tokens", "max_tokens_per_rank = 0",
         [](EpConfig& c) { c.max_tokens_per_rank = 0; },
         {"max_tokens_per_rank = 0", "[1, kMaxTokensPerRank = 65536]"});
  config("config.timeout_zero", "timeout_ms = 0", [](EpConfig& c) { c.timeout_ms = 0; },
         {"timeout_ms = 0", "[1, kMaxTimeoutMs = 86400000]"});
  config("config.timeout_negative", "timeout_ms = -1", [](EpConfig& c) { c.timeout_ms = -1; },
         {"timeout_ms = -1", "[1, kMaxTimeoutMs = 86400000]"});
  config("config.mask_with_ordered_rows", "mask_failed_ranks = true, deterministic = true",
         [](EpConfig& c) {
           c.mask_failed_ranks = true;
           c.deterministic = true;
         },
         {"mask_failed_ranks = true", "false with deterministic = true"});
  config("config.rounds_in_flight_three", "rounds_in_flight = 3",
         [](EpConfig& c) { c.rounds_in_flight = 3; },
         {"rounds_in_flight = 3", "[1, kMaxRoundsInFlight = 2]"});
  config("config.dtype_not_an_enum", "dtype = DispatchDtype(7)",
         [](EpConfig& c) { c.dtype = static_cast<DispatchDtype>(7); },
         {"dtype = 7", "one of bf16, fp8, bf16-to-fp8"});
  config("config.layout_not_an_enum", "layout = OutputLayout(5)",
         [](EpConfig& c) { c.layout = static_cast<OutputLayout>(5); },
         {"layout = 5", "one of token, expert"});
  config("config.round_scale_with_fp8_input", "dtype = fp8, round_scale = true",
         [](EpConfig& c) {
           c.dtype = DispatchDtype::kFP8;
           c.round_scale = true;
         },
         {"round_scale = true", "false with dtype fp8"});
  config("config.combine_not_an_enum", "combine = CombineMode(9)",
         [](EpConfig& c) { c.combine = static_cast<CombineMode>(9); },
         {"combine = 9", "one of auto, pull, push"});
  config("config.combine_format_not_an_enum", "combine_format = CombineFormat(2)",
         [](EpConfig& c) { c.combine_format = static_cast<CombineFormat>(2); },
         {"combine_format = 2", "one of bf16, logfmt"});
  config("config.combine_format_logfmt_hidden", "dtype = bf16, hidden = 1000, combine_format = logfmt",
         [](EpConfig& c) {
           c.dtype = DispatchDtype::kBF16;
           c.hidden = 1000;
           c.combine_format = CombineFormat::kLogFMT;
         },
         {"combine_format = logfmt", "bf16 with hidden = 1000", "a multiple of 128"});
  config("config.scale_layout_not_an_enum", "scale_layout = ScaleLayout(-1)",
         [](EpConfig& c) { c.scale_layout = static_cast<ScaleLayout>(-1); },
         {"scale_layout = -1", "one of row, column"});

  // ---- names of dtypes, layouts, backends -----------------------------------------------------
  api("names.dtype_fp4", "parse_dispatch_dtype(\"fp4\")", [] { parse_dispatch_dtype("fp4"); },
      ErrorCode::kConfig, {"dtype = \"fp4\"", "one of bf16, fp8, bf16-to-fp8"});
  api("names.dtype_upper_case", "parse_dispatch_dtype(\"BF16\")",
      [] { parse_dispatch_dtype("BF16"); }, ErrorCode::kConfig,
      {"dtype = \"BF16\"", "one of bf16, fp8, bf16-to-fp8"});
  api("names.layout_row", "parse_output_layout(\"row\")", [] { parse_output_layout("row"); },
      ErrorCode::kConfig, {"layout = \"row\"", "one of token, expert"});
  api("names.scale_layout_col", "parse_scale_layout(\"col\")", [] { parse_scale_layout("col"); },
      ErrorCode::kConfig, {"scale_layout = \"col\"", "one of row, column"});
  api("names.backend_empty", "parse_backend(\"\")", [] { parse_backend(""); }, ErrorCode::kConfig,
      {"backend = \"\"", "one of naive, allgather_reducescatter, low_latency"});

  // ---- bootstrap objects and options ----------------------------------------------------------
  const auto gather_nothing = [](const std::string&) { return std::vector<std::string>(2); };
  api(
      "bootstrap.callback_rank_not_below_size", "CallbackBootstrap(rank 3, size 3, f)",
      [=] { CallbackBootstrap b(3, 3, gather_nothing); }, ErrorCode::kConfig,
      {"rank = 3", "[0, size = 3)"}, Surface::kBootstrap);
  api(
      "bootstrap.callback_size_above_64", "CallbackBootstrap(rank 0, size 65, f)",
      [=] { CallbackBootstrap b(0, 65, gather_nothing); }, ErrorCode::kConfig,
      {"size = 65", "[1, kMaxRanks = 64]"}, Surface::kBootstrap);
  api(
      "bootstrap.callback_without_function", "CallbackBootstrap(rank 0, size 2, {})",
      [] { CallbackBootstrap b(0, 2, {}); }, ErrorCode::kConfig,
      {"all_gather = an empty function", "a callable that all-gathers bytes"}, Surface::kBootstrap);
  api(
      "bootstrap.callback_short_result", "size 3, the all-gather returns 2 strings",
      [=] {
        CallbackBootstrap b(0, 3, gather_nothing);
        (void)b.all_gather("x");
      },
      ErrorCode::kPeer, {"all_gather callback result size = 2", "3 (one entry per rank)"},
      Surface::kBootstrap);
  api(
      "bootstrap.callback_passes_no_fds", "CallbackBootstrap::all_gather_fds(0)",
      [=] {
        CallbackBootstrap b(0, 2, gather_nothing);
        (void)b.all_gather_fds(0);
      },
      ErrorCode::kUnsupported, {"cannot pass file descriptors", "CUDA IPC handles"},
      Surface::kBootstrap);
  api(
      "bootstrap.options_rank_not_below_world", "BootstrapOptions{rank 2, world_size 2}",
      [] {
        BootstrapOptions o;
        o.rank = 2;
        o.world_size = 2;
        o.address = "@epx-bad-inputs";
        o.validate();
      },
      ErrorCode::kConfig, {"rank = 2", "[0, world_size = 2)"}, Surface::kBootstrap);
  api(
      "bootstrap.options_timeout_zero", "BootstrapOptions{timeout_ms 0}",
      [] {
        BootstrapOptions o;
        o.timeout_ms = 0;
        o.validate();
      },
      ErrorCode::kConfig, {"timeout_ms = 0", "[1, kMaxTimeoutMs = 86400000]"}, Surface::kBootstrap);
  api(
      "bootstrap.options_address_too_long", "BootstrapOptions{address \"@\" + 108 bytes}",
      [] {
        BootstrapOptions o;
        o.world_size = 2;
        o.address = "@" + std::string(108, 'a');
        o.validate();
      },
      ErrorCode::kConfig, {"address = \"@aaa", "is 108 bytes long", "at most 107 (sockaddr_un)"},
      Surface::kBootstrap);
  api(
      "bootstrap.options_no_address_for_two", "BootstrapOptions{world_size 2, address \"\"}",
      [] {
        BootstrapOptions o;
        o.world_size = 2;
        o.validate();
      },
      ErrorCode::kConfig, {"address is empty", "all 2 ranks share"}, Surface::kBootstrap);
  api(
      "bootstrap.stale_socket_of_at", "remove_stale_socket_file(\"@\")",
      [] { (void)remove_stale_socket_file("@"); }, ErrorCode::kConfig,
      {"address = \"@\"", "\"@name\" or a socket file path"}, Surface::kBootstrap);

  // ---- ranks that disagree (check_fingerprints over an in-process all-gather) -------------------
  ranks("ranks.hidden_differs", "rank 2 has hidden 4096, the others 7168",
        [](int r, EpConfig& c, Backend&) {
          if (r == 2) c.hidden = 4096;
        },
        {"hidden: rank 0 has 7168, rank 2 has 4096"});
  ranks("ranks.backend_differs", "rank 1 runs naive, the others low_latency",
        [](int r, EpConfig&, Backend& b) {
          if (r == 1) b = Backend::kNaive;
        },
        {"backend: rank 0 has low_latency, rank 1 has naive"});
  ranks("ranks.dtype_differs", "rank 1 has dtype fp8, the others bf16-to-fp8",
        [](int r, EpConfig& c, Backend&) {
          if (r == 1) c.dtype = DispatchDtype::kFP8;
        },
        {"dtype: rank 0 has bf16-to-fp8, rank 1 has fp8"});
  ranks("ranks.max_tokens_differs", "rank 1 has max_tokens_per_rank 256, the others 128",
        [](int r, EpConfig& c, Backend&) {
          if (r == 1) c.max_tokens_per_rank = 256;
        },
        {"max_tokens_per_rank: rank 0 has 128, rank 1 has 256"});
  ranks("ranks.timeout_differs", "rank 2 has timeout_ms 5000 (its EPX_TIMEOUT_MS)",
        [](int r, EpConfig& c, Backend&) {
          if (r == 2) c.timeout_ms = 5000;
        },
        {"timeout_ms: rank 0 has 10000, rank 2 has 5000"});

  // ---- JSON launch files (parse_launch_configs, origin "launch.json") ---------------------------
  json("json.empty_text", "", {"launch.json: invalid JSON", "global, dispatch, combine"});
  json("json.truncated", R"({"global": {"num_blocks": 6)",
       {"launch.json: invalid JSON", "expected an object with keys global, dispatch, combine"});
  json("json.garbage", "\xff\xfe epx", {"launch.json: invalid JSON"});
  json("json.trailing_garbage", R"({"global": {}} x)", {"launch.json: invalid JSON"});
  json("json.top_level_array", R"([{"global": {}}])",
       {"launch.json: top level is a JSON array", "an object with keys global, dispatch, combine"});
  json("json.top_level_number", "64", {"top level is a JSON number", "global, dispatch, combine"});
  json("json.unknown_section", R"({"prefill": {"num_blocks": 8}})",
       {"launch.json: unknown key prefill", "one of global, dispatch, combine"});
  json("json.unknown_key", R"({"dispatch": {"num_warps": 4}})",
       {"unknown key dispatch.num_warps",
        "num_blocks (alias block_num), warps_per_block (alias warp_num_per_block)"});
  json("json.section_not_an_object", R"({"combine": 8})",
       {"combine is a JSON number", "expected an object with keys num_blocks"});
  json("json.section_null", R"({"global": null})",
       {"global is a JSON null", "expected an object with keys num_blocks"});
  json("json.string_value", R"({"dispatch": {"num_blocks": "64"}})",
       {"dispatch.num_blocks = \"64\" (a JSON string)", "an integer in [1, 1024]"});
  json("json.float_value", R"({"combine": {"warps_per_block": 8.5}})",
       {"combine.warps_per_block = 8.5 (a JSON number)", "an integer in [1, 32]"});
  json("json.bool_value", R"({"global": {"block_num": true}})",
       {"global.block_num = true (a JSON boolean)", "an integer in [1, 1024]"});
  json("json.array_value", R"({"global": {"warp_num_per_block": [8]}})",
       {"global.warp_num_per_block = [8] (a JSON array)", "an integer in [1, 32]"});
  json("json.zero", R"({"global": {"warps_per_block": 0}})",
       {"global.warps_per_block = 0", "an integer in [1, 32]"});
  json("json.negative", R"({"dispatch": {"num_blocks": -1}})",
       {"dispatch.num_blocks = -1", "an integer in [1, 1024]"});
  json("json.above_max", R"({"dispatch": {"num_blocks": 1025}})",
       {"dispatch.num_blocks = 1025", "an integer in [1, 1024]"});
  json("json.huge_integer", R"({"combine": {"block_num": 18446744073709551615}})",
       {"combine.block_num = 18446744073709551615", "an integer in [1, 1024]"});
  json("json.beyond_uint64", R"({"combine": {"num_blocks": 99999999999999999999}})",
       {"combine.num_blocks = ", "(a JSON number)", "an integer in [1, 1024]"});
  json("json.huge_float", R"({"combine": {"num_blocks": 1e99}})",
       {"combine.num_blocks = 1e+99 (a JSON number)", "an integer in [1, 1024]"});
  json("json.alias_conflict", R"({"dispatch": {"num_blocks": 8, "block_num": 8}})",
       {"dispatch.num_blocks and its alias dispatch.block_num are both set",
        "expected one of them"});
  json("json.duplicate_key", R"({"global": {"num_blocks": 8, "num_blocks": 16}})",
       {"duplicate key global.num_blocks", "expected each key once"});
  json("json.duplicate_section", R"({"dispatch": {}, "dispatch": {}})",
       {"duplicate key dispatch", "expected each key once"});
  api(
      "json.file_missing", "load_launch_configs(\"/nonexistent/epx.json\")",
      [] { (void)load_launch_configs("/nonexistent/epx.json"); }, ErrorCode::kConfig,
      {"/nonexistent/epx.json does not exist", "expected a JSON file"}, Surface::kJson);
  api(
      "json.file_is_a_directory", "load_launch_configs(\"/\")",
      [] { (void)load_launch_configs("/"); }, ErrorCode::kConfig,
      {"launch config path / is not a regular file", "expected a JSON file"}, Surface::kJson);
  api(
      "json.file_path_empty", "load_launch_configs(\"\")", [] { (void)load_launch_configs(""); },
      ErrorCode::kConfig, {"launch config path is empty", "expected a JSON file"}, Surface::kJson);

  // ---- environment variables ------------------------------------------------------------------
  const std::string timeout_bound = "expected a decimal integer in [1, 86400000]";
  for (const auto& [id, value] : std::vector<std::pair<std::string, std::string>>{
           {"env.timeout_negative", "-1"},
           {"env.timeout_letters", "abc"},
           {"env.timeout_exponent", "1e99"},
           {"env.timeout_zero", "0"},
           {"env.timeout_above_a_day", "86400001"},
           {"env.timeout_leading_space", " 100"},
           {"env.timeout_unit_suffix", "100ms"},
           {"env.timeout_twenty_digits", "99999999999999999999"}}) {
    env(id, "EPX_TIMEOUT_MS=" + value,
        // (an init-capture: clang before 16 cannot capture a structured binding)
        [text = value] { (void)parse_env(nullptr, text.c_str(), nullptr); },
        {"EPX_TIMEOUT_MS = \"" + value + "\"", timeout_bound});
  }
  env("env.backend_unknown", "EPX_BACKEND=foo", [] { (void)parse_env("foo", nullptr, nullptr); },
      {"EPX_BACKEND = \"foo\"", "one of naive, allgather_reducescatter, low_latency"});
  env("env.backend_from_process", "EPX_BACKEND=LOW_LATENCY in the process, read_env()",
      [] {
        ScopedEnv e("EPX_BACKEND", "LOW_LATENCY");
        (void)read_env();
      },
      {"EPX_BACKEND = \"LOW_LATENCY\"", "one of naive, allgather_reducescatter, low_latency"});
  env("env.config_path_empty", "EPX_CONFIG_PATH=", [] { (void)parse_env(nullptr, nullptr, ""); },
      {"EPX_CONFIG_PATH = \"\"", "the path of a JSON launch file"});
  for (const auto& [id, value] :
       std::vector<std::pair<std::string, std::string>>{{"env.max_connections_zero", "0"},
                                                        {"env.max_connections_33", "33"},
                                                        {"env.max_connections_negative", "-8"},
                                                        {"env.max_connections_letters", "many"}}) {
    env(id, "CUDA_DEVICE_MAX_CONNECTIONS=" + value,
        [text = value] { (void)hardware_queues_per_gpu(text.c_str()); },
        {"CUDA_DEVICE_MAX_CONNECTIONS = \"" + value + "\"", "an integer in 1..32"});
  }
  bootstrap_env("env.rank_not_below_world", "4", "4", "@epx-job",
                {"EPX_RANK = \"4\"", "[0, EPX_WORLD_SIZE = 4)"});
  bootstrap_env("env.rank_negative", "-1", "4", "@epx-job",
                {"EPX_RANK = \"-1\"", "[0, EPX_WORLD_SIZE = 4)"});
  bootstrap_env("env.rank_without_world", "1", nullptr, "@epx-job",
                {"EPX_RANK = \"1\" is set but EPX_WORLD_SIZE is not", "expected both"});
  bootstrap_env("env.world_without_rank", nullptr, "2", "@epx-job",
                {"EPX_WORLD_SIZE = \"2\" is set but EPX_RANK is not", "expected both"});
  bootstrap_env("env.world_above_64", "0", "65", "@epx-job",
                {"EPX_WORLD_SIZE = \"65\"", "a decimal integer in [1, 64]"});
  bootstrap_env("env.world_zero", "0", "0", "@epx-job",
                {"EPX_WORLD_SIZE = \"0\"", "a decimal integer in [1, 64]"});
  bootstrap_env("env.no_address_for_two", "0", "2", nullptr,
                {"EPX_BOOTSTRAP is not set", "EPX_WORLD_SIZE = 2 ranks share"});
  bootstrap_env("env.address_empty", "0", "2", "", {"EPX_BOOTSTRAP = \"\"", "\"@name\""});
  bootstrap_env("env.address_at_only", "0", "2", "@",
                {"EPX_BOOTSTRAP = \"@\"", "\"@name\" or a socket file path"});
  bootstrap_env("env.address_unix_prefix_only", "0", "2",
                "unix:", {"EPX_BOOTSTRAP = \"unix:\"", "\"@name\" or a socket file path"});
  env("env.bootstrap_from_process", "EPX_RANK=3 EPX_WORLD_SIZE=2 in the process, from_env()",
      [] {
        ScopedEnv r("EPX_RANK", "3"), w("EPX_WORLD_SIZE", "2"), a("EPX_BOOTSTRAP", "@epx-x");
        (void)BootstrapOptions::from_env();
      },
      {"EPX_RANK = \"3\"", "[0, EPX_WORLD_SIZE = 2)"});

  // ---- the command line: `epx <command> <bad flag>` exits 2 naming flag, value and bound, before
  // any GPU is needed; CLI11's own refusals exit with its codes --------------------------------
  const std::string bad_file = dir_.file("launch.json");
  std::ofstream(bad_file) << R"({"dispatch": {"num_blocks": 0}})";
  cli("cli.bench.iters_below_50", {"bench", "--iters", "10"},
      {"--iters = 10", "expected in [50, 1000000]"});
  cli("cli.bench.unknown_backend", {"bench", "--backends", "naive,fastest"},
      {"--backends = \"fastest\"", "one of naive, allgather_reducescatter, low_latency"});
  cli("cli.bench.zero_tokens", {"bench", "--tokens", "0,128"},
      {"--tokens = 0", "expected in [1, 65536]"});
  cli("cli.bench.world_above_64", {"bench", "--world", "65"},
      {"--world = 65", "[1, kMaxRanks = 64]"});
  cli("cli.bench.world_kind_unknown", {"bench", "--world-kind", "mpi"},
      {"--world-kind = 'mpi'", "one of in-process, ipc, nccl"});
  cli("cli.bench.bad_launch_file", {"bench"},
      {"/launch.json: dispatch.num_blocks = 0", "an integer in [1, 1024]"},
      {{"EPX_CONFIG_PATH", bad_file}}, 2,
      R"(EPX_CONFIG_PATH=<dir>/launch.json holding {"dispatch": {"num_blocks": 0}})");
  cli("cli.bench.timeout_env_exponent", {"bench"}, {"EPX_TIMEOUT_MS = \"1e99\"", timeout_bound},
      {{"EPX_TIMEOUT_MS", "1e99"}});
  cli("cli.check.topk_above_experts", {"check", "--experts", "8", "--topk", "9"},
      {"--topk = 9", "--experts = 8", "= [1, 8]"});
  cli("cli.check.experts_not_divisible", {"check", "--experts", "100"},
      {"--experts = 100", "a multiple of --world = 8"});
  cli("cli.check.hidden_fp8", {"check", "--dtype", "fp8", "--hidden", "1000"},
      {"--hidden = 1000", "a multiple of kFp8BlockSize = 128 for --dtype fp8"});
  cli("cli.check.too_many_tokens", {"check", "--tokens", "70000"},
      {"--tokens = 70000", "expected in [0, 65536]"});
  cli("cli.check.tokens_above_max_tokens",
      {"check", "--tokens", "7,128", "--world", "2", "--experts", "8", "--max-tokens", "64"},
      {"--tokens = 7,128", "counts of at most --max-tokens = 64"});
  cli("cli.check.token_list_length", {"check", "--world", "4", "--tokens", "1,2,3"},
      {"--tokens = '1,2,3' has 3 counts", "one count or 4 (one per rank of --world)"});
  cli("cli.check.routing_unknown", {"check", "--routing", "zipf"},
      {"--routing = 'zipf'", "one of uniform, skew, one-expert, masked"});
  cli("cli.check.gpus_above_world", {"check", "--world", "2", "--experts", "8", "--gpus", "3"},
      {"--gpus = 3", "expected in [1, 2]"});
  cli("cli.check.backend_env_unknown", {"check"},
      {"EPX_BACKEND = \"foo\"", "one of naive, allgather_reducescatter, low_latency"},
      {{"EPX_BACKEND", "foo"}});
  cli("cli.check.ipc_world_differs", {"check", "--world-kind", "ipc", "--world", "4"},
      {"--world = 4", "EPX_WORLD_SIZE = 1 with one process per rank"});
  cli("cli.check.ipc_rank_not_below_world", {"check", "--world-kind", "ipc"},
      {"EPX_RANK = \"2\"", "[0, EPX_WORLD_SIZE = 2)"},
      {{"EPX_RANK", "2"}, {"EPX_WORLD_SIZE", "2"}, {"EPX_BOOTSTRAP", "@epx-bad-inputs"}});
  const Env two_ranks = {
      {"EPX_RANK", "0"}, {"EPX_WORLD_SIZE", "2"}, {"EPX_BOOTSTRAP", "@epx-bad-inputs"}};
  cli("cli.check.fault_kill_outside_world",
      {"check", "--world-kind", "ipc", "--fault-kill-rank", "0,2"},
      {"--fault-kill-rank = 2", "a rank of the world, in [0, 2)"}, two_ranks);
  cli("cli.check.fault_kill_every_rank",
      {"check", "--world-kind", "nccl", "--fault-kill-rank", "1,0"},
      {"--fault-kill-rank = 2", "fewer ranks than the world (a survivor reports)"}, two_ranks);
  cli("cli.tune.warps_above_32", {"tune", "--warps", "4,64"},
      {"--warps = 64", "expected in [1, 32]"});
  cli("cli.tune.blocks_repeated", {"tune", "--blocks", "8,8"},
      {"--blocks = '8,8' lists 8 twice", "each value once"});
  cli("cli.tune.output_empty", {"tune", "--output", ""}, {"--output = ''", "a file name"});
  cli("cli.tune.iters_below_10", {"tune", "--iters", "5"}, {"--iters = 5", "[10, 100000]"});
  cli("cli.tune.ring_rows_without_rings", {"tune", "--ring-rows", "8"},
      {"--ring-rows = '8' with --backend low_latency", "only high_throughput has rings"});
  cli("cli.tune.ring_rows_zero", {"tune", "--backend", "high_throughput", "--ring-rows", "0,8"},
      {"--ring-rows = 0", "[1, 16384]"});
  cli("cli.serve_bench.topk_zero", {"serve-bench", "--topk", "0"},
      {"--topk = 0", "[1, min(kMaxTopk = 32, --experts = 256)] = [1, 32]"});
  cli("cli.serve_bench.hidden_not_multiple_of_512", {"serve-bench", "--hidden", "1000"},
      {"--hidden = 1000", "a multiple of 512 in [512, 65536]"});
  cli("cli.serve_bench.preset_unknown", {"serve-bench", "--preset", "r2"},
      {"--preset = 'r2'", "expected original"});
  cli("cli.serve_bench.overlap_world_graphs",
      {"serve-bench", "--overlap", "--cuda-graph", "--graph-scope", "world"},
      {"--overlap with --graph-scope world", "expected --graph-scope rank"});
  cli("cli.check.rounds_in_flight_three", {"check", "--rounds-in-flight", "3"},
      {"rounds_in_flight = 3", "[1, kMaxRoundsInFlight = 2]"});
  cli("cli.check.combine_sideways", {"check", "--combine", "sideways"},
      {"--combine = \"sideways\"", "expected one of auto, pull, push"});
  cli("cli.check.round_scale_bf16", {"check", "--dtype", "bf16", "--round-scale"},
      {"--round-scale = true", "false with --dtype bf16"});
  cli("cli.check.combine_format_logfmt_hidden",
      {"check", "--dtype", "bf16", "--hidden", "1000", "--combine-format", "logfmt"},
      {"--combine-format = logfmt", "bf16 with --hidden = 1000"});
  cli("cli.bench.combine_format_twice", {"bench", "--combine-format", "logfmt,logfmt"},
      {"--combine-format = 'logfmt,logfmt' lists logfmt twice"});
  cli("cli.launch.ranks_above_64", {"launch", "-n", "65", "--", "true"},
      {"-n = 65", "[1, kMaxRanks = 64]"});
  cli("cli.launch.no_ranks", {"launch", "-n", "0", "--", "true"},
      {"-n = 0", "[1, kMaxRanks = 64]"});
  cli("cli.launch.bootstrap_at_only", {"launch", "-n", "2", "--bootstrap", "@", "--", "true"},
      {"--bootstrap", "address = \"@\"", "\"@name\" or a socket file path"});
  cli("cli.parse.iters_not_a_number", {"bench", "--iters", "abc"},
      {"Could not convert: --iters = abc"}, {}, 104);
  cli("cli.parse.unknown_flag", {"check", "--no-such-flag"},
      {"The following argument was not expected: --no-such-flag"}, {}, 109);
}

// ---- the doc's table ---------------------------------------------------------------------------

std::string cell(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '|') {
      out += "\\|";
    } else if (c == '\n') {
      out += ' ';
    } else if (static_cast<unsigned char>(c) >= 0x80) {
      out += "\\x" + std::string(1, "0123456789abcdef"[(c >> 4) & 15]) + "0123456789abcdef"[c & 15];
    } else {
      out += c;
    }
  }
  return out;
}

std::string words_cell(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) {
    if (!out.empty()) out += " · ";
    out += '`';
    out += cell(w);
    out += '`';
  }
  return out;
}

std::string table(const Catalogue& cat) {
  std::ostringstream os;
  const auto& gpu = bad_inputs::gpu_cases();
  os << "CPU-side cases: " << cat.cases().size() << " (tests/cpu/test_bad_inputs.cpp). GPU-side "
     << "cases: " << gpu.size()
     << " (tests/gpu/test_bad_inputs_gpu.cpp). Total: " << cat.cases().size() + gpu.size()
     << ".\n\n";
  os << "| case | surface | input | expected | message names |\n";
  os << "|---|---|---|---|---|\n";
  for (const Case& c : cat.cases()) {
    const std::string expected = c.surface == Surface::kCli
                                     ? "exit " + std::to_string(c.expect.exit_code)
                                     : std::string(to_string(c.expect.code)) + " error";
    os << "| `" << c.id << "` | " << to_string(c.surface) << " | " << cell(c.input) << " | "
       << expected << " | " << words_cell(c.expect.words) << " |\n";
  }
  for (const auto& g : gpu) {
    os << "| `" << g.id << "` | GPU | " << cell(g.input) << " | " << to_string(g.code)
       << " error | " << words_cell(g.words) << " |\n";
  }
  return os.str();
}

constexpr const char* kDoc = EPX_SOURCE_DIR "/docs/reliability.md";
constexpr const char* kBegin = "<!-- bad-inputs: generated by tests/cpu/test_bad_inputs.cpp -->\n";
constexpr const char* kEnd = "<!-- bad-inputs: end -->\n";

// ---- tests -------------------------------------------------------------------------------------

TEST(BadInputs, CatalogueHasAtLeastFortyDistinctCases) {
  const Catalogue cat;
  std::set<std::string> ids;
  for (const Case& c : cat.cases()) EXPECT_TRUE(ids.insert(c.id).second) << "twice: " << c.id;
  for (const auto& g : bad_inputs::gpu_cases()) EXPECT_TRUE(ids.insert(g.id).second) << g.id;
  EXPECT_GE(cat.cases().size(), 40u);
  std::set<Surface> surfaces;
  for (const Case& c : cat.cases()) surfaces.insert(c.surface);
  EXPECT_EQ(surfaces.size(), 6u) << "every surface has cases";
  for (const Case& c : cat.cases()) EXPECT_FALSE(c.expect.words.empty()) << c.id;
}

// Every case, with its expectation; then the same observation against expectations it must
// not meet (another error, another exit code, a word it lacks, no error at all), so that no case
// passes whatever happens.
TEST(BadInputs, EveryCaseRaisesItsErrorNamingArgumentValueAndBound) {
  const Catalogue cat;
  for (const Case& c : cat.cases()) {
    const Observed o = c.run();
    EXPECT_TRUE(meets(c, c.expect, o));

    Expect other_error = c.expect;
    other_error.code = c.expect.code == ErrorCode::kConfig ? ErrorCode::kInput : ErrorCode::kConfig;
    other_error.exit_code = c.expect.exit_code + 1;
    EXPECT_FALSE(meets(c, other_error, o)) << c.id;
    Expect missing_word = c.expect;
    missing_word.words.push_back("a word no message holds");
    EXPECT_FALSE(meets(c, missing_word, o)) << c.id;
    Observed nothing;
    nothing.message = "(returned normally)";
    EXPECT_FALSE(meets(c, c.expect, nothing)) << c.id;
  }
}

TEST(BadInputs, ReliabilityDocListsTheCatalogue) {
  const Catalogue cat;
  std::ifstream in(kDoc);
  ASSERT_TRUE(in.good()) << kDoc;
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string doc = ss.str();
  const size_t begin = doc.find(kBegin);
  const size_t end = doc.find(kEnd);
  ASSERT_NE(begin, std::string::npos) << kDoc << " lacks " << kBegin;
  ASSERT_NE(end, std::string::npos) << kDoc << " lacks " << kEnd;
  ASSERT_LT(begin, end);
  const size_t from = begin + std::string(kBegin).size();
  const std::string want = table(cat);
  if (std::getenv("EPX_WRITE_DOCS") != nullptr) {
    std::ofstream(kDoc) << doc.substr(0, from) << want << doc.substr(end);
    GTEST_SKIP() << "wrote the table into " << kDoc;
  }
  EXPECT_EQ(doc.substr(from, end - from), want)
      << kDoc << " is out of date: run the test with EPX_WRITE_DOCS=1 to rewrite its table";
}

}  // namespace
}  // namespace epx
