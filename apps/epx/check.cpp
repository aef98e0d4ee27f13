// `epx check`: dispatch -> identity expert -> combine on the GPU, every output compared with the
// CPU reference, on an in-process world or with one process per rank; `--moe` checks the MoE
// layer instead (moe_check.hpp); `--fuzz` draws random cases until a time is up. The flags and
// which of them go together.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "check.hpp"
#include "commands.hpp"
#include "epx/error.hpp"
#include "moe_check.hpp"

namespace epx::cli {
namespace {

struct CheckFlags {
  CheckRunFlags run;
  std::string world_kind = "in-process";
  std::vector<int> fault_kill_ranks;  // testing (hidden): see --fault-kill-rank
  bool moe = false;
  MoeLayerFlags moe_layer;  // the layer's own flags (--moe)
  double fuzz_minutes = 0;  // --fuzz
  std::string json;
};

// The flags that go with --fuzz: the cases draw every other one.
constexpr const char* kFuzzFlags[] = {"--fuzz", "--seed", "--json", "--timeout-ms"};
// The longest run --fuzz accepts: a week.
constexpr double kMaxFuzzMinutes = 7 * 24 * 60;

// `epx check --moe`: the shared flags of `check` and the layer's own.
MoeCheckFlags moe_check_flags(const CheckFlags& f) {
  return {.shape = f.run.shape,
          .tokens = f.run.tokens,
          .backend = f.run.backend,
          .seed = f.run.seed,
          .layer = f.moe_layer};
}

}  // namespace

void add_check_run_flags(CLI::App* c, CheckRunFlags& f) {
  add_shape_flags(c, f.shape, MaxTokensFlag::kOffered);
  c->add_option("--tokens", f.tokens, "tokens per rank: one count, or a comma list (one per rank)")
      ->capture_default_str();
  c->add_option("--routing", f.routing, kRoutingNames)->capture_default_str();
  c->add_option("--backend", f.backend,
                "naive | allgather_reducescatter | low_latency | high_throughput (default: EPX_BACKEND or "
                "low_latency)");
  c->add_option("--seed", f.seed, "seed of inputs and routing")->capture_default_str();
  c->add_option("--iters", f.iters, "eager calls, fresh inputs each")->capture_default_str();
  c->add_option("--graph", f.graph, "capture once per rank, replay N times with fresh inputs");
  c->add_option("--verify-every", f.verify_every,
                "with --graph: download and compare every K-th replay (and the last) only; every "
                "replay still gets fresh inputs and its device status is checked (soak runs)")
      ->capture_default_str();
  c->add_flag("--mixed", f.mixed, "with --graph: rank 0 calls eagerly, the others replay");
  c->add_flag("--ids64", f.ids64, "pass topk_ids as int64");
  c->add_flag("--one-launch", f.one_launch,
              "in-process: the ranks of each GPU in one kernel per op (dispatch_group / "
              "combine_group), eager and with --graph; not with --mixed");
  c->add_flag("--halves", f.halves,
              "in-process: each op as its halves (every rank's send half, then every rank's "
              "receive half, on one stream per GPU), eager and with --graph; unordered rows only");
}

void add_check(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<CheckFlags>();
  CLI::App* c = app.add_subcommand(
      "check",
      "run dispatch -> identity expert -> combine on the GPU and compare every output "
      "with the CPU reference (exit 0 only if all match)");
  add_check_run_flags(c, f->run);
  c->add_option("--world-kind", f->world_kind,
                "in-process (every rank a stream of this process) | ipc (this process is one "
                "rank: run under `epx launch -n W`; --world defaults to EPX_WORLD_SIZE) | nccl "
                "(as ipc, memory through NCCL windows; one GPU per rank)")
      ->capture_default_str();
  // Testing only, hence hidden (empty group): proves that a killed rank is named by the others.
  c->add_option("--fault-kill-rank", f->fault_kill_ranks,
                "testing, --world-kind ipc or nccl: these ranks (a comma list, e.g. a node's) "
                "create their All2All, then kill themselves (SIGKILL) before their first dispatch")
      ->delimiter(',')
      ->group("");
  c->add_option("--fuzz", f->fuzz_minutes,
                "random cases (world, shape, dtype, layouts, routing, backend, call mode) from "
                "--seed, each checked against the reference, until MINUTES have passed; stops at "
                "the first failure with the command that reproduces it")
      ->type_name("MINUTES");
  c->add_option("--json", f->json,
                "write the options and the report (with memory samples), or with --fuzz the "
                "cases and the summary, as JSON to this file");
  c->add_flag("--moe", f->moe,
              "check the MoE layer instead: W ranks vs the same layer on one rank with every "
              "expert local (and vs the CPU reference when H <= 1024 and E <= 64)");
  MoeLayerFlags& m = f->moe_layer;
  const std::vector<CLI::Option*> moe_only = {
      c->add_option("--intermediate", m.intermediate, "--moe: routed experts' I")
          ->capture_default_str(),
      c->add_option("--scoring", m.scoring, "--moe: sigmoid (grouped) | softmax")
          ->capture_default_str(),
      c->add_option("--groups", m.groups, "--moe: expert groups")->capture_default_str(),
      c->add_option("--topk-groups", m.topk_groups, "--moe: groups kept per token")
          ->capture_default_str(),
      c->add_option("--shared-intermediate", m.shared_intermediate,
                    "--moe: shared expert's I (0 = none)")
          ->capture_default_str(),
      c->add_option("--tolerance", m.tolerance,
                    "--moe: bound of ||d||/||ref|| over all tokens (fp8 experts)")
          ->capture_default_str()};
  std::vector<CLI::Option*> not_moe;
  for (const char* name :
       {"--routing", "--iters", "--graph", "--verify-every", "--mixed", "--ids64", "--one-launch",
        "--halves", "--world-kind", "--gpus", "--fuzz", "--json"})
    not_moe.push_back(c->get_option(name));
  CLI::Option* world_opt = c->get_option("--world");
  CLI::Option* gpus_opt = c->get_option("--gpus");
  c->callback([c, f, world_opt, gpus_opt, moe_only, not_moe, &exit_code] {
    if (c->get_option("--fuzz")->count() > 0) {
      for (const CLI::Option* o : c->get_options()) {
        const std::string name = o->get_name();
        const bool allowed = std::any_of(std::begin(kFuzzFlags), std::end(kFuzzFlags),
                                         [&](const char* flag) { return name == flag; });
        EPX_CHECK(o->count() == 0 || allowed, ConfigError, name, "given",
                  "not with --fuzz (its cases draw it; --fuzz takes --seed, --json and "
                  "--timeout-ms)");
      }
      EPX_CHECK(f->fuzz_minutes > 0 && f->fuzz_minutes <= kMaxFuzzMinutes, ConfigError, "--fuzz",
                f->fuzz_minutes, fmt::format("minutes in (0, {}]", kMaxFuzzMinutes));
#if EPX_HAVE_CUDA
      exit_code = run_fuzz({.minutes = f->fuzz_minutes,
                            .seed = f->run.seed,
                            .timeout_ms = f->run.shape.timeout_ms,
                            .json = f->json});
#else
      EPX_THROW(UnsupportedError, "epx check needs an NVIDIA GPU and a CUDA build of epx");
#endif
      return;
    }
    const WorldKind kind = parse_world_kind(f->world_kind);
    EPX_CHECK(f->fault_kill_ranks.empty() || (!f->moe && one_process_per_rank(kind)),
              ConfigError, "--fault-kill-rank", "given", "only with --world-kind ipc or nccl");
    if (f->moe) {
      for (CLI::Option* o : not_moe)
        EPX_CHECK(o->count() == 0, ConfigError, o->get_name(), "given",
                  "not with --moe (the MoE check runs one forward on an in-process world)");
      exit_code = run_moe_check(moe_check_flags(*f));
      return;
    }
    for (CLI::Option* o : moe_only)
      EPX_CHECK(o->count() == 0, ConfigError, o->get_name(), "given", "only with --moe");
    for (const auto& [given, flag] : {std::pair{f->run.one_launch, "--one-launch"},
                                      std::pair{f->run.halves, "--halves"}}) {
      EPX_CHECK(!given || (!one_process_per_rank(kind) && !f->run.mixed), ConfigError, flag,
                "given",
                "only with --world-kind in-process and without --mixed (the ranks of one "
                "process share a stream; --mixed has rank 0 call on its own)");
    }
    if (one_process_per_rank(kind)) {
      EPX_CHECK(f->run.verify_every == 1, ConfigError, "--verify-every", f->run.verify_every,
                "1 with --world-kind ipc or nccl (the soak with sparse comparisons runs "
                "in-process)");
      EPX_CHECK(gpus_opt->count() == 0, ConfigError, "--gpus", "given",
                "only with --world-kind in-process (one process per rank takes GPU rank % GPUs)");
      ShapeFlags& shape = f->run.shape;
      take_world_from_env(shape, world_opt->count() > 0, "epx check");
      for (const int r : f->fault_kill_ranks)
        EPX_CHECK(r >= 0 && r < shape.world, ConfigError, "--fault-kill-rank", r,
                  fmt::format("a rank of the world, in [0, {})", shape.world));
      EPX_CHECK(int(f->fault_kill_ranks.size()) < shape.world, ConfigError, "--fault-kill-rank",
                f->fault_kill_ranks.size(), "fewer ranks than the world (a survivor reports)");
    }
#if EPX_HAVE_CUDA
    testing::CheckOptions o = check_options(f->run);
    if (one_process_per_rank(kind)) {
      exit_code = run_world_check(o, kind, f->run, f->fault_kill_ranks, f->json);
      return;
    }
    o.gpus = int(f->run.shape.devices().size());
    exit_code = run_in_process_check(o, f->run, f->json);
#else
    (void)exit_code;
    EPX_THROW(UnsupportedError, "epx check needs an NVIDIA GPU and a CUDA build of epx");
#endif
  });
}

}  // namespace epx::cli
