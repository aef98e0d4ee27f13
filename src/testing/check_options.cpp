// The rules of CheckOptions (harness.hpp), apart from the harness's GPU code so that a CPU test
// can hold the fuzz generator (fuzz_cases.hpp) to them.

#include <string>

#include "epx/error.hpp"
#include "testing/harness.hpp"

namespace epx::testing {

// Bound of CheckOptions::graph_execs: a few dozen buckets are what serve-bench replays.
constexpr int kMaxGraphExecs = 64;

void validate_shared_check_options(const CheckOptions& o) {
  const EpConfig& cfg = o.cfg;
  const int W = cfg.world_size;
  EPX_CHECK(o.pool >= 1, InputError, "pool", o.pool, "at least 1");
  EPX_CHECK(o.graph_replays >= 0, InputError, "graph replays", o.graph_replays, ">= 0");
  EPX_CHECK(o.verify_every >= 1, InputError, "verify_every", o.verify_every,
            "at least 1 (1: every replay is compared)");
  EPX_CHECK(o.verify_every == 1 || o.graph_replays > 0, InputError, "verify_every",
            o.verify_every, "1 without graph replays (it thins out the comparison of replays)");
  EPX_CHECK(!o.mixed || o.graph_replays > 0, InputError, "mixed", "true",
            "only together with graph replays (--graph N)");
  // high_throughput reads each round's row count back on the host unless its receive areas
  // hold the worst case: no capture then.
  EPX_CHECK(o.backend != Backend::kHighThroughput || o.graph_replays == 0 || cfg.worst_case_output,
            InputError, "graph replays", o.graph_replays,
            "0 for high_throughput without worst_case_output (--worst-case-output): its dispatch "
            "reads the row count back on the host, which a captured stream cannot");
  if (o.tokens.size() > 1) {
    EPX_CHECK(int(o.tokens.size()) == W, InputError, "tokens (list length)", o.tokens.size(),
              "1 or world size = " + std::to_string(W));
  }
  for (int c : o.tokens)
    EPX_CHECK(c <= cfg.max_tokens_per_rank, InputError, "tokens", c,
              "at most max_tokens_per_rank = " + std::to_string(cfg.max_tokens_per_rank));
}

void validate_check_options(const CheckOptions& o) {
  EpConfig cfg = o.cfg;
  cfg.rank = 0;
  cfg.validate();
  validate_shared_check_options(o);
  const bool one_stream = o.one_launch || o.halves;
  EPX_CHECK(!one_stream || (!o.mixed && !o.conditional && !o.rank_threads &&
                            o.graph_execs == 1 && !o.graph_split && !(o.one_launch && o.halves)),
            InputError, o.halves ? "halves" : "one_launch",
            "with mixed, a graph variant or each other",
            "one stream per GPU: plain eager calls and one captured graph per GPU");
  EPX_CHECK(!o.halves || o.backend != Backend::kHighThroughput, InputError, "halves", "true",
            "false for high_throughput (it has no send and receive halves)");
  // Ordered rows exchange counts in the send half: one stream for all ranks would deadlock.
  EPX_CHECK(!o.halves || (!cfg.deterministic && o.backend != Backend::kNaive), InputError,
            "halves", "with ordered rows (deterministic or naive)",
            "unordered rows: the send half of ordered rows waits for every peer's counts");
  // Rounds in flight: each call is R rounds interleaved, every dispatch before the combines;
  // the conditional and split variants capture the pieces of one round.
  const int R = cfg.rounds_in_flight;
  EPX_CHECK(R == 1 || (!o.conditional && !o.graph_split), InputError, "rounds_in_flight", R,
            "1 with the conditional or split graph variants");
  EPX_CHECK(o.graph_replays == 0 || (o.graph_execs >= 1 && o.graph_execs <= kMaxGraphExecs),
            InputError, "graph_execs", o.graph_execs,
            "in [1, " + std::to_string(kMaxGraphExecs) + "]");
}

}  // namespace epx::testing
