#pragma once
#include <cstdint>

namespace epx {
// Storage of a grid barrier (see sync_device.cuh); plain data so host code can size it.
struct GridBarrierWord {
  int32_t count;
  int32_t generation;
};
}  // namespace epx
