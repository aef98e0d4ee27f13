"""epx.vllm inside vLLM's own fused-MoE modular kernel, on the CPU: vLLM's FusedMoEKernel runs
epx's prepare/finalize and vLLM's experts (NaiveBatchedExperts in the BatchedExperts format, a
torch Standard experts class in the Standard format) on 1 and 2 ranks run as threads, each
All2All a torch model of epx's dispatch/combine contract (test_cpu_deep_ep_fake_core's), and the
outputs must match a dense torch MoE over the full weights at vLLM's tolerance
(vllm_kernel_case.py). Also vLLM's own maybe_make_prepare_finalize through the plugin.

Needs torch and vLLM's Python tree (a machine where vLLM imports, or a bundle of
tools/vllm/bundle.sh named by EPX_VLLM_BUNDLE); skipped, with the reason shown, elsewhere.
"""

import os
import sys
import threading
import traceback
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

if os.environ.get("EPX_VLLM_BUNDLE"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "vllm"))
    import bundle_env

    bundle_env.activate()

try:
    import vllm.model_executor.layers.fused_moe.modular_kernel  # noqa: F401
except ImportError as e:
    pytest.skip(f"vLLM's fused-MoE kernel does not import ({e!r}; a vLLM bundle is named by "
                "EPX_VLLM_BUNDLE)", allow_module_level=True)

import epx  # noqa: E402
import epx.vllm  # noqa: E402
import test_cpu_deep_ep_fake_core as fake  # noqa: E402
import vllm_kernel_case as case  # noqa: E402

CPU = torch.device("cpu")
SHAPE = case.Shape()


@pytest.fixture(autouse=True)
def no_accelerator(monkeypatch):
    """vLLM's batched experts ask torch.accelerator whether a CUDA graph is being captured,
    which raises where no accelerator exists: on the CPU nothing is ever captured."""
    if not torch.accelerator.is_available():
        from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe

        monkeypatch.setattr(fused_batched_moe, "_is_capturing_or_compiling",
                            lambda: torch.compiler.is_compiling())


def on_ranks(world, body):
    """Runs body(rank, fake_world) on `world` threads; raises with every failing rank's trace.
    vLLM's workspace manager is one per process: each rank (thread) gets a lane of its own."""
    from vllm.v1.worker import workspace

    workspace.init_workspace_manager(CPU, num_lanes=world)
    fabric = fake.Fabric(world)
    outcome = {}

    def main(rank):
        try:
            with workspace.use_workspace_lane(rank):
                body(rank, fake.FakeWorld(fabric, rank))
            outcome[rank] = "ok"
        except BaseException:
            outcome[rank] = traceback.format_exc()
            fabric.abort()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = {r: o for r, o in outcome.items() if o != "ok"}
    assert not failed and len(outcome) == world, "\n".join(
        f"rank {r}:\n{o}" for r, o in sorted(failed.items()))


class FakeManager(epx.vllm._ManagerMethods):
    """EpxAll2AllManager over the fake transport (get_handle makes fake All2Alls)."""

    def __init__(self, world):
        self.world, self.handles = world, {}

    def get_handle(self, kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in self.handles:
            fields = dict(kwargs)
            fields.pop("backend", None)
            self.handles[key] = fake.FakeAll2All(epx.EpConfig(**fields), self.world)
        return self.handles[key]


# Token counts per step, for each world size: a step above max_tokens (16) is split in chunks.
TOKENS = {1: [[5], [16], [37]], 2: [[5, 11], [0, 9], [16, 16], [37, 3]]}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("experts", ["naive_batched", "torch_standard"])
@pytest.mark.parametrize("fused_output", ["combine_buffer", "vllms"])
def test_vllm_kernel_with_epx(monkeypatch, world, dtype, experts, fused_output):
    """fused_output 'vllms': the experts write vLLM's own buffer (epx offers none), which is the
    layer's output itself where the shapes agree (one rank, Standard rows = tokens)."""
    if fused_output == "vllms":
        monkeypatch.setattr(epx.vllm._PrepareFinalizeMethods, "allocate_fused_expert_output",
                            lambda self, *args: None)
    weights = case.Weights(SHAPE, dtype, CPU)

    def body(rank, fw):
        cfg = case.ep_config(SHAPE, experts, dtype)
        a2a = fake.FakeAll2All(cfg, fw)
        moe = case.moe_config(SHAPE, world, rank, experts, CPU)
        qc = weights.quant_config(world, rank)
        pf = epx.vllm.EpxPrepareAndFinalize(a2a, moe, qc)  # vLLM's base takes no arguments
        kernel = case.make_kernel(pf, moe, qc, experts)
        case.run_rank(kernel, weights, SHAPE, world, rank, TOKENS[world], seed=1, device=CPU)

    on_ranks(world, body)


@pytest.mark.parametrize("experts", ["naive_batched", "torch_standard"])
def test_vllm_picks_epx_through_the_plugin(monkeypatch, experts):
    """vLLM's own maybe_make_prepare_finalize, patched by register(), returns epx's object in
    the layout of the format vLLM chose for the experts (batched_triton backend ->
    BatchedExperts -> 'expert'; the default -> Standard -> 'token'), and the kernel built on it
    computes the MoE; a layer without all2all kernels (one DP rank) keeps vLLM's own."""
    import vllm.model_executor.layers.fused_moe.all2all_utils as au

    monkeypatch.setenv("EPX_VLLM", "1")
    monkeypatch.delenv("EPX_VLLM_LAYOUT", raising=False)
    monkeypatch.setattr(au, "maybe_make_prepare_finalize", au.maybe_make_prepare_finalize)
    epx.vllm.register()
    assert au.maybe_make_prepare_finalize._epx_wrapper
    world, dtype = 2, "bf16"
    weights = case.Weights(SHAPE, dtype, CPU)

    def body(rank, fw):
        moe = case.moe_config(SHAPE, world, rank, experts, CPU)
        assert moe.moe_parallel_config.use_all2all_kernels
        qc = weights.quant_config(world, rank)
        pf = au.maybe_make_prepare_finalize(moe=moe, quant_config=qc, routing_tables=None,
                                            allow_new_interface=True, use_monolithic=False,
                                            all2all_manager=FakeManager(fw))
        assert type(pf).__name__ == "EpxPrepareAndFinalize", type(pf)
        assert pf.a2a.config.layout == case.layout_of(experts)
        kernel = case.make_kernel(pf, moe, qc, experts)
        case.run_rank(kernel, weights, SHAPE, world, rank, TOKENS[world][:2], seed=2,
                      device=CPU)

    on_ranks(world, body)

    solo = case.moe_config(SHAPE, 1, 0, experts, CPU)
    assert not solo.moe_parallel_config.use_all2all_kernels
    pf = au.maybe_make_prepare_finalize(moe=solo, quant_config=weights.quant_config(1, 0),
                                        allow_new_interface=True)
    assert pf is not None and type(pf).__name__ != "EpxPrepareAndFinalize"


def test_vllm_make_moe_kernel_takes_epx(monkeypatch):
    """Where vLLM has make_moe_kernel (the oracles' common step, 0.34), it builds the kernel on
    epx's prepare/finalize and passes its format check, in both formats."""
    base = pytest.importorskip("vllm.model_executor.layers.fused_moe.oracle.base")
    if not hasattr(base, "make_moe_kernel"):
        pytest.skip(f"vLLM {case.vllm_version()} has no oracle.base.make_moe_kernel")
    monkeypatch.setenv("EPX_VLLM", "1")
    monkeypatch.setattr(base, "maybe_make_prepare_finalize", base.maybe_make_prepare_finalize)
    import vllm.model_executor.layers.fused_moe.all2all_utils as au

    monkeypatch.setattr(au, "maybe_make_prepare_finalize", au.maybe_make_prepare_finalize)
    epx.vllm.register()
    world = 2
    weights = case.Weights(SHAPE, "bf16", CPU)

    def body(rank, fw):
        epx_manager = FakeManager(fw)
        for experts in ("naive_batched", "torch_standard"):
            moe = case.moe_config(SHAPE, world, rank, experts, CPU)
            kernel = base.make_moe_kernel(
                moe_quant_config=weights.quant_config(world, rank), moe_config=moe,
                experts_cls=case.experts_class(experts),
                prepare_finalize_kwargs={"all2all_manager": epx_manager})
            assert type(kernel.prepare_finalize).__name__ == "EpxPrepareAndFinalize"
            case.run_rank(kernel, weights, SHAPE, world, rank, [[7, 4]], seed=3, device=CPU)

    on_ranks(world, body)


def test_layout_must_follow_vllms_format(monkeypatch):
    moe = case.moe_config(SHAPE, 2, 0, "torch_standard", CPU)
    assert epx.vllm._layout_for(moe) == "token"
    monkeypatch.setenv("EPX_VLLM_LAYOUT", "expert")
    with pytest.raises(epx.ConfigError, match="EPX_VLLM_LAYOUT = 'expert', expected 'token'"):
        epx.vllm._layout_for(moe)


def test_bundle_stand_in_operators():
    """The torch stand-ins of vLLM's _C operators that a bundle defines where vLLM's extension
    is absent (tools/vllm/_epx_vllm_ops.py), against torch and ref.quantize."""
    import ref

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "vllm"))
    import _epx_vllm_ops as ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2 * 256, generator=g).to(torch.bfloat16)
    out = torch.full((3, 5, 256), 7.0, dtype=torch.bfloat16)
    counts = torch.tensor([5, 0, 2], dtype=torch.int32)
    ops._masked_moe_activation(out, x, counts, "silu", 0.0, 1.0, 0.0, 1.0, -1.0)
    want = (torch.nn.functional.silu(x[..., :256].float()) * x[..., 256:].float()).bfloat16()
    assert torch.equal(out[0], want[0]) and torch.equal(out[2, :2], want[2, :2])
    assert (out[1] == 7).all() and (out[2, 2:] == 7).all()
    flat = torch.empty(3, 5, 256, dtype=torch.bfloat16)
    ops._and_mul("silu")(flat, x)
    assert torch.equal(flat, want)
    a = (torch.randn(6, 384, generator=g) * 3).to(torch.bfloat16)
    q = torch.empty(6, 384, dtype=torch.float8_e4m3fn)
    s = torch.empty(3, 6).t()  # column-major scales, as vLLM allocates them
    ops._per_token_group_fp8_quant(a, q, s, 128, 1e-10, -448.0, 448.0, False, True, False)
    torch.testing.assert_close(ref.dequantize(q, s), ref.dequantize(*ref.quantize(a)),
                               rtol=0.07, atol=1e-2)
