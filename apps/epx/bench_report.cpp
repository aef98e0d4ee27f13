// `epx bench`'s report: the table for people and the "epx-bench/1" JSON for machines.
#include <fmt/format.h>

#include <algorithm>

#include "bench.hpp"
#include "epx/error.hpp"
#if EPX_HAVE_CUDA
#include "epx/world.hpp"
#endif

namespace epx::cli::bench {
namespace {

nlohmann::json figures(const Stats& s, const OpBytes& b, double floor_us, int world) {
  return {{"samples", s.samples},
          {"median_us", s.median_us},
          {"p90_us", s.p90_us},
          {"min_us", s.min_us},
          {"mean_us", s.mean_us},
          {"crossing_gbps_per_rank", gbps(b.crossing, s.median_us, world)},
          {"algorithm_gbps_per_rank", gbps(b.algorithm, s.median_us, world)},
          {"ratio_to_floor", s.median_us / floor_us}};
}

#if EPX_HAVE_CUDA
int gpus_used(const InProcessWorld& world) {
  std::vector<int> devices;
  for (int r = 0; r < world.size(); ++r)
    if (std::find(devices.begin(), devices.end(), world.device_of(r)) == devices.end())
      devices.push_back(world.device_of(r));
  return int(devices.size());
}

#endif

}  // namespace

std::optional<BackendResult> format_not_taken(Backend b, CombineFormat f) {
  if (f != CombineFormat::kLogFMT || takes_logfmt_combine(b)) return std::nullopt;
  BackendResult br;
  br.backend = b;
  br.format = f;
  br.status = "unavailable";
  br.message = fmt::format("combine_format {} is low_latency's only; {} combines bf16 rows",
                           to_string(f), to_string(b));
  return br;
}

std::string result_name(Backend b, CombineFormat f) {
  return f == CombineFormat::kBF16 ? std::string(to_string(b))
                                   : fmt::format("{} {}", to_string(b), to_string(f));
}

void print_table(const Plan& p, const std::vector<TokenResult>& results) {
  const int W = p.shape.cfg.world_size;
  const bool in_process = !p.ipc;
  fmt::print("\n{:>7}  {:<8}  {:<23}  {:>10}  {:>10}  {:>10}  {:>10}  {:>12}  {:>9}  {:>8}\n",
             "tokens", "op", "backend", "graph med", "graph p90", "eager med",
             in_process ? "per-rank" : "", "cross GB/s", "floor", "x floor");
  fmt::print("{:>7}  {:<8}  {:<23}  {:>10}  {:>10}  {:>10}  {:>10}  {:>12}  {:>9}  {:>8}\n",
             "/rank", "", "", "us", "us", "us", in_process ? "graph us" : "", "per rank", "us",
             "(graph)");
  auto cell = [](const BackendResult::Mode& m, int op) {
    if (!m.run) return fmt::format("{:>10}", "");
    return m.ok ? fmt::format("{:10.2f}", m.op[op].median_us) : fmt::format("{:>10}", "error");
  };
  for (const TokenResult& tr : results) {
    for (int op = 0; op < 2; ++op) {
      for (const BackendResult& br : tr.backends) {
        const bool eager_headline =
            br.status == "ok" && timing_of(headline_mode(br)) == TimingMode::kEager;
        const std::string head =
            fmt::format("{:>7}  {:<8}  {:<23}", tr.tokens, kOps[op],
                        result_name(br.backend, br.format) + (eager_headline ? " (eager)" : ""));
        if (br.status != "ok") {
          const std::string what = br.status == "failed" ? "FAILED" : br.status;
          fmt::print("{}  {}: {}\n", head, what, one_line(br.message, 100));
          continue;
        }
        const int hm = headline_mode(br);
        const LaunchMode launch = launch_of(hm);
        const auto& g = br.mode[hm];
        const std::string eager = cell(br.mode[mode_index(TimingMode::kEager, launch)], op);
        const std::string per_rank =
            launch == LaunchMode::kOnePerGpu
                ? cell(br.mode[mode_index(TimingMode::kGraph, LaunchMode::kPerRank)], op)
                : fmt::format("{:>10}", "");
        if (!g.ok) {
          fmt::print("{}  {:>10}  {:>10}  {}  {}  graph error: {}\n", head, "error", "", eager,
                     per_rank, one_line(g.error, 80));
          continue;
        }
        const double med = g.op[op].median_us;
        fmt::print("{}  {:10.2f}  {:10.2f}  {}  {}  {:12.1f}  {:9.2f}  {:8.2f}\n", head, med,
                   g.op[op].p90_us, eager, per_rank,
                   gbps(op_bytes(volumes_of(tr, br.format), op).crossing, med, W), tr.floor_us[op],
                   med / tr.floor_us[op]);
      }
    }
  }
  if (in_process) {
    fmt::print(
        "\ngraph / eager: the ranks of each GPU in one kernel per op (one launch, as a rank with "
        "a GPU of its own);\nper-rank: every rank its own kernel on its own stream, forked and "
        "joined in one graph.\n");
  }
  fmt::print(
      "cross GB/s per rank = payload bytes between distinct ranks after per-rank dedup "
      "/ graph median / world ({}){};\nfloor = HBM bytes of the op (input rows read once, "
      "deduplicated output rows written once) / measured copy bandwidth.\n",
      W,
      std::find(p.formats.begin(), p.formats.end(), CombineFormat::kLogFMT) != p.formats.end()
          ? " (a logfmt combine counts LogFMT rows, 41 * H / 32 bytes each)"
          : "");
}

void print_yardstick(const nlohmann::json& records) {
  fmt::print("\nNCCL's collectives on the same data (eager medians of the slowest rank, us):\n");
  fmt::print("{:>7}  {:<30} {:>12} {:>12}\n", "tokens", "collective", "dispatch", "combine");
  for (const auto& rec : records) {
    if (rec.at("status") != "ok") {
      fmt::print("{:>7}  {:<30} error: {}\n", rec.at("tokens_per_rank").get<int>(),
                 rec.at("collective").get<std::string>(),
                 one_line(rec.at("message").get<std::string>()));
      continue;
    }
    fmt::print("{:>7}  {:<30} {:>12.2f} {:>12.2f}\n", rec.at("tokens_per_rank").get<int>(),
               rec.at("collective").get<std::string>(),
               rec.at("dispatch").at("median_us").get<double>(),
               rec.at("combine").at("median_us").get<double>());
  }
}

nlohmann::json make_json(const Plan& p, const nlohmann::json& world_json, const GpuInfo& gpu,
                         const CopyBandwidth& bw, std::optional<double> fork_join_us,
                         const std::vector<TokenResult>& results) {
  using nlohmann::json;
  const EpConfig& cfg = p.shape.cfg;
  const int W = cfg.world_size;
  auto launch_json = [](const LaunchConfig& lc) {
    return json{{"num_blocks", lc.num_blocks}, {"warps_per_block", lc.warps_per_block}};
  };
  json doc;
  doc["schema"] = "epx-bench/1";
  doc["commit"] = git_commit();
  doc["timestamp_utc"] = utc_timestamp();
  // false while a run is still under way (its JSON is rewritten after each token count)
  doc["complete"] = results.size() == p.shape.tokens.size();
  doc["machine"] = machine_json(gpu);
  doc["world"] = world_json;
  doc["shape"] = {{"hidden", cfg.hidden},
                  {"experts", cfg.num_experts},
                  {"topk", cfg.topk},
                  {"dtype", to_string(cfg.dtype)},
                  {"layout", to_string(cfg.layout)},
                  {"scale_layout", to_string(cfg.scale_layout)},
                  {"round_scale", cfg.round_scale},
                  {"combine", to_string(cfg.combine)},
                  {"routing", p.shape.routing_name}};
  doc["shape"]["combine_formats"] = json::array();  // those measured; each result names its own
  for (CombineFormat f : p.formats) doc["shape"]["combine_formats"].push_back(to_string(f));
  doc["launch_configs"] = {{"source", p.launch.origin},
                           {"dispatch", launch_json(p.launch.launch.dispatch)},
                           {"combine", launch_json(p.launch.launch.combine)},
                           {"note", "0 = chosen by the backend per world and shape"}};
  doc["settings"] = {{"iters", p.iters},
                     {"warmup", p.warmup},
                     {"verify", p.verify},
                     {"seed", p.shape.seed},
                     {"timeout_ms", cfg.timeout_ms}};
  doc["copy_bandwidth"] = {{"bytes", bw.bytes},
                           {"repeats", bw.repeats},
                           {"median_us", bw.median_us},
                           {"gbps", bw.gbps},
                           {"counts", "read + write (2 x bytes per copy)"}};
  doc["fork_join_floor_us"] = fork_join_us ? json(*fork_join_us) : json(nullptr);
  json volumes = json::array();
  json records = json::array();
  for (const TokenResult& tr : results) {
    const Volumes& v = tr.volumes;
    json vol = {{"tokens_per_rank", tr.tokens},
                {"tokens_total", v.tokens},
                {"rows_crossing", v.rows_crossing},
                {"rows_self", v.rows_self},
                {"destination_ranks_per_token",
                 v.tokens ? double(v.rows_crossing + v.rows_self) / double(v.tokens) : 0.0},
                {"wire_row_bytes", v.wire_row_bytes},
                {"combine_row_bytes", v.combine_row_bytes}};
    for (int op = 0; op < 2; ++op) {
      const OpBytes& b = op_bytes(v, op);
      vol[kOps[op]] = {{"crossing_bytes", b.crossing},
                       {"algorithm_bytes", b.algorithm},
                       {"floor_bytes", b.floor},
                       {"floor_us", tr.floor_us[op]}};
    }
    // "combine" above counts bf16 rows; a run that measures LogFMT rows adds their figures.
    if (std::find(p.formats.begin(), p.formats.end(), CombineFormat::kLogFMT) !=
        p.formats.end()) {
      const Volumes& lv = tr.logfmt_volumes;
      vol["combine_logfmt"] = {{"combine_row_bytes", lv.combine_row_bytes},
                               {"crossing_bytes", lv.combine.crossing},
                               {"algorithm_bytes", lv.combine.algorithm},
                               {"floor_bytes", lv.combine.floor},
                               {"floor_us", tr.floor_us[1]}};
    }
    volumes.push_back(vol);
    for (const BackendResult& br : tr.backends) {
      for (int op = 0; op < 2; ++op) {
        for (int m = 0; m < 4; ++m) {
          const OpBytes& b = op_bytes(volumes_of(tr, br.format), op);
          const auto& mode = br.mode[m];
          if (!mode.run && br.status == "ok") continue;
          if (br.status != "ok" && m != headline_mode(br)) continue;  // one record says why
          json rec = {{"backend", to_string(br.backend)},
                      {"combine_format", to_string(br.format)},
                      {"tokens_per_rank", tr.tokens},
                      {"op", kOps[op]},
                      {"mode", to_string(timing_of(m))},
                      {"launch", to_string(launch_of(m))},
                      {"verification", br.verification},
                      {"crossing_bytes", b.crossing},
                      {"algorithm_bytes", b.algorithm},
                      {"floor_bytes", b.floor},
                      {"floor_us", tr.floor_us[op]}};
          if (br.status != "ok") {
            rec["status"] = br.status;
            rec["message"] = br.message;
          } else if (!mode.ok) {
            rec["status"] = "error";
            rec["message"] = mode.error;
          } else {
            rec["status"] = "ok";
            rec["message"] = nullptr;
            rec.update(figures(mode.op[op], b, tr.floor_us[op], W));
            if (!mode.per_rank[op].empty()) {
              rec["slowest_rank"] = mode.slowest_rank[op];
              json per_rank = json::array();
              for (const Stats& s : mode.per_rank[op]) per_rank.push_back(stats_json(s));
              rec["per_rank"] = per_rank;
            }
          }
          for (const char* k :
               {"samples", "median_us", "p90_us", "min_us", "mean_us", "crossing_gbps_per_rank",
                "algorithm_gbps_per_rank", "ratio_to_floor"})
            if (!rec.contains(k)) rec[k] = nullptr;
          records.push_back(rec);
        }
      }
    }
  }
  doc["volumes"] = volumes;
  doc["results"] = records;
  return doc;
}

bool all_ok(const std::vector<TokenResult>& results) {
  bool ok = true;  // an unavailable backend is reported, not a failure
  for (const TokenResult& tr : results)
    for (const BackendResult& br : tr.backends)
      if (br.status != "unavailable") {
        if (br.status != "ok") ok = false;
        for (const auto& m : br.mode)
          if (m.run && !m.ok) ok = false;
      }
  return ok;
}

std::string backend_list(const Plan& p) {
  std::string out;
  for (Backend b : p.backends) {
    if (!out.empty()) out += ',';
    out += to_string(b);
  }
  if (p.formats.size() > 1 || p.formats.front() != CombineFormat::kBF16) {
    out += " combine ";
    for (size_t i = 0; i < p.formats.size(); ++i)
      out += (i > 0 ? "," : "") + std::string(to_string(p.formats[i]));
  }
  return out;
}

#if EPX_HAVE_CUDA
nlohmann::json in_process_world_json(const InProcessWorld& world) {
  return {{"kind", "in_process"},
          {"ranks", world.size()},
          {"gpus_used", gpus_used(world)},
          {"ranks_per_gpu", world.ranks_on_device(world.device_of(0))},
          {"sm_budget_per_rank", world.sm_budget(0)}};
}
#endif

}  // namespace epx::cli::bench
