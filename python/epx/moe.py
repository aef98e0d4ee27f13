"""MoeLayer over the caller's torch tensors (include/epx/moe.hpp): router -> dispatch -> fp8
SwiGLU experts (cuBLASLt block-scaled GEMMs) -> combine -> + shared expert, on one rank.

The weights are read in place (never copied): fp8 e4m3 (torch.float8_e4m3fn) matrices with one
float32 scale per 128x128 block (a DeepSeek-V3/R1 checkpoint's ``weight`` / ``weight_scale_inv``),
the router ``gate.weight`` [E, H] bf16, its ``e_score_correction_bias`` [E] float32 (sigmoid-
grouped scoring only), and an optional shared expert. The layer keeps references to every tensor
it was given, so they live as long as it does.

The router runs inside the layer: forward() takes the hidden states and computes the routing
itself from the router weights (it can hand the routing back). Eager forwards synchronise the
stream once per chunk (to size the expert GEMMs); under ``torch.cuda.graph`` capture nothing
synchronises and the graph replays with whatever the captured input tensor then holds (copy new
inputs into it). In-process ranks on one GPU need CUDA_MODULE_LOADING=EAGER and one host thread
per rank for eager forwards (see moe.hpp).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

from . import _epx
from . import _torch as T

MoeShape = getattr(_epx, "MoeShape", None)


class ExpertWeights(NamedTuple):
    """One SwiGLU expert: out = down(silu(gate(x)) * up(x)). Each entry is
    (weight, scale_inv): weight [rows, cols] float8_e4m3fn, scale_inv [rows/128, cols/128] float32.
    gate, up: [I, H]; down: [H, I]."""

    gate: Tuple[object, object]
    up: Tuple[object, object]
    down: Tuple[object, object]


def _check_matrix(name: str, pair, rows: int, cols: int, device) -> Tuple[int, int]:
    torch = T.torch()
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise _epx.InputError(f"{name} = {type(pair).__name__}, expected (weight, scale_inv)")
    w, s = pair
    T.check(f"{name}.weight", w, dtype=T.fp8_dtype(), shape=(rows, cols), device=device)
    T.check(f"{name}.scale_inv", s, dtype=torch.float32, shape=(rows // 128, cols // 128),
            device=device, what="one scale per 128x128 block")
    return w.data_ptr(), s.data_ptr()


def _expert_pointers(name: str, e: ExpertWeights, hidden: int, inter: int, device):
    if not isinstance(e, ExpertWeights):
        e = ExpertWeights(*e)
    g = _check_matrix(f"{name}.gate", e.gate, inter, hidden, device)
    u = _check_matrix(f"{name}.up", e.up, inter, hidden, device)
    d = _check_matrix(f"{name}.down", e.down, hidden, inter, device)
    return (g[0], g[1], u[0], u[1], d[0], d[1])


class MoeLayer:
    """One rank's MoE layer: ``MoeLayer(shape, a2a, router, experts, correction_bias, shared)``.

    shape: epx.MoeShape (hidden, intermediate and shared_intermediate multiples of 512).
    a2a: this rank's epx.All2All (its config must agree with `shape`; ConfigError names the
    first mismatch). experts: the E / world_size local experts, ExpertWeights each (global
    expert rank * E/W + i). gemm_sms: multiprocessors the GEMMs may count on (ranks sharing a GPU
    pass their world's sm_budget; 0 = the whole GPU).
    """

    def __init__(
        self,
        shape,
        a2a,
        router,
        experts: Sequence[ExpertWeights],
        correction_bias=None,
        shared: Optional[ExpertWeights] = None,
        gemm_sms: int = 0,
    ):
        torch = T.torch()
        if MoeShape is None:
            raise _epx.UnsupportedError("this epx was built without CUDA: no MoeLayer")
        dev = a2a.device
        T.check("router", router, dtype=torch.bfloat16, shape=(shape.num_experts, shape.hidden),
                device=dev, what="gate.weight")
        bias_ptr = 0
        if correction_bias is not None:
            T.check("correction_bias", correction_bias, dtype=torch.float32,
                    shape=(shape.num_experts,), device=dev, what="e_score_correction_bias")
            bias_ptr = correction_bias.data_ptr()
        experts = list(experts)
        ptrs = [
            _expert_pointers(f"experts[{i}]", e, shape.hidden, shape.intermediate, dev)
            for i, e in enumerate(experts)
        ]
        shared_ptrs = (0, 0, 0, 0, 0, 0)
        if shared is not None:
            shared_ptrs = _expert_pointers("shared", shared, shape.hidden,
                                           shape.shared_intermediate, dev)
        # The layer reads these on every forward and replay: they live as long as it does.
        self._keep = (router, correction_bias, experts, shared)
        self.shape = shape
        self.a2a = a2a
        self._impl = _epx.MoeLayer(shape, router.data_ptr(), bias_ptr, ptrs, shared_ptrs,
                                   a2a.ep_config, gemm_sms)

    @classmethod
    def from_stacked(cls, shape, a2a, router, w13, w13_scale_inv, w2, w2_scale_inv,
                     correction_bias=None, shared: Optional[ExpertWeights] = None,
                     gemm_sms: int = 0) -> "MoeLayer":
        """From an engine's stacked tensors: w13 [E/W, 2I, H] (gate rows [0, I), up rows
        [I, 2I)), w13_scale_inv [E/W, 2I/128, H/128], w2 [E/W, H, I], w2_scale_inv
        [E/W, H/128, I/128]."""
        I = shape.intermediate
        n = a2a.config.num_local_experts
        for name, t, want in (
            ("w13", w13, (n, 2 * I, shape.hidden)),
            ("w13_scale_inv", w13_scale_inv, (n, 2 * I // 128, shape.hidden // 128)),
            ("w2", w2, (n, shape.hidden, I)),
            ("w2_scale_inv", w2_scale_inv, (n, shape.hidden // 128, I // 128)),
        ):
            T.check(name, t, shape=want, device=a2a.device)
        experts = [
            ExpertWeights(
                gate=(w13[e, :I], w13_scale_inv[e, : I // 128]),
                up=(w13[e, I:], w13_scale_inv[e, I // 128 :]),
                down=(w2[e], w2_scale_inv[e]),
            )
            for e in range(n)
        ]
        return cls(shape, a2a, router, experts, correction_bias, shared, gemm_sms)

    def forward(self, hidden_states, num_chunks: int = 0, return_routing: bool = False):
        """y [N, H] bf16 = MoE(hidden_states [N, H] bf16), on torch.cuda.current_stream().

        N may exceed max_tokens_per_rank (chunks of it); every rank must run the same number of
        chunks (num_chunks = 0: ceil(N / max_tokens_per_rank), else the maximum over ranks).
        return_routing: also (topk_ids [N, K] int32, topk_weights [N, K] float32).
        """
        torch = T.torch()
        s = self.shape
        T.check("hidden_states", hidden_states, dtype=torch.bfloat16, shape=(None, s.hidden),
                device=self.a2a.device)
        n = hidden_states.shape[0]
        y = torch.empty_like(hidden_states)
        ids = weights = None
        if return_routing:
            ids = torch.empty((n, s.topk), dtype=torch.int32, device=hidden_states.device)
            weights = torch.empty((n, s.topk), dtype=torch.float32, device=hidden_states.device)
        self._impl.forward(
            hidden_states.data_ptr(), n, y.data_ptr(), self.a2a._impl,
            T.current_stream(self.a2a.device), num_chunks,
            0 if ids is None else ids.data_ptr(), 0 if weights is None else weights.data_ptr(),
        )
        return (y, ids, weights) if return_routing else y

    __call__ = forward

    def set_capture_token_bound(self, max_tokens_per_rank: int = 0) -> None:
        """Bound on every rank's chunk for graphs captured from now on (moe.hpp); call it (0 is
        fine) before capturing a token-major forward."""
        self._impl.set_capture_token_bound(max_tokens_per_rank)

    def set_capture_experts(self, mode: str) -> None:
        """'switch' (default: conditional nodes, the eager GEMMs) or 'all_rows'."""
        self._impl.set_capture_experts(mode)
