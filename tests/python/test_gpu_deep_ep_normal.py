"""DeepEP's normal mode of epx.deep_ep.Buffer on the GPU: the scenarios of
test_cpu_deep_ep_normal.py (what the mode must do, in our words: dispatch with and without
top-k, cached dispatch, alignment, num_worst_tokens, fp8 rows with strided scales, combine with
top-k weights and bias, the refusals) on real epx objects — high_throughput over an IpcWorld made
from a gloo group, one process per rank, every process on GPU 0 — instead of the torch model of
the core. Each scenario gets a Buffer of its own (its objects are counted)."""

import pytest

from spawned import in_gloo_group, run_ranks

torch = pytest.importorskip("torch")

SCENARIOS = [  # (name, world size, Buffer keywords)
    ("scenario_dispatch_combine_and_cached", 2, {}),
    ("scenario_alignment_and_worst_tokens", 2, {"max_tokens_per_rank": 16}),
    ("scenario_fp8_strided_scales", 2, {}),
    ("scenario_without_topk_and_extras", 3, {}),
    ("scenario_refusals", 2, {"max_tokens_per_rank": 16}),
]


def _rank_main(rank, world, name, kwargs, init_file, results):
    def body():
        import torch.distributed as dist

        import epx.deep_ep as deep_ep
        import test_cpu_deep_ep_normal as normal

        normal.DEVICE = torch.device("cuda", 0)
        scenario = getattr(normal, name)
        buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 30,
                                explicitly_destroy=True, **kwargs)
        if name == "scenario_dispatch_combine_and_cached":
            scenario(buffer, rank, W=world, E=3 * world)
        else:
            scenario(buffer, rank)
        torch.cuda.synchronize()
        buffer.destroy()

    in_gloo_group(rank, world, init_file, results, body)


@pytest.mark.parametrize("name,world,kwargs", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_normal_mode_on_the_gpu(gpu, tmp_path, name, world, kwargs):
    run_ranks(_rank_main, world, world, name, kwargs, str(tmp_path / "init"), timeout_s=300)
