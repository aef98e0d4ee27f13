"""dispatch and combine as torch custom ops, for torch.compile and CUDA graphs.

``torch.ops.epx.dispatch(handle, x, topk_ids, topk_weights, x_scales) -> list[Tensor]`` returns
dispatch's views in DispatchOutput's field order (the fields this object's config has);
``torch.ops.epx.combine(handle, expert_out, dispatched, out) -> None`` writes y into `out`.
`handle` is ``All2All.handle``, an int the graph holds as a constant. epx.All2All calls these
ops itself when it is being compiled, so user code calls ``a2a.dispatch`` / ``a2a.combine``
either way.

combine takes the dispatch outputs (`dispatched`) as an input it does not read: it orders
combine after dispatch and after every use of the received rows, and keeps the compiled graph
from recycling epx's memory for its own temporaries before the round's combine. It declares
`out` as mutated, so the compiler never drops or reorders a combine (every rank must run it).

The fake implementations check the tensors as eager calls do (InputError at trace time) and
describe the outputs from the object's config; they never read the object's runtime state (the
last eager dispatch): combine's fake checks `out` against the config, its real implementation
against the dispatch that ran before it.
"""


from typing import List, Optional

from ._torch import torch
from .all2all import from_handle

_registered = False


def register() -> None:
    """Defines the ops (once per process). Called by epx.All2All on first use under torch."""
    global _registered
    if _registered:
        return
    t = torch()
    Tensor = t.Tensor

    @t.library.custom_op("epx::dispatch", mutates_args=())
    def dispatch(
        handle: int,
        x: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        x_scales: Optional[Tensor],
    ) -> List[Tensor]:
        a2a = from_handle(handle)
        out = a2a._dispatch_eager(x, topk_ids, topk_weights, x_scales)
        return a2a.dispatch_outputs_list(out)

    @dispatch.register_fake
    def _(handle, x, topk_ids, topk_weights, x_scales):
        a2a = from_handle(handle)
        a2a.check_dispatch_inputs(x, topk_ids, topk_weights, x_scales)
        return a2a.empty_outputs(x.device)

    @t.library.custom_op("epx::combine", mutates_args=("out",))
    def combine(handle: int, expert_out: Tensor, dispatched: List[Tensor], out: Tensor) -> None:
        from_handle(handle)._combine_eager(expert_out, out)

    @combine.register_fake
    def _(handle, expert_out, dispatched, out):
        # Config-only checks: while tracing, the object's last eager dispatch says nothing about
        # the traced one (the real implementation checks out's rows against it).
        from_handle(handle).check_combine_inputs(expert_out, out, None)
        return None

    _registered = True
