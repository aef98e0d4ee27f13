// `epx check` (GPU vs CPU reference), `epx selftest` (CPU reference only) and `epx sizes`.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.hpp"
#include "commands.hpp"
#include "epx/all2all.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "moe_check.hpp"
#include "reference/reference.hpp"
#if EPX_HAVE_CUDA
#include "testing/harness.hpp"
#include "epx/cuda_check.hpp"
#include "epx/bootstrap.hpp"
#include "epx/world.hpp"
#endif

namespace epx::cli {
namespace {

[[maybe_unused]] std::string mib(size_t bytes) {
  return fmt::format("{:.1f} MiB", double(bytes) / (1 << 20));
}

struct CheckFlags {
  ShapeFlags shape;
  std::string tokens = "128";
  std::string routing = "uniform";
  std::string backend;
  uint64_t seed = 1;
  int iters = 2;
  int graph = 0;
  bool mixed = false;
  bool graph_conditional = false;
  bool rank_threads = false;
  int graph_execs = 1;
  bool graph_split = false;
  bool ids64 = false;
  int pool = 3;
  std::string world_kind = "in-process";
  bool moe = false;
  int fault_kill_rank = -1;  // testing (hidden): see --fault-kill-rank
  MoeLayerFlags moe_flags;   // the layer's own flags
};

// `epx check --moe`: the shared flags of `check` and the layer's own.
MoeCheckFlags moe_check_flags(const CheckFlags& f) {
  return {.shape = f.shape, .tokens = f.tokens, .backend = f.backend, .seed = f.seed,
          .layer = f.moe_flags};
}

#if EPX_HAVE_CUDA
// --tokens: the per-rank counts, and max_tokens_per_rank unless --max-tokens is given.
testing::CheckOptions check_options(const CheckFlags& f) {
  testing::CheckOptions o;
  o.tokens = tokens_per_rank(parse_token_counts(f.tokens, "--tokens"), f.shape.world, "--tokens",
                             f.tokens);
  o.cfg = f.shape.config(std::max(1, *std::max_element(o.tokens.begin(), o.tokens.end())));
  o.backend = backend_or_env(f.backend, "--backend");
  o.launch = launch_from_env().launch;
  o.routing = parse_routing_flag(f.routing);
  o.seed = f.seed;
  o.iters = f.iters;
  o.graph_replays = f.graph;
  o.mixed = f.mixed;
  o.ids_int64 = f.ids64;
  o.pool = f.pool;
  o.log = [](const std::string& s) { fmt::print("  {}\n", s); };
  return o;
}
#endif

#if EPX_HAVE_CUDA
// `epx check --world-kind ipc`: this process is rank EPX_RANK of EPX_WORLD_SIZE (`epx launch`
// sets both). Every rank checks its own outputs; rank 0 prints; all exit with the same code.
// `epx check --world-kind ipc|nccl`: one process per rank.
void run_check_ipc_cli(const CheckFlags& flags, bool world_given, int& exit_code) {
  const BootstrapOptions env_world = BootstrapOptions::from_env();
  CheckFlags fl = flags;
  if (world_given) {
    EPX_CHECK(fl.shape.world == env_world.world_size, ConfigError, "--world", fl.shape.world,
              fmt::format("EPX_WORLD_SIZE = {} with --world-kind ipc (one process per rank: "
                          "run `epx launch -n {} -- epx check --world-kind ipc ...`, or leave "
                          "--world out)",
                          env_world.world_size, fl.shape.world));
  }
  fl.shape.world = env_world.world_size;
  EPX_CHECK(fl.fault_kill_rank < fl.shape.world, ConfigError, "--fault-kill-rank",
            fl.fault_kill_rank, fmt::format("a rank of the world, in [0, {})", fl.shape.world));
  require_gpu("epx check");
  testing::CheckOptions o = check_options(fl);
  // Ranks go round-robin over the GPUs this process sees (as in an in-process world).
  const int gpus = cuda_device_count();
  const int device = gpus > 0 ? env_world.rank % gpus : -1;
  const bool nccl = parse_world_kind(fl.world_kind) == WorldKind::kNccl;
  auto run_on = [&](auto& world) {
    const bool lead = world.rank() == 0;
    const EpConfig& cfg = o.cfg;
    if (fl.fault_kill_rank == world.rank()) {
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
          "tokens {}, max {}, dtype {}, layout {}, scales {}, routing {}, seed {}\n",
          fl.world_kind, world.size(), to_string(o.backend), cfg.world_size, cfg.hidden,
          cfg.num_experts, cfg.topk, fl.tokens, cfg.max_tokens_per_rank, to_string(cfg.dtype),
          to_string(cfg.layout), to_string(cfg.scale_layout), fl.routing, o.seed);
      std::fflush(stdout);
    }
    const auto t0 = std::chrono::steady_clock::now();
    const testing::CheckReport rep = testing::run_check_world(o, world);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (lead) {
      for (const auto& m : rep.mismatches) fmt::print("  MISMATCH {}\n", m);
      fmt::print("{}: {} call(s) checked on each of {} ranks, buffer {} per rank, {:.1f} s\n",
                 rep.ok ? "PASS" : "FAIL", rep.calls, world.size(), mib(rep.buffer_bytes), secs);
      std::fflush(stdout);
    }
    exit_code = rep.ok ? 0 : 1;
  };
  if (nccl) {
    NcclWorld world = NcclWorld::from_env(device);
    run_on(world);
  } else {
    IpcWorld world = IpcWorld::from_env(device);
    run_on(world);
  }
}
#endif

}  // namespace

void add_check(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<CheckFlags>();
  CLI::App* c = app.add_subcommand(
      "check",
      "run dispatch -> identity expert -> combine on the GPU and compare every output "
      "with the CPU reference (exit 0 only if all match)");
  add_shape_flags(c, f->shape, MaxTokensFlag::kOffered);
  c->add_option("--tokens", f->tokens, "tokens per rank: one count, or a comma list (one per rank)")
      ->capture_default_str();
  c->add_option("--routing", f->routing, kRoutingNames)
      ->capture_default_str();
  c->add_option("--backend", f->backend, "low_latency (default: EPX_BACKEND or low_latency)");
  c->add_option("--seed", f->seed, "seed of inputs and routing")->capture_default_str();
  c->add_option("--iters", f->iters, "eager calls, fresh inputs each")->capture_default_str();
  c->add_option("--graph", f->graph, "capture once per rank, replay N times with fresh inputs");
  c->add_flag("--mixed", f->mixed, "with --graph: rank 0 calls eagerly, the others replay");
  c->add_flag("--graph-conditional", f->graph_conditional,
              "with --graph, in-process: the captured expert runs inside a conditional (SWITCH) "
              "node set on the device, as the MoE layer's captured expert stage");
  c->add_flag("--rank-threads", f->rank_threads,
              "with --graph, in-process: every rank captures and replays from its own host thread");
  c->add_option("--graph-execs", f->graph_execs,
                "with --graph, in-process: executable graphs per rank, each captured on its own, "
                "replayed in turn (1..64)")
      ->capture_default_str();
  c->add_flag("--graph-split", f->graph_split,
              "with --graph, in-process: dispatch, expert and combine captured as three graphs "
              "replayed in order (as the MoE layer's split capture), not one");
  c->add_flag("--ids64", f->ids64, "pass topk_ids as int64");
  c->add_option("--pool", f->pool, "distinct input sets cycled through")->capture_default_str();
  // Testing only, hence hidden (empty group): proves that a killed rank is named by the others.
  c->add_option("--fault-kill-rank", f->fault_kill_rank,
                "testing, --world-kind ipc: this rank creates its All2All, then kills itself "
                "(SIGKILL) before its first dispatch")
      ->group("");
  CLI::Option* world_opt = c->get_option("--world");
  c->add_option("--world-kind", f->world_kind,
                "in-process (every rank a stream of this process) | ipc (this process is one "
                "rank: run under `epx launch -n W`; --world defaults to EPX_WORLD_SIZE) | nccl "
                "(as ipc, memory through NCCL windows; one GPU per rank)")
      ->capture_default_str();
  c->add_flag("--moe", f->moe,
              "check the MoE layer instead: W ranks vs the same layer on one rank with every "
              "expert local (and vs the CPU reference when H <= 1024 and E <= 64)");
  std::vector<CLI::Option*> moe_only = {
      c->add_option("--intermediate", f->moe_flags.intermediate, "--moe: routed experts' I")
          ->capture_default_str(),
      c->add_option("--scoring", f->moe_flags.scoring, "--moe: sigmoid (grouped) | softmax")
          ->capture_default_str(),
      c->add_option("--groups", f->moe_flags.groups, "--moe: expert groups")->capture_default_str(),
      c->add_option("--topk-groups", f->moe_flags.topk_groups, "--moe: groups kept per token")
          ->capture_default_str(),
      c->add_option("--shared-intermediate", f->moe_flags.shared_intermediate,
                    "--moe: shared expert's I (0 = none)")
          ->capture_default_str(),
      c->add_option("--tolerance", f->moe_flags.tolerance,
                    "--moe: bound of ||d||/||ref|| over all tokens (fp8 experts)")
          ->capture_default_str()};
  std::vector<CLI::Option*> not_moe = {c->get_option("--routing"),   c->get_option("--iters"),
                                       c->get_option("--graph"),     c->get_option("--mixed"),
                                       c->get_option("--ids64"),     c->get_option("--pool"),
                                       c->get_option("--world-kind"),
                                       c->get_option("--gpus"),
                                       c->get_option("--graph-conditional"),
                                       c->get_option("--rank-threads"),
                                       c->get_option("--graph-execs"),
                                       c->get_option("--graph-split")};
  CLI::Option* gpus_opt = c->get_option("--gpus");
  c->callback([f, world_opt, gpus_opt, moe_only, not_moe, &exit_code] {
    const WorldKind kind = parse_world_kind(f->world_kind);
    EPX_CHECK(f->fault_kill_rank < 0 || (!f->moe && one_process_per_rank(kind)), ConfigError,
              "--fault-kill-rank", f->fault_kill_rank, "only with --world-kind ipc or nccl");
    if (f->moe) {
      for (CLI::Option* o : not_moe)
        EPX_CHECK(o->count() == 0, ConfigError, o->get_name(), "given",
                  "not with --moe (the MoE check runs one forward on an in-process world)");
      exit_code = run_moe_check(moe_check_flags(*f));
      return;
    }
    for (CLI::Option* o : moe_only)
      EPX_CHECK(o->count() == 0, ConfigError, o->get_name(), "given", "only with --moe");
#if EPX_HAVE_CUDA
    EPX_CHECK(f->graph_execs >= 1 && f->graph_execs <= 64, ConfigError, "--graph-execs",
              f->graph_execs, "in [1, 64]");
    for (const auto& [given, name] : {std::pair{f->graph_conditional, "--graph-conditional"},
                                      std::pair{f->rank_threads, "--rank-threads"},
                                      std::pair{f->graph_execs != 1, "--graph-execs"},
                                      std::pair{f->graph_split, "--graph-split"}}) {
      EPX_CHECK(!given || (f->graph > 0 && kind == WorldKind::kInProcess), ConfigError, name,
                "given", "only with --graph and --world-kind in-process");
    }
    if (one_process_per_rank(kind)) {
      EPX_CHECK(gpus_opt->count() == 0, ConfigError, "--gpus", "given",
                "only with --world-kind in-process (one process per rank takes GPU rank % GPUs)");
      run_check_ipc_cli(*f, world_opt->count() > 0, exit_code);
      return;
    }
    testing::CheckOptions o = check_options(*f);
    o.gpus = int(f->shape.devices().size());
    o.conditional = f->graph_conditional;
    o.rank_threads = f->rank_threads;
    o.graph_execs = f->graph_execs;
    o.graph_split = f->graph_split;
    const EpConfig& cfg = o.cfg;
    fmt::print(
        "epx check: backend {}, world {}, H {}, E {}, K {}, tokens {}, max {}, dtype {}, "
        "layout {}, scales {}, routing {}, seed {}\n",
        to_string(o.backend), cfg.world_size, cfg.hidden, cfg.num_experts, cfg.topk, f->tokens,
        cfg.max_tokens_per_rank, to_string(cfg.dtype), to_string(cfg.layout),
        to_string(cfg.scale_layout), f->routing, o.seed);
    const auto t0 = std::chrono::steady_clock::now();
    const testing::CheckReport rep = testing::run_check(o);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (const auto& m : rep.mismatches) fmt::print("  MISMATCH {}\n", m);
    fmt::print("{}: {} call(s) checked, buffer {} per rank, {:.1f} s\n", rep.ok ? "PASS" : "FAIL",
               rep.calls, mib(rep.buffer_bytes), secs);
    exit_code = rep.ok ? 0 : 1;
#else
    (void)f;
    (void)world_opt;
    (void)exit_code;
    EPX_THROW(UnsupportedError, "epx check needs an NVIDIA GPU and a CUDA build of epx");
#endif
  });
}

void add_selftest(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<ShapeFlags>();
  auto seeds = std::make_shared<int>(3);
  auto tokens = std::make_shared<int>(128);
  CLI::App* c =
      app.add_subcommand("selftest",
                         "CPU only: check the reference's own invariants (delivery, dedup, counts, "
                         "combine of identity experts = sum_k w_k x within bf16 rounding)");
  add_shape_flags(c, *f, MaxTokensFlag::kOffered);
  c->add_option("--tokens", *tokens, "tokens per rank")->capture_default_str();
  c->add_option("--seeds", *seeds, "random cases")->capture_default_str();
  c->callback([f, seeds, tokens, &exit_code] {
    const EpConfig cfg = f->config(std::max(1, *tokens));
    int failures = 0;
    double worst = 0.0;
    for (int seed = 1; seed <= *seeds; ++seed) {
      std::vector<ref::RankInput> in;
      for (int r = 0; r < cfg.world_size; ++r) {
        auto routing = ref::make_routing(ref::RoutingKind::kUniform, *tokens, cfg.num_experts,
                                         cfg.topk, seed * 131 + r);
        in.push_back(ref::make_rank_input(cfg, *tokens, routing, seed * 977 + r));
      }
      const auto tm = ref::dispatch_token_major(cfg, in);
      std::vector<std::vector<uint16_t>> partials;
      int64_t delivered = 0, expected = 0;
      for (int r = 0; r < cfg.world_size; ++r) {
        partials.push_back(ref::identity_partials(cfg, r, tm[r]));
        delivered += tm[r].count;
      }
      for (const auto& ri : in) {
        for (int n = 0; n < ri.num_tokens; ++n) {
          uint64_t mask = 0;
          for (int k = 0; k < cfg.topk; ++k) {
            const int id = ri.routing.ids[size_t(n) * cfg.topk + k];
            if (id >= 0) mask |= uint64_t(1) << cfg.expert_rank(id);
          }
          expected += __builtin_popcountll(mask);
        }
      }
      if (delivered != expected) {
        ++failures;
        fmt::print("  seed {}: {} rows delivered, {} expected after per-rank dedup\n", seed,
                   delivered, expected);
      }
      const auto y = ref::combine_token_major(cfg, in, tm, partials);
      for (int s = 0; s < cfg.world_size; ++s) {
        for (int n = 0; n < in[s].num_tokens; ++n) {
          const auto v = ref::token_as_float(cfg, in[s], n);
          double wsum = 0;
          for (int k = 0; k < cfg.topk; ++k)
            if (in[s].routing.ids[size_t(n) * cfg.topk + k] >= 0)
              wsum += in[s].routing.weights[size_t(n) * cfg.topk + k];
          for (int h = 0; h < cfg.hidden; ++h) {
            const double want = wsum * v[h];
            const double got = ref::bf16_to_float(y[s][size_t(n) * cfg.hidden + h]);
            // bf16 rounding of each partial and of the sum: a few ulps of bf16 (2^-8 relative).
            const double err = std::fabs(got - want) / (std::fabs(want) + 1e-3);
            worst = std::max(worst, err);
            if (err > 4.0 / 256) {
              ++failures;
              if (failures < 8)
                fmt::print("  seed {} rank {} token {} col {}: got {} expected {}\n", seed, s, n, h,
                           got, want);
            }
          }
        }
      }
    }
    fmt::print(
        "{}: reference selftest, world {}, H {}, E {}, K {}, {} tokens/rank, {} seed(s), "
        "worst relative combine error {:.2e}\n",
        failures == 0 ? "PASS" : "FAIL", cfg.world_size, cfg.hidden, cfg.num_experts, cfg.topk,
        *tokens, *seeds, worst);
    exit_code = failures == 0 ? 0 : 1;
  });
}

void add_sizes(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<ShapeFlags>();
  auto tokens = std::make_shared<std::string>("128,1024");
  CLI::App* c = app.add_subcommand("sizes", "device memory of one rank's low_latency object");
  add_shape_flags(c, *f, MaxTokensFlag::kOffered);
  c->add_option("--tokens", *tokens, "max tokens per rank, comma list")->capture_default_str();
  c->callback([f, tokens, &exit_code] {
#if EPX_HAVE_CUDA
    fmt::print("{:>10} {:>8} {:>7} {:>16}\n", "max_tok", "dtype", "layout", "bytes per rank");
    for (int t : parse_int_list(*tokens, "--tokens", 1, kMaxTokensPerRank, "",
                                      Repeats::kAllowed)) {
      for (const char* layout : {"token", "expert"}) {
        ShapeFlags g = *f;
        g.max_tokens = 0;
        g.layout = layout;
        const EpConfig cfg = g.config(t);
        fmt::print("{:>10} {:>8} {:>7} {:>16}\n", t, to_string(cfg.dtype), layout,
                   mib(low_latency_buffer_bytes(cfg)));
      }
    }
    exit_code = 0;
#else
    (void)f;
    (void)tokens;
    (void)exit_code;
    EPX_THROW(UnsupportedError, "epx sizes needs a CUDA build of epx");
#endif
  });
}

}  // namespace epx::cli
