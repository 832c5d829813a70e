// Loss kernels on the CPU: squared error. Cross-entropy and NLL are log-softmax and the NLL
// kernels of kernels/cpu/softmax.hpp, as in PyTorch.
#pragma once

#include <cmath>
#include <cstdint>

#include "tessera/device/cpu.hpp"
#include "tessera/kernels/cpu/compiled.hpp"

namespace tessera {

// diff = y - t; returns sum_i diff_i^2 (accumulated in double).
template <class S>
double squared_error_forward(Cpu, const S* y, const S* t, std::int64_t n, S* diff) {
  return detail::parallel_sum<double>(n, n >= (1 << 15), [&](std::int64_t begin, std::int64_t end) {
    double total = 0;
#pragma omp simd reduction(+ : total)
    for (std::int64_t i = begin; i < end; ++i) {
      diff[i] = y[i] - t[i];
      total += static_cast<double>(diff[i]) * static_cast<double>(diff[i]);
    }
    return total;
  });
}

// Compiled once in compiled-kernels mode (kernels/cpu/compiled.hpp).
#define TESSERA_CPU_LOSS_INSTANCES(PREFIX, S) \
  PREFIX template double squared_error_forward<S>(Cpu, const S*, const S*, std::int64_t, S*);
TESSERA_CPU_KERNEL_INSTANCES(TESSERA_CPU_LOSS_INSTANCES)

}  // namespace tessera
