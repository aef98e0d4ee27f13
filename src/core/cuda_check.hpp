#pragma once
// The library's CUDA check: the public EPX_CUDA_CHECK (epx/cuda_check.hpp).

#include "epx/cuda_check.hpp"
