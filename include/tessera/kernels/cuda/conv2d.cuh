// 2-D convolution on the GPU through cuDNN: the Cuda overloads of kernels/cpu/conv2d.hpp's
// conv2d_forward / conv2d_backward / conv2d_bias_backward (same arguments; the CPU blocking and
// workspace arguments are unused here, cuDNN brings its own).
//
// Plans. Per device, data type, batch size and geometry, a plan holds the cuDNN descriptors and
// the three algorithms (forward, backward data, backward filter), chosen once and cached for the
// process. By default from cuDNN's heuristics (cudnnGet*Algorithm_v7: the first deterministic one
// that runs within kMaxWorkspaceBytes), like PyTorch with cudnn.benchmark off; under
// Cuda::set_cudnn_benchmark(true) (or TESSERA_CUDNN_BENCHMARK=1) from timing them
// (cudnnFind*Algorithm, which allocates its own scratch with cudaMalloc, once per shape): the
// fastest that fits, deterministic or not, like PyTorch with cudnn.benchmark on. cuDNN runs an algorithm in the math
// type of the convolution descriptor it is given, so each direction has its own descriptor set to
// the chosen entry's math type, and its workspace is asked for with that descriptor (the
// heuristic's perf.memory may be for another math type).
//
// Math. CUDNN_FMA_MATH under MathPrecision::Float32 and BFloat16 (no TF32 rounding: results match
// the CPU to float precision); under TensorFloat32, tensor-core entries too, with
// CUDNN_TENSOR_OP_MATH (fp32 data, TF32 products: PyTorch's default cudnn.allow_tf32); under
// Float16, with CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION (fp32 data rounded to fp16). BFloat16
// stays in fp32 here because the legacy API's conversion is to fp16 only, whose range (65504)
// activations and scaled gradients can exceed; BFloat16 changes only cuBLAS's products.
//
// Workspace. One buffer per device, grown to the largest size any plan asked for and reused by
// every convolution: all of them run on the device's one stream, so they never overlap.
#pragma once

#include <array>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>

#include "tessera/kernels/conv2d_geometry.hpp"
#include "tessera/kernels/cuda/batch_norm.cuh"
#include "tessera/kernels/cuda/elementwise.cuh"
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
  // One per direction: each carries the math type its chosen algorithm runs in.
  cudnnConvolutionDescriptor_t conv_forward = nullptr, conv_backward_data = nullptr, conv_backward_filter = nullptr;
  cudnnConvolutionFwdAlgo_t forward{};
  cudnnConvolutionBwdDataAlgo_t backward_data{};
  cudnnConvolutionBwdFilterAlgo_t backward_filter{};
  std::size_t workspace_bytes = 0;  // the largest of the three algorithms' needs
};

// cuDNN's descriptors take int; a dimension beyond it would wrap silently.
inline int cudnn_dim(std::int64_t v, const char* what) {
  TESSERA_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), ArgumentError, "cuDNN convolution: ", what, " = ", v,
                " does not fit cuDNN's int dimensions");
  return static_cast<int>(v);
}

// The first heuristic entry that runs: status success, a math type within `widest` (FMA <
// TENSOR_OP (TF32 for float data) < TENSOR_OP_ALLOW_CONVERSION (fp16)), and a workspace - asked for with the descriptor set to that
// math type - within the cap; deterministic algorithms first (some backward ones sum with
// atomics, in a varying order), so a seed reproduces a run when cuDNN offers a deterministic one.
// Timed entries (benchmark) come fastest first and are taken in that order, determinism aside.
// workspace_of(algo, &bytes) queries cudnnGet*WorkspaceSize with `conv`.
template <class Perf, class WorkspaceOf>
auto pick_algorithm(const Perf* perf, int count, cudnnConvolutionDescriptor_t conv, cudnnMathType_t widest,
                    bool prefer_deterministic, WorkspaceOf&& workspace_of, std::size_t& workspace_bytes,
                    const char* what, const Conv2dGeometry& g) {
  for (bool need_deterministic : {prefer_deterministic, false})
    for (int i = 0; i < count; ++i) {
      const Perf& entry = perf[i];
      if (entry.status != CUDNN_STATUS_SUCCESS) continue;
      if (need_deterministic && entry.determinism != CUDNN_DETERMINISTIC) continue;
      // The entry's status holds for its own math type: in FMA, only entries that run in FMA
      // already (FMA, or DEFAULT for algorithms without tensor-core variants); in TF32, none
      // that converts to fp16.
      const bool fma = widest == CUDNN_FMA_MATH;
      if (fma && entry.mathType != CUDNN_FMA_MATH && entry.mathType != CUDNN_DEFAULT_MATH) continue;
      if (widest == CUDNN_TENSOR_OP_MATH && entry.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
      const cudnnMathType_t math = fma ? CUDNN_FMA_MATH : entry.mathType;
      if (cudnnSetConvolutionMathType(conv, math) != CUDNN_STATUS_SUCCESS) continue;
      std::size_t bytes = 0;
      if (workspace_of(entry.algo, &bytes) != CUDNN_STATUS_SUCCESS || bytes > kMaxWorkspaceBytes) continue;
      workspace_bytes = std::max(workspace_bytes, bytes);
      return entry.algo;
    }
  throw CudaError(detail::cat("cuDNN has no ", what, " algorithm for a convolution of ", g.channels, "x", g.height, "x",
                              g.width, " to ", g.out_channels, " channels with kernel ", g.kernel_h, "x", g.kernel_w,
                              widest == CUDNN_FMA_MATH ? " in FMA math" : "", " within ", kMaxWorkspaceBytes >> 20,
                              " MiB of workspace"));
}

template <class S>
ConvPlan& conv_plan(const Conv2dGeometry& g, std::int64_t batch) {
  using Key = std::array<std::int64_t, 18>;
  // Reduced precision applies to float data under Float16 and TensorFloat32 only (see the header);
  // double always computes in double.
  const MathPrecision precision = Cuda::math_precision();
  const cudnnMathType_t widest = !std::is_same_v<S, float>                      ? CUDNN_FMA_MATH
                                 : precision == MathPrecision::Float16        ? CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION
                                 : precision == MathPrecision::TensorFloat32 ? CUDNN_TENSOR_OP_MATH
                                                                              : CUDNN_FMA_MATH;
  const bool benchmark = Cuda::cudnn_benchmark();
  const Key key{Cuda::current_device(), static_cast<std::int64_t>(sizeof(S)), batch, g.channels, g.height, g.width,
                g.out_channels, g.groups, g.kernel_h, g.kernel_w, g.stride_h, g.stride_w, g.pad_h, g.pad_w,
                g.dilation_h, g.dilation_w, widest, benchmark};
  static std::mutex mutex;
  static std::map<Key, std::unique_ptr<ConvPlan>> plans;  // kept for the process, like the handles
  std::lock_guard lock(mutex);
  auto& slot = plans[key];
  if (slot) return *slot;
  auto plan = std::make_unique<ConvPlan>();
  constexpr cudnnDataType_t type = cudnn_data_type<S>();
  const int n = cudnn_dim(batch, "batch"), c = cudnn_dim(g.channels, "channels"), h = cudnn_dim(g.height, "height"),
            wd = cudnn_dim(g.width, "width"), k = cudnn_dim(g.out_channels, "out_channels"),
            oh = cudnn_dim(g.out_height, "out_height"), ow = cudnn_dim(g.out_width, "out_width");
  TESSERA_CHECK(static_cast<double>(batch) * std::max(g.channels * g.height * g.width,
                                                      g.out_channels * g.out_height * g.out_width) <=
                    static_cast<double>(std::numeric_limits<int>::max()),
                ArgumentError, "cuDNN convolution: a batch of ", batch, " tensors of ", g.channels, "x", g.height, "x",
                g.width, " has more than 2^31 elements; split the batch");
  TESSERA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan->x));
  TESSERA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan->y));
  TESSERA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan->bias));
  TESSERA_CUDNN_CHECK(cudnnCreateFilterDescriptor(&plan->w));
  TESSERA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->x, CUDNN_TENSOR_NCHW, type, n, c, h, wd));
  TESSERA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->y, CUDNN_TENSOR_NCHW, type, n, k, oh, ow));
  TESSERA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->bias, CUDNN_TENSOR_NCHW, type, 1, k, 1, 1));
  TESSERA_CUDNN_CHECK(cudnnSetFilter4dDescriptor(plan->w, type, CUDNN_TENSOR_NCHW, k, static_cast<int>(g.channels / g.groups),
                                                 static_cast<int>(g.kernel_h), static_cast<int>(g.kernel_w)));
  const auto make_conv = [&](cudnnConvolutionDescriptor_t& conv) {
    TESSERA_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&conv));
    TESSERA_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(
        conv, static_cast<int>(g.pad_h), static_cast<int>(g.pad_w), static_cast<int>(g.stride_h),
        static_cast<int>(g.stride_w), static_cast<int>(g.dilation_h), static_cast<int>(g.dilation_w),
        CUDNN_CROSS_CORRELATION, type));
    TESSERA_CUDNN_CHECK(cudnnSetConvolutionGroupCount(conv, static_cast<int>(g.groups)));
    // The heuristics are asked under the widest math type allowed; pick_algorithm then sets it.
    TESSERA_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, widest));
  };
  make_conv(plan->conv_forward);
  make_conv(plan->conv_backward_data);
  make_conv(plan->conv_backward_filter);

  cudnnHandle_t handle = Cuda::cudnn();
  int returned = 0;
  std::array<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT> forward{};
  if (benchmark)
    TESSERA_CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithm(handle, plan->x, plan->w, plan->conv_forward, plan->y,
                                                             static_cast<int>(forward.size()), &returned, forward.data()));
  else
    TESSERA_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(handle, plan->x, plan->w, plan->conv_forward, plan->y,
                                                               static_cast<int>(forward.size()), &returned,
                                                               forward.data()));
  plan->forward = pick_algorithm(
      forward.data(), returned, plan->conv_forward, widest, !benchmark,
      [&](cudnnConvolutionFwdAlgo_t algo, std::size_t* bytes) {
        return cudnnGetConvolutionForwardWorkspaceSize(handle, plan->x, plan->w, plan->conv_forward, plan->y, algo,
                                                       bytes);
      },
      plan->workspace_bytes, "forward", g);
  std::array<cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT> data{};
  if (benchmark)
    TESSERA_CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithm(handle, plan->w, plan->y, plan->conv_backward_data,
                                                                  plan->x, static_cast<int>(data.size()), &returned,
                                                                  data.data()));
  else
    TESSERA_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, plan->w, plan->y, plan->conv_backward_data,
                                                                    plan->x, static_cast<int>(data.size()), &returned,
                                                                    data.data()));
  plan->backward_data = pick_algorithm(
      data.data(), returned, plan->conv_backward_data, widest, !benchmark,
      [&](cudnnConvolutionBwdDataAlgo_t algo, std::size_t* bytes) {
        return cudnnGetConvolutionBackwardDataWorkspaceSize(handle, plan->w, plan->y, plan->conv_backward_data,
                                                            plan->x, algo, bytes);
      },
      plan->workspace_bytes, "backward-data", g);
  std::array<cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT> filter{};
  if (benchmark)
    TESSERA_CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithm(handle, plan->x, plan->y,
                                                                    plan->conv_backward_filter, plan->w,
                                                                    static_cast<int>(filter.size()), &returned,
                                                                    filter.data()));
  else
    TESSERA_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, plan->x, plan->y,
                                                                      plan->conv_backward_filter, plan->w,
                                                                      static_cast<int>(filter.size()), &returned,
                                                                      filter.data()));
  plan->backward_filter = pick_algorithm(
      filter.data(), returned, plan->conv_backward_filter, widest, !benchmark,
      [&](cudnnConvolutionBwdFilterAlgo_t algo, std::size_t* bytes) {
        return cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, plan->x, plan->y, plan->conv_backward_filter,
                                                              plan->w, algo, bytes);
      },
      plan->workspace_bytes, "backward-filter", g);
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
    // Forget the old block before allocating: if the allocation throws (out of memory), the
    // buffer is empty rather than pointing at a block the cache may hand out again.
    void* old = b.p;
    const std::size_t old_bytes = b.bytes;
    b = Buffer{};
    Cuda::deallocate(old, old_bytes);  // stream-ordered: earlier users are done before later ones run
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
  TESSERA_CUDNN_CHECK(cudnnConvolutionForward(Cuda::cudnn(), &one, plan.x, x, plan.w, w, plan.conv_forward, plan.forward,
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
  TESSERA_CUDNN_CHECK(cudnnConvolutionBackwardFilter(Cuda::cudnn(), &one, plan.x, x, plan.y, dy, plan.conv_backward_filter,
                                                     plan.backward_filter, workspace, plan.workspace_bytes, &one, plan.w,
                                                     dw));
  if (dx != nullptr)
    TESSERA_CUDNN_CHECK(cudnnConvolutionBackwardData(Cuda::cudnn(), &one, plan.w, w, plan.y, dy, plan.conv_backward_data,
                                                     plan.backward_data, workspace, plan.workspace_bytes, &zero, plan.x,
                                                     dx));
}

// Forward only (Mode::Inference; ConvEpilogue): cuDNN's convolution, then the eval BatchNorm
// (with the ReLU unless an addend follows) and the residual add(+ReLU) in place, the kernels the
// unfused layers run, so the numbers are theirs. Fusing these into cuDNN's epilogue is left to
// a measurement on a GPU.
template <class S>
void conv2d_forward_epilogue(Cuda, const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x,
                             const S* w, const ConvEpilogue<S>& e, S* y, S* workspace) {
  conv2d_forward(Cuda{}, g, b, batch, x, w, e.bias, y, workspace);
  const BatchNormShape shape{batch, g.out_channels, g.out_plane()};
  batch_norm_normalize(Cuda{}, y, shape, e.mean, e.invstd, e.gamma, e.beta, y, e.relu && e.addend == nullptr);
  if (e.addend == nullptr) return;
  if (e.relu) add_relu_forward(Cuda{}, y, e.addend, shape.numel(), y);
  else add(Cuda{}, y, e.addend, shape.numel(), y);
}

}  // namespace tessera
