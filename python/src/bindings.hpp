#pragma once
// The pieces of epx._epx, one function per concern (module.cpp calls them in order). The binding
// validates, converts and forwards: every rule lives in the library (include/epx), every tensor
// check in the Python layer (python/epx), which passes data pointers and streams as integers.

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace epx::python {

namespace nb = nanobind;

// epx.Error and its subclasses, and the translation of every epx::Error into them.
void bind_errors(nb::module_& m);
// EpConfig, LaunchConfig(s), the JSON launch file, the environment, buffer sizes.
void bind_config(nb::module_& m);
// The library version, fingerprints, BootstrapOptions, CallbackBootstrap (no CUDA).
void bind_bootstrap(nb::module_& m);
#if EPX_PYTHON_CUDA
// Worlds, All2All and its DLPack views.
void bind_gpu(nb::module_& m);
// MoeShape and MoeLayer over the caller's weights.
void bind_moe(nb::module_& m);
#endif

// Sets one field of a value from a Python keyword argument; ConfigError names `what`.`key`,
// the value and what was expected.
int int_arg(const std::string& what, const std::string& key, nb::handle value);
bool bool_arg(const std::string& what, const std::string& key, nb::handle value);
std::string str_arg(const std::string& what, const std::string& key, nb::handle value);

// A Python all-gather of bytes as the C++ callback CallbackBootstrap takes: called with the GIL
// taken, each result entry must be bytes.
struct PyAllGather {
  std::shared_ptr<nb::object> fn;
  std::vector<std::string> operator()(const std::string& bytes) const;
};
PyAllGather py_all_gather(nb::object fn);

}  // namespace epx::python
