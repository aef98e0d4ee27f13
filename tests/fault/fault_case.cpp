#include "fault_case.hpp"

#include <fmt/format.h>

#include <array>
#include <cctype>
#include <string_view>
#include <utility>

#include "epx/error.hpp"

namespace epx::fault {
namespace {

template <typename E, size_t N>
E parse_name(const char* flag, const std::string& value,
             const std::array<std::pair<const char*, E>, N>& names) {
  std::string list;
  for (const auto& [name, e] : names) {
    if (value == name) return e;
    list += list.empty() ? name : std::string(", ") + name;
  }
  EPX_THROW(ConfigError, fmt::format("{} = '{}', expected one of {}", flag, value, list));
}

constexpr std::array<std::pair<const char*, WorldKind>, 2> kWorldKinds{
    {{"in-process", WorldKind::kInProcess}, {"ipc", WorldKind::kIpc}}};
constexpr std::array<std::pair<const char*, Mode>, 2> kModes{
    {{"eager", Mode::kEager}, {"graph", Mode::kGraph}}};
constexpr std::array<std::pair<const char*, Fault>, 4> kFaults{
    {{"never-arrives", Fault::kNeverArrives},
     {"killed", Fault::kKilled},
     {"stops-calling", Fault::kStopsCalling},
     {"kernel-fault", Fault::kKernelFault}}};
constexpr std::array<std::pair<const char*, Point>, 4> kPoints{
    {{"before-dispatch", Point::kBeforeDispatch},
     {"in-dispatch", Point::kInDispatch},
     {"between", Point::kBetween},
     {"in-combine", Point::kInCombine}}};

template <typename E, size_t N>
const char* name_of(E e, const std::array<std::pair<const char*, E>, N>& names) {
  for (const auto& [name, v] : names) {
    if (v == e) return name;
  }
  return "?";
}

constexpr int kMaxRounds = 1000;

// The text of a quoted field of a result line: no double quote, no line break.
std::string quoted(std::string s) {
  for (char& ch : s) {
    if (ch == '"') ch = '\'';
    if (ch == '\n' || ch == '\r' || ch == '\t') ch = ' ';
  }
  return "\"" + s + "\"";
}

std::string case_fields(const FaultCase& c) {
  return fmt::format("world={} ranks={} mode={} case={} faulty={} mask={}", to_string(c.kind),
                     c.world, to_string(c.mode), c.name(), c.faulty_rank, c.mask ? 1 : 0);
}

}  // namespace

const char* to_string(WorldKind k) {
  return name_of(k, kWorldKinds);
}
const char* to_string(Mode m) {
  return name_of(m, kModes);
}
const char* to_string(Fault f) {
  return name_of(f, kFaults);
}
const char* to_string(Point p) {
  return p == Point::kNone ? "none" : name_of(p, kPoints);
}

void add_fault_flags(CLI::App& app, FaultFlags& f) {
  app.add_option("--world-kind", f.world_kind,
                 "in-process (every rank a stream of this process) | ipc (this process is one "
                 "rank of `epx launch -n W`)")
      ->capture_default_str();
  app.add_option("--world", f.world,
                 "ranks of an in-process world (default 3); with ipc, if given, must equal "
                 "EPX_WORLD_SIZE");
  app.add_option("--mode", f.mode,
                 "eager | graph (each rank captures its round once, as a dispatch + expert graph "
                 "and a combine graph, and replays them)")
      ->capture_default_str();
  app.add_option("--fault", f.fault, "never-arrives | killed | stops-calling | kernel-fault")
      ->required();
  app.add_option("--at", f.at,
                 "before-dispatch | in-dispatch | between | in-combine (not with never-arrives)");
  app.add_option("--faulty-rank", f.faulty_rank, "the rank that fails")->capture_default_str();
  app.add_option_function<int>(
      "--rounds",
      [&f](const int& v) {
        f.rounds = v;
        f.rounds_given = true;
      },
      "healthy rounds before the fault round (default 3; not with never-arrives)");
  app.add_option("--timeout-ms", f.timeout_ms, "EpConfig::timeout_ms and the bootstrap's timeout")
      ->capture_default_str();
  app.add_flag("--mask", f.mask,
               "EpConfig::mask_failed_ranks: the survivors mask the faulty rank and serve " +
                   std::to_string(kRoundsAfterFault) + " more rounds");
}

std::string FaultCase::name() const {
  return at == Point::kNone ? to_string(fault)
                            : fmt::format("{}@{}", to_string(fault), to_string(at));
}

EpConfig FaultCase::config() const {
  EpConfig cfg;
  cfg.world_size = world;
  cfg.hidden = kHidden;
  cfg.num_experts = experts;
  cfg.topk = kTopk;
  cfg.max_tokens_per_rank = kTokens;
  cfg.dtype = DispatchDtype::kBF16;
  cfg.layout = OutputLayout::kTokenMajor;
  cfg.mask_failed_ranks = mask;
  cfg.timeout_ms = timeout_ms;
  return cfg;
}

std::string FaultCase::expected() const {
  return mask ? "masked" : "TimeoutError|PeerError";
}

FaultCase make_fault_case(const FaultFlags& f, const BootstrapOptions& ipc_env) {
  FaultCase c;
  c.kind = parse_name("--world-kind", f.world_kind, kWorldKinds);
  c.mode = parse_name("--mode", f.mode, kModes);
  c.fault = parse_name("--fault", f.fault, kFaults);
  if (c.fault == Fault::kNeverArrives) {
    EPX_CHECK(f.at.empty(), ConfigError, "--at", "'" + f.at + "' with --fault never-arrives",
              "no --at (the rank never takes part, so it fails at no point of a round)");
    EPX_CHECK(!f.rounds_given, ConfigError, "--rounds",
              std::to_string(f.rounds) + " with --fault never-arrives",
              "no --rounds (the rank never takes part, so no round is healthy)");
    c.at = Point::kNone;
    c.fault_round = 0;
  } else {
    EPX_CHECK(!f.at.empty(), ConfigError, "--at", "(none)",
              fmt::format("one of before-dispatch, in-dispatch, between, in-combine with --fault "
                          "{}",
                          f.fault));
    c.at = parse_name("--at", f.at, kPoints);
    EPX_CHECK(f.rounds >= 0 && f.rounds <= kMaxRounds, ConfigError, "--rounds", f.rounds,
              fmt::format("in [0, {}]", kMaxRounds));
    c.fault_round = f.rounds;
  }
  if (c.kind == WorldKind::kInProcess) {
    EPX_CHECK(c.fault != Fault::kKilled, ConfigError, "--fault",
              "'killed' with --world-kind in-process",
              "--world-kind ipc (a SIGKILL ends the process, and with it every rank of an "
              "in-process world)");
    EPX_CHECK(c.fault != Fault::kKernelFault, ConfigError, "--fault",
              "'kernel-fault' with --world-kind in-process",
              "--world-kind ipc (an illegal address ends the CUDA context of the process, and "
              "with it every rank of an in-process world)");
    c.world = f.world == 0 ? 3 : f.world;
    EPX_CHECK(c.world >= 2 && c.world <= kMaxRanks, ConfigError, "--world", c.world,
              fmt::format("in [2, kMaxRanks = {}] (a fault needs a surviving rank)", kMaxRanks));
  } else {
    EPX_CHECK(ipc_env.world_size >= 2, ConfigError, "EPX_WORLD_SIZE", ipc_env.world_size,
              "at least 2 with --world-kind ipc (run under `epx launch -n W`, W >= 2: a fault "
              "needs a surviving rank)");
    EPX_CHECK(f.world == 0 || f.world == ipc_env.world_size, ConfigError, "--world", f.world,
              fmt::format("EPX_WORLD_SIZE = {} with --world-kind ipc (or no --world)",
                          ipc_env.world_size));
    c.world = ipc_env.world_size;
    EPX_CHECK(!(f.mask && c.fault == Fault::kNeverArrives), ConfigError, "--mask",
              "set with --fault never-arrives --world-kind ipc",
              "another fault (the world cannot be made without the rank, so there is nothing "
              "to serve it without)");
  }
  EPX_CHECK(f.faulty_rank >= 0 && f.faulty_rank < c.world, ConfigError, "--faulty-rank",
            f.faulty_rank, fmt::format("a rank of the world, in [0, {})", c.world));
  c.faulty_rank = f.faulty_rank;
  EPX_CHECK(f.timeout_ms >= 1 && f.timeout_ms <= kMaxTimeoutMs, ConfigError, "--timeout-ms",
            f.timeout_ms, fmt::format("in [1, kMaxTimeoutMs = {}]", kMaxTimeoutMs));
  c.timeout_ms = f.timeout_ms;
  c.mask = f.mask;
  c.experts = (kMinExperts + c.world - 1) / c.world * c.world;
  c.config().validate();
  return c;
}

// ---- verdicts ----------------------------------------------------------------------------------

bool names_rank(const std::string& message, int rank) {
  const std::string what = "rank " + std::to_string(rank);
  for (size_t at = message.find(what); at != std::string::npos; at = message.find(what, at + 1)) {
    const size_t end = at + what.size();
    if (end == message.size() || !std::isdigit(static_cast<unsigned char>(message[end]))) {
      return true;
    }
  }
  return false;
}

std::string named_phase(const std::string& message) {
  // Device phases as the status word names them (src/core/device_status.cpp): "dispatch/..."
  // and "combine/..." words, and the two waits that belong to neither op.
  for (std::string_view op : {"dispatch/", "combine/"}) {
    const size_t at = message.find(op);
    if (at == std::string::npos) continue;
    size_t end = at + op.size();
    while (end < message.size() &&
           (std::islower(static_cast<unsigned char>(message[end])) || message[end] == '-')) {
      ++end;
    }
    if (end > at + op.size()) return message.substr(at, end - at);
  }
  for (const char* word : {"grid-barrier", "ring-space"}) {
    if (message.find(word) != std::string::npos) return word;
  }
  // The bootstrap (src/transport/bootstrap_*.cpp): the rendezvous, and its collectives.
  if (message.find("did not arrive") != std::string::npos ||
      message.find("during start-up") != std::string::npos) {
    return "start-up";
  }
  for (const char* word : {"all_gather #", "all_gather_fds #", "barrier #"}) {
    if (message.find(word) != std::string::npos) return "collective";
  }
  return "";
}

Verdict judge(const FaultCase& c, const Observation& o) {
  std::string why;
  auto fail = [&why](const std::string& s) { why += (why.empty() ? "" : "; ") + s; };
  if (c.mask) {
    if (o.seen != "masked") {
      fail(fmt::format("saw {}{}, expected the survivors to mask rank {} and go on", o.seen,
                       o.error.empty() ? "" : " (" + o.error + ")", c.faulty_rank));
    }
    const uint64_t want = uint64_t(1) << c.faulty_rank;
    if (o.masked != want) {
      fail(fmt::format("masked_ranks = {:#x}, expected {:#x}", o.masked, want));
    }
    if (o.dropped < o.dropped_min || o.dropped > o.dropped_max) {
      fail(fmt::format("dropped_pairs = {}, expected in [{}, {}]", o.dropped, o.dropped_min,
                       o.dropped_max));
    }
  } else {
    if (o.seen != "TimeoutError" && o.seen != "PeerError") {
      fail(fmt::format("saw {}, expected TimeoutError or PeerError", o.seen));
    } else {
      if (o.error_round < c.fault_round &&
          !(o.error_round == -1 && c.fault == Fault::kNeverArrives)) {
        fail(fmt::format("the error came in round {}, before the fault round {}", o.error_round,
                         c.fault_round));
      }
      if (!names_rank(o.error, c.faulty_rank)) {
        fail(fmt::format("the error does not name rank {}", c.faulty_rank));
      }
      if (named_phase(o.error).empty()) fail("the error names no phase");
    }
  }
  if (o.seconds < 0) {
    fail("no time measured");
  } else if (o.seconds > c.bound_seconds()) {
    fail(fmt::format("took {:.3f} s, expected at most {:.3f} s (timeout_ms + 1 s)", o.seconds,
                     c.bound_seconds()));
  }
  if (!o.alive) fail("the survivor's CUDA context did not work afterwards");
  const bool recreate = c.kind == WorldKind::kInProcess && !c.mask;
  if (recreate && o.recreated != "ok") {
    fail(fmt::format("recreated = {}, expected ok", o.recreated));
  } else if (!recreate && o.recreated != "n/a") {
    fail(fmt::format("recreated = {}, expected n/a", o.recreated));
  }
  if (!o.wrong_output.empty()) fail(o.wrong_output);
  return Verdict{why.empty(), why};
}

std::string result_line(const FaultCase& c, const Observation& o, const Verdict& v) {
  const std::string phase = named_phase(o.error);
  return fmt::format(
      "fault-result rank={} {} expected={} seen={} phase={} round={} seconds={} bound={:.3f} "
      "alive={} recreated={} masked={:#x} dropped={} verdict={} why={} error={}",
      o.rank, case_fields(c), c.expected(), o.seen, phase.empty() ? "-" : phase, o.error_round,
      o.seconds < 0 ? std::string("-") : fmt::format("{:.3f}", o.seconds), c.bound_seconds(),
      o.alive ? 1 : 0, o.recreated.substr(0, o.recreated.find(':')), o.masked, o.dropped,
      v.pass ? "pass" : "fail", quoted(v.why), quoted(o.error));
}

std::string injected_line(const FaultCase& c, int rank, const std::string& detail) {
  return fmt::format("fault-injected rank={} {} round={} detail={}", rank, case_fields(c),
                     c.fault_round, quoted(detail));
}

}  // namespace epx::fault
