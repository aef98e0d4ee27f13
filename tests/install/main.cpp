// Links the MoE layer from an installed epx (its dependencies come from epxConfig.cmake: CUDA's
// runtime and cuBLASLt) and validates a shape; constructs nothing, so no GPU is needed.

#include <cstdio>

#include "epx/moe.hpp"

int main() {
  const epx::MoeShape shape = epx::MoeShape::deepseek_r1();
  shape.validate();
  const epx::MoeShape& (epx::MoeLayer::*layer_shape)() const = &epx::MoeLayer::shape;
  std::printf("epx::epx_moe linked (%d), DeepSeek-R1 hidden %d\n", layer_shape != nullptr,
              shape.hidden);
  return 0;
}
