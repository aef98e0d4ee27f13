#include "serve_flags.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "epx/error.hpp"

namespace epx::cli::serve {
namespace {

constexpr int kDeepSeekMoeLayers = 58;  // DeepSeek-R1: 61 layers, the first 3 dense

// ---- --preset ----------------------------------------------------------------------------------

// --preset original: the original test's numbers, scaled to one GPU (see the help text).
constexpr int kOrigPrompts = 2000, kOrigIsl = 2000, kOrigOsl = 100, kOrigConcurrency = 2000,
              kOrigChunk = 1024, kOrigBatched = 32768;

// --preset prefill: long prompts, few output tokens (prefill-heavy).
constexpr int kPrefillPromptsPerRank = 4, kPrefillIsl = 8192, kPrefillOsl = 16,
              kPrefillBatched = 2048, kPrefillChunk = 128;

std::string preset_help() {
  const std::string original = fmt::format(
      "original: the DeepSeek-R1 DP{0}/EP{0} test of the system we descend from ({1} prompts, "
      "ISL {2}, OSL {3}, concurrency {4}, chunk {5}, {6} batched tokens per rank) scaled to one "
      "GPU: the --world ranks share one GPU, so prompts, concurrency and batched tokens are "
      "divided by --world ({7}, {7}, {8} at 8 ranks: the GPU carries per step the tokens one "
      "GPU of the original carried); ISL, OSL and chunk are kept; the model's {9} MoE layers "
      "become --layers",
      8, kOrigPrompts, kOrigIsl, kOrigOsl, kOrigConcurrency, kOrigChunk, kOrigBatched,
      (kOrigPrompts + 7) / 8, kOrigBatched / 8, kDeepSeekMoeLayers);
  return original + fmt::format(
      ". prefill: a prefill-heavy workload ({} prompts per rank of ISL {}, OSL {}, {} batched "
      "tokens per rank, chunk {}), to compare a decode backend alone with DECODE+high_throughput. "
      "Flags given explicitly win over the preset",
      kPrefillPromptsPerRank, kPrefillIsl, kPrefillOsl, kPrefillBatched, kPrefillChunk);
}

// Sets the workload flags the user did not give (`given` holds the names of those given);
// returns the line that says what it did.
std::string apply_preset(Flags& f, const std::set<std::string>& given) {
  if (f.preset.empty()) return "";
  if (f.preset != "original" && f.preset != "prefill") {
    EPX_THROW(ConfigError,
              fmt::format("--preset = '{}', expected original or prefill", f.preset));
  }
  Workload& w = f.workload;
  check_range("--world", w.world, 1, 32, "in-process ranks on one GPU");
  const int div = w.world;
  auto set = [&](const char* flag, int& field, int value) {
    if (!given.count(flag)) field = value;
  };
  if (f.preset == "prefill") {
    set("--num-prompts", w.num_prompts, kPrefillPromptsPerRank * w.world);
    set("--concurrency", w.concurrency, kPrefillPromptsPerRank * w.world);
    set("--isl", w.isl, kPrefillIsl);
    set("--osl", w.osl, kPrefillOsl);
    set("--max-batched-tokens", w.max_batched_tokens, kPrefillBatched);
    set("--chunk-size", w.chunk_size, kPrefillChunk);
    return fmt::format(
        "preset prefill: {} prompts ({} per rank), concurrency {}, ISL {}, OSL {}, {} batched "
        "tokens per rank, chunk {}: mostly prefill steps ({})",
        w.num_prompts, kPrefillPromptsPerRank, w.concurrency, w.isl, w.osl, w.max_batched_tokens,
        w.chunk_size, given.empty() ? "no workload flag given" : "explicit flags win");
  }
  set("--num-prompts", w.num_prompts, (kOrigPrompts + div - 1) / div);
  set("--concurrency", w.concurrency, (kOrigConcurrency + div - 1) / div);
  set("--max-batched-tokens", w.max_batched_tokens, std::max(1, kOrigBatched / div));
  set("--isl", w.isl, kOrigIsl);
  set("--osl", w.osl, kOrigOsl);
  set("--chunk-size", w.chunk_size, kOrigChunk);
  return fmt::format(
      "preset original: {} prompts -> {}, concurrency {} -> {}, batched tokens/rank {} -> {} "
      "(divided by the {} ranks sharing one GPU), ISL {}, OSL {}, chunk {} (kept: {}), "
      "{} MoE layers -> {}",
      kOrigPrompts, w.num_prompts, kOrigConcurrency, w.concurrency, kOrigBatched,
      w.max_batched_tokens, div, w.isl, w.osl, w.chunk_size,
      given.empty() ? "no workload flag given" : "explicit flags win", kDeepSeekMoeLayers,
      f.layers);
}

// ---- the model ---------------------------------------------------------------------------------

void check_multiple_of_512(const char* flag, int value, bool zero_ok) {
  if ((zero_ok && value == 0) || (value >= 512 && value <= kMaxHidden && value % 512 == 0)) return;
  EPX_THROW(ConfigError,
            fmt::format("--{} = {}, expected {}a multiple of 512 in [512, {}] (the MoE layer's fp8 "
                        "GEMMs: K / 128 a multiple of 4)",
                        flag, value, zero_ok ? "0 (none) or " : "", kMaxHidden));
}

// The rules of the MoE layer's shape beyond EpConfig's (which make_config() leaves to
// EpConfig::validate()).
void check_model_flags(const Flags& f) {
  check_range("--layers", f.layers, 1, 1024);
  check_multiple_of_512("hidden", f.hidden, false);
  check_multiple_of_512("intermediate", f.intermediate, false);
  check_multiple_of_512("shared-intermediate", f.shared_intermediate, true);
  check_range("--experts", f.experts, 1, 1 << 16, "the MoE layer's routed experts");
}

WeightsMode parse_weights(const std::string& name) {
  if (name == "auto") return WeightsMode::kAuto;
  if (name == "distinct") return WeightsMode::kDistinct;
  if (name == "shared") return WeightsMode::kShared;
  EPX_THROW(ConfigError,
            fmt::format("--weights = '{}', expected one of auto, distinct, shared", name));
}

// DeepSeek-R1 routing (sigmoid, best 4 of 8 groups) where the expert count allows it,
// otherwise one group (plain sigmoid top-k).
MoeShape make_shape(const Flags& f) {
  MoeShape s;
  s.hidden = f.hidden;
  s.intermediate = f.intermediate;
  s.num_experts = f.experts;
  s.topk = f.topk;
  s.shared_intermediate = f.shared_intermediate;
  s.scoring = MoeScoring::kSigmoidGrouped;
  const bool grouped = f.experts % 8 == 0 && f.experts / 8 >= 2 && f.topk <= 4 * (f.experts / 8);
  s.num_groups = grouped ? 8 : 1;
  s.topk_groups = grouped ? 4 : 1;
  s.validate();
  return s;
}

// One rank's All2All config through the shape flags' path (EpConfig::validate() decides, in flag
// names); its max_tokens_per_rank is the chunk.
EpConfig make_config(const Flags& f) {
  ShapeFlags shape;
  shape.world = f.workload.world;
  shape.hidden = f.hidden;
  shape.experts = f.experts;
  shape.topk = f.topk;
  shape.dtype = f.dtype;
  shape.layout = f.layout;
  return shape.config(f.workload.chunk_size, "--chunk-size");
}

// ---- --cuda-graph and its diagnosis options ----------------------------------------------------

// --graph-experts auto: all-rows whenever ranks share the GPU. Measured on an H200 (32 hardware
// queues), decode graphs with SWITCH nodes stop from 20 in-process ranks (split or not; at 16 one
// run of two), and once at 8 ranks with two layers sharing one MoeLayer (a rank late by one call,
// 10 s); graphs without conditional nodes replayed every time, at 8 and 32 ranks.
void plan_graphs(const Flags& f, Plan& p) {
  const int W = p.workload.world;
  if (f.graph_scope != "rank" && f.graph_scope != "world") {
    EPX_THROW(ConfigError,
              fmt::format("--graph-scope = '{}', expected rank or world", f.graph_scope));
  }
  if (f.graph_scope == "world" && !f.cuda_graph)
    EPX_THROW(ConfigError, "--graph-scope = 'world', expected only with --cuda-graph");
  p.world_graphs = f.graph_scope == "world";
  for (const auto& [flag, value] : {std::pair{"--graph-split", &f.graph_split},
                                    std::pair{"--graph-experts", &f.graph_experts}}) {
    if (!value->empty() && !f.cuda_graph) {
      EPX_THROW(ConfigError,
                fmt::format("{} = '{}', expected only with --cuda-graph", flag, *value));
    }
  }
  if (!f.graph_split.empty() && f.graph_split != "expert" && f.graph_split != "none") {
    EPX_THROW(ConfigError,
              fmt::format("--graph-split = '{}', expected expert or none", f.graph_split));
  }
  if (f.graph_split == "expert" && p.world_graphs) {
    EPX_THROW(ConfigError, "--graph-split = 'expert', expected only with --graph-scope rank");
  }
  p.split_graphs = f.graph_split != "none" && !p.world_graphs;
  if (f.overlap && p.world_graphs) {
    EPX_THROW(ConfigError, "--overlap with --graph-scope world, expected --graph-scope rank (each "
                           "rank captures its own two micro-batches)");
  }
  p.overlap = f.overlap;
  if (f.graph_experts.empty() || f.graph_experts == "auto") {
    p.graph_experts = W > 1 ? GraphExperts::kAllRows : GraphExperts::kSwitch;
  } else if (f.graph_experts == "switch" || f.graph_experts == "all-rows") {
    p.graph_experts = f.graph_experts == "switch" ? GraphExperts::kSwitch : GraphExperts::kAllRows;
  } else {
    EPX_THROW(ConfigError, fmt::format("--graph-experts = '{}', expected auto, switch or all-rows",
                                       f.graph_experts));
  }
  const int largest = largest_decode_bucket(p.workload);
  if (f.graph_buckets.empty()) {
    p.graph_buckets = decode_buckets(largest);
    return;
  }
  if (!f.cuda_graph)
    EPX_THROW(ConfigError,
              "--graph-buckets = '" + f.graph_buckets + "', expected only with --cuda-graph");
  // Integers in [1, largest], each once (named when not), then ascending.
  p.graph_buckets = parse_int_list(
      f.graph_buckets, "--graph-buckets", 1, largest,
      fmt::format("the smaller of --chunk-size, --max-batched-tokens and {}", kMaxGraphBatch));
  if (!std::is_sorted(p.graph_buckets.begin(), p.graph_buckets.end())) {
    EPX_THROW(ConfigError, fmt::format("--graph-buckets = '{}', expected ascending batch sizes",
                                       f.graph_buckets));
  }
}

}  // namespace

const char* graph_experts_name(GraphExperts g) {
  return g == GraphExperts::kSwitch ? "switch" : "all-rows";
}

std::string BackendMix::name() const {
  return prefill ? fmt::format("{}+{}", to_string(decode), to_string(*prefill))
                 : std::string(to_string(decode));
}

namespace {

// --backends: comma items, each a backend or decode+prefill; each item once.
std::vector<BackendMix> parse_backend_mixes(const std::string& text) {
  std::vector<BackendMix> out;
  for (const std::string& item : split_list(text, "--backends")) {
    const size_t plus = item.find('+');
    BackendMix m;
    m.decode = parse_backend_flag(item.substr(0, plus), "--backends");
    if (plus != std::string::npos) {
      m.prefill = parse_backend_flag(item.substr(plus + 1), "--backends");
      if (*m.prefill == m.decode) {
        EPX_THROW(ConfigError, fmt::format("--backends item '{}': expected two different backends "
                                           "(decode+prefill)",
                                           item));
      }
    }
    const bool seen = std::any_of(out.begin(), out.end(),
                                  [&](const BackendMix& o) { return o.name() == m.name(); });
    if (seen) {
      EPX_THROW(ConfigError, fmt::format("--backends = '{}' lists {} twice, expected each backend "
                                         "once",
                                         text, item));
    }
    out.push_back(m);
  }
  return out;
}

}  // namespace

Plan make_plan(Flags f, const std::set<std::string>& given) {
  Plan p;
  p.cuda_graph = f.cuda_graph;
  p.preset_note = apply_preset(f, given);
  p.workload = f.workload;
  validate(p.workload);
  check_model_flags(f);
  p.cfg = make_config(f);
  p.backends = parse_backend_mixes(f.backends);
  const Workload& w = p.workload;
  const bool mixed = std::any_of(p.backends.begin(), p.backends.end(),
                                 [](const BackendMix& m) { return m.prefill.has_value(); });
  p.prefill_threshold = f.prefill_threshold < 0 ? std::min(w.chunk_size, w.max_batched_tokens)
                                                : f.prefill_threshold;
  p.prefill_chunk = f.prefill_chunk == 0 ? w.max_batched_tokens : f.prefill_chunk;
  if (f.prefill_threshold >= 0 || f.prefill_chunk != 0) {
    EPX_CHECK(mixed, ConfigError, f.prefill_chunk != 0 ? "--prefill-chunk" : "--prefill-threshold",
              f.prefill_chunk != 0 ? f.prefill_chunk : f.prefill_threshold,
              "only with a DECODE+PREFILL entry in --backends");
  }
  check_range("--prefill-threshold", p.prefill_threshold, 0, w.max_batched_tokens,
              "tokens per rank, at most --max-batched-tokens");
  check_range("--prefill-chunk", p.prefill_chunk, 1, kMaxTokensPerRank,
              "the prefill backend's max tokens per rank");
  p.layer_max_tokens = mixed ? std::max(w.chunk_size, p.prefill_chunk) : w.chunk_size;
  p.weights = parse_weights(f.weights);
  p.shape = make_shape(f);
  p.launch = launch_from_env();
  p.layers = f.layers;
  p.seed = f.seed;
  p.json_path = f.json_path;
  plan_graphs(f, p);
  return p;
}

std::vector<CLI::Option*> add_flags(CLI::App* c, Flags& f) {
  Workload& w = f.workload;
  std::vector<CLI::Option*> workload_opts = {
      c->add_option("--world", w.world, "data-parallel ranks, in-process, all on GPU 0 (1..32)"),
      c->add_option("--num-prompts", w.num_prompts, "requests, all submitted at t = 0"),
      c->add_option("--isl", w.isl, "input (prompt) tokens per request"),
      c->add_option("--osl", w.osl, "output tokens per request"),
      c->add_option("--concurrency", w.concurrency, "requests in flight over all ranks"),
      c->add_option("--max-batched-tokens", w.max_batched_tokens,
                    "token budget per rank per step (decodes first, then prefill chunks)"),
      c->add_option("--chunk-size", w.chunk_size,
                    "DP chunk = the All2All's max_tokens_per_rank; a rank's tokens beyond it go "
                    "in further chunks")};
  for (CLI::Option* o : workload_opts) o->capture_default_str();
  c->add_option("--backends", f.backends,
                "comma list of naive | allgather_reducescatter | low_latency | high_throughput, "
                "or DECODE+PREFILL (e.g. low_latency+high_throughput): steps whose largest rank "
                "holds more than --prefill-threshold tokens go through PREFILL, in chunks of "
                "--prefill-chunk, the others through DECODE")
      ->capture_default_str();
  c->add_option("--prefill-threshold", f.prefill_threshold,
                "with a DECODE+PREFILL backend: tokens per rank above which a step is a prefill "
                "step (default: --chunk-size)");
  c->add_option("--prefill-chunk", f.prefill_chunk,
                "with a DECODE+PREFILL backend: the prefill backend's max tokens per rank "
                "(default: --max-batched-tokens, one call per step)");
  c->add_option("--hidden", f.hidden, "hidden size H (multiple of 512)")->capture_default_str();
  c->add_option("--intermediate", f.intermediate, "routed experts' I (multiple of 512)")
      ->capture_default_str();
  c->add_option("--experts", f.experts, "global experts E (multiple of --world)")
      ->capture_default_str();
  c->add_option("--topk", f.topk, "experts per token K")->capture_default_str();
  c->add_option("--shared-intermediate", f.shared_intermediate,
                "shared expert's I (0 = none, else a multiple of 512)")
      ->capture_default_str();
  c->add_option("--layers", f.layers, "MoE layers per step")->capture_default_str();
  c->add_option("--weights", f.weights,
                "auto | distinct | shared: one MoeLayer per layer, or one per rank reused by "
                "every layer (auto: distinct when they fit in device memory)")
      ->capture_default_str();
  c->add_option("--dtype", f.dtype, "dispatch wire dtype: bf16 | fp8 | bf16-to-fp8")
      ->capture_default_str();
  c->add_option("--layout", f.layout, "token | expert (dispatch output layout)")
      ->capture_default_str();
  c->add_option("--seed", f.seed, "seed of weights and activations")->capture_default_str();
  c->add_option("--json", f.json_path, "also write the results as JSON to FILE");
  c->add_option("--preset", f.preset, preset_help());
  c->add_flag("--cuda-graph", f.cuda_graph,
              "run every backend twice, eager then with decode-only steps (one chunk) replayed "
              "as CUDA graphs captured per batch bucket (--graph-buckets, --graph-scope; "
              "batches padded with dummy tokens); prefill and mixed steps stay eager");
  // How the decode graphs are built: defaults that run; the others diagnose graph replay.
  c->add_option("--graph-scope", f.graph_scope,
                "with --cuda-graph, who captures and launches the decode graphs: rank (the "
                "default: every rank its own graphs, from its own thread, as engines do) | world "
                "(one graph per bucket holding every rank's forward as parallel branches, "
                "launched from one thread)")
      ->capture_default_str();
  c->add_option("--graph-split", f.graph_split,
                "with --cuda-graph and --graph-scope rank, where a step's graph is cut: expert "
                "(the default: each layer's expert stage in a graph of its own, apart from "
                "dispatch and combine, as an engine that runs other work between them would "
                "capture; the table shows each piece's GPU time) | none (one graph per step)");
  c->add_option("--graph-experts", f.graph_experts,
                "with --cuda-graph, how a graph holds the expert GEMMs, whose row counts are "
                "known only on the device: switch (a SWITCH node per local expert picks its GEMM "
                "rows from the received count) | all-rows (no conditional nodes: every local "
                "expert's GEMMs at the most rows it can receive) | auto (the default: all-rows "
                "when ranks share the GPU, where graphs with SWITCH nodes have hung, from 20 "
                "ranks and once at 8; else switch)");
  c->add_flag("--overlap", f.overlap,
              "run every backend (and mode) again with each decode step (one chunk) as two "
              "micro-batches whose communication waits under each other's compute (dual-batch "
              "overlap: MoeLayer::forward_pair, the halves of dispatch and combine, two rounds in "
              "flight); the table shows both. Overlapped decode graphs are not split");
  c->add_option("--graph-buckets", f.graph_buckets,
                fmt::format("with --cuda-graph, the decode batch sizes (tokens per rank) "
                            "captured: an ascending comma list, each at most the smallest of "
                            "--chunk-size, --max-batched-tokens and {} (default 1, 2, 4, ... up to "
                            "that bound); a decode step replays the smallest bucket that holds "
                            "the largest rank's batch, larger ones run eagerly",
                            kMaxGraphBatch));
  return workload_opts;
}

}  // namespace epx::cli::serve
