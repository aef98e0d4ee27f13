"""DeepEP V2's ElasticBuffer of epx.deep_ep on the GPU: the scenarios of
test_cpu_deep_ep_elastic.py (dispatch with its handle, cached dispatch, no host read, combine in
V2's order with bias and weights, fp8 rows, the refusals, the expand mode's dispatch and its
reduced combines) on real epx objects —
high_throughput over an IpcWorld made from a gloo group, one process per rank, every process on
GPU 0 — instead of the torch model of the core. Each scenario gets a buffer of its own."""

import pytest

from spawned import in_gloo_group, run_ranks

torch = pytest.importorskip("torch")

SCENARIOS = [  # (name, world size, scenario keywords)
    ("scenario_dispatch_and_cached", 2, {"W": 2, "E": 6}),
    ("scenario_dispatch_and_cached", 3, {"W": 3, "E": 9}),
    ("scenario_without_cpu_sync", 2, {}),
    ("scenario_combine", 3, {}),
    ("scenario_fp8", 2, {}),
    ("scenario_refusals", 2, {}),
    ("scenario_expand_dispatch", 3, {}),
    ("scenario_expand_combine", 3, {}),
]


def _rank_main(rank, world, name, kwargs, init_file, results):
    def body():
        import torch.distributed as dist

        import epx.deep_ep as deep_ep
        import test_cpu_deep_ep_elastic as elastic
        import test_cpu_deep_ep_normal as normal

        elastic.DEVICE = normal.DEVICE = torch.device("cuda", 0)
        buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=elastic.T_MAX,
                                       hidden=elastic.H, explicitly_destroy=True)
        getattr(elastic, name)(buffer, rank, **kwargs)
        torch.cuda.synchronize()
        buffer.destroy()

    in_gloo_group(rank, world, init_file, results, body)


@pytest.mark.parametrize("name,world,kwargs", SCENARIOS,
                         ids=[f"{s[0]}-{s[1]}" for s in SCENARIOS])
def test_elastic_buffer_on_the_gpu(gpu, tmp_path, name, world, kwargs):
    run_ranks(_rank_main, world, world, name, kwargs, str(tmp_path / "init"), timeout_s=300)


# DeepEP's profiler-based benchmark (deep_ep.utils.testing.bench_kineto, used by the perf part of
# tests/elastic/test_ep.py) times each stage by a word in the kernels' names, in the profiler's
# table with names cut at 100 characters: each word must be found in exactly one row, or it
# asserts (more than one) or divides by a zero time (none).
STAGES = {
    "dispatch": ("dispatch_impl", "dispatch_copy_epilogue_impl"),
    "combine": ("combine_impl", "combine_reduce_epilogue_impl"),
}


def _profiled_rows(fn, barrier):
    """The profiler's table rows (as bench_kineto prints them) of a few calls of fn()."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            barrier()
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total",
                                     max_name_column_width=100).split("\n")


def _stage_names_main(rank, world, init_file, results):
    def body():
        import torch.distributed as dist

        import epx.deep_ep as deep_ep
        import test_cpu_deep_ep_elastic as elastic

        elastic.DEVICE = torch.device("cuda", 0)
        E = 6
        buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=elastic.T_MAX,
                                       hidden=elastic.H, explicitly_destroy=True)
        x, idx, w = elastic.inputs(rank, E)
        recv_x, _, recv_w, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w,
                                                       num_experts=E)
        expanded = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                   do_expand=True, expert_alignment=4)
        calls = {
            "dispatch": lambda: buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E),
            "cached dispatch": lambda: buffer.dispatch(x, handle=handle, topk_weights=w),
            "expanded dispatch": lambda: buffer.dispatch(x, topk_idx=idx, topk_weights=w,
                                                         num_experts=E, do_expand=True,
                                                         expert_alignment=4),
            "combine": lambda: buffer.combine(recv_x, handle=handle, topk_weights=recv_w),
            "reduced combine": lambda: buffer.combine(expanded[0], handle=expanded[3]),
        }
        for what, fn in calls.items():
            rows = _profiled_rows(fn, buffer.barrier)
            for word in STAGES[what.split()[-1]]:
                found = [r for r in rows if word in r]
                assert len(found) == 1, (what, word, rows)
        torch.cuda.synchronize()
        buffer.destroy()

    in_gloo_group(rank, world, init_file, results, body)


def test_profilers_find_each_stage_by_deep_eps_names(gpu, tmp_path):
    run_ranks(_stage_names_main, 2, 2, str(tmp_path / "init"), timeout_s=300)
