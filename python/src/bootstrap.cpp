// The start-up agreement and the bootstrap pieces that need no GPU: the library version, the
// fingerprint of a configuration, BootstrapOptions from the environment, and CallbackBootstrap
// over a Python all-gather of bytes (torch.distributed's all_gather_object, say).

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "epx/bootstrap.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"

namespace epx::python {

namespace {

nb::dict options_dict(const BootstrapOptions& o) {
  nb::dict d;
  d["rank"] = o.rank;
  d["world_size"] = o.world_size;
  d["address"] = o.address;
  d["timeout_ms"] = o.timeout_ms;
  return d;
}

const char* c_str_or_null(const std::optional<std::string>& s) {
  return s ? s->c_str() : nullptr;
}

}  // namespace

std::vector<std::string> PyAllGather::operator()(const std::string& bytes) const {
  nb::gil_scoped_acquire gil;
  nb::object out = (*fn)(nb::bytes(bytes.data(), bytes.size()));
  std::vector<std::string> result;
  for (nb::handle entry : out) {
    EPX_CHECK(PyBytes_Check(entry.ptr()), PeerError, "all_gather callback entry type",
              nb::cast<std::string>(nb::repr(entry.type())), "bytes (one entry per rank)");
    result.emplace_back(PyBytes_AS_STRING(entry.ptr()), size_t(PyBytes_GET_SIZE(entry.ptr())));
  }
  return result;
}

PyAllGather py_all_gather(nb::object fn) {
  EPX_CHECK(PyCallable_Check(fn.ptr()), ConfigError, "all_gather",
            nb::cast<std::string>(nb::repr(fn)), "a callable bytes -> list of bytes");
  // The callable may be copied and dropped on threads that do not hold the GIL (the world's
  // constructor runs without it): only the last owner touches the reference, under the GIL.
  auto* held = new nb::object(std::move(fn));
  return PyAllGather{std::shared_ptr<nb::object>(held, [](nb::object* o) {
    nb::gil_scoped_acquire gil;
    delete o;
  })};
}

void bind_bootstrap(nb::module_& m) {
  m.def("library_version", [] { return std::string(library_version()); });
  m.def(
      "fingerprint",
      [](const EpConfig& cfg, const std::string& backend) {
        return fingerprint(cfg, parse_backend(backend));
      },
      nb::arg("config"), nb::arg("backend"),
      "What the ranks of one job must agree on, one key=value line each.");
  m.def("bootstrap_options_from_env", [] { return options_dict(BootstrapOptions::from_env()); },
        "EPX_RANK, EPX_WORLD_SIZE, EPX_BOOTSTRAP, EPX_TIMEOUT_MS (as `epx launch` sets them).");
  m.def(
      "parse_bootstrap_options",
      [](std::optional<std::string> rank, std::optional<std::string> world_size,
         std::optional<std::string> address, std::optional<std::string> timeout_ms) {
        return options_dict(BootstrapOptions::parse_env(c_str_or_null(rank),
                                                        c_str_or_null(world_size),
                                                        c_str_or_null(address),
                                                        c_str_or_null(timeout_ms)));
      },
      nb::arg("rank").none(), nb::arg("world_size").none(), nb::arg("address").none(),
      nb::arg("timeout_ms").none());

  nb::class_<CallbackBootstrap>(m, "CallbackBootstrap",
                                "A bootstrap over a caller's all-gather of bytes: "
                                "all_gather(bytes) -> list of `size` bytes, in rank order.")
      .def("__init__",
           [](CallbackBootstrap* b, int rank, int size, nb::object all_gather) {
             new (b) CallbackBootstrap(rank, size, py_all_gather(std::move(all_gather)));
           },
           nb::arg("rank"), nb::arg("size"), nb::arg("all_gather"))
      .def_prop_ro("rank", &CallbackBootstrap::rank)
      .def_prop_ro("size", &CallbackBootstrap::size)
      .def("all_gather",
           [](CallbackBootstrap& b, nb::bytes bytes) {
             std::vector<std::string> out =
                 b.all_gather(std::string(bytes.c_str(), bytes.size()));
             nb::list l;
             for (const std::string& s : out) l.append(nb::bytes(s.data(), s.size()));
             return l;
           },
           nb::arg("bytes"))
      .def("barrier", &CallbackBootstrap::barrier)
      .def(
          "check_fingerprints",
          [](CallbackBootstrap& b, const EpConfig& cfg, const std::string& backend) {
            check_fingerprints(b, cfg, parse_backend(backend));
          },
          nb::arg("config"), nb::arg("backend"),
          "Collective: ConfigError on every rank when the ranks' configurations differ.");
}

}  // namespace epx::python
