#include "serve_report.hpp"

#include <algorithm>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <fstream>

#include "epx/error.hpp"

namespace epx::cli::serve {
namespace {

std::string backend_names(const std::vector<BackendMix>& backends) {
  std::string out;
  for (const BackendMix& b : backends) out += (out.empty() ? "" : ",") + b.name();
  return out;
}

}  // namespace

std::string one_line(std::string s, size_t max) {
  for (char& c : s)
    if (c == '\n') c = ' ';
  if (s.size() > max) s = s.substr(0, max - 3) + "...";
  return s;
}

// ---- stdout ------------------------------------------------------------------------------------

void print_header(const Plan& p, const GpuInfo& gpu, int sm_budget_per_rank,
                  const std::string& env_note) {
  const Workload& w = p.workload;
  fmt::print(
      "epx serve-bench: {} in-process ranks on {} ({} SMs, {} blocks per rank), "
      "backends {}, commit {}\n",
      w.world, gpu.name, gpu.sm_count, sm_budget_per_rank, backend_names(p.backends), git_commit());
  fmt::print(
      "  MoE: H {}, I {}, E {}, top-{} ({} of {} groups), shared I {}, dtype {}, layout "
      "{}, {} layer(s), seed {}\n",
      p.shape.hidden, p.shape.intermediate, p.shape.num_experts, p.shape.topk, p.shape.topk_groups,
      p.shape.num_groups, p.shape.shared_intermediate, to_string(p.cfg.dtype),
      to_string(p.cfg.layout), p.layers, p.seed);
  fmt::print(
      "  workload: {} prompts, ISL {}, OSL {}, concurrency {}, {} batched tokens per rank "
      "per step, chunk {} (max_tokens_per_rank), all submitted at t = 0, round robin "
      "over ranks\n",
      w.num_prompts, w.isl, w.osl, w.concurrency, w.max_batched_tokens, w.chunk_size);
  if (!p.preset_note.empty()) fmt::print("  {}\n", p.preset_note);
  fmt::print("  simulated: the MoE layers only; attention and dense layers are not simulated\n");
  if (p.cuda_graph) {
    fmt::print(
        "  --cuda-graph: every backend runs eager, then with decode-only steps as CUDA graph "
        "replays (buckets {}; {}; {})\n",
        fmt::join(p.graph_buckets, ","),
        p.world_graphs   ? "one graph of every rank per bucket, one launch per step"
        : p.split_graphs ? "per-rank graphs, each launched from its rank's thread; each layer's "
                           "expert stage in a graph of its own, 2 x layers + 1 launches per step"
                         : "per-rank graphs, each launched from its rank's thread, one per step",
        p.graph_experts == GraphExperts::kSwitch
            ? "experts: a SWITCH node each picks the GEMM rows from the received count"
            : "experts: no conditional nodes, every local expert's GEMMs at the most rows it "
              "can receive");
  }
  fmt::print("  launch shapes: {}, timeout {} ms, {}\n", p.launch.origin, p.cfg.timeout_ms,
             env_note);
  std::fflush(stdout);
}

// A row's name: the backend (or decode+prefill), then how decode steps ran.
std::string row_name(const BackendResult& br) {
  return fmt::format("{}{}{}", br.backend.name(), br.cuda_graph ? " (graph)" : "",
                     br.overlap ? " (overlap)" : "");
}

void print_table(const std::vector<BackendResult>& results) {
  int kName = 41;  // "allgather_reducescatter (graph) (overlap)", or the longest row's
  for (const BackendResult& br : results) kName = std::max(kName, int(row_name(br).size()));
  fmt::print("\n{:<{}} {:>9} {:>8} {:>8} {:>8} {:>10} {:>9} {:>10} {:>6} {:>8}\n", "backend", kName,
             "ITL mean", "P25", "P50", "P75", "TTFT mean", "TTFT P50", "out tok/s", "steps",
             "total");
  fmt::print("{:<{}} {:>9} {:>8} {:>8} {:>8} {:>10} {:>9} {:>10} {:>6} {:>8}\n", "", kName, "ms",
             "ms", "ms", "ms", "ms", "ms", "", "", "s");
  bool any_graph = false;
  for (const BackendResult& br : results) {
    const std::string name = row_name(br);
    any_graph |= br.cuda_graph;
    if (br.status != "ok") {
      fmt::print("{:<{}} {}: {}\n", name, kName, br.status, one_line(br.message, 100));
      continue;
    }
    const LatencyReport& l = br.latency;
    fmt::print("{:<{}} {:9.2f} {:8.2f} {:8.2f} {:8.2f} {:10.1f} {:9.1f} {:10.0f} {:6} {:8.2f}\n",
               name, kName, 1e3 * l.itl_s.mean, 1e3 * l.itl_s.p25, 1e3 * l.itl_s.p50,
               1e3 * l.itl_s.p75, 1e3 * l.ttft_s.mean, 1e3 * l.ttft_s.p50, l.output_tokens_per_s,
               br.steps, l.end_s);
  }
  fmt::print(
      "\nITL = gaps between consecutive output tokens of a request, pooled over requests; "
      "TTFT from submission (t = 0);\npercentiles by linear interpolation between closest "
      "ranks (numpy's default).\n");
  if (std::any_of(results.begin(), results.end(),
                  [](const BackendResult& br) { return br.backend.prefill.has_value(); })) {
    fmt::print(
        "DECODE+PREFILL rows: steps whose largest rank holds more than --prefill-threshold "
        "tokens go through the PREFILL backend in chunks of --prefill-chunk; the others through "
        "DECODE.\n");
    for (const BackendResult& br : results) {
      if (br.backend.prefill && br.status == "ok")
        fmt::print("  {}: {} of {} steps through {}\n", row_name(br), br.prefill_backend_steps,
                   br.steps, to_string(*br.backend.prefill));
    }
  }
  if (std::any_of(results.begin(), results.end(), [](const BackendResult& br) { return br.overlap; })) {
    fmt::print(
        "(overlap) rows: each decode-only step within one chunk runs as two micro-batches (half "
        "the tokens each) on two rounds in flight, each one's dispatch and combine waiting under "
        "the other's compute (MoeLayer::forward_pair); other steps as without.\n");
  }
  if (!any_graph) return;
  fmt::print(
      "(graph) rows: decode-only steps within one chunk replay per-rank CUDA graphs captured "
      "per batch bucket (every rank padded to the bucket of the largest rank's batch); prefill "
      "and mixed steps run eagerly. The padding tokens are routed and computed like real ones, "
      "so a graph step does up to the bucket's work on every rank.\n");
  for (const BackendResult& br : results) {
    if (!br.cuda_graph || br.status != "ok") continue;
    fmt::print(
        "  {}{}: {} of {} steps replayed, capture + instantiation {:.2f} s, host time of one "
        "rank's cudaGraphLaunch calls of a step P50 {:.3f} ms, max {:.3f} ms\n",
        br.backend.name(), br.overlap ? " (overlap)" : "", br.graph_steps, br.steps, br.capture_s, 1e3 * br.launch_s.p50,
        1e3 * br.launch_s.max);
    if (br.piece_s.empty()) continue;
    std::string pieces;
    for (size_t i = 0; i < br.piece_s.size(); ++i) {
      pieces +=
          fmt::format("{}{} {:.2f}", i ? ", " : "",
                      graph_piece_name(int(i), int(br.piece_s.size())), 1e3 * br.piece_s[i].p50);
    }
    fmt::print("    GPU time per piece of a step, P50 over ranks and replays, ms: {}\n", pieces);
  }
}

// ---- JSON --------------------------------------------------------------------------------------

namespace {

nlohmann::json summary_json(const Summary& s) {
  return {{"count", s.count},   {"mean", 1e3 * s.mean}, {"p25", 1e3 * s.p25},
          {"p50", 1e3 * s.p50}, {"p75", 1e3 * s.p75},   {"max", 1e3 * s.max}};
}
}  // namespace

nlohmann::json make_json(const Plan& p, int sm_budget_per_rank, const GpuInfo& gpu,
                         const std::string& weights_note, int distinct_layers,
                         const std::vector<BackendResult>& results) {
  using nlohmann::json;
  const Workload& w = p.workload;
  json doc;
  doc["schema"] = "epx-serve-bench/1";
  doc["commit"] = git_commit();
  doc["timestamp_utc"] = utc_timestamp();
  doc["machine"] = machine_json(gpu);
  doc["world"] = {{"kind", "in_process"},
                  {"ranks", w.world},
                  {"gpus_used", 1},
                  {"sm_budget_per_rank", sm_budget_per_rank}};
  doc["shape"] = {{"hidden", p.shape.hidden},
                  {"intermediate", p.shape.intermediate},
                  {"experts", p.shape.num_experts},
                  {"topk", p.shape.topk},
                  {"groups", p.shape.num_groups},
                  {"topk_groups", p.shape.topk_groups},
                  {"shared_intermediate", p.shape.shared_intermediate},
                  {"dtype", to_string(p.cfg.dtype)},
                  {"layout", to_string(p.cfg.layout)},
                  {"layers", p.layers},
                  {"distinct_layer_weights", distinct_layers},
                  {"weights", weights_note}};
  doc["workload"] = {
      {"num_prompts", w.num_prompts},
      {"isl", w.isl},
      {"osl", w.osl},
      {"concurrency", w.concurrency},
      {"max_batched_tokens_per_rank", w.max_batched_tokens},
      {"chunk_size", w.chunk_size},
      {"preset", p.preset_note.empty() ? json(nullptr) : json(p.preset_note)},
      {"seed", p.seed},
      {"timeout_ms", p.cfg.timeout_ms},
      {"launch_configs", p.launch.origin},
      {"simulated", "MoE layers only (no attention, no dense layers)"},
      {"percentiles", "linear interpolation between closest ranks (numpy default)"},
      {"warmup",
       "3 untimed steps per backend (full budget, one chunk, one token)"
       "; with cuda_graph also the capture and one replay per bucket"},
      {"cuda_graph", p.cuda_graph},
      {"overlap", p.overlap},
      {"graph_buckets", p.cuda_graph ? json(p.graph_buckets) : json(nullptr)},
      {"graph_scope", p.cuda_graph ? json(p.world_graphs ? "world" : "rank") : json(nullptr)},
      {"graph_split", p.cuda_graph ? json(p.split_graphs ? "expert" : "none") : json(nullptr)},
      {"graph_experts", p.cuda_graph ? json(graph_experts_name(p.graph_experts)) : json(nullptr)}};
  json records = json::array();
  for (const BackendResult& br : results) {
    json rec = {{"backend", br.backend.name()},
                {"decode_backend", to_string(br.backend.decode)},
                {"prefill_backend", br.backend.prefill ? json(to_string(*br.backend.prefill))
                                                       : json(nullptr)},
                {"prefill_backend_steps", br.prefill_backend_steps},
                {"mode", br.cuda_graph ? "cuda_graph" : "eager"},
                {"overlap", br.overlap},
                {"status", br.status}};
    if (br.status != "ok") {
      rec["message"] = br.message;
    } else {
      const LatencyReport& l = br.latency;
      rec["itl_ms"] = summary_json(l.itl_s);
      rec["ttft_ms"] = summary_json(l.ttft_s);
      rec["step_ms"] = summary_json(br.step_s);
      rec["output_tokens"] = l.output_tokens;
      rec["output_tokens_per_s"] = l.output_tokens_per_s;
      rec["total_s"] = l.end_s;
      rec["steps"] = br.steps;
      rec["prefill_steps"] = br.prefill_steps;
      rec["warmup_s"] = br.warmup_s;
      if (br.cuda_graph) {
        rec["graph_launch_ms"] = summary_json(br.launch_s);
        if (!br.piece_s.empty()) {
          json pieces = json::array();
          for (size_t i = 0; i < br.piece_s.size(); ++i) {
            json piece = summary_json(br.piece_s[i]);
            piece["piece"] = graph_piece_name(int(i), int(br.piece_s.size()));
            pieces.push_back(piece);
          }
          rec["graph_piece_ms"] = pieces;
        }
        rec["graph_steps"] = br.graph_steps;
        rec["capture_s"] = br.capture_s;
      }
    }
    records.push_back(rec);
  }
  doc["results"] = records;
  return doc;
}

void check_json_path(const std::string& path) {
  std::ofstream probe(path);
  if (!probe) EPX_THROW(InputError, fmt::format("--json = '{}' cannot be written", path));
}

}  // namespace epx::cli::serve
