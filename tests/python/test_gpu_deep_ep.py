"""epx.deep_ep.Buffer on two processes sharing one GPU through a gloo group: what DeepEP's
low-latency API promises (shapes, dtypes, scale layouts, counts, the handle's src_info and
layout_range, the received bytes, combine's weighted sum), checked against a torch reference of
that contract written here; weights at combine and at dispatch, zero-copy, hooks, events, two
rounds in flight, and the refusals.

Each process makes every rank's inputs from the same seeds, so it knows what it must receive
without asking its peer."""

import epx
import ref
from spawned import in_gloo_group, run_ranks

WORLD = 2
H, E, K, T = 1024, 8, 4, 32
L = E // WORLD
CAP = WORLD * T
G = H // 128

# (use_fp8, round_scale, use_ue8m0)
MODES = {
    "bf16": (False, False, False),
    "fp8": (True, False, False),
    "pow2": (True, True, False),
    "ue8m0": (True, True, True),
}


def make_inputs(q, n, seed, device):
    """Rank q's tokens: x bf16 [n, H], topk_idx int64 [n, K] (distinct, about 10% -1),
    topk_weights f32 [n, K]."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed * 1000 + q)
    x = (torch.randn(n, H, generator=g) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else \
        torch.empty(0, K, dtype=torch.int64)
    drop = torch.rand(n, K, generator=g) < 0.1
    ids = torch.where(drop, torch.full_like(ids, -1), ids).to(torch.int64)
    w = torch.rand(n, K, generator=g).float() + 0.1
    return x.to(device), ids.to(device), w.to(device)


def pow2_reference(x):
    """DeepEP's power-of-two cast, computed another way (frexp and ldexp instead of bits):
    (fp8 [n, H], scale_inv f32 [n, G], biased exponent [n, G])."""
    import torch

    n = x.shape[0]
    blocks = x.float().view(n, G, 128)
    amax = blocks.abs().amax(dim=2).clamp_min(1e-4)
    t = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32, device=x.device)
    m, e = torch.frexp(t)
    ceil_log2 = torch.where(m == 0.5, e - 1, e)
    q = torch.ldexp(blocks, -ceil_log2.unsqueeze(-1).float()).to(torch.float8_e4m3fn)
    scale_inv = torch.ldexp(torch.ones_like(t), ceil_log2.float())
    return q.view(n, H), scale_inv, (ceil_log2 + 127)


def travelled(mode, x):
    """What the expert sees of tokens x, as f32 values."""
    if mode == "bf16":
        return x.float()
    if mode == "fp8":
        q, s = ref.quantize(x)
        return ref.dequantize(q, s)
    q, s, _ = pow2_reference(x)
    return ref.dequantize(q, s)


def received_values(mode, recv_x):
    """recv_x (as dispatch returned it) -> f32 [L, CAP, H]."""
    import torch

    if mode == "bf16":
        return recv_x.float()
    q, s = recv_x
    if s.dtype == torch.int32:  # UE8M0: exponent bytes, group 4p + i in byte i of word p
        s = (s.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    return (q.float().view(L, CAP, G, 128) * s.reshape(L, CAP, G, 1)).view(L, CAP, H)


def expert_stage(rank, values):
    """out[e] = f_e(x) = x * (1 + (e % 7) / 8) for the global expert e, as bf16."""
    import torch

    e = torch.arange(rank * L, (rank + 1) * L, device=values.device)
    coef = (1.0 + (e % 7).float() / 8.0).view(L, 1, 1)
    return (values * coef).to(torch.bfloat16)


def combined_reference(mode, x, ids, w):
    """y[n] = sum over k with ids >= 0 of w_k * f_{ids_k}(travelled x_n), in f32."""
    import torch

    il = ids.long()
    coef = torch.where(il >= 0, w * (1.0 + (il.clamp(min=0) % 7).float() / 8.0),
                       torch.zeros_like(w))
    return travelled(mode, x) * coef.sum(dim=1, keepdim=True)


def logfmt_combined_reference(mode, x, ids, w):
    """combine's result with use_logfmt and the weights given at combine, from the tokens: each
    expert row is scaled by its weight in bf16 at the expert's rank (epx.deep_ep's
    combine-time weights), the rank's partial p_q[n] = sum over k ascending with e_k on q of
    bf16(w_k * bf16(f_{e_k}(travelled x_n))) crosses as a LogFMT row of bf16(p_q)
    (ref.logfmt_round_trip), and y = bf16(sum over q ascending)."""
    import torch

    v = travelled(mode, x)
    il = ids.long()
    y = torch.zeros_like(v)
    for q in range(WORLD):
        p = torch.zeros_like(v)
        for k in range(il.shape[1]):
            e = il[:, k]
            coef = 1.0 + (e.clamp(min=0) % 7).float() / 8.0
            rows = (v * coef.unsqueeze(1)).to(torch.bfloat16).float()
            weighted = (w[:, k:k + 1] * rows).to(torch.bfloat16).float()
            mine = ((e >= 0) & (e // L == q)).unsqueeze(1)
            p = p + torch.where(mine, weighted, torch.zeros_like(rows))
        y = y + ref.logfmt_round_trip(p.to(torch.bfloat16))
    return y.to(torch.bfloat16)


def check_dispatch(mode, rank, inputs, result, stats=None):
    """Shapes, dtypes, strides, counts, handle and received rows of one dispatch."""
    import torch

    recv_x, recv_count, handle, event, hook = result
    use_fp8, round_scale, use_ue8m0 = MODES[mode]
    if use_fp8:
        q, s = recv_x
        assert (q.shape, q.dtype) == ((L, CAP, H), torch.float8_e4m3fn)
        if use_ue8m0:
            assert (s.shape, s.dtype) == ((L, CAP, H // 512), torch.int32), (s.shape, s.dtype)
            assert s.stride() == (H // 512 * CAP, 1, CAP), s.stride()
        else:
            assert (s.shape, s.dtype) == ((L, CAP, G), torch.float32), (s.shape, s.dtype)
            assert s.stride() == (G * CAP, 1, CAP), s.stride()
    else:
        assert (recv_x.shape, recv_x.dtype) == ((L, CAP, H), torch.bfloat16)
    assert (recv_count.shape, recv_count.dtype) == ((L,), torch.int32)
    assert isinstance(handle, tuple) and len(handle) == 5
    src_info, layout_range = handle[0], handle[1]
    assert tuple(handle[2:]) == (T, H, E), handle[2:]
    assert (src_info.shape, src_info.dtype) == ((L, CAP), torch.int32)
    assert (layout_range.shape, layout_range.dtype) == ((L, WORLD), torch.int64)
    assert src_info.is_contiguous() and layout_range.is_contiguous()

    counts = recv_count.tolist()
    for e in range(L):
        ge = rank * L + e
        # Rows of expert e: (source rank, source index) of every token that chose it.
        want = [(q_, n) for q_, (_, ids, _) in enumerate(inputs)
                for n in (ids == ge).any(dim=1).nonzero().flatten().tolist()]
        assert counts[e] == len(want), f"{mode}: expert {ge}: {counts[e]} rows, expected " \
                                       f"{len(want)}"
        ranges = layout_range[e].tolist()
        total = 0
        for q_ in range(WORLD):
            begin, count = ranges[q_] >> 32, ranges[q_] & 0xFFFFFFFF
            mine = [n for (qq, n) in want if qq == q_]
            assert count == len(mine), f"{mode}: expert {ge}, rank {q_}: {count} != {len(mine)}"
            total += count
            if count == 0:
                continue
            rows = slice(begin, begin + count)
            got_idx = src_info[e, rows].tolist()
            assert sorted(got_idx) == mine, f"{mode}: expert {ge}, rank {q_}: {got_idx}"
            x_src = inputs[q_][0][torch.tensor(got_idx, device=src_info.device)]
            if mode == "bf16":
                assert torch.equal(recv_x[e, rows], x_src), f"bf16 rows of expert {ge}"
            elif mode == "fp8":
                q_want, s_want = ref.quantize(x_src)
                assert torch.equal(recv_x[0][e, rows].view(torch.uint8),
                                   q_want.view(torch.uint8)), f"fp8 bytes of expert {ge}"
                assert torch.equal(recv_x[1][e, rows], s_want), f"fp8 scales of expert {ge}"
            else:
                q_want, s_want, biased = pow2_reference(x_src)
                assert torch.equal(recv_x[0][e, rows].view(torch.uint8),
                                   q_want.view(torch.uint8)), f"{mode} bytes of expert {ge}"
                if use_ue8m0:
                    got = recv_x[1][e, rows].contiguous().view(torch.uint8)
                    assert torch.equal(got.long(), biased.long()), f"UE8M0 of expert {ge}"
                else:
                    assert torch.equal(recv_x[1][e, rows], s_want), f"{mode} scales of {ge}"
        assert total == counts[e]
    if stats is not None:
        assert stats.tolist() == counts, (stats.tolist(), counts)


def run_scenario(buffer, rank, dev):
    """Every check of this file, on one rank (every rank runs it at once). Events and
    torch.cuda calls only on a CUDA device (the fake-core test runs this on the CPU)."""
    import torch

    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def inputs_for(seed, sizes=(T, 5)):
        return [make_inputs(q, sizes[q], seed, dev) for q in range(WORLD)]

    def round_trip(mode, inputs, *, weights_at_dispatch=False, zero_copy=False, hook=False,
                   use_out=False, combine_ids=None):
        use_fp8, round_scale, use_ue8m0 = MODES[mode]
        x, ids, w = inputs[rank]
        stats = torch.zeros(L, dtype=torch.int32, device=dev)
        extra = {"topk_weights": w} if weights_at_dispatch else {}
        asynchronous = cuda and not hook
        result = buffer.low_latency_dispatch(
            x, ids, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
            round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=asynchronous,
            return_recv_hook=hook, **extra)
        recv_x, recv_count, handle, event, h = result
        if hook:
            assert event.event is None and callable(h)
            h()
        else:
            assert h is None
            if asynchronous:
                event.current_stream_wait()
        check_dispatch(mode, rank, inputs, result, stats)
        expert_out = expert_stage(rank, received_values(mode, recv_x))
        if zero_copy:
            buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = expert_out
        out = torch.empty(x.shape[0], H, dtype=torch.bfloat16, device=dev) if use_out else None
        ids_c = ids if combine_ids is None else combine_ids
        y, event, h = buffer.low_latency_combine(expert_out, ids_c, w, handle,
                                                 zero_copy=zero_copy, async_finish=asynchronous,
                                                 return_recv_hook=hook, out=out)
        if hook:
            h()
        elif asynchronous:
            event.current_stream_wait()
        if use_out:
            assert y is out
        assert (y.shape, y.dtype) == ((x.shape[0], H), torch.bfloat16)
        torch.testing.assert_close(y.float(), combined_reference(mode, x, ids_c, w),
                                   rtol=3e-2, atol=3e-2)
        return handle

    for mode in MODES:
        for seed, sizes in ((1, (T, 5)), (2, (0, 17))):
            inputs = inputs_for(seed, sizes)
            round_trip(mode, inputs)
            round_trip(mode, inputs, weights_at_dispatch=True, zero_copy=True, hook=True)
            round_trip(mode, inputs, zero_copy=True, use_out=True)
    sync()

    # A -1 given at combine drops that expert's part, as DeepEP's combine does.
    inputs = inputs_for(3)
    ids = inputs[rank][1].clone()
    ids[0, (ids[0] >= 0).nonzero()[0]] = -1
    round_trip("bf16", inputs, combine_ids=ids)

    # LogFMT (use_logfmt). Named at dispatch, the round's own objects combine it; named at
    # combine only (DeepEP's API), the round is dispatched again on the shape's LogFMT objects
    # (and the other way round for a bf16 combine of a round dispatched for LogFMT). The sums
    # are the torch model's of the format (up to a level now and then) and not the bf16
    # combine's bits: the partials did cross as LogFMT rows.
    x, ids, w = inputs_for(6)[rank]
    for mode in ("bf16", "fp8"):
        y = {}
        for at_dispatch, at_combine in ((False, False), (True, True), (False, True),
                                        (True, False)):
            recv_x, _, handle, _, _ = buffer.low_latency_dispatch(
                x, ids, T, E, use_fp8=MODES[mode][0], use_logfmt=at_dispatch)
            expert_out = expert_stage(rank, received_values(mode, recv_x))
            y[at_dispatch, at_combine], _, _ = buffer.low_latency_combine(
                expert_out, ids, w, handle, use_logfmt=at_combine)
        sync()
        assert torch.equal(y[True, False], y[False, False]), f"{mode}: bf16 combines differ"
        assert torch.equal(y[False, True], y[True, True]), f"{mode}: LogFMT combines differ"
        assert not torch.equal(y[True, True], y[False, False]), f"{mode}: LogFMT = bf16 bits"
        want = logfmt_combined_reference(mode, x, ids, w)
        same = (y[True, True] == want).float().mean().item()
        assert same > 0.99, f"{mode}: {same:.4f} of the LogFMT sums equal the model's"
        torch.testing.assert_close(y[True, True].float(), want.float(), rtol=5e-2, atol=1e-2)
    try:
        buffer.low_latency_dispatch(x[:, :1000].contiguous(), ids, T, E, use_fp8=False, use_logfmt=True)
        raise AssertionError("use_logfmt with hidden 1000 was not refused")
    except epx.InputError as e:
        assert "multiple of 128 with use_logfmt" in str(e), str(e)

    # Two rounds in flight: dispatch, dispatch, combine, combine.
    a_in, b_in = inputs_for(4), inputs_for(5)
    pending = []
    for inputs in (a_in, b_in):
        x, ids, w = inputs[rank]
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, ids, T, E, use_fp8=True)
        pending.append((inputs, handle, expert_stage(rank, received_values("fp8", recv_x))))
    for inputs, handle, expert_out in pending:
        x, ids, w = inputs[rank]
        y, _, _ = buffer.low_latency_combine(expert_out, ids, w, handle)
        torch.testing.assert_close(y.float(), combined_reference("fp8", x, ids, w),
                                   rtol=3e-2, atol=3e-2)

    # A third dispatch of the shape reuses the first one's epx object: its handle is gone.
    zeros = torch.zeros(L, CAP, H, dtype=torch.bfloat16, device=dev)
    handles = []
    for inputs in (a_in, b_in, a_in):
        x, ids, w = inputs[rank]
        handles.append(buffer.low_latency_dispatch(x, ids, T, E, use_fp8=True)[2])
    x, ids, w = a_in[rank]
    try:
        buffer.low_latency_combine(zeros, ids, w, handles[0])
        raise AssertionError("a combine of a reused round was not refused")
    except NotImplementedError as e:
        assert "earlier round" in str(e), str(e)
    buffer.low_latency_combine(zeros, ids, w, handles[2])

    # Weights given at dispatch, others at combine: refused before anything is launched.
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, ids, T, E, use_fp8=False, topk_weights=w)
    try:
        buffer.low_latency_combine(zeros, ids, w * 2, handle)
        raise AssertionError("other weights at combine were not refused")
    except NotImplementedError as e:
        assert "weights given at combine need core support" in str(e), str(e)
    buffer.low_latency_combine(zeros, ids, w, handle)

    # Bad inputs name the tensor.
    try:
        buffer.low_latency_dispatch(x.float(), ids, T, E)
        raise AssertionError("f32 x was not refused")
    except epx.InputError as e:
        assert "x.dtype" in str(e), str(e)
    try:
        buffer.low_latency_dispatch(x, ids, T, E, use_ue8m0=True)
        raise AssertionError("use_ue8m0 without round_scale was not refused")
    except epx.InputError as e:
        assert "round_scale" in str(e), str(e)
    sync()


def _rank_main(rank, init_file, results):
    def body():
        import torch
        import torch.distributed as dist

        import epx.deep_ep as deep_ep

        dev = torch.device("cuda", 0)
        group = dist.new_group(list(range(WORLD)))
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, WORLD, E)
        buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True,
                                num_qps_per_rank=L, explicitly_destroy=True)
        assert (buffer.rank, buffer.group_size) == (rank, WORLD)
        assert deep_ep.topk_idx_t == torch.int64
        run_scenario(buffer, rank, dev)
        buffer.destroy()

    in_gloo_group(rank, WORLD, init_file, results, body)


def test_deep_ep_buffer_two_processes_one_gpu(gpu, tmp_path):
    run_ranks(_rank_main, WORLD, str(tmp_path / "init"), timeout_s=600)
