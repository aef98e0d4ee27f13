// epx._epx: the raw extension of the Python package. Values and data pointers only; the Python
// layer (python/epx) checks torch tensors and turns the DLPack views into tensors.

#include "bindings.hpp"

namespace nb = nanobind;

NB_MODULE(_epx, m) {
  // Python objects held by C++ (a bootstrap's all-gather callable) may outlive interpreter
  // teardown in reference cycles Python cannot see; that is not a leak worth a warning.
  nb::set_leak_warnings(false);
  m.doc() = "epx's raw extension: use the epx package, which checks and converts torch tensors";
  epx::python::bind_errors(m);
  epx::python::bind_config(m);
  epx::python::bind_bootstrap(m);
#if EPX_PYTHON_CUDA
  epx::python::bind_gpu(m);
  epx::python::bind_moe(m);
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;  // a build without the CUDA toolkit: configs and errors only
#endif
}
