// CHECK_CUDA(call) for the standalone design probes: a failed CUDA runtime call prints where and
// why to stderr and exits with status 1.
#pragma once

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(call)                                                                  \
  do {                                                                                    \
    cudaError_t err_ = (call);                                                            \
    if (err_ != cudaSuccess) {                                                            \
      fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));       \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)
