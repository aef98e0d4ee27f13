"""epx.MoeLayer over torch tensors (one rank, every expert local) against a torch reference of
the layer: the layer's own routing, fp8 block-scaled weights dequantised, SwiGLU, the shared
expert. Eager and captured forwards."""

import pytest

import epx

H, I, E, K = 1024, 512, 8, 2


def _fp8_weight(torch, rows, cols, gen, dev):
    w = (torch.randn(rows, cols, generator=gen) * 0.05)
    blocks = w.view(rows // 128, 128, cols // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-6)
    scale = amax / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rows, cols)
    return q.to(dev), scale.float().contiguous().to(dev)


def _dequant(torch, pair):
    q, s = pair
    rows, cols = q.shape
    return (q.float().view(rows // 128, 128, cols // 128, 128) *
            s[:, None, :, None]).view(rows, cols)


def _swiglu(torch, x, e):
    g = x @ _dequant(torch, e.gate).t()
    u = x @ _dequant(torch, e.up).t()
    return (torch.nn.functional.silu(g) * u) @ _dequant(torch, e.down).t()


def _layer(gpu, shared=True):
    import torch

    gen = torch.Generator().manual_seed(0)
    shape = epx.MoeShape(hidden=H, intermediate=I, num_experts=E, topk=K, num_groups=1,
                         topk_groups=1, scoring="softmax",
                         shared_intermediate=I if shared else 0)
    cfg = epx.EpConfig(hidden=H, num_experts=E, topk=K, max_tokens_per_rank=64,
                       dtype="bf16-to-fp8", world_size=1)
    (a,) = epx.make_group(cfg, epx.InProcessWorld(1))
    router = (torch.randn(E, H, generator=gen) * 0.05).to(torch.bfloat16).to(gpu)
    experts = [epx.ExpertWeights(gate=_fp8_weight(torch, I, H, gen, gpu),
                                 up=_fp8_weight(torch, I, H, gen, gpu),
                                 down=_fp8_weight(torch, H, I, gen, gpu)) for _ in range(E)]
    sh = None
    if shared:
        sh = epx.ExpertWeights(gate=_fp8_weight(torch, I, H, gen, gpu),
                               up=_fp8_weight(torch, I, H, gen, gpu),
                               down=_fp8_weight(torch, H, I, gen, gpu))
    layer = epx.MoeLayer(shape, a, router, experts, shared=sh)
    return layer, experts, sh, router


def _reference(torch, x, ids, weights, experts, shared):
    xf = x.float()
    y = torch.zeros_like(xf)
    for k in range(ids.shape[1]):
        for e in range(len(experts)):
            rows = (ids[:, k] == e).nonzero().flatten()
            if rows.numel():
                y[rows] += weights[rows, k, None] * _swiglu(torch, xf[rows], experts[e])
    if shared is not None:
        y += _swiglu(torch, xf, shared)
    return y


def _rel_err(torch, got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def test_moe_layer_eager_and_captured(gpu):
    import torch

    layer, experts, shared, router = _layer(gpu)
    gen = torch.Generator().manual_seed(1)
    for n in (0, 5, 64, 150):  # 150: three chunks of max_tokens_per_rank
        x = torch.randn(n, H, generator=gen).to(torch.bfloat16).to(gpu)
        y, ids, w = layer.forward(x, return_routing=True)
        torch.cuda.synchronize()
        assert y.shape == (n, H) and ids.shape == (n, K)
        if n == 0:
            continue
        logits = x.float() @ router.float().t()
        p = torch.softmax(logits, dim=1)
        torch.testing.assert_close(w, p.gather(1, ids.long()) /
                                   p.gather(1, ids.long()).sum(1, keepdim=True),
                                   rtol=2e-2, atol=2e-3)
        # fp8 activations inside the layer: within a few percent of the f32 reference.
        assert _rel_err(torch, y, _reference(torch, x, ids.long(), w, experts, shared)) < 6e-2

    # Captured: replays follow what the captured input holds.
    layer.set_capture_token_bound(0)
    x = torch.randn(32, H, generator=gen).to(torch.bfloat16).to(gpu)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = layer.forward(x)
    for it in range(3):
        x.copy_(torch.randn(32, H, generator=gen).to(torch.bfloat16))
        g.replay()
        ye, ids, w = layer.forward(x, return_routing=True)
        torch.cuda.synchronize()
        torch.testing.assert_close(yg, ye, rtol=1e-2, atol=1e-2)


def test_moe_layer_refuses_bad_weights(gpu):
    import torch

    layer, experts, shared, router = _layer(gpu, shared=False)
    a = layer.a2a
    with pytest.raises(epx.InputError, match="experts\\[1\\].up.weight.dtype"):
        bad = list(experts)
        bad[1] = bad[1]._replace(up=(bad[1].up[0].float(), bad[1].up[1]))
        epx.MoeLayer(layer.shape, a, router, bad)
    with pytest.raises(epx.InputError, match="router.shape"):
        epx.MoeLayer(layer.shape, a, router[:4], experts)
    with pytest.raises(epx.InputError, match="hidden_states.dtype"):
        layer.forward(torch.zeros(4, H, device=gpu))
