"""torch, imported on first use, and the checks that stand between a tensor and a data pointer.

Nothing here calls ``tensor.__dlpack__()``: tensors reach epx as ``data_ptr()`` integers (no
stream synchronisation, nothing that breaks CUDA-graph capture), and epx memory comes back as
DLPack capsules made by the extension, turned into tensors by ``torch.from_dlpack``.
"""

from __future__ import annotations

from . import _epx

_torch = None


def torch():
    """The torch module; epx.UnsupportedError when it is not installed."""
    global _torch
    if _torch is None:
        try:
            import torch as t
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise _epx.UnsupportedError(
                "this part of epx works on torch tensors: install torch (pip install torch)"
            ) from e
        _torch = t
    return _torch


def has_torch() -> bool:
    try:
        torch()
    except _epx.UnsupportedError:
        return False
    return True


def fp8_dtype():
    return torch().float8_e4m3fn


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "torch.")


def check(name: str, t, *, dtype=None, dtypes=None, shape=None, device=None, what="") -> None:
    """Raises epx.InputError naming `name`, the value and the bound, in the library's words.

    `shape` entries may be None (any size). The tensor must be row-major contiguous: epx reads
    rows of fixed stride.
    """
    T = torch()
    suffix = f" ({what})" if what else ""
    if not isinstance(t, T.Tensor):
        raise _epx.InputError(f"{name} = {type(t).__name__}, expected a torch.Tensor{suffix}")
    if dtype is not None and t.dtype != dtype:
        raise _epx.InputError(f"{name}.dtype = {t.dtype}, expected {dtype}{suffix}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise _epx.InputError(f"{name}.dtype = {t.dtype}, expected {allowed}{suffix}")
    if device is not None and t.device != device:
        raise _epx.InputError(f"{name}.device = {t.device}, expected {device}{suffix}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(
            want is None or got == want for got, want in zip(t.shape, shape)
        )
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise _epx.InputError(f"{name}.shape = {list(t.shape)}, expected {want}{suffix}")
    if not t.is_contiguous():
        raise _epx.InputError(
            f"{name}.stride() = {list(t.stride())}, expected a contiguous (row-major) tensor"
            f"{suffix}; call .contiguous() first"
        )


def cuda_device(index: int):
    return torch().device("cuda", index)


def current_stream(device) -> int:
    """torch's current stream on `device`, as the integer the extension takes."""
    return torch().cuda.current_stream(device).cuda_stream


def from_dlpack(array, fp8: bool = False):
    """A tensor over an extension array; fp8 arrives as uint8 and is viewed as float8_e4m3fn.

    `array` is what the extension returns for a view: a DLPack capsule (nanobind 3) or an object
    with ``__dlpack__`` (nanobind 2). Both go to torch.from_dlpack as they are, once (a capsule
    is consumed by it); nothing else is called on them."""
    T = torch()
    t = T.from_dlpack(array)
    return t.view(T.float8_e4m3fn) if fp8 else t
