// epx.Error and its subclasses. Each C++ epx::Error becomes the Python exception of its class,
// carrying the C++ message (argument, value, bound, file:line). ConfigError and InputError are
// also ValueErrors, so code that catches ValueError for bad arguments keeps working.

#include <Python.h>
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "epx/error.hpp"

namespace epx::python {

namespace {

struct ExceptionTypes {
  PyObject* base = nullptr;
  PyObject* config = nullptr;
  PyObject* input = nullptr;
  PyObject* timeout = nullptr;
  PyObject* peer = nullptr;
  PyObject* cuda = nullptr;
  PyObject* state = nullptr;
  PyObject* unsupported = nullptr;
};
ExceptionTypes g_types;  // owned by the module for the life of the process

PyObject* add_exception(nb::module_& m, const char* name, PyObject* bases, const char* code,
                        const char* doc) {
  const std::string qualified = std::string("epx.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (type == nullptr) throw nb::python_error();
  if (PyObject_SetAttrString(type, "code", nb::str(code).ptr()) != 0) throw nb::python_error();
  m.attr(name) = nb::handle(type);
  return type;
}

PyObject* add_exception2(nb::module_& m, const char* name, PyObject* base, PyObject* second,
                         const char* code, const char* doc) {
  nb::object bases = nb::steal(PyTuple_Pack(2, base, second));
  if (!bases.is_valid()) throw nb::python_error();
  return add_exception(m, name, bases.ptr(), code, doc);
}

void translate(const std::exception_ptr& p, void*) {
  // Most derived first; anything else goes on to nanobind's own translators.
  try {
    std::rethrow_exception(p);
  } catch (const ConfigError& e) {
    PyErr_SetString(g_types.config, e.what());
  } catch (const InputError& e) {
    PyErr_SetString(g_types.input, e.what());
  } catch (const TimeoutError& e) {
    PyErr_SetString(g_types.timeout, e.what());
  } catch (const PeerError& e) {
    PyErr_SetString(g_types.peer, e.what());
  } catch (const CudaError& e) {
    PyErr_SetString(g_types.cuda, e.what());
  } catch (const StateError& e) {
    PyErr_SetString(g_types.state, e.what());
  } catch (const UnsupportedError& e) {
    PyErr_SetString(g_types.unsupported, e.what());
  } catch (const Error& e) {
    PyErr_SetString(g_types.base, e.what());
  }
}

// Throws the C++ error of `code` ("config", "input", ...): lets tests prove the translation.
[[noreturn]] void throw_error(const std::string& code, const std::string& message) {
  if (code == "config") throw ConfigError(message);
  if (code == "input") throw InputError(message);
  if (code == "timeout") throw TimeoutError(message);
  if (code == "peer") throw PeerError(message);
  if (code == "cuda") throw CudaError(message);
  if (code == "state") throw StateError(message);
  if (code == "unsupported") throw UnsupportedError(message);
  EPX_CHECK(false, InputError, "code", "\"" + code + "\"",
            "one of config, input, timeout, peer, cuda, state, unsupported");
  throw Error(ErrorCode::kInput, message);  // not reached
}

}  // namespace

void bind_errors(nb::module_& m) {
  g_types.base = add_exception(m, "Error", PyExc_RuntimeError, "error",
                               "Base of every error epx raises (C++ epx::Error).");
  g_types.config = add_exception2(m, "ConfigError", g_types.base, PyExc_ValueError, "config",
                                  "An EpConfig, launch configuration or environment value is "
                                  "impossible (the message names the field, value and bound).");
  g_types.input = add_exception2(m, "InputError", g_types.base, PyExc_ValueError, "input",
                                 "A call's arguments (tensors, shapes, dtypes, expert ids) are "
                                 "wrong (the message names the argument, value and bound).");
  g_types.timeout = add_exception(m, "TimeoutError", g_types.base, "timeout",
                                  "A bounded wait expired (EPX_TIMEOUT_MS); the message names "
                                  "the rank that was waited for.");
  g_types.peer = add_exception(m, "PeerError", g_types.base, "peer",
                               "A peer rank failed, disconnected or disagreed.");
  g_types.cuda = add_exception(m, "CudaError", g_types.base, "cuda",
                               "A CUDA runtime or driver call failed.");
  g_types.state = add_exception(m, "StateError", g_types.base, "state",
                                "The object refuses calls after an earlier error, or the call "
                                "order was wrong: recreate it.");
  g_types.unsupported = add_exception(m, "UnsupportedError", g_types.base, "unsupported",
                                      "A valid request this build or machine cannot serve "
                                      "(e.g. no GPU).");
  nb::register_exception_translator(translate);
  m.def("_throw", &throw_error, nb::arg("code"), nb::arg("message"),
        "Raises the C++ epx error of `code` (tests of the exception mapping).");
}

}  // namespace epx::python
