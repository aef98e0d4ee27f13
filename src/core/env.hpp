#pragma once
// The variables of the process environment that configure epx, each read here and nowhere else:
//
//   EPX_BACKEND                  backend by name                settings()
//   EPX_TIMEOUT_MS               bound of every wait            settings(), timeout_ms(),
//                                                               bootstrap()
//   EPX_CONFIG_PATH              JSON launch file               settings()
//   EPX_RANK, EPX_WORLD_SIZE,    where a process's rank meets   bootstrap()
//   EPX_BOOTSTRAP                its peers (`epx launch` sets them)
//   RANK, WORLD_SIZE, LOCAL_RANK, the same, from torchrun         bootstrap()
//   LOCAL_WORLD_SIZE, MASTER_ADDR,
//   MASTER_PORT
//   SLURM_PROCID, SLURM_NTASKS,  the same, from Slurm's srun      bootstrap()
//   SLURM_LOCALID, SLURM_NODEID,
//   SLURM_NTASKS_PER_NODE,
//   SLURM_STEP_TASKS_PER_NODE,
//   SLURM_TASKS_PER_NODE
//   OMPI_COMM_WORLD_RANK, _SIZE,  the same, from Open MPI          bootstrap()
//   _LOCAL_RANK, _LOCAL_SIZE
//   EPX_NCCL_LIBRARY             libnccl to open                nccl_library()
//   CUDA_DEVICE_MAX_CONNECTIONS  hardware queues per GPU        hardware_queues_per_gpu()
//   EPX_ABLATE                   stages a measurement build     ablate_text()
//                                leaves out (release builds never ask)
//   EPX_PHASE_CLOCK              a measurement build times the  phase_clock_text()
//                                phases of each op (release builds never ask)
//
// Each variable has a pure parser, which takes the variable's text (nullptr = unset) and never
// looks at the process environment, so that tests can feed it any value, and a getter, which
// reads the process environment and parses. A malformed value is a ConfigError naming the
// variable, its value and the bound. The public entry points (epx/config.hpp: read_env,
// parse_env, hardware_queues_per_gpu; epx/bootstrap.hpp: BootstrapOptions::from_env, parse_env)
// are defined on top of these.

#include <cstdint>
#include <string>
#include <string_view>

#include "epx/bootstrap.hpp"
#include "epx/config.hpp"

namespace epx::env {

// ---- parsers --------------------------------------------------------------------------------

// Strict decimal in [lo, hi]: digits only, no sign, no spaces, no suffix, no exponent.
// ConfigError "NAME = "text", expected BOUND".
int parse_decimal(std::string_view name, std::string_view text, uint64_t lo, uint64_t hi,
                  const std::string& bound);

// A timeout in milliseconds: a decimal integer in [1, kMaxTimeoutMs].
int parse_timeout_ms(std::string_view name, std::string_view text);

// EPX_RANK, EPX_WORLD_SIZE, EPX_BOOTSTRAP and EPX_TIMEOUT_MS as BootstrapOptions. Neither rank
// nor world size set: a world of one rank. Refuses one of the two without the other, a rank
// outside [0, world size), and an empty or, for several ranks, missing address. The address's
// form (length, "@name") is the bootstrap's to check: BootstrapOptions::parse_env does.
BootstrapOptions parse_bootstrap(const char* rank, const char* world_size, const char* address,
                                 const char* timeout_ms);

// Every launcher's variables (BootstrapOptions::from_env in epx/bootstrap.hpp says which, in
// what order, and what they mean), looked up through `get` (nullptr = unset). The address's form
// is checked as in parse_bootstrap; the layout is checked here, naming the variables.
BootstrapOptions parse_launcher(const BootstrapOptions::Lookup& get);

// SLURM_*TASKS_PER_NODE: "4", "4(x2)", "4(x2),4": the ranks per node, the same on every node.
// ConfigError naming `name` for another form or for nodes with different counts.
int parse_slurm_tasks_per_node(std::string_view name, std::string_view text);

// EPX_NCCL_LIBRARY: the NCCL library to open; unset or empty = "libnccl.so.2".
std::string parse_nccl_library(const char* text);

// ---- getters: the process environment, parsed as above ----------------------------------------

EnvSettings settings();  // EPX_BACKEND, EPX_TIMEOUT_MS, EPX_CONFIG_PATH
int timeout_ms();        // EPX_TIMEOUT_MS, else EpConfig's default (10 s)
BootstrapOptions bootstrap();  // parse_launcher on the process environment
std::string nccl_library();
int hardware_queues_per_gpu();  // CUDA_DEVICE_MAX_CONNECTIONS, else CUDA's default 8
// EPX_ABLATE as set ("" when unset): parsed by the peer engine of a measurement build only.
std::string ablate_text();
// EPX_PHASE_CLOCK as set ("" when unset): read by the engines of a measurement build only
// (backends/common/phase_clock.cpp).
std::string phase_clock_text();

}  // namespace epx::env

namespace epx::detail {

// parse_backend() with `what` naming where the text came from (a field or a variable); defined
// in config.cpp beside the other names.
Backend parse_backend_as(std::string_view what, const std::string& text);

}  // namespace epx::detail
