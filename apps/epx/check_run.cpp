// The runs of `epx check` (and `epx diag graph-replay`): the harness on an in-process world, or
// on this process's rank of a world of one process per rank, with the lines a user reads and the
// JSON report; and `epx check --fuzz`, random cases one after another.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "check.hpp"
#include "epx/all2all.hpp"
#include "epx/bootstrap.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"
#include "report.hpp"
#include "testing/fuzz_cases.hpp"

namespace epx::cli {

testing::CheckOptions check_options(const CheckRunFlags& f) {
  testing::CheckOptions o;
  // The config first: it refuses a bad --world before the counts are spread over its ranks.
  const std::vector<int> counts = parse_token_counts(f.tokens, "--tokens");  // never empty
  const int most = *std::max_element(counts.begin(), counts.end());
  o.cfg = f.shape.config(std::max(1, most));
  // A count above --max-tokens would reach dispatch and be refused there, on the GPU.
  EPX_CHECK(most <= o.cfg.max_tokens_per_rank, ConfigError, "--tokens", f.tokens,
            fmt::format("counts of at most --max-tokens = {}", o.cfg.max_tokens_per_rank));
  o.tokens = tokens_per_rank(counts, f.shape.world, "--tokens", f.tokens);
  o.backend = backend_or_env(f.backend, "--backend");
  o.launch = launch_from_env().launch;
  o.routing = parse_routing_flag(f.routing);
  o.seed = f.seed;
  o.iters = f.iters;
  o.graph_replays = f.graph;
  check_range("--verify-every", f.verify_every, 1, INT64_MAX);
  EPX_CHECK(f.verify_every == 1 || f.graph > 0, ConfigError, "--verify-every", f.verify_every,
            "1 without --graph N (it thins out the comparison of graph replays)");
  o.verify_every = f.verify_every;
  o.mixed = f.mixed;
  o.ids_int64 = f.ids64;
  o.one_launch = f.one_launch;
  o.halves = f.halves;
  o.log = [](const std::string& s) { fmt::print("  {}\n", s); };
  return o;
}

namespace {

nlohmann::json options_json(const testing::CheckOptions& o, const CheckRunFlags& f) {
  const EpConfig& cfg = o.cfg;
  return {{"backend", to_string(o.backend)},
          {"world", cfg.world_size},
          {"gpus", o.gpus},
          {"hidden", cfg.hidden},
          {"experts", cfg.num_experts},
          {"topk", cfg.topk},
          {"max_tokens", cfg.max_tokens_per_rank},
          {"tokens", f.tokens},
          {"dtype", to_string(cfg.dtype)},
          {"layout", to_string(cfg.layout)},
          {"scale_layout", to_string(cfg.scale_layout)},
          {"round_scale", cfg.round_scale},
          {"deterministic", cfg.deterministic},
          {"rounds_in_flight", cfg.rounds_in_flight},
          {"worst_case_output", cfg.worst_case_output},
          {"combine", to_string(cfg.combine)},
          {"combine_format", to_string(cfg.combine_format)},
          {"combine_order", to_string(cfg.combine_order)},
          {"timeout_ms", cfg.timeout_ms},
          {"routing", f.routing},
          {"seed", o.seed},
          {"iters", o.iters},
          {"graph_replays", o.graph_replays},
          {"verify_every", o.verify_every},
          {"mixed", o.mixed},
          {"ids64", o.ids_int64},
          {"one_launch", o.one_launch},
          {"halves", o.halves}};
}

nlohmann::json report_json(const testing::CheckReport& rep, double seconds) {
  nlohmann::json memory = nlohmann::json::array();
  for (const testing::MemorySample& m : rep.memory)
    memory.push_back({{"replays", m.replays},
                      {"device_bytes", m.device_bytes},
                      {"host_rss_bytes", m.host_rss_bytes}});
  return {{"ok", rep.ok},
          {"calls_checked", rep.calls},
          {"graph_replays_run", rep.replays},
          {"mismatches", rep.mismatches},
          {"buffer_bytes_per_rank", rep.buffer_bytes},
          {"tokens_per_rank", rep.tokens},
          {"memory", memory},
          {"seconds", seconds}};
}

// The document of `epx check --json`.
void write_check_json(const std::string& path, const std::string& world_kind, int device,
                      const testing::CheckOptions& o, const CheckRunFlags& f,
                      const testing::CheckReport& rep, double seconds) {
  nlohmann::json doc;
  doc["schema"] = "epx-check/1";
  doc["commit"] = git_commit();
  doc["timestamp_utc"] = utc_timestamp();
  doc["machine"] = machine_json(gpu_info(device));
  doc["world_kind"] = world_kind;
  doc["options"] = options_json(o, f);
  doc["report"] = report_json(rep, seconds);
  write_json(path, doc);
}

}  // namespace

int run_in_process_check(const testing::CheckOptions& o, const CheckRunFlags& f,
                         const std::string& json) {
  const EpConfig& cfg = o.cfg;
  fmt::print(
      "epx check: backend {}, world {}, H {}, E {}, K {}, tokens {}, max {}, dtype {}, "
      "layout {}, scales {}{}, combine {} {}, routing {}, seed {}\n",
      to_string(o.backend), cfg.world_size, cfg.hidden, cfg.num_experts, cfg.topk, f.tokens,
      cfg.max_tokens_per_rank, to_string(cfg.dtype), to_string(cfg.layout),
      to_string(cfg.scale_layout), cfg.round_scale ? " (powers of two)" : "",
      to_string(cfg.combine), to_string(cfg.combine_format), f.routing, o.seed);
  const auto t0 = std::chrono::steady_clock::now();
  const testing::CheckReport rep = testing::run_check(o);
  const double secs = seconds_since(t0);
  for (const auto& m : rep.mismatches) fmt::print("  MISMATCH {}\n", m);
  fmt::print("{}: {} call(s) checked, buffer {} per rank, {:.1f} s\n", rep.ok ? "PASS" : "FAIL",
             rep.calls, mib(rep.buffer_bytes), secs);
  if (!json.empty()) write_check_json(json, "in-process", 0, o, f, rep, secs);
  return rep.ok ? 0 : 1;
}

namespace {

template <typename World>
int check_on(World& world, const testing::CheckOptions& o, WorldKind kind, const CheckRunFlags& f,
             const std::vector<int>& fault_kill_ranks, const std::string& json) {
  const bool lead = world.rank() == 0;
  const EpConfig& cfg = o.cfg;
  if (std::find(fault_kill_ranks.begin(), fault_kill_ranks.end(), world.rank()) !=
      fault_kill_ranks.end()) {
    // Fault injection: take part in the world and in the creation of the All2All (the first
    // collective of run_check_ipc), then die abruptly before the first dispatch. The other ranks
    // must report this rank by name within EPX_TIMEOUT_MS and leave no socket file.
    EPX_CUDA_CHECK(cudaSetDevice(world.device()));
    const std::unique_ptr<All2All> a2a = make_all2all(o.backend, cfg, world, o.launch);
    fmt::print(
        "fault injection: rank {} (pid {}) created its All2All and kills itself (SIGKILL) "
        "before its first dispatch\n",
        world.rank(), long(::getpid()));
    std::fflush(stdout);
    ::raise(SIGKILL);
  }
  if (lead) {
    fmt::print(
        "epx check: {} world ({} processes), backend {}, world {}, H {}, E {}, K {}, "
        "tokens {}, max {}, dtype {}, layout {}, scales {}{}, combine {} {}, routing {}, "
        "seed {}\n",
        to_string(kind), world.size(), to_string(o.backend), cfg.world_size, cfg.hidden,
        cfg.num_experts, cfg.topk, f.tokens, cfg.max_tokens_per_rank, to_string(cfg.dtype),
        to_string(cfg.layout), to_string(cfg.scale_layout),
        cfg.round_scale ? " (powers of two)" : "", to_string(cfg.combine),
        to_string(cfg.combine_format), f.routing, o.seed);
    std::fflush(stdout);
  }
  const auto t0 = std::chrono::steady_clock::now();
  const testing::CheckReport rep = testing::run_check_world(o, world);
  const double secs = seconds_since(t0);
  if (lead) {
    for (const auto& m : rep.mismatches) fmt::print("  MISMATCH {}\n", m);
    fmt::print("{}: {} call(s) checked on each of {} ranks, buffer {} per rank, {:.1f} s\n",
               rep.ok ? "PASS" : "FAIL", rep.calls, world.size(), mib(rep.buffer_bytes), secs);
    if (!json.empty()) write_check_json(json, to_string(kind), world.device(), o, f, rep, secs);
    std::fflush(stdout);
  }
  return rep.ok ? 0 : 1;
}

}  // namespace

int run_world_check(const testing::CheckOptions& o, WorldKind kind, const CheckRunFlags& f,
                    const std::vector<int>& fault_kill_ranks, const std::string& json) {
  require_gpu("epx check");
  // Ranks go round-robin over the GPUs this process sees (as in an in-process world).
  const int gpus = cuda_device_count();
  const int device = gpus > 0 ? BootstrapOptions::from_env().rank % gpus : -1;
  if (kind == WorldKind::kNccl) {
    NcclWorld world = NcclWorld::from_env(device);
    return check_on(world, o, kind, f, fault_kill_ranks, json);
  }
  IpcWorld world = IpcWorld::from_env(device);
  return check_on(world, o, kind, f, fault_kill_ranks, json);
}

// ---- epx check --fuzz ---------------------------------------------------------------------------

namespace {

// The options `epx check` builds from a fuzz case's command line: the same flags, parsed by the
// same functions as a user's.
testing::CheckOptions options_of_command(const std::string& command) {
  constexpr const char* kPrefix = "epx check ";
  EPX_CHECK(command.rfind(kPrefix, 0) == 0, InputError, "fuzz command", command,
            "a line that starts with 'epx check '");
  CLI::App app;
  CheckRunFlags f;
  add_check_run_flags(&app, f);
  app.parse(command.substr(std::strlen(kPrefix)), false);
  return check_options(f);
}

// Whether `a` and `b` check the same thing (launch shapes, log and timeout aside).
bool same_check(const testing::CheckOptions& a, const testing::CheckOptions& b) {
  const EpConfig &x = a.cfg, &y = b.cfg;
  return x.world_size == y.world_size && x.hidden == y.hidden &&
         x.num_experts == y.num_experts && x.topk == y.topk &&
         x.max_tokens_per_rank == y.max_tokens_per_rank && x.dtype == y.dtype &&
         x.scale_layout == y.scale_layout && x.round_scale == y.round_scale && x.layout == y.layout &&
         x.deterministic == y.deterministic && x.rounds_in_flight == y.rounds_in_flight &&
         x.worst_case_output == y.worst_case_output && x.combine == y.combine &&
         x.combine_format == y.combine_format && x.combine_order == y.combine_order &&
         a.gpus == b.gpus && a.backend == b.backend && a.tokens == b.tokens &&
         a.routing == b.routing && a.seed == b.seed && a.iters == b.iters &&
         a.graph_replays == b.graph_replays && a.verify_every == b.verify_every &&
         a.mixed == b.mixed && a.one_launch == b.one_launch && a.halves == b.halves &&
         a.pool == b.pool && a.ids_int64 == b.ids_int64;
}

}  // namespace

int run_fuzz(const FuzzFlags& f) {
  require_gpu("epx check --fuzz");
  if (f.timeout_ms != 0) check_range("--timeout-ms", f.timeout_ms, 1, kMaxTimeoutMs);
  // The cases' own config leaves the timeout at the library's default; EPX_TIMEOUT_MS, then
  // --timeout-ms, as for every check (a reproducing command in the same environment agrees).
  const int timeout_ms = f.timeout_ms != 0 ? f.timeout_ms : read_env().timeout_ms.value_or(0);
  fmt::print(
      "epx check --fuzz {:g} --seed {}: random cases on GPU 0, each against the CPU reference, "
      "until {:g} min have passed; stops at the first failure\n",
      f.minutes, f.seed, f.minutes);
  if (read_env().config_path)
    fmt::print("  note: EPX_CONFIG_PATH is not read by --fuzz (the backends' launch shapes)\n");
  std::fflush(stdout);
  const GpuInfo gpu = gpu_info(0);
  const auto t0 = std::chrono::steady_clock::now();
  auto minutes = [&] { return seconds_since(t0) / 60.0; };
  nlohmann::json cases = nlohmann::json::array();
  int64_t num_cases = 0, calls = 0, mismatches = 0;
  bool ok = true;
  for (int64_t i = 0; ok && minutes() < f.minutes; ++i) {
    const testing::FuzzCase c = testing::make_fuzz_case(f.seed, i);
    testing::CheckOptions o = c.options;
    std::string command = c.command;
    if (timeout_ms != 0) o.cfg.timeout_ms = timeout_ms;
    if (f.timeout_ms != 0) command += fmt::format(" --timeout-ms {}", f.timeout_ms);
    const auto c0 = std::chrono::steady_clock::now();
    testing::CheckReport rep;
    if (!same_check(o, options_of_command(command))) {
      rep.ok = false;
      rep.mismatches.push_back("the case's command line does not reproduce it (fuzz_cases.cpp)");
    } else {
      try {
        rep = testing::run_check(o);
      } catch (const Error& e) {  // a refused case or an error outside the comparison
        rep.ok = false;
        rep.mismatches.push_back(fmt::format("{} error: {}", to_string(e.code()), e.what()));
      }
    }
    const double secs = seconds_since(c0);
    ++num_cases;
    calls += rep.calls;
    mismatches += int64_t(rep.mismatches.size());
    ok = rep.ok;
    fmt::print("#{} {} {:.1f} s  {}\n", i, rep.ok ? "PASS" : "FAIL", secs, c.description);
    cases.push_back({{"index", i},
                     {"description", c.description},
                     {"mode", testing::to_string(c.mode)},
                     {"command", command},
                     {"ok", rep.ok},
                     {"calls", rep.calls},
                     {"seconds", secs},
                     {"mismatches", rep.mismatches}});
    if (!rep.ok) {
      for (const auto& m : rep.mismatches) fmt::print("  MISMATCH {}\n", m);
      fmt::print("reproduce: {}\n", command);
    }
    std::fflush(stdout);
  }
  const double total = minutes();
  fmt::print("fuzz: {} cases, {} calls, {} mismatches, {:.1f} min\n", num_cases, calls, mismatches,
             total);
  if (!f.json.empty()) {
    nlohmann::json doc;
    doc["schema"] = "epx-check-fuzz/1";
    doc["commit"] = git_commit();
    doc["timestamp_utc"] = utc_timestamp();
    doc["machine"] = machine_json(gpu);
    doc["seed"] = f.seed;
    doc["minutes"] = f.minutes;
    doc["timeout_ms"] = timeout_ms;
    doc["cases"] = cases;
    doc["summary"] = {{"ok", ok},
                      {"cases", num_cases},
                      {"calls", calls},
                      {"mismatches", mismatches},
                      {"minutes", total}};
    write_json(f.json, doc);
  }
  return ok ? 0 : 1;
}

}  // namespace epx::cli
