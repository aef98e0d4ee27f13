"""torch implementations of the few operators of vLLM's compiled extension that its fused-MoE
experts call (namespace ``_C``), for a vLLM whose extension cannot load (a bundle made by
tools/vllm/bundle.sh, on a torch other than the one vLLM's wheel was built for).

``register()`` defines each operator only where ``torch.ops._C`` lacks it, so a real extension
always wins. Written for epx's tests from the operators' calls in vLLM's Python code (argument
order and meaning), not from vLLM's kernels:

- ``silu_and_mul``, ``gelu_and_mul``, ``gelu_tanh_and_mul`` (out, x): out = act(x[..., :d]) *
  x[..., d:], in float32, rounded once to out's dtype.
- ``masked_moe_activation`` (out, x, counts, name, clamp_limit, alpha, beta, situ_beta,
  situ_linear_beta): the same per expert on rows [0, counts[e]) of [E, T, 2d] (or of [T, 2d]
  with one count); other rows are left as they are. No host synchronisation.
- ``per_token_group_fp8_quant`` (x, q, s, group, eps, fp8_min, fp8_max, ue8m0, column_major,
  tma_aligned): per group of `group` elements, scale = max(amax, eps) / fp8_max (rounded up to a
  power of two with ue8m0), q = clamp(x / scale) in fp8; `s` is written through its own strides
  (row- or column-major alike).
And Stream.is_capturing where the installed torch lacks it (see _torch_compat).

- ``cutlass_scaled_mm_supports_fp8``, ``..._block_fp8``, ``..._fp4`` (capability): False, since
  there are no CUTLASS kernels here (vLLM calls the block-fp8 one when it imports its fp8
  utilities on a GPU).
"""

import torch

_lib = None


def _gated(name):
    def act(g):
        if name == "silu":
            return torch.nn.functional.silu(g)
        if name == "gelu":
            return torch.nn.functional.gelu(g)
        if name == "gelu_tanh":
            return torch.nn.functional.gelu(g, approximate="tanh")
        raise NotImplementedError(f"activation {name!r} is not in epx's stand-in operators")

    return act


def _and_mul(name):
    act = _gated(name)

    def op(out, x):
        d = x.shape[-1] // 2
        xf = x.float()
        out.copy_((act(xf[..., :d]) * xf[..., d:]).to(out.dtype))

    return op


def _masked_moe_activation(out, x, counts, name, clamp_limit, alpha, beta, situ_beta,
                           situ_linear_beta):
    xf = x.float()
    if name.endswith("_no_mul"):
        y = _gated(name[: -len("_no_mul")])(xf)
    else:
        d = xf.shape[-1] // 2
        y = _gated(name)(xf[..., :d]) * xf[..., d:]
    rows = torch.arange(x.shape[-2], device=x.device)
    if x.dim() == 3:
        keep = rows[None, :] < counts.to(rows.dtype)[:, None]
    else:
        keep = rows < counts.to(rows.dtype)[0]
    out.copy_(torch.where(keep[..., None], y.to(out.dtype), out))


def _per_token_group_fp8_quant(x, q, s, group_size, eps, fp8_min, fp8_max, ue8m0,
                               column_major, tma_aligned):
    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // group_size, group_size)
    amax = g.abs().amax(dim=-1).clamp_min(eps)
    scale = amax * (1.0 / fp8_max)
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    qv = (g / scale[..., None]).clamp(fp8_min, fp8_max).to(q.dtype).reshape(shape)
    q.copy_(qv)
    s.copy_(scale.reshape(s.shape))


def _noop(*args):
    return None


def _no_cutlass(cuda_device_capability):
    return False


_OPS = {
    "silu_and_mul": ("(Tensor(a!) out, Tensor input) -> ()", _and_mul("silu")),
    "gelu_and_mul": ("(Tensor(a!) out, Tensor input) -> ()", _and_mul("gelu")),
    "gelu_tanh_and_mul": ("(Tensor(a!) out, Tensor input) -> ()", _and_mul("gelu_tanh")),
    "masked_moe_activation": (
        "(Tensor(a!) out, Tensor input, Tensor valid_token_counts, str activation, "
        "float clamp_limit, float alpha, float beta, float situ_beta, float situ_linear_beta) "
        "-> ()", _masked_moe_activation),
    # What vLLM asks at import on a GPU: whether its CUTLASS kernels serve a capability. The
    # stand-ins have none, so vLLM takes its Triton and torch paths.
    "cutlass_scaled_mm_supports_fp8": ("(int cuda_device_capability) -> bool", _no_cutlass),
    "cutlass_scaled_mm_supports_block_fp8": ("(int cuda_device_capability) -> bool",
                                             _no_cutlass),
    "cutlass_scaled_mm_supports_fp4": ("(int cuda_device_capability) -> bool", _no_cutlass),
    "per_token_group_fp8_quant": (
        "(Tensor input, Tensor(a!) output_q, Tensor(b!) output_s, int group_size, float eps, "
        "float fp8_min, float fp8_max, bool scale_ue8m0, bool column_major_scales, "
        "bool tma_aligned_scales) -> ()", _per_token_group_fp8_quant),
}


def _present(name):
    try:
        getattr(torch.ops._C, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _torch_compat():
    """What vLLM calls on torch that an older torch lacks: Stream.is_capturing() (vLLM 0.34 asks
    it of torch.accelerator.current_stream(); torch 2.11's streams have no such method, and its
    torch.Stream is a built-in type that takes no new attribute). Where it is missing, CUDA
    streams (torch.cuda.Stream, a Python class) get it, answered by
    torch.cuda.is_current_stream_capturing() (vLLM asks it of the current stream), and
    torch.accelerator.current_stream() returns torch.cuda's stream object for CUDA devices."""
    accelerator = getattr(torch, "accelerator", None)
    stream = getattr(torch, "Stream", None)
    if accelerator is None or stream is None or hasattr(stream, "is_capturing"):
        return
    if not hasattr(torch.cuda.Stream, "is_capturing"):
        torch.cuda.Stream.is_capturing = lambda self: torch.cuda.is_current_stream_capturing()
    current = accelerator.current_stream

    def current_stream(device=None):
        s = current(device)
        return torch.cuda.current_stream(s.device) if s.device.type == "cuda" else s

    accelerator.current_stream = current_stream


def register():
    """Defines each operator of _OPS that torch.ops._C lacks; returns the names defined."""
    global _lib
    if _lib is not None:
        return []
    _torch_compat()
    lib = torch.library.Library("_C", "FRAGMENT")
    defined = []
    for name, (schema, fn) in _OPS.items():
        if _present(name):
            continue
        lib.define(name + schema)
        lib.impl(name, fn, "CompositeExplicitAutograd")
        lib.impl(name, _noop, "Meta")
        defined.append(name)
    _lib = lib
    return defined
