#pragma once
// One case of the reliability fault matrix (scripts/fault_matrix.sh), as `epx_fault_rank` runs
// it: which rank fails, how, and at which point of which round; what every surviving rank must
// then see; and the one line per rank that reports it. No CUDA here: the flags are refused
// before the driver touches a GPU, and the CPU tests hold the rules and the verdicts.
//
// A round is what every rank does per MoE layer forward: dispatch, the expert stage (a copy of
// the received rows: partials = rows, so y = x times the number of ranks the token reached),
// combine, then a bounded wait for its stream. Rounds 0 .. fault_round-1 are healthy; in
// fault_round the faulty rank fails at the point:
//   before-dispatch  it makes no call of the round;
//   in-dispatch      it enqueues its dispatch and fails at once (no wait, no combine);
//   between          its dispatch completed (waited for) and its expert stage ran; no combine;
//   in-combine       it enqueues its combine and fails at once (no wait).
// The faults:
//   never-arrives  the rank never takes part (in-process: its object exists but never calls;
//                  ipc: the process never joins the world, sleeps, then exits 0);
//   killed         the process raises SIGKILL on itself at the point (ipc only);
//   stops-calling  the rank makes no further call but stays alive (ipc: until its peers ended);
//   kernel-fault   the rank launches a kernel that writes to an illegal address on its stream
//                  at the point (ipc only: in one process it ends every rank's context).
// Every survivor must then see a TimeoutError or PeerError that names the faulty rank and a
// phase, within timeout_ms + 1 s of the start of the fault round; with mask, the survivors must
// instead mask the faulty rank and go on serving.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#include "epx/bootstrap.hpp"
#include "epx/config.hpp"

namespace epx::fault {

enum class WorldKind { kInProcess, kIpc };
enum class Mode { kEager, kGraph };
enum class Fault { kNeverArrives, kKilled, kStopsCalling, kKernelFault };
enum class Point { kNone, kBeforeDispatch, kInDispatch, kBetween, kInCombine };

const char* to_string(WorldKind k);
const char* to_string(Mode m);
const char* to_string(Fault f);
const char* to_string(Point p);  // kNone: "none"

// Shape of every case: H 2048, top-4, 64 tokens per rank, bf16, the low_latency backend; experts:
// 16, or the least multiple of the world size above it (18 for 3 ranks).
inline constexpr int kHidden = 2048;
inline constexpr int kTopk = 4;
inline constexpr int kTokens = 64;
inline constexpr int kMinExperts = 16;
// Rounds after the fault round: with mask, served without the faulty rank; without, the rounds in
// which a survivor may still meet its error (a rank that stopped in-combine may have completed
// the fault round: its peers meet the fault in the next one).
inline constexpr int kRoundsAfterFault = 3;

// The flags as given (add_fault_flags binds them); make_fault_case decides.
struct FaultFlags {
  std::string world_kind = "in-process";
  int world = 0;  // 0: not given (in-process: 3 ranks; ipc: EPX_WORLD_SIZE)
  std::string mode = "eager";
  std::string fault;
  std::string at;
  int faulty_rank = 1;
  int rounds = 3;
  bool rounds_given = false;
  int timeout_ms = 2000;
  bool mask = false;
};

// Binds the flags of `epx_fault_rank` to `f`. --fault is required.
void add_fault_flags(CLI::App& app, FaultFlags& f);

struct FaultCase {
  WorldKind kind = WorldKind::kInProcess;
  int world = 3;
  Mode mode = Mode::kEager;
  Fault fault = Fault::kStopsCalling;
  Point at = Point::kNone;  // kNone exactly for never-arrives
  int faulty_rank = 1;
  int fault_round = 3;  // never-arrives: 0 (the rank is absent from the start)
  int timeout_ms = 2000;
  bool mask = false;
  int experts = kMinExperts;

  // "killed@in-dispatch", "never-arrives"
  std::string name() const;
  // The configuration of every rank (rank 0; set the rank per object).
  EpConfig config() const;
  // Seconds within which a survivor must see its error (or, with mask, finish the fault round).
  double bound_seconds() const { return timeout_ms / 1000.0 + 1.0; }
  // "TimeoutError|PeerError", or "masked".
  std::string expected() const;
};

// Decides the case from the flags; ConfigError naming the flag, its value and the bound
// otherwise. `ipc_env` is this process's bootstrap environment (BootstrapOptions::from_env())
// for --world-kind ipc, ignored for in-process.
FaultCase make_fault_case(const FaultFlags& f, const BootstrapOptions& ipc_env);

// ---- what a surviving rank saw, and whether it meets the expectation ---------------------------

struct Observation {
  int rank = 0;
  std::string seen = "nothing";   // "TimeoutError", "PeerError", another error's class, "hang"
  std::string error;              // its message
  int error_round = -1;           // the round whose calls raised it (-1: creation of the group)
  double seconds = -1;            // from the start of the fault round to the error (or, with
                                  // mask, to the end of the round after which it showed)
  bool alive = false;             // the process and its CUDA context still work afterwards
  std::string recreated = "n/a";  // in-process: "ok" or "failed: why"; ipc: "n/a"
  uint64_t masked = 0;
  uint64_t dropped = 0;
  uint64_t dropped_min = 0, dropped_max = 0;  // mask: what the rounds after masking must drop
  std::string wrong_output;  // the first output that differed from the expected one, if any
};

struct Verdict {
  bool pass = false;
  std::string why;  // empty when pass
};

// Whether `message` names rank `rank` ("rank 1", not "rank 12"), and the phase it names: a
// device phase ("dispatch/data-arrival", "combine/partials-ready", ...), "start-up" for a
// bootstrap rendezvous, "collective" for a bootstrap collective; "" when none.
bool names_rank(const std::string& message, int rank);
std::string named_phase(const std::string& message);

Verdict judge(const FaultCase& c, const Observation& o);

// fault-result rank=0 world=ipc ranks=2 mode=eager case=killed@in-dispatch faulty=1 mask=0
//   expected=TimeoutError|PeerError seen=TimeoutError phase=combine/partials-ready round=3
//   seconds=2.013 bound=3.000 alive=1 recreated=n/a masked=0x0 dropped=0 verdict=pass why=""
//   error="..."   (one line; the quoted fields never hold a double quote or a newline)
std::string result_line(const FaultCase& c, const Observation& o, const Verdict& v);
// fault-injected rank=1 world=ipc ranks=2 mode=eager case=killed@in-dispatch round=3 ...
std::string injected_line(const FaultCase& c, int rank, const std::string& detail);

}  // namespace epx::fault
