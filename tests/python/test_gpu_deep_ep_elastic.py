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
