// `epx diag`: diagnosis only, left out of `epx --help`. Runs of past investigations, kept so that
// their findings (docs/perf-notes.md) can be measured again (tools/diag/*.sh); not what a user
// checks (that is `epx check`).
//
// graph-replay: `epx check` on an in-process world with variants of the graph replay of the MoE
// layer's captured path: the captured expert inside a conditional SWITCH node, every rank
// capturing and replaying from its own host thread, several executable graphs per rank replayed
// in turn, dispatch / expert / combine captured as three graphs; and the number of distinct input
// sets cycled through.
#include <fmt/format.h>

#include <memory>
#include <utility>

#include "check.hpp"
#include "commands.hpp"
#include "epx/error.hpp"

namespace epx::cli {
namespace {

constexpr int kMaxGraphExecs = 64;

struct GraphReplayFlags {
  CheckRunFlags run;
  int pool = 3;
  bool conditional = false;
  bool rank_threads = false;
  int graph_execs = 1;
  bool split = false;
};

void add_graph_replay(CLI::App* diag, int& exit_code) {
  auto f = std::make_shared<GraphReplayFlags>();
  CLI::App* c = diag->add_subcommand(
      "graph-replay",
      "diagnosis: `epx check` on an in-process world with variants of the MoE layer's graph "
      "replay (docs/perf-notes.md)");
  add_check_run_flags(c, f->run);
  c->add_option("--pool", f->pool, "distinct input sets cycled through")->capture_default_str();
  c->add_flag("--graph-conditional", f->conditional,
              "with --graph: the captured expert runs inside a conditional (SWITCH) node set on "
              "the device, as the MoE layer's captured expert stage");
  c->add_flag("--rank-threads", f->rank_threads,
              "with --graph: every rank captures and replays from its own host thread");
  c->add_option("--graph-execs", f->graph_execs,
                fmt::format("with --graph: executable graphs per rank, each captured on its own, "
                            "replayed in turn (1..{})",
                            kMaxGraphExecs))
      ->capture_default_str();
  c->add_flag("--graph-split", f->split,
              "with --graph: dispatch, expert and combine captured as three graphs replayed in "
              "order (as the MoE layer's split capture), not one");
  c->callback([f, &exit_code] {
    EPX_CHECK(f->graph_execs >= 1 && f->graph_execs <= kMaxGraphExecs, ConfigError, "--graph-execs",
              f->graph_execs, fmt::format("in [1, {}]", kMaxGraphExecs));
    for (const auto& [given, name] :
         {std::pair{f->conditional, "--graph-conditional"},
          std::pair{f->rank_threads, "--rank-threads"},
          std::pair{f->graph_execs != 1, "--graph-execs"}, std::pair{f->split, "--graph-split"}}) {
      EPX_CHECK(!given || f->run.graph > 0, ConfigError, name, "given",
                "only with --graph (graph replays)");
    }
#if EPX_HAVE_CUDA
    testing::CheckOptions o = check_options(f->run);
    o.gpus = int(f->run.shape.devices().size());
    o.pool = f->pool;
    o.conditional = f->conditional;
    o.rank_threads = f->rank_threads;
    o.graph_execs = f->graph_execs;
    o.graph_split = f->split;
    exit_code = run_in_process_check(o, f->run);
#else
    (void)exit_code;
    EPX_THROW(UnsupportedError, "epx diag needs an NVIDIA GPU and a CUDA build of epx");
#endif
  });
}

}  // namespace

void add_diag(CLI::App& app, int& exit_code) {
  CLI::App* diag = app.add_subcommand(
      "diag", "diagnosis only: runs of past investigations (docs/perf-notes.md, tools/diag)");
  diag->group("");  // not in `epx --help`: not the user surface
  diag->require_subcommand(1);
  add_graph_replay(diag, exit_code);
}

}  // namespace epx::cli
