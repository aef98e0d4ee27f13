// MoeShape by keyword and MoeLayer over the caller's device memory (include/epx/moe.hpp). Weights
// arrive as data pointers; the Python layer (epx.MoeLayer) checks the torch tensors and keeps
// them alive as long as the layer.

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.hpp"
#include "epx/all2all.hpp"
#include "epx/error.hpp"
#include "epx/moe.hpp"
#include "epx/moe_shape.hpp"

namespace epx::python {

namespace {

// gate (weight, scale_inv), up (...), down (...) as six addresses.
using ExpertPointers = std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t>;

MoeExpertWeights expert_weights(const ExpertPointers& p) {
  auto w = [](uintptr_t a) { return reinterpret_cast<const void*>(a); };
  auto s = [](uintptr_t a) { return reinterpret_cast<const float*>(a); };
  return MoeExpertWeights{.gate = {w(std::get<0>(p)), s(std::get<1>(p))},
                          .up = {w(std::get<2>(p)), s(std::get<3>(p))},
                          .down = {w(std::get<4>(p)), s(std::get<5>(p))}};
}

const char* scoring_name(MoeScoring s) {
  return s == MoeScoring::kSoftmax ? "softmax" : "sigmoid_grouped";
}

struct IntField {
  const char* name;
  int MoeShape::*member;
};
constexpr std::array<IntField, 7> kIntFields{{
    {"hidden", &MoeShape::hidden},
    {"intermediate", &MoeShape::intermediate},
    {"num_experts", &MoeShape::num_experts},
    {"topk", &MoeShape::topk},
    {"num_groups", &MoeShape::num_groups},
    {"topk_groups", &MoeShape::topk_groups},
    {"shared_intermediate", &MoeShape::shared_intermediate},
}};

void set_shape_field(MoeShape& s, const std::string& key, nb::handle v) {
  for (const IntField& f : kIntFields) {
    if (key == f.name) {
      s.*f.member = int_arg("MoeShape", key, v);
      return;
    }
  }
  if (key == "routed_scaling") {
    EPX_CHECK(PyFloat_Check(v.ptr()) || (PyLong_Check(v.ptr()) && !PyBool_Check(v.ptr())),
              ConfigError, "MoeShape.routed_scaling", nb::cast<std::string>(nb::repr(v)),
              "a number");
    s.routed_scaling = float(PyFloat_AsDouble(v.ptr()));
  } else if (key == "scoring") {
    const std::string name = str_arg("MoeShape", key, v);
    EPX_CHECK(name == "sigmoid_grouped" || name == "softmax", ConfigError, "MoeShape.scoring",
              "\"" + name + "\"", "sigmoid_grouped or softmax");
    s.scoring = name == "softmax" ? MoeScoring::kSoftmax : MoeScoring::kSigmoidGrouped;
  } else {
    EPX_CHECK(false, ConfigError, "MoeShape key", "'" + key + "'",
              "one of hidden, intermediate, num_experts, topk, num_groups, topk_groups, "
              "routed_scaling, shared_intermediate, scoring");
  }
}

std::string shape_repr(const MoeShape& s) {
  return fmt::format(
      "MoeShape(hidden={}, intermediate={}, num_experts={}, topk={}, num_groups={}, "
      "topk_groups={}, routed_scaling={}, shared_intermediate={}, scoring='{}')",
      s.hidden, s.intermediate, s.num_experts, s.topk, s.num_groups, s.topk_groups,
      s.routed_scaling, s.shared_intermediate, scoring_name(s.scoring));
}

}  // namespace

void bind_moe(nb::module_& m) {
  nb::class_<MoeShape> shape(m, "MoeShape",
                             "The shape of one MoE layer (include/epx/moe_shape.hpp); the "
                             "defaults are DeepSeek-R1's.");
  shape
      .def("__init__",
           [](MoeShape* s, nb::kwargs kw) {
             new (s) MoeShape();
             for (auto [k, v] : kw) set_shape_field(*s, nb::cast<std::string>(k), v);
           })
      .def("validate", &MoeShape::validate)
      .def_prop_rw(
          "routed_scaling", [](const MoeShape& s) { return s.routed_scaling; },
          [](MoeShape& s, nb::handle v) { set_shape_field(s, "routed_scaling", v); })
      .def_prop_rw(
          "scoring", [](const MoeShape& s) { return std::string(scoring_name(s.scoring)); },
          [](MoeShape& s, nb::handle v) { set_shape_field(s, "scoring", v); })
      .def_prop_ro("has_shared_expert", &MoeShape::has_shared_expert)
      .def("__repr__", &shape_repr);
  for (const IntField& f : kIntFields) {
    const auto member = f.member;
    const std::string name = f.name;
    shape.def_prop_rw(
        f.name, [member](const MoeShape& s) { return s.*member; },
        [member, name](MoeShape& s, nb::handle v) { s.*member = int_arg("MoeShape", name, v); });
  }

  nb::class_<MoeLayer>(m, "MoeLayer",
                       "One rank's MoE layer over the caller's weights (include/epx/moe.hpp); "
                       "addresses as integers. Use epx.MoeLayer for torch tensors.")
      .def(
          "__init__",
          [](MoeLayer* layer, const MoeShape& shape, uintptr_t router, uintptr_t correction_bias,
             const std::vector<ExpertPointers>& experts, const ExpertPointers& shared,
             const EpConfig& ep, int gemm_sms) {
            MoeWeights w;
            w.router = reinterpret_cast<const void*>(router);
            w.correction_bias = reinterpret_cast<const float*>(correction_bias);
            for (const ExpertPointers& e : experts) w.experts.push_back(expert_weights(e));
            w.shared = expert_weights(shared);
            nb::gil_scoped_release release;
            new (layer) MoeLayer(shape, w, ep, gemm_sms);
          },
          nb::arg("shape"), nb::arg("router"), nb::arg("correction_bias"), nb::arg("experts"),
          nb::arg("shared"), nb::arg("ep"), nb::arg("gemm_sms") = 0)
      .def(
          "forward",
          [](MoeLayer& layer, uintptr_t x, int num_tokens, uintptr_t y, All2All& a2a,
             uintptr_t stream, int num_chunks, uintptr_t topk_ids, uintptr_t topk_weights) {
            MoeRoutingOut routing{.topk_ids = reinterpret_cast<int32_t*>(topk_ids),
                                  .topk_weights = reinterpret_cast<float*>(topk_weights)};
            layer.forward(reinterpret_cast<const void*>(x), num_tokens, reinterpret_cast<void*>(y),
                          a2a, reinterpret_cast<cudaStream_t>(stream), num_chunks,
                          topk_ids != 0 ? &routing : nullptr);
          },
          nb::arg("x"), nb::arg("num_tokens"), nb::arg("y"), nb::arg("a2a"), nb::arg("stream"),
          nb::arg("num_chunks") = 0, nb::arg("topk_ids") = 0, nb::arg("topk_weights") = 0,
          nb::call_guard<nb::gil_scoped_release>())
      .def("set_capture_token_bound", &MoeLayer::set_capture_token_bound,
           nb::arg("max_tokens_per_rank"))
      .def(
          "set_capture_experts",
          [](MoeLayer& layer, const std::string& mode) {
            EPX_CHECK(mode == "switch" || mode == "all_rows", ConfigError, "capture_experts",
                      "\"" + mode + "\"", "switch or all_rows");
            layer.set_capture_experts(mode == "switch" ? CaptureExperts::kSwitch
                                                       : CaptureExperts::kAllRows);
          },
          nb::arg("mode"));
}

}  // namespace epx::python
