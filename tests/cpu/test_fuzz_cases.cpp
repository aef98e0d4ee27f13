// The cases of `epx check --fuzz` (src/testing/fuzz_cases.hpp) on the CPU: every drawn case is
// one the harness accepts (validate_check_options) within the bounds the fuzz promises, its
// command line reads back (through the CLI's own parsers) to the same options, every backend,
// dtype, layout, mode and rounds-in-flight value is drawn, and a seed always gives the same
// cases. Also the rules of validate_check_options themselves, so that "accepted" means something.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "epx/error.hpp"
#include "flags.hpp"
#include "testing/fuzz_cases.hpp"
#include "testing/harness.hpp"

namespace epx::testing {
namespace {

constexpr int kCases = 2000;

// The flags of an `epx check ...` line: value flags to their text, switches to "".
std::map<std::string, std::string> flags_of(const std::string& command) {
  std::istringstream in(command);
  std::string epx, check, word;
  in >> epx >> check;
  EXPECT_EQ(epx + " " + check, "epx check") << command;
  const std::set<std::string> switches = {"--deterministic", "--ids64",      "--mixed",
                                          "--one-launch",    "--halves",     "--round-scale",
                                          "--worst-case-output"};
  std::map<std::string, std::string> out;
  while (in >> word) {
    EXPECT_EQ(word.rfind("--", 0), 0u) << "not a flag: " << word << " in " << command;
    EXPECT_EQ(out.count(word), 0u) << word << " twice in " << command;
    std::string value;
    if (switches.count(word) == 0) in >> value;
    out[word] = value;
  }
  return out;
}

// What the command line of case `c` means to the CLI's parsers, compared with its options.
void expect_command_reproduces(const FuzzCase& c) {
  const CheckOptions& o = c.options;
  auto f = flags_of(c.command);
  auto take = [&](const char* flag) {
    const auto it = f.find(flag);
    EXPECT_NE(it, f.end()) << flag << " missing from " << c.command;
    if (it == f.end()) return std::string("0");
    std::string v = it->second;
    f.erase(it);
    return v;
  };
  auto has = [&](const char* flag) { return f.erase(flag) == 1; };
  cli::ShapeFlags shape;
  shape.world = std::stoi(take("--world"));
  shape.hidden = std::stoi(take("--hidden"));
  shape.experts = std::stoi(take("--experts"));
  shape.topk = std::stoi(take("--topk"));
  shape.max_tokens = std::stoi(take("--max-tokens"));
  shape.dtype = take("--dtype");
  shape.layout = take("--layout");
  shape.scale_layout = take("--scale-layout");
  shape.rounds_in_flight = std::stoi(take("--rounds-in-flight"));
  shape.deterministic = has("--deterministic");
  shape.worst_case_output = has("--worst-case-output");
  shape.round_scale = has("--round-scale");
  if (f.count("--combine") != 0) shape.combine = take("--combine");
  if (f.count("--combine-format") != 0) shape.combine_format = take("--combine-format");
  if (f.count("--combine-order") != 0) shape.combine_order = take("--combine-order");
  const EpConfig cfg = shape.config(1);  // as `epx check` builds it (--max-tokens given)
  EXPECT_EQ(cfg.world_size, o.cfg.world_size) << c.command;
  EXPECT_EQ(cfg.hidden, o.cfg.hidden) << c.command;
  EXPECT_EQ(cfg.num_experts, o.cfg.num_experts) << c.command;
  EXPECT_EQ(cfg.topk, o.cfg.topk) << c.command;
  EXPECT_EQ(cfg.max_tokens_per_rank, o.cfg.max_tokens_per_rank) << c.command;
  EXPECT_EQ(cfg.dtype, o.cfg.dtype) << c.command;
  EXPECT_EQ(cfg.layout, o.cfg.layout) << c.command;
  EXPECT_EQ(cfg.scale_layout, o.cfg.scale_layout) << c.command;
  EXPECT_EQ(cfg.rounds_in_flight, o.cfg.rounds_in_flight) << c.command;
  EXPECT_EQ(cfg.deterministic, o.cfg.deterministic) << c.command;
  EXPECT_EQ(cfg.worst_case_output, o.cfg.worst_case_output) << c.command;
  EXPECT_EQ(cfg.combine, o.cfg.combine) << c.command;
  EXPECT_EQ(cfg.round_scale, o.cfg.round_scale) << c.command;
  EXPECT_EQ(cfg.combine_format, o.cfg.combine_format) << c.command;
  EXPECT_EQ(cfg.combine_order, o.cfg.combine_order) << c.command;
  const std::string tokens = take("--tokens");
  EXPECT_EQ(cli::tokens_per_rank(cli::parse_token_counts(tokens, "--tokens"), cfg.world_size,
                                 "--tokens", tokens),
            o.tokens)
      << c.command;
  EXPECT_EQ(cli::parse_routing_flag(take("--routing")), o.routing) << c.command;
  EXPECT_EQ(cli::parse_backend_flag(take("--backend"), "--backend"), o.backend) << c.command;
  EXPECT_EQ(std::stoull(take("--seed")), o.seed) << c.command;
  EXPECT_EQ(std::stoi(take("--iters")), o.iters) << c.command;
  EXPECT_EQ(o.graph_replays > 0 ? std::stoi(take("--graph")) : 0, o.graph_replays) << c.command;
  EXPECT_EQ(has("--ids64"), o.ids_int64) << c.command;
  EXPECT_EQ(has("--mixed"), o.mixed) << c.command;
  EXPECT_EQ(has("--one-launch"), o.one_launch) << c.command;
  EXPECT_EQ(has("--halves"), o.halves) << c.command;
  EXPECT_TRUE(f.empty()) << "unexpected flags in " << c.command;
}

// The promises of fuzz_cases.hpp beyond the harness's rules.
void expect_within_bounds(const FuzzCase& c) {
  const CheckOptions& o = c.options;
  const EpConfig& cfg = o.cfg;
  const int W = cfg.world_size;
  const std::string& why = c.description;
  EXPECT_TRUE(std::set<int>({1, 2, 3, 4, 8, 16}).count(W)) << why;
  EXPECT_EQ(cfg.hidden % (cfg.wire_fp8() ? 128 : 8), 0) << why;
  EXPECT_LE(cfg.hidden, kFuzzMaxHidden) << why;
  EXPECT_EQ(cfg.num_experts % W, 0) << why;
  EXPECT_GE(cfg.num_local_experts(), 1) << why;
  EXPECT_LE(cfg.num_local_experts(), kFuzzMaxLocalExperts) << why;
  EXPECT_LE(cfg.num_experts, kFuzzMaxExperts) << why;
  EXPECT_GE(cfg.topk, 1) << why;
  EXPECT_LE(cfg.topk, std::min(cfg.num_experts, kMaxTopk)) << why;
  EXPECT_GE(cfg.max_tokens_per_rank, 1) << why;
  EXPECT_LE(cfg.max_tokens_per_rank, kFuzzMaxTokens) << why;
  ASSERT_EQ(int(o.tokens.size()), W) << why;
  for (int t : o.tokens) {
    EXPECT_GE(t, 0) << why;
    EXPECT_LE(t, cfg.max_tokens_per_rank) << why;
  }
  // The budgets that keep a case to a second or two (a case of one token per rank may exceed
  // them: there is nothing smaller).
  if (cfg.max_tokens_per_rank > 1) {
    const int64_t rows = (delivers_every_token(o.backend) ? W : std::min(cfg.topk, W)) +
                         (cfg.layout == OutputLayout::kExpertMajor ? cfg.topk : 0);
    EXPECT_LE(int64_t(W) * cfg.max_tokens_per_rank * cfg.hidden * rows, kFuzzReferenceBudget)
        << why;
  }
  // One GPU, the backends' launch shapes (they respect the SM budget of W ranks on one GPU).
  EXPECT_EQ(o.gpus, 1) << why;
  EXPECT_EQ(o.launch.dispatch.num_blocks, 0) << why;
  EXPECT_EQ(o.launch.combine.num_blocks, 0) << why;
  EXPECT_FALSE(o.log) << why;
  // The expert-major layout is the low_latency backend's alone.
  EXPECT_TRUE(cfg.layout == OutputLayout::kTokenMajor || o.backend == Backend::kLowLatency) << why;
  // high_throughput: one round, no halves, worst-case receive areas where a graph is captured.
  if (o.backend == Backend::kHighThroughput) {
    EXPECT_EQ(cfg.rounds_in_flight, 1) << why;
    EXPECT_FALSE(o.halves) << why;
    EXPECT_TRUE(o.graph_replays == 0 || cfg.worst_case_output) << why;
  } else {
    EXPECT_FALSE(cfg.worst_case_output) << why;
  }
  // The mode says how the ops are called.
  EXPECT_EQ(o.mixed, c.mode == FuzzMode::kMixed) << why;
  EXPECT_EQ(o.one_launch, c.mode == FuzzMode::kOneLaunch) << why;
  EXPECT_EQ(o.halves, c.mode == FuzzMode::kHalves) << why;
  if (c.mode == FuzzMode::kEager) {
    EXPECT_EQ(o.graph_replays, 0) << why;
  }
  if (c.mode == FuzzMode::kGraph || c.mode == FuzzMode::kMixed) {
    EXPECT_GT(o.graph_replays, 0) << why;
  }
  EXPECT_GE(o.iters + o.graph_replays, 1) << why;
  EXPECT_LE(o.iters + o.graph_replays, 7) << why;
  EXPECT_EQ(o.verify_every, 1) << why;
}

TEST(FuzzCases, EveryDrawnCaseIsAcceptedAndReproducedByItsCommand) {
  for (int i = 0; i < kCases; ++i) {
    const FuzzCase c = make_fuzz_case(1, i);
    ASSERT_EQ(c.index, i);
    try {
      validate_check_options(c.options);
    } catch (const Error& e) {
      ADD_FAILURE() << "case " << i << " refused: " << e.what() << "\n  " << c.description;
    }
    expect_within_bounds(c);
    expect_command_reproduces(c);
    if (HasFailure()) {
      ADD_FAILURE() << "first bad case " << i << ": " << c.description << "\n  " << c.command;
      return;
    }
  }
}

TEST(FuzzCases, EveryChoiceIsDrawn) {
  std::set<int> worlds, backends, dtypes, layouts, scale_layouts, routings, modes, rounds, topks;
  std::set<bool> deterministic, ids64;
  bool empty_rank = false, full_rank = false, one_launch_replayed = false, halves_replayed = false;
  bool expert_rounds2 = false, halves_rounds2 = false, mixed_rounds2 = false;
  bool ht_replayed = false, ht_exact_eager = false, ht_one_launch = false;
  bool push_expert = false, push_replayed = false, push_agrs = false;
  bool round_scale_ht = false, round_scale_ll = false;
  bool logfmt_expert = false, logfmt_push = false, logfmt_replayed = false;
  bool highest_slot_eager = false, highest_slot_replayed = false;
  for (int i = 0; i < kCases; ++i) {
    const FuzzCase c = make_fuzz_case(1, i);
    const CheckOptions& o = c.options;
    worlds.insert(o.cfg.world_size);
    backends.insert(int(o.backend));
    dtypes.insert(int(o.cfg.dtype));
    layouts.insert(int(o.cfg.layout));
    scale_layouts.insert(int(o.cfg.scale_layout));
    routings.insert(int(o.routing));
    modes.insert(int(c.mode));
    rounds.insert(o.cfg.rounds_in_flight);
    topks.insert(o.cfg.topk > 8 ? 9 : o.cfg.topk);
    deterministic.insert(o.cfg.deterministic);
    ids64.insert(o.ids_int64);
    for (int t : o.tokens) {
      empty_rank |= t == 0;
      full_rank |= t == o.cfg.max_tokens_per_rank && t > 1;
    }
    one_launch_replayed |= o.one_launch && o.graph_replays > 0;
    halves_replayed |= o.halves && o.graph_replays > 0;
    const bool r2 = o.cfg.rounds_in_flight == 2;
    expert_rounds2 |= r2 && o.cfg.layout == OutputLayout::kExpertMajor;
    halves_rounds2 |= r2 && o.halves;
    mixed_rounds2 |= r2 && o.mixed;
    const bool ht = o.backend == Backend::kHighThroughput;
    ht_replayed |= ht && o.graph_replays > 0;
    ht_exact_eager |= ht && !o.cfg.worst_case_output && o.iters > 0;
    ht_one_launch |= ht && o.one_launch;
    const bool push = o.cfg.combine == CombineMode::kPush;
    EXPECT_TRUE(!push || (!ht && o.backend != Backend::kNaive)) << c.description;
    push_expert |= push && o.cfg.layout == OutputLayout::kExpertMajor;
    push_replayed |= push && o.graph_replays > 0;
    push_agrs |= push && o.backend == Backend::kAllgatherReduceScatter;
    EXPECT_TRUE(!o.cfg.round_scale || o.cfg.dtype == DispatchDtype::kBF16ToFP8) << c.description;
    round_scale_ht |= o.cfg.round_scale && ht;
    round_scale_ll |= o.cfg.round_scale && o.backend == Backend::kLowLatency;
    const bool logfmt = o.cfg.combine_format == CombineFormat::kLogFMT;
    EXPECT_TRUE(!logfmt || (o.backend == Backend::kLowLatency && o.cfg.hidden % 128 == 0))
        << c.description;
    logfmt_expert |= logfmt && o.cfg.layout == OutputLayout::kExpertMajor;
    logfmt_push |= logfmt && push;
    logfmt_replayed |= logfmt && o.graph_replays > 0;
    const bool highest_slot = o.cfg.combine_order == CombineOrder::kHighestSlot;
    EXPECT_TRUE(!highest_slot || ht) << c.description;
    highest_slot_eager |= highest_slot && o.graph_replays == 0;
    highest_slot_replayed |= highest_slot && o.graph_replays > 0;
  }
  EXPECT_TRUE(highest_slot_eager && highest_slot_replayed);
  EXPECT_TRUE(logfmt_expert && logfmt_push && logfmt_replayed);
  EXPECT_TRUE(push_expert && push_replayed && push_agrs);
  EXPECT_TRUE(round_scale_ht && round_scale_ll);
  EXPECT_TRUE(ht_replayed && ht_exact_eager && ht_one_launch);
  EXPECT_EQ(worlds, (std::set<int>{1, 2, 3, 4, 8, 16}));
  EXPECT_EQ(backends.size(), 4u);
  EXPECT_EQ(dtypes.size(), 3u);
  EXPECT_EQ(layouts.size(), 2u);
  EXPECT_EQ(scale_layouts.size(), 2u);
  EXPECT_EQ(routings.size(), 4u);
  EXPECT_EQ(modes.size(), size_t(kNumFuzzModes));
  EXPECT_EQ(rounds, (std::set<int>{1, 2}));
  EXPECT_EQ(topks, (std::set<int>{1, 2, 3, 4, 5, 6, 7, 8, 9}));  // 9: above 8
  EXPECT_EQ(deterministic.size(), 2u);
  EXPECT_EQ(ids64.size(), 2u);
  EXPECT_TRUE(empty_rank);
  EXPECT_TRUE(full_rank);
  EXPECT_TRUE(one_launch_replayed);
  EXPECT_TRUE(halves_replayed);
  EXPECT_TRUE(expert_rounds2);
  EXPECT_TRUE(halves_rounds2);
  EXPECT_TRUE(mixed_rounds2);
}

TEST(FuzzCases, SameSeedSameCasesInAnyOrder) {
  std::vector<FuzzCase> forward;
  for (int i = 0; i < 500; ++i) forward.push_back(make_fuzz_case(7, i));
  int differ_from_other_seed = 0;
  for (int i = 499; i >= 0; --i) {
    const FuzzCase again = make_fuzz_case(7, i);
    EXPECT_EQ(again.command, forward[size_t(i)].command);
    EXPECT_EQ(again.description, forward[size_t(i)].description);
    EXPECT_EQ(again.mode, forward[size_t(i)].mode);
    differ_from_other_seed += make_fuzz_case(8, i).command != again.command;
  }
  // Another seed is another stream (the commands hold the harness seed, so all differ).
  EXPECT_EQ(differ_from_other_seed, 500);
}

// ---- the rules the cases are held to ------------------------------------------------------------

CheckOptions small_options() {
  CheckOptions o;
  o.cfg.world_size = 2;
  o.cfg.hidden = 256;
  o.cfg.num_experts = 8;
  o.cfg.topk = 2;
  o.cfg.max_tokens_per_rank = 16;
  o.backend = Backend::kLowLatency;
  o.tokens = {16, 3};
  return o;
}

// The message of the InputError that validate_check_options(o) throws ("" when none).
std::string input_error(const CheckOptions& o) {
  try {
    validate_check_options(o);
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InputError";
  return "";
}

#define EXPECT_MESSAGE_HAS(message, part) \
  EXPECT_NE((message).find(part), std::string::npos) << (message)

TEST(CheckOptionsRules, RefuseWhatTheHarnessCannotRun) {
  validate_check_options(small_options());
  CheckOptions o = small_options();
  o.cfg.num_experts = 7;
  EXPECT_THROW(validate_check_options(o), ConfigError);
  o = small_options();
  o.halves = true;
  o.cfg.deterministic = true;
  EXPECT_MESSAGE_HAS(input_error(o), "halves = with ordered rows");
  o.cfg.deterministic = false;
  o.backend = Backend::kNaive;
  EXPECT_MESSAGE_HAS(input_error(o), "halves = with ordered rows");
  o.backend = Backend::kAllgatherReduceScatter;
  validate_check_options(o);
  o.one_launch = true;
  EXPECT_MESSAGE_HAS(input_error(o), "with mixed, a graph variant or each other");
  o = small_options();
  o.one_launch = true;
  o.graph_replays = 2;
  o.mixed = true;
  EXPECT_MESSAGE_HAS(input_error(o), "one_launch = with mixed");
  o = small_options();
  o.mixed = true;
  EXPECT_MESSAGE_HAS(input_error(o), "only together with graph replays");
  o = small_options();
  o.tokens = {1, 2, 3};
  EXPECT_MESSAGE_HAS(input_error(o), "tokens (list length) = 3, expected 1 or world size = 2");
  o.tokens = {17};
  EXPECT_MESSAGE_HAS(input_error(o), "tokens = 17, expected at most max_tokens_per_rank = 16");
  o = small_options();
  o.cfg.rounds_in_flight = 2;
  o.graph_replays = 2;
  validate_check_options(o);
  o.graph_split = true;
  EXPECT_MESSAGE_HAS(input_error(o), "rounds_in_flight = 2, expected 1 with the conditional");
  o = small_options();
  o.graph_replays = 2;
  o.graph_execs = 65;
  EXPECT_MESSAGE_HAS(input_error(o), "graph_execs = 65, expected in [1, 64]");
}

TEST(CheckOptionsRules, VerifyEveryNeedsReplays) {
  CheckOptions o = small_options();
  o.verify_every = 0;
  EXPECT_MESSAGE_HAS(input_error(o), "verify_every = 0, expected at least 1");
  o.verify_every = 10;
  EXPECT_MESSAGE_HAS(input_error(o), "verify_every = 10, expected 1 without graph replays");
  o.graph_replays = 100;
  validate_check_options(o);
  validate_shared_check_options(o);
}

}  // namespace
}  // namespace epx::testing
