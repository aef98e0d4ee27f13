"""epx.deep_ep.Buffer in shrink mode (enable_shrink=True, DeepEP's rank masking) on three
processes sharing one GPU: rank 2 stops calling after the first round and rank 1 after the
second, each staying alive (it only waits in destroy()), while the others go on. What is checked,
against a torch reference written here: the received rows are exactly those of the ranks still
calling (counts, src_info, layout_range, bytes), combine sums only the experts of those ranks,
low_latency_query_mask_buffer names exactly the stopped ranks after each call,
clean_low_latency_buffer masks a rank that stopped, and the mask updates epx can and cannot do.

The ranks line up on a host barrier before each dispatch and combine, and load their torch
kernels before the first (the waits' timeout is short: a rank late for another reason must not
be taken for a stopped one). Each process makes every rank's inputs from the same seeds, so it
knows what it must receive without asking its peers."""

import os
import traceback

import pytest

import epx
import ref
from spawned import run_ranks

WORLD = 3
H, E, K, T = 512, 12, 4, 16
L = E // WORLD
CAP = WORLD * T
G = H // 128
TIMEOUT_MS = "500"

# (use_fp8, round_scale); 'pow2' is DeepEP's round_scale (fp8 on the wire, its own shape).
MODES = {"bf16": (False, False), "fp8": (True, False), "pow2": (True, True)}


def make_inputs(q, n, seed, device):
    """Rank q's tokens: x bf16 [n, H], topk_idx int64 [n, K] (distinct experts, some -1),
    topk_weights f32 [n, K]."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed * 100 + q)
    x = (torch.randn(n, H, generator=g) * 3).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    ids = torch.where(torch.rand(n, K, generator=g) < 0.15, torch.full_like(ids, -1), ids)
    w = torch.rand(n, K, generator=g).float() + 0.25
    return x.to(device), ids.to(torch.int64).to(device), w.to(device)


def pow2_cast(x):
    """x bf16 [n, H] -> (fp8 [n, H], scales f32 [n, G]) with scale s = 2^ceil(log2(t)),
    t = amax * f32(1 / 448) (DeepEP's rounding of the ratio), computed with frexp."""
    import torch

    n = x.shape[0]
    blocks = x.float().view(n, G, 128)
    amax = blocks.abs().amax(dim=2).clamp_min(1e-4)
    t = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32, device=x.device)
    mant, exp = torch.frexp(t)  # t = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    scales = torch.ldexp(torch.ones_like(amax), exp.float())
    q = (blocks / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(n, H)
    return q, scales


def travelled(mode, x):
    """What the expert sees of tokens x, as f32 values."""
    if mode == "bf16":
        return x.float()
    q, s = ref.quantize(x) if mode == "fp8" else pow2_cast(x)
    return ref.dequantize(q, s)


def received_values(mode, recv_x):
    """recv_x as dispatch returned it -> f32 [L, CAP, H]."""
    if mode == "bf16":
        return recv_x.float()
    q, s = recv_x
    return (q.float().view(L, CAP, G, 128) * s.reshape(L, CAP, G, 1)).view(L, CAP, H)


def expert_stage(rank, values):
    """out[e] = x * (1 + (e % 7) / 8) for the global expert e, as bf16."""
    import torch

    e = torch.arange(rank * L, (rank + 1) * L, device=values.device)
    return (values * (1.0 + (e % 7).float() / 8.0).view(L, 1, 1)).to(torch.bfloat16)


def combined_reference(mode, x, ids, w, live):
    """y[n] = sum over k whose expert lives on a rank of `live` of w_k * f_{e_k}(x_n), in f32."""
    import torch

    il = ids.long()
    on_live = torch.zeros_like(il, dtype=torch.bool)
    for q in live:
        on_live |= (il >= q * L) & (il < (q + 1) * L)
    coef = torch.where(on_live, w * (1.0 + (il.clamp(min=0) % 7).float() / 8.0),
                       torch.zeros_like(w))
    return travelled(mode, x) * coef.sum(dim=1, keepdim=True)


def check_dispatch(mode, rank, inputs, live, result, stats):
    """Counts, handle and rows of one dispatch: exactly the tokens of the ranks in `live`, each
    expert's rows ordered by (source rank, source index)."""
    import torch

    recv_x, recv_count, handle, _, _ = result
    src_info, layout_range = handle[0], handle[1]
    assert (src_info.shape, layout_range.shape) == ((L, CAP), (L, WORLD))
    counts = recv_count.tolist()
    assert stats.tolist() == counts
    for e in range(L):
        ge = rank * L + e
        want = [(q, n) for q in sorted(live)
                for n in (inputs[q][1] == ge).any(dim=1).nonzero().flatten().tolist()]
        assert counts[e] == len(want), f"{mode}: expert {ge}: {counts[e]} rows, expected " \
                                       f"{len(want)} (live ranks {sorted(live)})"
        begin_want = 0
        for q in range(WORLD):
            begin, count = layout_range[e, q].item() >> 32, layout_range[e, q].item() & 0xFFFFFFFF
            mine = [n for (qq, n) in want if qq == q]
            assert count == len(mine), f"{mode}: expert {ge}, rank {q}: {count} != {len(mine)}"
            if count == 0:
                continue
            assert begin == begin_want, f"{mode}: expert {ge}, rank {q}: begins at {begin}"
            begin_want += count
            rows = slice(begin, begin + count)
            assert src_info[e, rows].tolist() == mine, f"{mode}: expert {ge}, rank {q}"
            x_src = inputs[q][0][torch.tensor(mine, device=src_info.device)]
            if mode == "bf16":
                assert torch.equal(recv_x[e, rows], x_src), f"bf16 rows of expert {ge}"
                continue
            q_want, s_want = ref.quantize(x_src) if mode == "fp8" else pow2_cast(x_src)
            assert torch.equal(recv_x[0][e, rows].view(torch.uint8),
                               q_want.view(torch.uint8)), f"{mode} bytes of expert {ge}"
            assert torch.equal(recv_x[1][e, rows], s_want), f"{mode} scales of expert {ge}"


def run_shrink_scenario(buffer, rank, dev, align):
    """Every check of this file, on one rank (every rank runs it at once). align(live) returns
    once every rank of `live` has called it. Events and torch.cuda calls only on a CUDA device
    (the fake-core test runs this on the CPU)."""
    import torch

    cuda = dev.type == "cuda"
    every = set(range(WORLD))
    for use_fp8, round_scale in MODES.values():  # made while every rank is here
        buffer.prepare_low_latency_shape(T, H, E, K, use_fp8=use_fp8, round_scale=round_scale)
    status = torch.zeros(WORLD, dtype=torch.int32, device=dev)

    def masked():
        status.fill_(7)
        buffer.low_latency_query_mask_buffer(status)
        assert set(status.tolist()) <= {0, 1}, status.tolist()
        return set(status.nonzero().flatten().tolist())

    def round_trip(mode, seed, live, *, weights_at_dispatch=False, zero_copy=False, hook=False):
        align(live)
        inputs = [make_inputs(q, (T, 5, T)[q], seed, dev) for q in range(WORLD)]
        x, ids, w = inputs[rank]
        use_fp8, round_scale = MODES[mode]
        stats = torch.zeros(L, dtype=torch.int32, device=dev)
        extra = {"topk_weights": w} if weights_at_dispatch else {}
        asynchronous = cuda and not hook
        result = buffer.low_latency_dispatch(
            x, ids, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
            round_scale=round_scale, async_finish=asynchronous, return_recv_hook=hook, **extra)
        recv_x, _, handle, event, h = result
        if hook:
            h()
        elif asynchronous:
            event.current_stream_wait()
        check_dispatch(mode, rank, inputs, live, result, stats)
        expert_out = expert_stage(rank, received_values(mode, recv_x))
        if zero_copy:
            buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = expert_out
        align(live)  # the checks above take each rank its own time
        y, event, h = buffer.low_latency_combine(expert_out, ids, w, handle, zero_copy=zero_copy,
                                                 async_finish=asynchronous, return_recv_hook=hook)
        if hook:
            h()
        elif asynchronous:
            event.current_stream_wait()
        torch.testing.assert_close(y.float(), combined_reference(mode, x, ids, w, live),
                                   rtol=3e-2, atol=3e-2)
        assert masked() == every - live, f"{mode} seed {seed}: masked {masked()}, live {live}"

    # Everyone: nothing is masked.
    round_trip("fp8", 1, every)
    align(every)
    buffer.clean_low_latency_buffer(T, H, E)
    assert masked() == set()
    if rank == 2:
        return  # stops calling

    # Ranks 0 and 1: each epx object that waits for rank 2 masks it once its timeout passes.
    live = {0, 1}
    round_trip("fp8", 2, live)
    round_trip("bf16", 3, live, weights_at_dispatch=True, zero_copy=True, hook=True)
    align(live)
    buffer.clean_low_latency_buffer(T, H, E)
    assert masked() == {2}
    # Not every object has waited for rank 2 yet (the other fp8 one has not): epx cannot mask
    # it on request. Unmasking the only masked rank is clearing every mask.
    with pytest.raises(NotImplementedError, match="never on request"):
        buffer.low_latency_update_mask_buffer(2, True)
    buffer.low_latency_update_mask_buffer(2, False)
    assert masked() == set()
    round_trip("fp8", 4, live)  # masked again, after one more timeout
    if rank == 1:
        return  # stops calling

    # Rank 0 alone.
    live = {0}
    round_trip("pow2", 5, live)
    with pytest.raises(NotImplementedError, match=r"while ranks \[1\] stay masked"):
        buffer.low_latency_update_mask_buffer(2, False)
    with pytest.raises(NotImplementedError, match="not every epx object has masked"):
        buffer.low_latency_update_mask_buffer(1, True)  # clean's barrier has not yet
    buffer.clean_low_latency_buffer(T, H, E)
    assert masked() == {1, 2}
    round_trip("fp8", 6, live)
    round_trip("bf16", 7, live, zero_copy=True)
    round_trip("fp8", 8, live, hook=True)
    round_trip("bf16", 9, live)  # the other object of each shape that rank 0 alone has not used
    round_trip("pow2", 10, live, hook=True)
    # Every object has masked both now: masking either again, or unmasking rank 0 (never
    # masked), changes nothing.
    buffer.low_latency_update_mask_buffer(1, True)
    buffer.low_latency_update_mask_buffer(2, True)
    buffer.low_latency_update_mask_buffer(0, False)
    assert masked() == {1, 2}
    for bad in (WORLD, -1):
        with pytest.raises(epx.InputError, match=f"rank_to_mask = {bad}"):
            buffer.low_latency_update_mask_buffer(bad, True)
    with pytest.raises(epx.InputError, match="mask_status.dtype"):
        buffer.low_latency_query_mask_buffer(status.float())
    with pytest.raises(epx.InputError, match="mask_status.numel"):
        buffer.low_latency_query_mask_buffer(torch.zeros(WORLD + 1, dtype=torch.int32,
                                                         device=dev))
    # A shape first dispatched now cannot be made (collective over ranks that are gone).
    x, ids, _ = make_inputs(0, T, 9, dev)
    with pytest.raises(epx.StateError, match=r"while ranks \[1, 2\] are masked"):
        buffer.low_latency_dispatch(x, ids, 2 * T, E, use_fp8=False)
    buffer.low_latency_clean_mask_buffer()
    assert masked() == set()
    round_trip("bf16", 10, live)  # masked again, after one more timeout


def _load_torch_kernels(dev):
    """Runs the torch operations of the scenario and of the Buffer's own torch work once, so
    that no kernel module loads between a rank's calls while its peers wait (the first launch of
    a kernel loads its module, and waits for the kernels already running)."""
    import torch

    x, ids, w = make_inputs(0, T, 0, dev)
    for mode in MODES:
        values = travelled(mode, x)
        combined_reference(mode, x, ids, w, {0, 1})
    expert_stage(0, values.view(1, T, H).expand(L, T, H).reshape(L, T, H).contiguous())
    rows = torch.arange(CAP, device=dev, dtype=torch.int32)
    key = torch.where(rows.unsqueeze(0) < rows[:L].unsqueeze(1), rows.long().unsqueeze(0),
                      torch.full((L, CAP), CAP, dtype=torch.int64, device=dev))
    order = key.argsort(dim=1)
    for dtype in (torch.bfloat16, torch.uint8, torch.int32, torch.float32):
        t = torch.zeros((L * CAP, 8), dtype=dtype, device=dev)
        torch.index_select(t, 0, order.view(-1), out=torch.empty_like(t))
        torch.gather(t.view(L, CAP, 8).transpose(1, 2), 2,
                     order.unsqueeze(1).expand(L, 8, CAP), out=torch.empty(L, 8, CAP, dtype=dtype,
                                                                          device=dev))
    table = torch.zeros((CAP + 1, K), dtype=torch.float32, device=dev)
    table.index_copy_(0, order[0], torch.ones((CAP, K), device=dev))
    table[order, order % K]
    w.masked_fill(ids < 0, 0.0)
    torch.mul(x, w[:, :1], out=torch.empty_like(x))
    torch.zeros(L, dtype=torch.int32, device=dev).add_(rows[:L])
    torch.cuda.synchronize()


def _rank_main(rank, init_file, results):
    import torch
    import torch.distributed as dist

    import epx.deep_ep as deep_ep

    try:
        os.environ["EPX_TIMEOUT_MS"] = TIMEOUT_MS
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=WORLD)
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        group = dist.new_group(list(range(WORLD)))
        aligners = {frozenset(range(WORLD)): group, frozenset({0, 1}): dist.new_group([0, 1])}

        def align(live):
            g = aligners.get(frozenset(live))
            if g is not None:
                torch.cuda.synchronize()
                dist.barrier(group=g)

        _load_torch_kernels(dev)
        buffer = deep_ep.Buffer(group, low_latency_mode=True, num_qps_per_rank=L,
                                explicitly_destroy=True, enable_shrink=True)
        run_shrink_scenario(buffer, rank, dev, align)
        buffer.destroy()  # collective: the stopped ranks wait here for the others
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_deep_ep_shrink_three_processes_one_gpu(gpu, tmp_path):
    run_ranks(_rank_main, WORLD, str(tmp_path / "init"), timeout_s=600)
