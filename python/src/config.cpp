// EpConfig and the launch configurations by keyword, the JSON launch file, the environment and the
// buffer sizes. Enumerations cross as the library's own names ("bf16-to-fp8", "token", ...), parsed
// by its parse_* functions, so Python accepts exactly what `epx` and EPX_* accept.

#include <fmt/format.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <array>
#include <string>

#include "bindings.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"

namespace epx::python {

namespace {

std::string type_of(nb::handle value) { return Py_TYPE(value.ptr())->tp_name; }

std::string repr_of(nb::handle value) { return nb::cast<std::string>(nb::repr(value)); }

struct IntField {
  const char* name;
  int EpConfig::*member;
};
constexpr std::array<IntField, 8> kIntFields{{
    {"rank", &EpConfig::rank},
    {"world_size", &EpConfig::world_size},
    {"hidden", &EpConfig::hidden},
    {"num_experts", &EpConfig::num_experts},
    {"topk", &EpConfig::topk},
    {"max_tokens_per_rank", &EpConfig::max_tokens_per_rank},
    {"rounds_in_flight", &EpConfig::rounds_in_flight},
    {"timeout_ms", &EpConfig::timeout_ms},
}};
constexpr const char* kEpConfigKeys =
    "rank, world_size, hidden, num_experts, topk, max_tokens_per_rank, dtype, scale_layout, "
    "round_scale, layout, deterministic, rounds_in_flight, mask_failed_ranks, worst_case_output, combine, "
    "combine_format, combine_order, timeout_ms";

void set_ep_field(EpConfig& c, const std::string& key, nb::handle v) {
  for (const IntField& f : kIntFields) {
    if (key == f.name) {
      c.*f.member = int_arg("EpConfig", key, v);
      return;
    }
  }
  if (key == "dtype") {
    c.dtype = parse_dispatch_dtype(str_arg("EpConfig", key, v));
  } else if (key == "scale_layout") {
    c.scale_layout = parse_scale_layout(str_arg("EpConfig", key, v));
  } else if (key == "layout") {
    c.layout = parse_output_layout(str_arg("EpConfig", key, v));
  } else if (key == "round_scale") {
    c.round_scale = bool_arg("EpConfig", key, v);
  } else if (key == "deterministic") {
    c.deterministic = bool_arg("EpConfig", key, v);
  } else if (key == "mask_failed_ranks") {
    c.mask_failed_ranks = bool_arg("EpConfig", key, v);
  } else if (key == "worst_case_output") {
    c.worst_case_output = bool_arg("EpConfig", key, v);
  } else if (key == "combine") {
    c.combine = parse_combine_mode(str_arg("EpConfig", key, v));
  } else if (key == "combine_format") {
    c.combine_format = parse_combine_format(str_arg("EpConfig", key, v));
  } else if (key == "combine_order") {
    c.combine_order = parse_combine_order(str_arg("EpConfig", key, v));
  } else {
    EPX_CHECK(false, ConfigError, "EpConfig key", "'" + key + "'",
              std::string("one of ") + kEpConfigKeys);
  }
}

std::string ep_repr(const EpConfig& c) {
  return fmt::format(
      "EpConfig(rank={}, world_size={}, hidden={}, num_experts={}, topk={}, "
      "max_tokens_per_rank={}, dtype='{}', scale_layout='{}', round_scale={}, layout='{}', "
      "deterministic={}, "
      "rounds_in_flight={}, mask_failed_ranks={}, worst_case_output={}, combine='{}', "
      "combine_format='{}', combine_order='{}', timeout_ms={})",
      c.rank, c.world_size, c.hidden, c.num_experts, c.topk, c.max_tokens_per_rank,
      to_string(c.dtype), to_string(c.scale_layout), c.round_scale ? "True" : "False",
      to_string(c.layout), c.deterministic ? "True" : "False", c.rounds_in_flight,
      c.mask_failed_ranks ? "True" : "False", c.worst_case_output ? "True" : "False",
      to_string(c.combine), to_string(c.combine_format), to_string(c.combine_order),
      c.timeout_ms);
}

void set_launch_field(LaunchConfig& l, const std::string& key, nb::handle v) {
  if (key == "num_blocks") {
    l.num_blocks = int_arg("LaunchConfig", key, v);
  } else if (key == "warps_per_block") {
    l.warps_per_block = int_arg("LaunchConfig", key, v);
  } else if (key == "ring_rows") {
    l.ring_rows = int_arg("LaunchConfig", key, v);
  } else {
    EPX_CHECK(false, ConfigError, "LaunchConfig key", "'" + key + "'",
              "num_blocks, warps_per_block or ring_rows (the JSON file also takes block_num, "
              "warp_num_per_block)");
  }
}

nb::dict env_dict(const EnvSettings& env) {
  nb::dict d;
  d["backend"] = env.backend ? nb::object(nb::str(to_string(*env.backend))) : nb::none();
  d["timeout_ms"] = env.timeout_ms ? nb::object(nb::int_(*env.timeout_ms)) : nb::none();
  d["config_path"] = env.config_path ? nb::object(nb::str(env.config_path->c_str())) : nb::none();
  return d;
}

const char* c_str_or_null(const std::optional<std::string>& s) {
  return s ? s->c_str() : nullptr;
}

}  // namespace

int int_arg(const std::string& what, const std::string& key, nb::handle value) {
  // bool is an int in Python; a flag where a count belongs is a mistake worth naming.
  EPX_CHECK(PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr()), ConfigError,
            what + "." + key, repr_of(value) + " (" + type_of(value) + ")", "an int");
  long long v = PyLong_AsLongLong(value.ptr());
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    v = (1LL << 40);  // out of range either way: reported below
  }
  EPX_CHECK(v >= INT32_MIN && v <= INT32_MAX, ConfigError, what + "." + key, repr_of(value),
            "a 32-bit int");
  return int(v);
}

bool bool_arg(const std::string& what, const std::string& key, nb::handle value) {
  EPX_CHECK(PyBool_Check(value.ptr()), ConfigError, what + "." + key,
            repr_of(value) + " (" + type_of(value) + ")", "True or False");
  return value.ptr() == Py_True;
}

std::string str_arg(const std::string& what, const std::string& key, nb::handle value) {
  EPX_CHECK(PyUnicode_Check(value.ptr()), ConfigError, what + "." + key,
            repr_of(value) + " (" + type_of(value) + ")", "a str");
  return nb::cast<std::string>(value);
}

void bind_config(nb::module_& m) {
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_TOPK") = kMaxTopk;
  m.attr("MAX_HIDDEN") = kMaxHidden;
  m.attr("MAX_TOKENS_PER_RANK") = kMaxTokensPerRank;
  m.attr("FP8_BLOCK_SIZE") = kFp8BlockSize;
  m.attr("MAX_WARPS_PER_BLOCK") = kMaxWarpsPerBlock;
  m.attr("MAX_BLOCKS") = kMaxBlocks;

  nb::class_<EpConfig> ep(m, "EpConfig",
                          "The shape of one expert-parallel MoE layer as one rank sees it "
                          "(include/epx/config.hpp). Keyword arguments set fields; unknown keys "
                          "and wrong types raise ConfigError; validate() checks the whole.");
  ep.def("__init__",
         [](EpConfig* c, nb::kwargs kw) {
           new (c) EpConfig();
           for (auto [k, v] : kw) set_ep_field(*c, nb::cast<std::string>(k), v);
         })
      .def("replace",
           [](const EpConfig& c, nb::kwargs kw) {
             EpConfig out = c;
             for (auto [k, v] : kw) set_ep_field(out, nb::cast<std::string>(k), v);
             return out;
           },
           "A copy with the given fields changed.")
      .def("validate", &EpConfig::validate, "Raises ConfigError naming the first impossible field.")
      .def_prop_ro("num_local_experts", &EpConfig::num_local_experts)
      .def_prop_ro("num_scale_groups", &EpConfig::num_scale_groups)
      .def_prop_ro("capacity", &EpConfig::capacity,
                   "Rows of the token-major receive area; rows per expert when expert-major.")
      .def_prop_ro("wire_row_bytes", &EpConfig::wire_row_bytes)
      .def_prop_ro("input_fp8", &EpConfig::input_fp8)
      .def_prop_ro("wire_fp8", &EpConfig::wire_fp8)
      .def("expert_rank", &EpConfig::expert_rank, nb::arg("expert"))
      .def("__repr__", &ep_repr)
      .def("__eq__", [](const EpConfig& a, const EpConfig& b) { return ep_repr(a) == ep_repr(b); })
      .def_static("keys", [] { return std::string(kEpConfigKeys); });
  for (const IntField& f : kIntFields) {
    const auto member = f.member;
    const std::string name = f.name;
    ep.def_prop_rw(
        f.name, [member](const EpConfig& c) { return c.*member; },
        [member, name](EpConfig& c, nb::handle v) { c.*member = int_arg("EpConfig", name, v); });
  }
  ep.def_prop_rw(
      "dtype", [](const EpConfig& c) { return std::string(to_string(c.dtype)); },
      [](EpConfig& c, nb::handle v) { set_ep_field(c, "dtype", v); },
      "'bf16', 'fp8' (fp8 e4m3 + f32 1x128 scales in) or 'bf16-to-fp8' (quantised in dispatch)");
  ep.def_prop_rw(
      "scale_layout", [](const EpConfig& c) { return std::string(to_string(c.scale_layout)); },
      [](EpConfig& c, nb::handle v) { set_ep_field(c, "scale_layout", v); },
      "'row' or 'column' (received scales, token index fastest)");
  ep.def_prop_rw(
      "layout", [](const EpConfig& c) { return std::string(to_string(c.layout)); },
      [](EpConfig& c, nb::handle v) { set_ep_field(c, "layout", v); },
      "'token' (token-major, vLLM Standard) or 'expert' (expert-major, vLLM BatchedExperts)");
  ep.def_prop_rw(
      "round_scale", [](const EpConfig& c) { return c.round_scale; },
      [](EpConfig& c, nb::handle v) { set_ep_field(c, "round_scale", v); },
      "bf16-to-fp8: each 1x128 block's scale a power of two (DeepEP's round_scale).");
  ep.def_prop_rw(
      "deterministic", [](const EpConfig& c) { return c.deterministic; },
      [](EpConfig& c, nb::handle v) { set_ep_field(c, "deterministic", v); },
      "Rows ordered by (source rank, source index).");
  ep.def_prop_rw(
      "mask_failed_ranks", [](const EpConfig& c) { return c.mask_failed_ranks; },
      [](EpConfig& c, nb::handle v) { set_ep_field(c, "mask_failed_ranks", v); },
      "A peer that does not arrive within timeout_ms is masked instead of failing the call.");
  ep.def_prop_rw(
      "worst_case_output", [](const EpConfig& c) { return c.worst_case_output; },
      [](EpConfig& c, nb::handle v) { set_ep_field(c, "worst_case_output", v); },
      "high_throughput: receive areas for world_size x max_tokens_per_rank rows (fixed "
      "shapes, no host read of the row count, capturable); required from Python.");
  ep.def_prop_rw(
      "combine", [](const EpConfig& c) { return std::string(to_string(c.combine)); },
      [](EpConfig& c, nb::handle v) { set_ep_field(c, "combine", v); },
      "'auto', 'pull' or 'push': how combine moves the partials (low_latency, "
      "allgather_reducescatter); 'auto' pulls when every rank is on one GPU, pushes otherwise.");
  ep.def_prop_rw(
      "combine_format", [](const EpConfig& c) { return std::string(to_string(c.combine_format)); },
      [](EpConfig& c, nb::handle v) { set_ep_field(c, "combine_format", v); },
      "'bf16' or 'logfmt': what each partial crosses as in combine (LogFMT-10 rows, about 0.64 "
      "of the bytes, DeepEP's use_logfmt; low_latency only, hidden a multiple of 128).");
  ep.def_prop_rw(
      "combine_order", [](const EpConfig& c) { return std::string(to_string(c.combine_order)); },
      [](EpConfig& c, nb::handle v) { set_ep_field(c, "combine_order", v); },
      "'rank' or 'highest_slot': the order of combine's f32 sum ('highest_slot': each rank at "
      "its highest top-k slot of the token, DeepEP V2's order; high_throughput only).");

  nb::class_<LaunchConfig>(m, "LaunchConfig",
                           "Launch shape of one op; 0 = chosen per world and shape.")
      .def("__init__",
           [](LaunchConfig* l, nb::kwargs kw) {
             new (l) LaunchConfig();
             for (auto [k, v] : kw) set_launch_field(*l, nb::cast<std::string>(k), v);
           })
      .def_rw("num_blocks", &LaunchConfig::num_blocks)
      .def_rw("warps_per_block", &LaunchConfig::warps_per_block)
      .def_rw("ring_rows", &LaunchConfig::ring_rows)
      .def("__repr__", [](const LaunchConfig& l) {
        return fmt::format("LaunchConfig(num_blocks={}, warps_per_block={}, ring_rows={})",
                           l.num_blocks, l.warps_per_block, l.ring_rows);
      });
  nb::class_<LaunchConfigs>(m, "LaunchConfigs",
                            "Launch shapes of dispatch and combine (DESIGN §6).")
      .def(nb::init<>())
      .def_rw("dispatch", &LaunchConfigs::dispatch)
      .def_rw("combine", &LaunchConfigs::combine)
      .def("to_json", [](const LaunchConfigs& l) { return to_json(l); })
      .def("__repr__", [](const LaunchConfigs& l) { return "LaunchConfigs(" + to_json(l) + ")"; });
  m.def("load_launch_configs", &load_launch_configs, nb::arg("path"),
        "Reads a JSON launch file; ConfigError names the file, the key and the range.");
  m.def("parse_launch_configs", &parse_launch_configs, nb::arg("json_text"), nb::arg("origin"),
        "Parses JSON launch text; `origin` names it in errors.");

  m.def("read_env", [] { return env_dict(read_env()); },
        "EPX_BACKEND, EPX_TIMEOUT_MS and EPX_CONFIG_PATH, parsed (None when unset).");
  m.def(
      "parse_env",
      [](std::optional<std::string> backend, std::optional<std::string> timeout_ms,
         std::optional<std::string> config_path) {
        return env_dict(parse_env(c_str_or_null(backend), c_str_or_null(timeout_ms),
                                  c_str_or_null(config_path)));
      },
      nb::arg("backend").none(), nb::arg("timeout_ms").none(), nb::arg("config_path").none(),
      "read_env() on given values (None = unset).");
  m.def(
      "hardware_queues_per_gpu",
      [](std::optional<std::string> value) { return hardware_queues_per_gpu(c_str_or_null(value)); },
      nb::arg("max_connections").none(),
      "Hardware work queues per GPU for a value of CUDA_DEVICE_MAX_CONNECTIONS (None: unset).");

  m.def("parse_backend", [](const std::string& n) { return std::string(to_string(parse_backend(n))); },
        nb::arg("name"), "The backend's canonical name; ConfigError lists the valid ones.");
}

}  // namespace epx::python
