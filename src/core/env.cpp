// The process environment (core/env.hpp) and the public entry points built on it.

#include "core/env.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <climits>
#include <cstdlib>
#include <string>
#include <system_error>
#include <vector>

#include "epx/error.hpp"

namespace epx {
namespace env {
namespace {

// The one place that looks at the process environment.
const char* raw(const char* name) { return std::getenv(name); }

}  // namespace

// ---- parsers --------------------------------------------------------------------------------

int parse_decimal(std::string_view name, std::string_view text, uint64_t lo, uint64_t hi,
                  const std::string& bound) {
  EPX_CHECK(lo <= hi && hi <= uint64_t(INT_MAX), InputError, "hi", hi, "in [lo, INT_MAX]");
  const bool digits_only = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
    return std::isdigit(static_cast<unsigned char>(c)) != 0;
  });
  uint64_t value = 0;
  const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (!digits_only || err != std::errc() || end != text.data() + text.size() || value < lo ||
      value > hi) {
    EPX_THROW(ConfigError, fmt::format("{} = \"{}\", expected {}", name, text, bound));
  }
  return static_cast<int>(value);
}

int parse_timeout_ms(std::string_view name, std::string_view text) {
  return parse_decimal(name, text, 1, static_cast<uint64_t>(kMaxTimeoutMs),
                       fmt::format("a decimal integer in [1, {}]", kMaxTimeoutMs));
}

BootstrapOptions parse_bootstrap(const char* rank, const char* world_size, const char* address,
                                 const char* timeout_ms) {
  BootstrapOptions o;
  if (timeout_ms != nullptr) o.timeout_ms = parse_timeout_ms("EPX_TIMEOUT_MS", timeout_ms);
  if (rank != nullptr && world_size == nullptr) {
    EPX_THROW(ConfigError, fmt::format("EPX_RANK = \"{}\" is set but EPX_WORLD_SIZE is not, "
                                       "expected both (or neither, for a single rank)",
                                       rank));
  }
  if (rank == nullptr && world_size != nullptr) {
    EPX_THROW(ConfigError, fmt::format("EPX_WORLD_SIZE = \"{}\" is set but EPX_RANK is not, "
                                       "expected both (or neither, for a single rank)",
                                       world_size));
  }
  if (world_size != nullptr) {
    o.world_size = parse_decimal("EPX_WORLD_SIZE", world_size, 1, kMaxRanks,
                                 fmt::format("a decimal integer in [1, {}]", kMaxRanks));
    o.rank = parse_decimal(
        "EPX_RANK", rank, 0, uint64_t(o.world_size - 1),
        fmt::format("a decimal integer in [0, EPX_WORLD_SIZE = {})", o.world_size));
    o.launcher = "epx";
  }
  // `epx launch` starts the ranks of one node.
  o.local_rank = o.rank;
  o.local_world_size = o.world_size;
  if (address != nullptr) {
    o.address = address;
    if (o.address.empty()) {
      EPX_THROW(ConfigError, "EPX_BOOTSTRAP = \"\", expected \"@name\" or a socket file path "
                             "(or tcp://HOST:PORT)");
    }
  }
  if (o.world_size > 1 && o.address.empty()) {
    EPX_THROW(ConfigError,
              fmt::format("EPX_BOOTSTRAP is not set, expected the socket address that all "
                          "EPX_WORLD_SIZE = {} ranks share (\"@name\" or a socket file path; "
                          "`epx launch` sets it; tcp://HOST:PORT across hosts)",
                          o.world_size));
  }
  return o;
}

namespace {

using Lookup = BootstrapOptions::Lookup;

// `names` joined as "A = "1", B = "2"" (with values) or "A, B".
std::string listed(const Lookup& get, const std::vector<const char*>& names, bool values) {
  std::string out;
  for (const char* n : names) {
    if (!out.empty()) out += ", ";
    out += values ? fmt::format("{} = \"{}\"", n, get(n)) : std::string(n);
  }
  return out;
}

// Every one of `names` set, or a ConfigError naming those set and those missing.
void require_all(const Lookup& get, std::string_view launcher,
                 const std::vector<const char*>& names) {
  std::vector<const char*> set, missing;
  for (const char* n : names) (get(n) != nullptr ? set : missing).push_back(n);
  if (missing.empty()) return;
  EPX_THROW(ConfigError,
            fmt::format("{}'s variables are set in part: {} set, but {} not; expected all of "
                        "{} (or EPX_RANK and EPX_WORLD_SIZE, which take precedence)",
                        launcher, listed(get, set, true), listed(get, missing, false),
                        listed(get, names, false)));
}

// The rank, world size and layout of one launcher's variables, all of them set.
void parse_layout(const Lookup& get, BootstrapOptions& o, const char* rank_name,
                  const char* size_name, const char* local_rank_name, const char* local_size_name,
                  int local_size) {
  o.world_size = parse_decimal(size_name, get(size_name), 1, kMaxRanks,
                               fmt::format("a decimal integer in [1, {}]", kMaxRanks));
  o.rank = parse_decimal(rank_name, get(rank_name), 0, uint64_t(o.world_size - 1),
                         fmt::format("a decimal integer in [0, {} = {})", size_name,
                                     o.world_size));
  if (local_size > o.world_size || o.world_size % local_size != 0) {
    EPX_THROW(ConfigError,
              fmt::format("{} = {} with {} = {}, expected a divisor of {} (every node runs as "
                          "many ranks)",
                          local_size_name, local_size, size_name, o.world_size, size_name));
  }
  o.local_world_size = local_size;
  o.local_rank = parse_decimal(local_rank_name, get(local_rank_name), 0, uint64_t(local_size - 1),
                               fmt::format("a decimal integer in [0, {} = {})", local_size_name,
                                           local_size));
  if (o.rank % local_size != o.local_rank) {
    EPX_THROW(ConfigError,
              fmt::format("{} = {} and {} = {} with {} = {}: expected {} = {} % {} = {}. epx "
                          "places ranks on nodes by block (node = rank / ranks per node, the "
                          "ranks of one node consecutive); start the ranks with block placement",
                          rank_name, o.rank, local_rank_name, o.local_rank, local_size_name,
                          local_size, local_rank_name, rank_name, local_size_name,
                          o.rank % local_size));
  }
}

// EPX_BOOTSTRAP as given: unset = "", set but empty = a ConfigError.
std::string epx_bootstrap(const char* text) {
  if (text != nullptr && *text == '\0') {
    EPX_THROW(ConfigError, "EPX_BOOTSTRAP = \"\", expected \"@name\" or a socket file path "
                           "(or tcp://HOST:PORT)");
  }
  return text != nullptr ? std::string(text) : std::string();
}

// torchrun: tcp://MASTER_ADDR:(MASTER_PORT + 1). torch's TCP store listens on MASTER_PORT of
// rank 0's host; the port after it is epx's.
std::string torchrun_address(const Lookup& get) {
  const char* host = get("MASTER_ADDR");
  const char* port = get("MASTER_PORT");
  if (host == nullptr || port == nullptr) {
    EPX_THROW(ConfigError,
              fmt::format("torchrun's {} is not set, expected MASTER_ADDR and MASTER_PORT "
                          "(torchrun sets both; epx meets at MASTER_PORT + 1), or "
                          "EPX_BOOTSTRAP=tcp://HOST:PORT",
                          host == nullptr ? "MASTER_ADDR" : "MASTER_PORT"));
  }
  const std::string_view h(host);
  const bool bad_host = h.empty() || std::any_of(h.begin(), h.end(), [](char c) {
                          return c == '/' || c == '[' || c == ']' ||
                                 std::isspace(static_cast<unsigned char>(c)) != 0;
                        });
  if (bad_host) {
    EPX_THROW(ConfigError, fmt::format("MASTER_ADDR = \"{}\", expected a host name or an IPv4 "
                                       "or IPv6 address",
                                       host));
  }
  const int p = parse_decimal("MASTER_PORT", port, 1, 65534,
                              "a decimal integer in [1, 65534] (epx listens on MASTER_PORT + 1)");
  const bool v6 = h.find(':') != std::string_view::npos;
  return fmt::format("tcp://{}{}{}:{}", v6 ? "[" : "", h, v6 ? "]" : "", p + 1);
}

}  // namespace

int parse_slurm_tasks_per_node(std::string_view name, std::string_view text) {
  auto bad = [&](std::string_view why) {
    EPX_THROW(ConfigError, fmt::format("{} = \"{}\" {}, expected the ranks per node as Slurm "
                                       "writes them (\"4\", \"4(x2)\", \"4(x2),4\"), the same "
                                       "on every node",
                                       name, text, why));
  };
  int count = 0;
  std::string_view rest = text;
  if (rest.empty()) bad("is empty");
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view field = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    if (comma != std::string_view::npos && rest.empty()) bad("ends with a comma");
    const size_t paren = field.find('(');
    if (paren != std::string_view::npos) {
      const std::string_view rep = field.substr(paren);
      const bool digits = rep.size() >= 4 && rep.substr(0, 2) == "(x" && rep.back() == ')' &&
                          std::all_of(rep.begin() + 2, rep.end() - 1, [](char c) {
                            return std::isdigit(static_cast<unsigned char>(c)) != 0;
                          });
      if (!digits) bad("has a malformed repeat count");
      field = field.substr(0, paren);
    }
    const bool digits = !field.empty() && field.size() <= 9 &&
                        std::all_of(field.begin(), field.end(), [](char c) {
                          return std::isdigit(static_cast<unsigned char>(c)) != 0;
                        });
    if (!digits) bad("has a malformed count");
    const int c = std::stoi(std::string(field));
    if (c < 1 || c > kMaxRanks) bad(fmt::format("has {} ranks on a node, outside [1, {}]", c,
                                                kMaxRanks));
    if (count != 0 && c != count) {
      bad(fmt::format("gives nodes different numbers of ranks ({} and {})", count, c));
    }
    count = c;
  }
  return count;
}

BootstrapOptions parse_launcher(const Lookup& get) {
  if (get("EPX_RANK") != nullptr || get("EPX_WORLD_SIZE") != nullptr) {
    return parse_bootstrap(get("EPX_RANK"), get("EPX_WORLD_SIZE"), get("EPX_BOOTSTRAP"),
                           get("EPX_TIMEOUT_MS"));
  }
  BootstrapOptions o;
  if (const char* t = get("EPX_TIMEOUT_MS"); t != nullptr) {
    o.timeout_ms = parse_timeout_ms("EPX_TIMEOUT_MS", t);
  }
  o.address = epx_bootstrap(get("EPX_BOOTSTRAP"));
  if (get("RANK") != nullptr || get("WORLD_SIZE") != nullptr) {
    o.launcher = "torchrun";
    require_all(get, o.launcher, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"});
    const int local = parse_decimal("LOCAL_WORLD_SIZE", get("LOCAL_WORLD_SIZE"), 1, kMaxRanks,
                                    fmt::format("a decimal integer in [1, {}]", kMaxRanks));
    parse_layout(get, o, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", local);
    if (o.address.empty() && o.world_size > 1) o.address = torchrun_address(get);
  } else if (get("SLURM_PROCID") != nullptr || get("SLURM_NTASKS") != nullptr) {
    o.launcher = "slurm";
    require_all(get, o.launcher, {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"});
    const char* per_node = nullptr;
    for (const char* name :
         {"SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
      if (get(name) != nullptr) {
        per_node = name;
        break;
      }
    }
    if (per_node == nullptr) {
      EPX_THROW(ConfigError,
                "Slurm's SLURM_PROCID and SLURM_NTASKS are set, but none of "
                "SLURM_NTASKS_PER_NODE, SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE: "
                "expected one of them (srun sets them), for the ranks per node");
    }
    const int local =
        std::string_view(per_node) == "SLURM_NTASKS_PER_NODE"
            ? parse_decimal(per_node, get(per_node), 1, kMaxRanks,
                            fmt::format("a decimal integer in [1, {}]", kMaxRanks))
            : parse_slurm_tasks_per_node(per_node, get(per_node));
    parse_layout(get, o, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", per_node, local);
    if (const char* node = get("SLURM_NODEID"); node != nullptr) {
      const int expected = o.rank / local;
      const int n = parse_decimal("SLURM_NODEID", node, 0, uint64_t(kMaxRanks - 1),
                                  fmt::format("a decimal integer in [0, {})", kMaxRanks));
      if (n != expected) {
        EPX_THROW(ConfigError,
                  fmt::format("SLURM_NODEID = {} with SLURM_PROCID = {} and {} = {}, expected "
                              "node {} = SLURM_PROCID / {}: epx places ranks on nodes by block "
                              "(srun --distribution=block)",
                              n, o.rank, per_node, local, expected, per_node));
      }
    }
  } else if (get("OMPI_COMM_WORLD_RANK") != nullptr || get("OMPI_COMM_WORLD_SIZE") != nullptr) {
    o.launcher = "mpi";
    require_all(get, "Open MPI",
                {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE"});
    const int local =
        parse_decimal("OMPI_COMM_WORLD_LOCAL_SIZE", get("OMPI_COMM_WORLD_LOCAL_SIZE"), 1,
                      kMaxRanks, fmt::format("a decimal integer in [1, {}]", kMaxRanks));
    parse_layout(get, o, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", local);
  } else {
    return o;  // no launcher: one rank
  }
  if (o.address.empty() && o.world_size > 1) {
    EPX_THROW(ConfigError,
              fmt::format("EPX_BOOTSTRAP is not set, and {} names no rendezvous address for its "
                          "{} ranks: expected EPX_BOOTSTRAP=tcp://<first host>:<port>, the same "
                          "on every rank (the host of rank 0 and a free port on it)",
                          o.launcher == "slurm" ? "Slurm" : "Open MPI", o.world_size));
  }
  if (o.num_nodes() > 1 && o.address.substr(0, 6) != "tcp://") {
    EPX_THROW(ConfigError,
              fmt::format("EPX_BOOTSTRAP = \"{}\" is a Unix socket, but the {} ranks are on {} "
                          "nodes ({} per node), expected tcp://HOST:PORT (a Unix socket does "
                          "not cross hosts)",
                          o.address, o.world_size, o.num_nodes(), o.local_world_size));
  }
  return o;
}

std::string parse_nccl_library(const char* text) {
  return text != nullptr && *text != '\0' ? std::string(text) : std::string("libnccl.so.2");
}

// ---- getters --------------------------------------------------------------------------------

EnvSettings settings() {
  return parse_env(raw("EPX_BACKEND"), raw("EPX_TIMEOUT_MS"), raw("EPX_CONFIG_PATH"));
}

int timeout_ms() {
  const char* text = raw("EPX_TIMEOUT_MS");
  return text != nullptr ? parse_timeout_ms("EPX_TIMEOUT_MS", text) : EpConfig{}.timeout_ms;
}

BootstrapOptions bootstrap() { return parse_launcher(raw); }

std::string nccl_library() { return parse_nccl_library(raw("EPX_NCCL_LIBRARY")); }

std::string ablate_text() {
  const char* v = raw("EPX_ABLATE");
  return v == nullptr ? std::string() : std::string(v);
}

std::string phase_clock_text() {
  const char* v = raw("EPX_PHASE_CLOCK");
  return v == nullptr ? std::string() : std::string(v);
}

int hardware_queues_per_gpu() {
  return ::epx::hardware_queues_per_gpu(raw("CUDA_DEVICE_MAX_CONNECTIONS"));
}

}  // namespace env

// ---- public entry points (epx/config.hpp) -----------------------------------------------------

EnvSettings parse_env(const char* backend, const char* timeout_ms, const char* config_path) {
  EnvSettings out;
  if (backend != nullptr) out.backend = detail::parse_backend_as("EPX_BACKEND", backend);
  if (timeout_ms != nullptr) out.timeout_ms = env::parse_timeout_ms("EPX_TIMEOUT_MS", timeout_ms);
  if (config_path != nullptr) {
    if (*config_path == '\0') {
      EPX_THROW(ConfigError, "EPX_CONFIG_PATH = \"\", expected the path of a JSON launch file");
    }
    out.config_path = std::string(config_path);
  }
  return out;
}

EnvSettings read_env() { return env::settings(); }

int hardware_queues_per_gpu(const char* max_connections) {
  if (max_connections == nullptr) return 8;  // CUDA's default
  return env::parse_decimal("CUDA_DEVICE_MAX_CONNECTIONS", max_connections, 1, 32,
                            "an integer in 1..32");
}

}  // namespace epx
