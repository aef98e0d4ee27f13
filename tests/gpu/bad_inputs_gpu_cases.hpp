#pragma once
// The GPU half of the bad-input catalogue (docs/reliability.md, "Bad inputs"): what a caller
// can get wrong that only an All2All or a world on a GPU can see — pointers, token counts at
// call time, expert ids on the device, the call order, launch shapes against the SM budget.
// tests/gpu/test_bad_inputs_gpu.cpp runs every entry (each id has one scenario there, and an id
// without one fails); tests/cpu/test_bad_inputs.cpp counts them and writes them into the doc.
// No CUDA here, so that the CPU test can read the list.

#include <string>
#include <vector>

#include "epx/error.hpp"

namespace epx::bad_inputs {

struct GpuCase {
  const char* id;
  const char* input;               // what the scenario passes, in words
  ErrorCode code;                  // the error it must raise
  std::vector<std::string> words;  // the message must contain each (argument, value, bound)
};

// Scenarios run on one GPU with EpConfig{hidden 2048, 16 experts, topk 4, 8 tokens per rank,
// bf16, timeout 300 ms} unless the input says otherwise.
inline const std::vector<GpuCase>& gpu_cases() {
  static const std::vector<GpuCase> kCases = {
      {"gpu.dispatch.num_tokens_above_max",
       "dispatch with num_tokens = 9 (max_tokens_per_rank 8)",
       ErrorCode::kInput,
       {"num_tokens = 9", "0..max_tokens_per_rank = 8"}},
      {"gpu.dispatch.num_tokens_negative",
       "dispatch with num_tokens = -1",
       ErrorCode::kInput,
       {"num_tokens = -1", "0..max_tokens_per_rank = 8"}},
      {"gpu.dispatch.null_x",
       "dispatch of 2 tokens with x = nullptr",
       ErrorCode::kInput,
       {"x = nullptr", "a device pointer"}},
      {"gpu.dispatch.null_topk_ids",
       "dispatch of 2 tokens with topk_ids = nullptr",
       ErrorCode::kInput,
       {"topk_ids = nullptr", "a device pointer"}},
      {"gpu.dispatch.null_topk_weights",
       "dispatch of 2 tokens with topk_weights = nullptr",
       ErrorCode::kInput,
       {"topk_weights = nullptr", "a device pointer"}},
      {"gpu.dispatch.null_x_scales_fp8",
       "dtype fp8: dispatch of 2 tokens with x_scales = nullptr",
       ErrorCode::kInput,
       {"x_scales = nullptr", "a device pointer"}},
      {"gpu.dispatch.misaligned_x",
       "x = a device allocation + 2 bytes",
       ErrorCode::kInput,
       {"x = 0x", "16-byte alignment"}},
      {"gpu.dispatch.misaligned_ids_int64",
       "topk_ids int64 at a device allocation + 4 bytes",
       ErrorCode::kInput,
       {"topk_ids = 0x", "8-byte alignment"}},
      {"gpu.dispatch.host_x",
       "x in pageable host memory (std::vector)",
       ErrorCode::kInput,
       {"x = 0x", "expected device memory on GPU 0", "unregistered host"}},
      {"gpu.dispatch.pinned_host_weights",
       "topk_weights in pinned host memory (cudaMallocHost)",
       ErrorCode::kInput,
       {"topk_weights = 0x", "expected device memory on GPU 0", "pinned host"}},
      {"gpu.dispatch.expert_id_out_of_range",
       "2 ranks; rank 1's topk_ids[2][1] = 16 (E = 16)",
       ErrorCode::kInput,
       {"topk_ids[2][1] = 16", "[0, 16)", "the token was not sent"}},
      {"gpu.dispatch.expert_id_below_minus_one",
       "topk_ids[0][3] = -2",
       ErrorCode::kInput,
       {"topk_ids[0][3] = -2", "expected -1 or an expert id in [0, 16)"}},
      {"gpu.dispatch.repeated_expert",
       "token 1 lists expert 4 in slots 0 and 2",
       ErrorCode::kInput,
       {"topk_ids[1][2] = 4 repeats the expert of slot 0"}},
      {"gpu.dispatch.after_device_error",
       "dispatch again after a recorded bad expert id",
       ErrorCode::kState,
       {"refuses further calls", "recreate it", "topk_ids[0][3] = -2"}},
      {"gpu.combine.before_dispatch",
       "combine on a fresh All2All, no dispatch before it",
       ErrorCode::kState,
       {"combine", "dispatch"}},
      {"gpu.combine.null_y",
       "combine after a dispatch of 2 tokens with y = nullptr",
       ErrorCode::kInput,
       {"y = nullptr", "a device pointer"}},
      {"gpu.combine.null_expert_out",
       "combine with expert_out = nullptr",
       ErrorCode::kInput,
       {"expert_out = nullptr", "a device pointer"}},
      {"gpu.combine.misaligned_expert_out",
       "combine with expert_out = combine_buffer() + 2 bytes",
       ErrorCode::kInput,
       {"expert_out = 0x", "16-byte alignment"}},
      {"gpu.combine.pinned_host_expert_out_ht",
       "high_throughput, 2 ranks: rank 0's combine with expert_out in pinned host memory",
       ErrorCode::kInput,
       {"expert_out = 0x", "expected device memory on GPU 0", "pinned host"}},
      {"gpu.launch.dispatch_blocks_over_budget",
       "8 ranks on one GPU, dispatch.num_blocks = sm_budget + 1",
       ErrorCode::kConfig,
       {"dispatch.num_blocks (rank 0) = ", "the SM budget of one rank when 8 ranks share the GPU"}},
      {"gpu.launch.combine_blocks_over_budget",
       "8 ranks on one GPU, combine.num_blocks = sm_budget + 1",
       ErrorCode::kConfig,
       {"combine.num_blocks (rank 0) = ", "the SM budget of one rank"}},
      {"gpu.launch.warps_above_32",
       "combine.warps_per_block = 33",
       ErrorCode::kConfig,
       {"combine.warps_per_block = 33", "1..32"}},
      {"gpu.group.invalid_config",
       "make_all2all_group with hidden = 1000 (bf16-to-fp8)",
       ErrorCode::kConfig,
       {"hidden = 1000", "kFp8BlockSize = 128"}},
      {"gpu.group.baseline_expert_major",
       "backend naive with layout expert",
       ErrorCode::kConfig,
       {"layout = expert", "no expert-major output"}},
      {"gpu.world.device_out_of_range",
       "InProcessWorld(2, {99})",
       ErrorCode::kInput,
       {"device = 99", "(visible GPUs)"}},
      {"gpu.world.ranks_above_64",
       "InProcessWorld(65)",
       ErrorCode::kInput,
       {"num_ranks = 65", "1..64"}},
      {"gpu.world.ranks_above_hardware_queues",
       "CUDA_DEVICE_MAX_CONNECTIONS=2, InProcessWorld(3)",
       ErrorCode::kConfig,
       {"3 ranks on GPU 0", "CUDA_DEVICE_MAX_CONNECTIONS = 2"}},
  };
  return kCases;
}

}  // namespace epx::bad_inputs
