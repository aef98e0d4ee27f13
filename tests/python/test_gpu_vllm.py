"""epx.vllm's prepare/finalize through a stand-in of vLLM's modular kernel: prepare -> a torch
expert -> finalize, on two in-process ranks, against a dense torch reference. Both activation
formats (Standard = token-major, BatchedExperts = expert-major), bf16 and block-scaled fp8."""

import threading
from types import SimpleNamespace

import pytest

import epx
import epx.vllm
import ref

W, E, K, H, N = 2, 16, 4, 1024, 24


@pytest.mark.parametrize("layout", ["token", "expert"])
@pytest.mark.parametrize("dtype", ["bf16", "bf16-to-fp8"])
def test_prepare_expert_finalize(gpu, layout, dtype):
    import torch

    cfg = epx.EpConfig(hidden=H, num_experts=E, topk=K, max_tokens_per_rank=32, dtype=dtype,
                       layout=layout)
    group = epx.make_group(cfg, epx.InProcessWorld(W))
    pfs = [epx.vllm.EpxPrepareAndFinalize(a) for a in group]
    qc = SimpleNamespace(quant_dtype=torch.float8_e4m3fn if dtype != "bf16" else None,
                         block_shape=[128, 128] if dtype != "bf16" else None)
    c = group[0].config
    L = c.num_local_experts
    fmt = pfs[0].activation_format
    assert fmt == ("standard" if layout == "token" else "batched_experts") or \
        fmt.name == ("Standard" if layout == "token" else "BatchedExperts")
    assert pfs[0].max_num_tokens_per_rank() == 32 and pfs[0].num_dispatchers() == W

    def expert(r, prepared):
        a1q, scales, meta, ids, w = prepared
        if layout == "token":
            xv = ref.as_bf16_values(a1q, scales if c.wire_fp8 else None)
            idl = ids.long()
            local = (idl >= r * L) & (idl < (r + 1) * L)
            coef = torch.where(local, 1.0 + (idl % 7).float() / 8.0, torch.zeros_like(w))
            return (xv[:, None, :] * coef[..., None]).to(torch.bfloat16), w, ids  # [cap, K, H]
        return ref.expert_outputs(c, r, a1q, scales), None, None

    def run(group, pfs, inputs):
        streams = [torch.cuda.Stream() for _ in group]
        outs, fused = [], []
        prepared, errors = [None] * len(group), []
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())

        # Each rank's prepare on a thread of its own, as each rank of vLLM calls it: Standard
        # rows are exact, so prepare reads its row count back, which needs every rank's dispatch.
        def prepare(r):
            try:
                x, ids, w, _ = inputs[r]
                with torch.cuda.stream(streams[r]):
                    prepared[r] = pfs[r].prepare(x, w, ids, E, None, False, qc)
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors.append(e)

        threads = [threading.Thread(target=prepare, args=(r,)) for r in range(len(group))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        for r in range(len(group)):
            with torch.cuda.stream(streams[r]):
                fused.append(expert(r, prepared[r]))
        for r in range(len(group)):
            x = inputs[r][0]
            out = torch.empty(x.shape[0], H, dtype=torch.bfloat16, device=gpu)
            fo, tw, ti = fused[r]
            with torch.cuda.stream(streams[r]):
                pfs[r].finalize(out, fo, tw, ti, False, None)
            outs.append(out)
        torch.cuda.synchronize()
        return prepared, outs

    # prepare's and finalize's torch kernels load in a world of one rank first: loaded while
    # in-process peers spin on each other, a kernel would wait for them.
    (solo,) = epx.make_group(cfg.replace(world_size=1), epx.InProcessWorld(1))
    run([solo], [epx.vllm.EpxPrepareAndFinalize(solo)],
        [ref.make_inputs(cfg, 0, 8, 0, gpu, ids_dtype=torch.int64)])
    for seed in range(3):
        inputs = [ref.make_inputs(cfg, r, N - 7 * r, seed, gpu, ids_dtype=torch.int64)
                  for r in range(W)]
        prepared, outs = run(group, pfs, inputs)
        for r in range(W):
            x, ids, w, _ = inputs[r]
            meta = prepared[r][2]
            assert meta.expert_num_tokens.is_cuda
            # Standard rows are exact (the count was read back): the host copy comes with them.
            if layout == "token":
                assert torch.equal(meta.expert_num_tokens_cpu, meta.expert_num_tokens.cpu())
            else:
                assert meta.expert_num_tokens_cpu is None
            want = ref.combined(cfg, x, ids, w, None)
            torch.testing.assert_close(outs[r].float(), want, rtol=3e-2, atol=3e-2)


def test_quant_config_must_match(gpu):
    import torch

    cfg = epx.EpConfig(hidden=H, num_experts=E, topk=K, max_tokens_per_rank=32, dtype="bf16")
    (a,) = epx.make_group(cfg.replace(world_size=1), epx.InProcessWorld(1))
    pf = epx.vllm.EpxPrepareAndFinalize(a)
    x, ids, w, _ = ref.make_inputs(a.config, 0, 4, 0, gpu)
    fp8 = SimpleNamespace(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])
    with pytest.raises(epx.ConfigError, match="quant_dtype"):
        pf.prepare(x, w, ids, E, None, False, fp8)
    with pytest.raises(epx.ConfigError, match="num_experts = 8"):
        pf.prepare(x, w, ids, 8, None, False, None)
