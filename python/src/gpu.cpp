// Worlds, All2All and the DLPack views of its memory. Data pointers and streams cross as
// integers (the Python layer passes tensor.data_ptr() and torch.cuda.current_stream().cuda_stream);
// what dispatch returns is described once, by views(): one DLPack array per field, each with a
// storage of its own, owned by the All2All object (it stays alive while any view does).

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "epx/all2all.hpp"
#include "epx/bootstrap.hpp"
#include "epx/config.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

namespace epx::python {

namespace {

using Array = nb::ndarray<>;

constexpr nb::dlpack::dtype kBF16{uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
constexpr nb::dlpack::dtype kU8{uint8_t(nb::dlpack::dtype_code::UInt), 8, 1};
constexpr nb::dlpack::dtype kF32{uint8_t(nb::dlpack::dtype_code::Float), 32, 1};
constexpr nb::dlpack::dtype kI32{uint8_t(nb::dlpack::dtype_code::Int), 32, 1};

template <typename T>
T* as_ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// A dispatch's arguments from the integers the Python side passes.
DispatchInput dispatch_input(int num_tokens, uintptr_t x, uintptr_t x_scales, uintptr_t topk_ids,
                             bool ids_int64, uintptr_t topk_weights) {
  return DispatchInput{.num_tokens = num_tokens,
                       .x = as_ptr<const void>(x),
                       .x_scales = as_ptr<const float>(x_scales),
                       .topk_ids = as_ptr<const void>(topk_ids),
                       .ids_type = ids_int64 ? IdType::kInt64 : IdType::kInt32,
                       .topk_weights = as_ptr<const float>(topk_weights)};
}

IpcHandles parse_handles(const std::string& name) {
  if (name == "auto") return IpcHandles::kAuto;
  if (name == "posix-fd") return IpcHandles::kPosixFd;
  if (name == "cuda-ipc") return IpcHandles::kCudaIpc;
  EPX_CHECK(false, ConfigError, "handles", "\"" + name + "\"", "one of auto, posix-fd, cuda-ipc");
  return IpcHandles::kAuto;
}

// The CUDA device that holds `p` (device memory of this process).
int device_of_pointer(const void* p) {
  cudaPointerAttributes attr{};
  EPX_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  return attr.device;
}

// One view: `shape` and element `strides` over `data`, owned by `owner`.
nb::object view(const void* data, std::vector<size_t> shape, std::vector<int64_t> strides,
                nb::dlpack::dtype dtype, int device, nb::handle owner) {
  Array a(const_cast<void*>(data), shape.size(), shape.data(), owner, strides.data(), dtype,
          nb::device::cuda::value, device);
  return nb::cast(a);
}

std::vector<int64_t> row_major(const std::vector<size_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) s[i - 1] = s[i] * int64_t(shape[i]);
  return s;
}

nb::object contiguous(const void* data, std::vector<size_t> shape, nb::dlpack::dtype dtype,
                      int device, nb::handle owner) {
  std::vector<int64_t> strides = row_major(shape);
  return view(data, std::move(shape), std::move(strides), dtype, device, owner);
}

// Every field of `r` as a view, keyed by its DispatchResult name. Scales are indexed [row, group]
// in either layout: column-major scales are that view with the row index fastest in memory.
// The backend of `name` for a Python object. The package's tensors have fixed shapes (the
// custom ops' fake implementations describe them from the config alone), so high_throughput,
// whose receive areas otherwise follow each round's row count, must hold the worst case.
// `across_nodes`: an NcclWorld of several nodes, whose collective engine keeps its receive areas
// at the worst case's shape either way (worst_case_output = false there moves exact sizes).
Backend python_backend(const std::string& name, const EpConfig& cfg, bool across_nodes = false) {
  const Backend b = parse_backend(name);
  EPX_CHECK(b != Backend::kHighThroughput || cfg.worst_case_output || across_nodes, ConfigError,
            "worst_case_output", "False",
            "True for backend high_throughput from Python (its tensors keep one shape, "
            "world_size x max_tokens_per_rank rows; C++ callers and NcclWorlds of several nodes "
            "may size them per call)");
  return b;
}

nb::dict views(nb::handle owner, const All2All& a2a, const DispatchResult& r) {
  const EpConfig& c = a2a.config();
  const size_t cap = size_t(r.capacity), H = size_t(c.hidden), K = size_t(c.topk);
  const size_t G = size_t(c.num_scale_groups()), L = size_t(c.num_local_experts());
  const int dev = device_of_pointer(r.recv_x);
  const nb::dlpack::dtype x_dtype = c.wire_fp8() ? kU8 : kBF16;
  const bool col = c.scale_layout == ScaleLayout::kColumnMajor;
  nb::dict d;
  d["recv_count"] = contiguous(r.recv_count, {1}, kI32, dev, owner);
  d["recv_x"] = contiguous(r.recv_x, {cap, H}, x_dtype, dev, owner);
  if (r.recv_scales != nullptr) {
    d["recv_scales"] = col ? view(r.recv_scales, {cap, G}, {1, int64_t(cap)}, kF32, dev, owner)
                           : contiguous(r.recv_scales, {cap, G}, kF32, dev, owner);
  }
  d["recv_src_rank"] = contiguous(r.recv_src_rank, {cap}, kI32, dev, owner);
  d["recv_src_idx"] = contiguous(r.recv_src_idx, {cap}, kI32, dev, owner);
  d["recv_topk_ids"] = contiguous(r.recv_topk_ids, {cap, K}, kI32, dev, owner);
  d["recv_topk_weights"] = contiguous(r.recv_topk_weights, {cap, K}, kF32, dev, owner);
  d["expert_counts"] = contiguous(r.expert_counts, {L}, kI32, dev, owner);
  if (r.expert_x != nullptr) {
    d["expert_x"] = contiguous(r.expert_x, {L, cap, H}, x_dtype, dev, owner);
    if (r.expert_scales != nullptr) {
      d["expert_scales"] =
          col ? view(r.expert_scales, {L, cap, G}, {int64_t(G * cap), 1, int64_t(cap)}, kF32, dev,
                     owner)
              : contiguous(r.expert_scales, {L, cap, G}, kF32, dev, owner);
    }
    d["expert_src_rank"] = contiguous(r.expert_src_rank, {L, cap}, kI32, dev, owner);
    d["expert_src_idx"] = contiguous(r.expert_src_idx, {L, cap}, kI32, dev, owner);
    d["expert_topk_slot"] = contiguous(r.expert_topk_slot, {L, cap}, kI32, dev, owner);
    d["expert_weight"] = contiguous(r.expert_weight, {L, cap}, kF32, dev, owner);
  }
  return d;
}

nb::object combine_buffer_view(nb::handle owner, All2All& a2a) {
  const EpConfig& c = a2a.config();
  void* p = a2a.combine_buffer();
  const size_t cap = size_t(c.capacity()), H = size_t(c.hidden);
  const int dev = device_of_pointer(p);
  if (c.layout == OutputLayout::kExpertMajor) {
    return contiguous(p, {size_t(c.num_local_experts()), cap, H}, kBF16, dev, owner);
  }
  return contiguous(p, {cap, H}, kBF16, dev, owner);
}

nb::dict result_pointers(const DispatchResult& r) {
  nb::dict d;
  d["capacity"] = r.capacity;
  d["recv_count"] = uintptr_t(r.recv_count);
  d["recv_x"] = uintptr_t(r.recv_x);
  d["recv_scales"] = uintptr_t(r.recv_scales);
  d["expert_x"] = uintptr_t(r.expert_x);
  return d;
}

}  // namespace

void bind_gpu(nb::module_& m) {
  m.def("cuda_device_count", &cuda_device_count, "Visible CUDA devices; 0 without driver or GPU.");
  m.def("buffer_bytes",
        [](const std::string& backend, const EpConfig& cfg) {
          return buffer_bytes(parse_backend(backend), cfg);
        },
        nb::arg("backend"), nb::arg("config"),
        "Bytes of device memory one rank's All2All needs for `config`.");

  nb::class_<InProcessWorld>(m, "InProcessWorld")
      .def(nb::init<int, std::vector<int>>(), nb::arg("num_ranks"),
           nb::arg("devices") = std::vector<int>{})
      .def_prop_ro("size", &InProcessWorld::size)
      .def("device_of", &InProcessWorld::device_of, nb::arg("rank"))
      .def("ranks_on_device", &InProcessWorld::ranks_on_device, nb::arg("device"))
      .def("num_sms", &InProcessWorld::num_sms, nb::arg("rank"))
      .def("sm_budget", &InProcessWorld::sm_budget, nb::arg("rank"));

  nb::class_<IpcWorld>(m, "IpcWorld")
      .def_static(
          "from_env",
          [](int device, const std::string& handles) {
            return IpcWorld::from_env(device, parse_handles(handles));
          },
          nb::arg("device") = -1, nb::arg("handles") = "auto",
          nb::call_guard<nb::gil_scoped_release>())
      .def_static(
          "from_all_gather",
          [](int rank, int size, nb::object all_gather, int device, const std::string& handles) {
            auto boot = std::make_unique<CallbackBootstrap>(rank, size,
                                                            py_all_gather(std::move(all_gather)));
            const IpcHandles h = parse_handles(handles);
            nb::gil_scoped_release release;  // the all-gather takes the GIL when it runs
            return IpcWorld(std::move(boot), device, h);
          },
          nb::arg("rank"), nb::arg("size"), nb::arg("all_gather"), nb::arg("device") = -1,
          nb::arg("handles") = "auto")
      .def_prop_ro("rank", &IpcWorld::rank)
      .def_prop_ro("size", &IpcWorld::size)
      .def_prop_ro("device", &IpcWorld::device)
      .def_prop_ro("ranks_on_device", &IpcWorld::ranks_on_device)
      .def_prop_ro("num_sms", &IpcWorld::num_sms)
      .def_prop_ro("sm_budget", &IpcWorld::sm_budget)
      .def_prop_ro("handles", [](const IpcWorld& w) { return std::string(to_string(w.handles())); })
      .def("barrier", [](IpcWorld& w) { w.bootstrap().barrier(); },
           nb::call_guard<nb::gil_scoped_release>());

  nb::class_<NcclWorld>(m, "NcclWorld")
      .def_static("from_env", [](int device) { return NcclWorld::from_env(device); },
                  nb::arg("device") = -1, nb::call_guard<nb::gil_scoped_release>())
      .def_static(
          "from_all_gather",
          [](int rank, int size, nb::object all_gather, int device, int local_world_size) {
            auto boot = std::make_unique<CallbackBootstrap>(rank, size,
                                                            py_all_gather(std::move(all_gather)));
            nb::gil_scoped_release release;
            return NcclWorld(std::move(boot), device, local_world_size);
          },
          nb::arg("rank"), nb::arg("size"), nb::arg("all_gather"), nb::arg("device") = -1,
          nb::arg("local_world_size") = 0)
      .def_prop_ro("num_nodes", &NcclWorld::num_nodes)
      .def_prop_ro("rank", &NcclWorld::rank)
      .def_prop_ro("size", &NcclWorld::size)
      .def_prop_ro("device", &NcclWorld::device)
      .def_prop_ro("ranks_on_device", &NcclWorld::ranks_on_device)
      .def_prop_ro("num_sms", &NcclWorld::num_sms)
      .def_prop_ro("sm_budget", &NcclWorld::sm_budget)
      .def("barrier", [](NcclWorld& w) { w.bootstrap().barrier(); },
           nb::call_guard<nb::gil_scoped_release>());

  nb::class_<DispatchResult>(m, "DispatchResult")
      .def_ro("capacity", &DispatchResult::capacity)
      .def("pointers", &result_pointers, "The addresses of the main fields (for caching views).");

  nb::class_<All2All>(m, "All2All",
                      "One rank's dispatch/combine (include/epx/all2all.hpp). Pointers and the "
                      "stream are integers; use epx.All2All for torch tensors.")
      .def_prop_ro("config", [](const All2All& a) { return a.config(); })
      .def_prop_ro("backend", [](const All2All& a) { return std::string(to_string(a.backend())); })
      .def_prop_ro("symmetric_bytes", &All2All::symmetric_bytes)
      .def_prop_ro("device", [](All2All& a) { return device_of_pointer(a.combine_buffer()); },
                   "CUDA ordinal of the GPU this rank's memory is on")
      .def(
          "dispatch",
          [](All2All& a, int num_tokens, uintptr_t x, uintptr_t x_scales, uintptr_t topk_ids,
             bool ids_int64, uintptr_t topk_weights, uintptr_t stream) {
            return a.dispatch(
                dispatch_input(num_tokens, x, x_scales, topk_ids, ids_int64, topk_weights),
                as_stream(stream));
          },
          nb::arg("num_tokens"), nb::arg("x"), nb::arg("x_scales"), nb::arg("topk_ids"),
          nb::arg("ids_int64"), nb::arg("topk_weights"), nb::arg("stream"),
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "combine",
          [](All2All& a, uintptr_t expert_out, uintptr_t y, uintptr_t stream) {
            a.combine(as_ptr<const void>(expert_out), as_ptr<void>(y), as_stream(stream));
          },
          nb::arg("expert_out"), nb::arg("y"), nb::arg("stream"),
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "dispatch_by_rank",
          [](All2All& a, int num_tokens, uintptr_t x, uintptr_t x_scales, uintptr_t rank_mask,
             uintptr_t expert_counts, uintptr_t stream) {
            DispatchInput in = dispatch_input(num_tokens, x, x_scales, 0, false, 0);
            in.rank_mask = as_ptr<const uint8_t>(rank_mask);
            in.expert_counts = as_ptr<const int32_t>(expert_counts);
            return a.dispatch(in, as_stream(stream));
          },
          nb::arg("num_tokens"), nb::arg("x"), nb::arg("x_scales"), nb::arg("rank_mask"),
          nb::arg("expert_counts"), nb::arg("stream"), nb::call_guard<nb::gil_scoped_release>(),
          "dispatch routed by rank_mask [N, W] (bytes) with the sender's expert_counts [E] "
          "(DispatchInput::rank_mask; high_throughput)")
      .def(
          "combine_extras",
          [](All2All& a, uintptr_t expert_out, uintptr_t y, uintptr_t topk_weights,
             uintptr_t y_topk_weights, uintptr_t bias0, uintptr_t bias1, uintptr_t stream) {
            CombineExtras ex;
            ex.topk_weights = as_ptr<const float>(topk_weights);
            ex.y_topk_weights = as_ptr<float>(y_topk_weights);
            ex.bias[0] = as_ptr<const void>(bias0);
            ex.bias[1] = as_ptr<const void>(bias1);
            a.combine(as_ptr<const void>(expert_out), as_ptr<void>(y), ex, as_stream(stream));
          },
          nb::arg("expert_out"), nb::arg("y"), nb::arg("topk_weights"), nb::arg("y_topk_weights"),
          nb::arg("bias0"), nb::arg("bias1"), nb::arg("stream"),
          nb::call_guard<nb::gil_scoped_release>(),
          "combine with CombineExtras: top-k weights summed back, bias rows (high_throughput)")
      .def(
          "dispatch_send",
          [](All2All& a, int num_tokens, uintptr_t x, uintptr_t x_scales, uintptr_t topk_ids,
             bool ids_int64, uintptr_t topk_weights, uintptr_t stream) {
            a.dispatch_send(
                dispatch_input(num_tokens, x, x_scales, topk_ids, ids_int64, topk_weights),
                as_stream(stream));
          },
          nb::arg("num_tokens"), nb::arg("x"), nb::arg("x_scales"), nb::arg("topk_ids"),
          nb::arg("ids_int64"), nb::arg("topk_weights"), nb::arg("stream"),
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "dispatch_recv", [](All2All& a, uintptr_t stream) { return a.dispatch_recv(as_stream(stream)); },
          nb::arg("stream"), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "combine_send",
          [](All2All& a, uintptr_t expert_out, uintptr_t stream) {
            a.combine_send(as_ptr<const void>(expert_out), as_stream(stream));
          },
          nb::arg("expert_out"), nb::arg("stream"), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "combine_recv",
          [](All2All& a, uintptr_t y, uintptr_t stream) {
            a.combine_recv(as_ptr<void>(y), as_stream(stream));
          },
          nb::arg("y"), nb::arg("stream"), nb::call_guard<nb::gil_scoped_release>())
      .def("combine_buffer_ptr", [](All2All& a) { return uintptr_t(a.combine_buffer()); })
      .def_prop_ro("masked_ranks", &All2All::masked_ranks,
                   "Bit r set: this rank gave up waiting for rank r (EpConfig::mask_failed_ranks). "
                   "Read from mapped host memory; never synchronises.")
      .def_prop_ro("dropped_pairs", &All2All::dropped_pairs,
                   "(token, expert) pairs this rank's dispatches dropped because their expert's "
                   "rank was masked. Read from mapped host memory; never synchronises.")
      .def(
          "clear_mask", [](All2All& a, uintptr_t stream) { a.clear_mask(as_stream(stream)); },
          nb::arg("stream"),
          "Unmasks every rank for the calls enqueued on `stream` after this one; zeroes "
          "dropped_pairs.")
      .def("poll", &All2All::poll)
      .def(
          "synchronize", [](All2All& a, uintptr_t stream) { a.synchronize(as_stream(stream)); },
          nb::arg("stream"), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "views",
          [](nb::handle self, const DispatchResult& r) {
            return views(self, nb::cast<const All2All&>(self), r);
          },
          nb::arg("result"),
          "DLPack arrays over every field of a dispatch result, owned by this object.")
      .def(
          "combine_buffer",
          [](nb::handle self) { return combine_buffer_view(self, nb::cast<All2All&>(self)); },
          "DLPack array over combine_buffer(): [capacity, H] or [E/W, capacity, H] bf16.");

  m.def(
      "make_all2all_group",
      [](const std::string& backend, const EpConfig& cfg, const InProcessWorld& world,
         const LaunchConfigs& launch) {
        return make_all2all_group(python_backend(backend, cfg), cfg, world, launch);
      },
      nb::arg("backend"), nb::arg("config"), nb::arg("world"), nb::arg("launch") = LaunchConfigs{},
      "One All2All per rank of an in-process world (rank and world_size set per rank).");
  m.def(
      "make_all2all",
      [](const std::string& backend, const EpConfig& cfg, IpcWorld& world,
         const LaunchConfigs& launch) {
        const Backend b = python_backend(backend, cfg);
        nb::gil_scoped_release release;  // collective; a callback bootstrap takes the GIL itself
        return make_all2all(b, cfg, world, launch);
      },
      nb::arg("backend"), nb::arg("config"), nb::arg("world"), nb::arg("launch") = LaunchConfigs{},
      nb::keep_alive<0, 3>(), "This process's All2All of an IpcWorld (collective).");
  m.def(
      "make_all2all",
      [](const std::string& backend, const EpConfig& cfg, NcclWorld& world,
         const LaunchConfigs& launch) {
        const Backend b = python_backend(backend, cfg, world.num_nodes() > 1);
        nb::gil_scoped_release release;
        return make_all2all(b, cfg, world, launch);
      },
      nb::arg("backend"), nb::arg("config"), nb::arg("world"), nb::arg("launch") = LaunchConfigs{},
      nb::keep_alive<0, 3>(), "This process's All2All of an NcclWorld (collective).");
  m.def(
      "copy_rows",
      [](uintptr_t dst, size_t dst_stride, uintptr_t src, size_t src_stride, size_t row_bytes,
         int64_t rows, uintptr_t index, uintptr_t zero, uintptr_t stream) {
        copy_rows(as_ptr<void>(dst), dst_stride, as_ptr<const void>(src), src_stride, row_bytes,
                  rows, as_ptr<const int64_t>(index), as_ptr<const bool>(zero), as_stream(stream));
      },
      nb::arg("dst"), nb::arg("dst_stride"), nb::arg("src"), nb::arg("src_stride"),
      nb::arg("row_bytes"), nb::arg("rows"), nb::arg("index"), nb::arg("zero"), nb::arg("stream"),
      "Row i of dst from row index[i] of src (index 0: row i), zeros where zero[i] (0: none); "
      "pointers, strides (bytes) and the stream as integers. Stream-ordered.");
}

}  // namespace epx::python
