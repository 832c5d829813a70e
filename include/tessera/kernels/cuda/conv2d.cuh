// 2-D convolution on the GPU through cuDNN: the Cuda overloads of kernels/cpu/conv2d.hpp's
// conv2d_forward / conv2d_backward / conv2d_bias_backward (same arguments; the CPU blocking and
// workspace arguments are unused here, cuDNN brings its own).
//
// Plans. Per device, data type, batch size and geometry, a plan holds the cuDNN descriptors and
// the three algorithms (forward, backward data, backward filter), chosen once from cuDNN's
// heuristics (cudnnGet*Algorithm_v7: the first that succeeds within kMaxWorkspaceBytes) and
// cached for the process, like PyTorch with cudnn.benchmark off. Math is CUDNN_FMA_MATH under
// MathPrecision::Float32 (no TF32 tensor-core rounding: results match the CPU to float precision),
// CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION (16-bit tensor-core products) under Float16/BFloat16.
//
// Workspace. One buffer per device, grown to the largest size any plan asked for and reused by
// every convolution: all of them run on the device's one stream, so they never overlap.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>

#include "tessera/kernels/conv2d_geometry.hpp"
#include "tessera/kernels/cuda/launch.cuh"
#include "tessera/kernels/cuda/reduce.cuh"

namespace tessera {

namespace cuda_detail {

inline constexpr std::size_t kMaxWorkspaceBytes = std::size_t{1} << 30;

template <class S>
constexpr cudnnDataType_t cudnn_data_type() {
  static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>, "cuDNN convolution: float or double");
  return std::is_same_v<S, float> ? CUDNN_DATA_FLOAT : CUDNN_DATA_DOUBLE;
}

struct ConvPlan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr, bias = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  cudnnConvolutionFwdAlgo_t forward{};
  cudnnConvolutionBwdDataAlgo_t backward_data{};
  cudnnConvolutionBwdFilterAlgo_t backward_filter{};
  std::size_t workspace_bytes = 0;  // the largest of the three algorithms' needs
};

// The first heuristic choice that runs, within the workspace cap, without tensor-core math;
// deterministic algorithms first (some backward ones sum with atomics, in a varying order), so
// a seed reproduces a run when cuDNN offers a deterministic one.
template <class Perf>
const Perf& pick_algorithm(const Perf* perf, int count, const char* what, const Conv2dGeometry& g, bool tensor_ops) {
  for (bool need_deterministic : {true, false})
    for (int i = 0; i < count; ++i)
      if (perf[i].status == CUDNN_STATUS_SUCCESS && perf[i].memory <= kMaxWorkspaceBytes &&
          (tensor_ops || perf[i].mathType == CUDNN_FMA_MATH || perf[i].mathType == CUDNN_DEFAULT_MATH) &&
          (!need_deterministic || perf[i].determinism == CUDNN_DETERMINISTIC))
        return perf[i];
  throw CudaError(detail::cat("cuDNN has no ", what, " algorithm for a convolution of ", g.channels, "x", g.height, "x",
                              g.width, " to ", g.out_channels, " channels with kernel ", g.kernel_h, "x", g.kernel_w,
                              " within ", kMaxWorkspaceBytes >> 20, " MiB of workspace"));
}

template <class S>
ConvPlan& conv_plan(const Conv2dGeometry& g, std::int64_t batch) {
  using Key = std::array<std::int64_t, 17>;
  // Reduced precision applies to float data only; double always computes in double.
  const bool tensor_ops = std::is_same_v<S, float> && Cuda::math_precision() != MathPrecision::Float32;
  const Key key{Cuda::current_device(), static_cast<std::int64_t>(sizeof(S)), batch, g.channels, g.height, g.width,
                g.out_channels, g.groups, g.kernel_h, g.kernel_w, g.stride_h, g.stride_w, g.pad_h, g.pad_w,
                g.dilation_h, g.dilation_w, tensor_ops};
  static std::mutex mutex;
  static std::map<Key, std::unique_ptr<ConvPlan>> plans;  // kept for the process, like the handles
  std::lock_guard lock(mutex);
  auto& slot = plans[key];
  if (slot) return *slot;
  auto plan = std::make_unique<ConvPlan>();
  const auto i = [](std::int64_t v) { return static_cast<int>(v); };
  constexpr cudnnDataType_t type = cudnn_data_type<S>();
  TESSERA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan->x));
  TESSERA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan->y));
  TESSERA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan->bias));
  TESSERA_CUDNN_CHECK(cudnnCreateFilterDescriptor(&plan->w));
  TESSERA_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&plan->conv));
  TESSERA_CUDNN_CHECK(
      cudnnSetTensor4dDescriptor(plan->x, CUDNN_TENSOR_NCHW, type, i(batch), i(g.channels), i(g.height), i(g.width)));
  TESSERA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->y, CUDNN_TENSOR_NCHW, type, i(batch), i(g.out_channels),
                                                 i(g.out_height), i(g.out_width)));
  TESSERA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->bias, CUDNN_TENSOR_NCHW, type, 1, i(g.out_channels), 1, 1));
  TESSERA_CUDNN_CHECK(cudnnSetFilter4dDescriptor(plan->w, type, CUDNN_TENSOR_NCHW, i(g.out_channels),
                                                 i(g.channels / g.groups), i(g.kernel_h), i(g.kernel_w)));
  TESSERA_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(plan->conv, i(g.pad_h), i(g.pad_w), i(g.stride_h), i(g.stride_w),
                                                      i(g.dilation_h), i(g.dilation_w), CUDNN_CROSS_CORRELATION, type));
  TESSERA_CUDNN_CHECK(cudnnSetConvolutionGroupCount(plan->conv, i(g.groups)));
  TESSERA_CUDNN_CHECK(
      cudnnSetConvolutionMathType(plan->conv, tensor_ops ? CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION : CUDNN_FMA_MATH));

  cudnnHandle_t handle = Cuda::cudnn();
  int returned = 0;
  std::array<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT> forward{};
  TESSERA_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(handle, plan->x, plan->w, plan->conv, plan->y,
                                                             i(forward.size()), &returned, forward.data()));
  const auto& f = pick_algorithm(forward.data(), returned, "forward", g, tensor_ops);
  std::array<cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT> data{};
  TESSERA_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, plan->w, plan->y, plan->conv, plan->x,
                                                                  i(data.size()), &returned, data.data()));
  const auto& d = pick_algorithm(data.data(), returned, "backward-data", g, tensor_ops);
  std::array<cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT> filter{};
  TESSERA_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, plan->x, plan->y, plan->conv, plan->w,
                                                                    i(filter.size()), &returned, filter.data()));
  const auto& w = pick_algorithm(filter.data(), returned, "backward-filter", g, tensor_ops);
  plan->forward = f.algo;
  plan->backward_data = d.algo;
  plan->backward_filter = w.algo;
  plan->workspace_bytes = std::max({f.memory, d.memory, w.memory});
  slot = std::move(plan);
  return *slot;
}

// The device's shared convolution workspace, at least `bytes` long.
inline void* conv_workspace(std::size_t bytes) {
  struct Buffer {
    void* p = nullptr;
    std::size_t bytes = 0;
  };
  static std::mutex mutex;
  static std::array<Buffer, Cuda::kMaxDevices> buffers{};
  std::lock_guard lock(mutex);
  Buffer& b = buffers[static_cast<std::size_t>(Cuda::current_device())];
  if (b.bytes < bytes) {
    Cuda::deallocate(b.p, b.bytes);  // stream-ordered: earlier users are done before later ones run
    b.p = Cuda::allocate(bytes);
    b.bytes = bytes;
  }
  return b.p;
}

// db (K) += sum over n and the plane of dy (N, K, plane): one block per channel.
template <class S>
__global__ void conv_bias_backward_kernel(std::int64_t batch, std::int64_t channels, std::int64_t plane, const S* dy,
                                          S* db) {
  __shared__ S scratch[32];
  const std::int64_t ch = blockIdx.x;
  S sum = 0;
  for (std::int64_t k = threadIdx.x; k < batch * plane; k += blockDim.x)
    sum += dy[((k / plane) * channels + ch) * plane + k % plane];
  sum = block_reduce<false>(sum, scratch);
  if (threadIdx.x == 0) db[ch] += sum;
}

}  // namespace cuda_detail

template <class S>
void conv2d_forward(Cuda, const Conv2dGeometry& g, const Conv2dBlocking& /*cpu_blocking*/, std::int64_t batch,
                    const S* x, const S* w, const S* bias, S* y, S* /*cpu_workspace*/) {
  if (batch == 0) return;
  auto& plan = cuda_detail::conv_plan<S>(g, batch);
  void* workspace = cuda_detail::conv_workspace(plan.workspace_bytes);
  const S one = 1, zero = 0;
  TESSERA_CUDNN_CHECK(cudnnConvolutionForward(Cuda::cudnn(), &one, plan.x, x, plan.w, w, plan.conv, plan.forward,
                                              workspace, plan.workspace_bytes, &zero, plan.y, y));
  if (bias != nullptr) TESSERA_CUDNN_CHECK(cudnnAddTensor(Cuda::cudnn(), &one, plan.bias, bias, &one, plan.y, y));
}

template <class S>
void conv2d_bias_backward(Cuda, std::int64_t batch, std::int64_t channels, std::int64_t plane, const S* dy, S* db) {
  if (channels == 0) return;
  cuda_detail::conv_bias_backward_kernel<S><<<static_cast<unsigned>(channels), cuda_detail::kThreads, 0,
                                              Cuda::stream()>>>(batch, channels, plane, dy, db);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

// dw += dL/dw (beta = 1: gradients accumulate, as on the CPU); dx = dL/dx unless dx is null.
template <class S>
void conv2d_backward(Cuda, const Conv2dGeometry& g, const Conv2dBlocking& /*cpu_blocking*/, std::int64_t batch,
                     const S* x, const S* w, const S* dy, S* dw, S* dx, S* /*cpu_workspace*/) {
  if (batch == 0) return;
  auto& plan = cuda_detail::conv_plan<S>(g, batch);
  void* workspace = cuda_detail::conv_workspace(plan.workspace_bytes);
  const S one = 1, zero = 0;
  TESSERA_CUDNN_CHECK(cudnnConvolutionBackwardFilter(Cuda::cudnn(), &one, plan.x, x, plan.y, dy, plan.conv,
                                                     plan.backward_filter, workspace, plan.workspace_bytes, &one, plan.w,
                                                     dw));
  if (dx != nullptr)
    TESSERA_CUDNN_CHECK(cudnnConvolutionBackwardData(Cuda::cudnn(), &one, plan.w, w, plan.y, dy, plan.conv,
                                                     plan.backward_data, workspace, plan.workspace_bytes, &zero, plan.x,
                                                     dx));
}

}  // namespace tessera
