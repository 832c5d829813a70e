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
// Math. CUDNN_FMA_MATH under MathPrecision::Float32 (no TF32 rounding: results match the CPU to
// float precision); under TensorFloat32, tensor-core entries too, with CUDNN_TENSOR_OP_MATH (fp32
// data, TF32 products: PyTorch's default cudnn.allow_tf32); under Float16, with
// CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION (fp32 data rounded to fp16).
//
// bfloat16. A layer of Env<Cuda, Comm, float, BFloat16> (Conv2dBlocking::bf16), or any float
// layer under MathPrecision::BFloat16, convolves in bfloat16 as PyTorch's autocast does: x, w
// (and dy) are rounded to bfloat16 copies (cast_to_wire, round to nearest even), cuDNN convolves
// them with fp32 accumulation on the tensor cores (its PSEUDO_BFLOAT16 configuration: bf16 data,
// CUDNN_DATA_FLOAT compute), and the bf16 result is widened back into the layer's float tensor
// (y, dx) or added to its float gradient (dw += the bf16 dw: the sum over steps and micro-batches
// stays fp32). The legacy API converts fp32 data only to fp16 (ALLOW_CONVERSION), whose range
// (65504) activations and scaled gradients can exceed, hence the explicit copies. Relative to the
// float result each output carries its operands' rounding (at most 2^-8 of each, 8 significant
// bits, the products summed in fp32) and its own (2^-8 more): about 1e-2 of the output's scale at
// worst (tests/cuda/layer_equivalence.hpp, kBf16Cases). The copies live in a second per-device
// buffer beside the workspace, grown like it.
//
// Channels last (Conv2dGeometry::channels_last, MemoryFormat::ChannelsLast). x, y and their
// gradients are NHWC and described so to cuDNN, whose tensor-core kernels work in that layout (on
// NCHW tensors it transposes internally). cuDNN wants an NHWC convolution's filter in NHWC too,
// (K, kh, kw, C/G), while the layer keeps PyTorch's (K, C/G, kh, kw) for state_dicts and
// optimizers: each call transposes the filter into a scratch copy (nchw_to_nhwc with K images of
// C/G channels by kh kw pixels), and backward computes dw in that layout and adds it back
// transposed (one accumulating transpose). The filters are small next to the activations (ResNet-50: 25.5 M weights, against
// about 25 M activation values kept per image of the batch), and the scratch is one buffer per
// device, reused.
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

// Whether a float convolution runs in bfloat16 (see the header): asked by its Env, or by the
// process's math precision. Double never does.
template <class S>
bool conv_in_bf16(const Conv2dBlocking& b) {
  return std::is_same_v<S, float> && (b.bf16 || Cuda::math_precision() == MathPrecision::BFloat16);
}

struct ConvPlan {
  // x, y and w in the convolution's data type (bf16 in a bfloat16 plan); y_out and bias in the
  // layer's Scalar, for the bias added to the widened output.
  cudnnTensorDescriptor_t x = nullptr, y = nullptr, y_out = nullptr, bias = nullptr;
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
                              g.channels_last ? " in NHWC (channels_last)" : "",
                              widest == CUDNN_FMA_MATH ? " in FMA math" : "", " within ", kMaxWorkspaceBytes >> 20,
                              " MiB of workspace"));
}

// `bf16`: the plan of a bfloat16 convolution (conv_in_bf16), float layers only.
template <class S>
ConvPlan& conv_plan(const Conv2dGeometry& g, std::int64_t batch, bool bf16) {
  using Key = std::array<std::int64_t, 20>;
  // Reduced precision applies to float data under Float16 and TensorFloat32 (see the header), and
  // to bfloat16 plans, whose bf16 data the tensor cores take as it is; double always computes in
  // double.
  const MathPrecision precision = Cuda::math_precision();
  const cudnnMathType_t widest = !std::is_same_v<S, float>                      ? CUDNN_FMA_MATH
                                 : bf16                                        ? CUDNN_TENSOR_OP_MATH
                                 : precision == MathPrecision::Float16        ? CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION
                                 : precision == MathPrecision::TensorFloat32 ? CUDNN_TENSOR_OP_MATH
                                                                              : CUDNN_FMA_MATH;
  const bool benchmark = Cuda::cudnn_benchmark();
  const Key key{Cuda::current_device(), static_cast<std::int64_t>(sizeof(S)), batch, g.channels, g.height, g.width,
                g.out_channels, g.groups, g.kernel_h, g.kernel_w, g.stride_h, g.stride_w, g.pad_h, g.pad_w,
                g.dilation_h, g.dilation_w, widest, benchmark, bf16, g.channels_last};
  static std::mutex mutex;
  static std::map<Key, std::unique_ptr<ConvPlan>> plans;  // kept for the process, like the handles
  std::lock_guard lock(mutex);
  auto& slot = plans[key];
  if (slot) return *slot;
  auto plan = std::make_unique<ConvPlan>();
  constexpr cudnnDataType_t scalar_type = cudnn_data_type<S>();
  // The data's type, and the type the convolution computes (accumulates) in: bf16 data with fp32
  // sums in a bfloat16 plan (cuDNN's PSEUDO_BFLOAT16 configuration), else both the Scalar.
  const cudnnDataType_t type = bf16 ? CUDNN_DATA_BFLOAT16 : scalar_type;
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
  TESSERA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan->y_out));
  TESSERA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&plan->bias));
  TESSERA_CUDNN_CHECK(cudnnCreateFilterDescriptor(&plan->w));
  const cudnnTensorFormat_t layout = g.channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  TESSERA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->x, layout, type, n, c, h, wd));
  TESSERA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->y, layout, type, n, k, oh, ow));
  TESSERA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->y_out, layout, scalar_type, n, k, oh, ow));
  TESSERA_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->bias, CUDNN_TENSOR_NCHW, scalar_type, 1, k, 1, 1));
  TESSERA_CUDNN_CHECK(cudnnSetFilter4dDescriptor(plan->w, type, layout, k, static_cast<int>(g.channels / g.groups),
                                                 static_cast<int>(g.kernel_h), static_cast<int>(g.kernel_w)));
  const auto make_conv = [&](cudnnConvolutionDescriptor_t& conv) {
    TESSERA_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&conv));
    TESSERA_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(
        conv, static_cast<int>(g.pad_h), static_cast<int>(g.pad_w), static_cast<int>(g.stride_h),
        static_cast<int>(g.stride_w), static_cast<int>(g.dilation_h), static_cast<int>(g.dilation_w),
        CUDNN_CROSS_CORRELATION, scalar_type));
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

// The device's shared convolution buffers, at least `bytes` long: kWorkspace, cuDNN's workspace;
// kBf16Copies, the bfloat16 copies of a bfloat16 convolution's operands and results.
// kChannelsLastFilters, the filter and its gradient in NHWC (channels_last_filters).
enum ConvBuffer { kWorkspace = 0, kBf16Copies = 1, kChannelsLastFilters = 2 };
inline void* conv_buffer(ConvBuffer which, std::size_t bytes) {
  struct Buffer {
    void* p = nullptr;
    std::size_t bytes = 0;
  };
  static std::mutex mutex;
  static std::array<std::array<Buffer, 3>, Cuda::kMaxDevices> buffers{};
  std::lock_guard lock(mutex);
  Buffer& b = buffers[static_cast<std::size_t>(Cuda::current_device())][which];
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
inline void* conv_workspace(std::size_t bytes) { return conv_buffer(kWorkspace, bytes); }

// The bfloat16 copies of one convolution, each 256-byte aligned (as cudaMalloc's blocks, which
// the tensor-core kernels' vector loads want): x (and, in backward, dx: x's copy is read before
// dx is written), y (or dy), w and dw.
struct Bf16Copies {
  BHalf *x, *y, *w, *dw;
};
inline Bf16Copies bf16_copies(const Conv2dGeometry& g, std::int64_t batch) {
  const auto bytes = [](std::int64_t elements) { return (static_cast<std::size_t>(elements) * 2 + 255) / 256 * 256; };
  const std::size_t x = bytes(batch * g.channels * g.height * g.width);
  const std::size_t y = bytes(batch * g.out_channels * g.out_plane());
  const std::size_t w = bytes(g.out_channels * (g.channels / g.groups) * g.kernel_h * g.kernel_w);
  auto* base = static_cast<unsigned char*>(conv_buffer(kBf16Copies, x + y + 2 * w));
  return {reinterpret_cast<BHalf*>(base), reinterpret_cast<BHalf*>(base + x), reinterpret_cast<BHalf*>(base + x + y),
          reinterpret_cast<BHalf*>(base + x + y + w)};
}

// A channels-last convolution's filters (see the header), each 256-byte aligned: w and dw in
// (K, kh, kw, C/G).
template <class S>
struct NhwcFilters {
  S *w, *dw;
};
template <class S>
NhwcFilters<S> channels_last_filters(const Conv2dGeometry& g) {
  const std::size_t bytes = (static_cast<std::size_t>(g.weight_elements()) * sizeof(S) + 255) / 256 * 256;
  auto* base = static_cast<unsigned char*>(conv_buffer(kChannelsLastFilters, 2 * bytes));
  return {reinterpret_cast<S*>(base), reinterpret_cast<S*>(base + bytes)};
}
// The filter as cuDNN takes it for g: w itself (NCHW), or its NHWC copy in f.w.
template <class S>
const S* filter_for(const Conv2dGeometry& g, const S* w, const NhwcFilters<S>& f) {
  if (!g.channels_last) return w;
  nchw_to_nhwc(Cuda{}, g.out_channels, g.channels / g.groups, g.taps(), w, f.w);
  return f.w;
}
// dw += f.dw (NHWC) transposed back, in one pass.
template <class S>
void add_nhwc_filter_grad(const Conv2dGeometry& g, const NhwcFilters<S>& f, S* dw) {
  transpose_images(g.out_channels, g.taps(), g.channels / g.groups, f.dw, dw, /*accumulate=*/true);
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

// Of the CPU blocking only `bf16` is read (Env<Cuda, Comm, float, BFloat16>); cuDNN blocks itself.
template <class S>
void conv2d_forward(Cuda, const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x, const S* w,
                    const S* bias, S* y, S* /*cpu_workspace*/) {
  if (batch == 0) return;
  const bool bf16 = cuda_detail::conv_in_bf16<S>(b);
  auto& plan = cuda_detail::conv_plan<S>(g, batch, bf16);
  void* workspace = cuda_detail::conv_workspace(plan.workspace_bytes);
  const S one = 1, zero = 0;  // fp32 for a bfloat16 plan too: cuDNN's scaling factors follow the compute type
  const cuda_detail::NhwcFilters<S> filters =
      g.channels_last ? cuda_detail::channels_last_filters<S>(g) : cuda_detail::NhwcFilters<S>{};
  w = cuda_detail::filter_for(g, w, filters);
  if (bf16) {
    const cuda_detail::Bf16Copies copies = cuda_detail::bf16_copies(g, batch);
    const std::int64_t ny = batch * g.out_channels * g.out_plane();
    cast_to_wire(Cuda{}, x, batch * g.channels * g.height * g.width, copies.x);
    cast_to_wire(Cuda{}, w, g.out_channels * (g.channels / g.groups) * g.kernel_h * g.kernel_w, copies.w);
    TESSERA_CUDNN_CHECK(cudnnConvolutionForward(Cuda::cudnn(), &one, plan.x, copies.x, plan.w, copies.w,
                                                plan.conv_forward, plan.forward, workspace, plan.workspace_bytes,
                                                &zero, plan.y, copies.y));
    cast_from_wire(Cuda{}, copies.y, ny, y);
  } else {
    TESSERA_CUDNN_CHECK(cudnnConvolutionForward(Cuda::cudnn(), &one, plan.x, x, plan.w, w, plan.conv_forward,
                                                plan.forward, workspace, plan.workspace_bytes, &zero, plan.y, y));
  }
  if (bias != nullptr) TESSERA_CUDNN_CHECK(cudnnAddTensor(Cuda::cudnn(), &one, plan.bias, bias, &one, plan.y_out, y));
}

template <class S>
void conv2d_bias_backward(Cuda, std::int64_t batch, std::int64_t channels, std::int64_t plane, const S* dy, S* db) {
  if (channels == 0) return;
  cuda_detail::conv_bias_backward_kernel<S><<<static_cast<unsigned>(channels), cuda_detail::kThreads, 0,
                                              Cuda::stream()>>>(batch, channels, plane, dy, db);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

// dw += dL/dw (beta = 1: gradients accumulate, as on the CPU) unless dw is null; dx = dL/dx unless
// dx is null.
template <class S>
void conv2d_backward(Cuda, const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x,
                     const S* w, const S* dy, S* dw, S* dx, S* /*cpu_workspace*/) {
  if (batch == 0) return;
  const bool bf16 = cuda_detail::conv_in_bf16<S>(b);
  auto& plan = cuda_detail::conv_plan<S>(g, batch, bf16);
  void* workspace = cuda_detail::conv_workspace(plan.workspace_bytes);
  const S one = 1, zero = 0;
  // Channels last: dw is computed in NHWC into the scratch (beta = 0) and added back transposed.
  const cuda_detail::NhwcFilters<S> filters =
      g.channels_last ? cuda_detail::channels_last_filters<S>(g) : cuda_detail::NhwcFilters<S>{};
  w = cuda_detail::filter_for(g, w, filters);
  S* const dw_layer = dw;
  if (g.channels_last && dw != nullptr) dw = filters.dw;
  const S dw_beta = g.channels_last ? zero : one;
  if (bf16) {
    // dw: the bf16 sum over the batch, then added to the fp32 gradient; dx widened from bf16. The
    // copy of x is dead once the filter gradient is computed, so dx's bf16 result takes its place.
    const cuda_detail::Bf16Copies copies = cuda_detail::bf16_copies(g, batch);
    const std::int64_t nx = batch * g.channels * g.height * g.width;
    const std::int64_t nw = g.out_channels * (g.channels / g.groups) * g.kernel_h * g.kernel_w;
    if (dw != nullptr) cast_to_wire(Cuda{}, x, nx, copies.x);  // the filter gradient's input only
    cast_to_wire(Cuda{}, dy, batch * g.out_channels * g.out_plane(), copies.y);
    if (dw != nullptr) {
      TESSERA_CUDNN_CHECK(cudnnConvolutionBackwardFilter(Cuda::cudnn(), &one, plan.x, copies.x, plan.y, copies.y,
                                                         plan.conv_backward_filter, plan.backward_filter, workspace,
                                                         plan.workspace_bytes, &zero, plan.w, copies.dw));
      if (g.channels_last) {
        cast_from_wire(Cuda{}, copies.dw, nw, dw);
        cuda_detail::add_nhwc_filter_grad(g, filters, dw_layer);
      } else {
        add_from_wire(Cuda{}, copies.dw, nw, dw);
      }
    }
    if (dx == nullptr) return;
    cast_to_wire(Cuda{}, w, nw, copies.w);
    TESSERA_CUDNN_CHECK(cudnnConvolutionBackwardData(Cuda::cudnn(), &one, plan.w, copies.w, plan.y, copies.y,
                                                     plan.conv_backward_data, plan.backward_data, workspace,
                                                     plan.workspace_bytes, &zero, plan.x, copies.x));
    cast_from_wire(Cuda{}, copies.x, nx, dx);
    return;
  }
  if (dw != nullptr) {
    TESSERA_CUDNN_CHECK(cudnnConvolutionBackwardFilter(Cuda::cudnn(), &one, plan.x, x, plan.y, dy,
                                                       plan.conv_backward_filter, plan.backward_filter, workspace,
                                                       plan.workspace_bytes, &dw_beta, plan.w, dw));
    if (g.channels_last) cuda_detail::add_nhwc_filter_grad(g, filters, dw_layer);
  }
  if (dx != nullptr)
    TESSERA_CUDNN_CHECK(cudnnConvolutionBackwardData(Cuda::cudnn(), &one, plan.w, w, plan.y, dy, plan.conv_backward_data,
                                                     plan.backward_data, workspace, plan.workspace_bytes, &zero, plan.x,
                                                     dx));
}

// Forward only (Mode::Inference; ConvEpilogue): cuDNN's convolution, then the eval BatchNorm,
// the residual add and the ReLU in place in one pass (batch_norm_normalize_add_relu; the ReLU
// alone or the add alone as the unfused kernels), with the unfused layers' roundings, so the
// numbers are theirs. Fusing these into cuDNN's own epilogue (its graph API) is left to a
// measurement on a GPU.
template <class S>
void conv2d_forward_epilogue(Cuda, const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x,
                             const S* w, const ConvEpilogue<S>& e, S* y, S* workspace) {
  conv2d_forward(Cuda{}, g, b, batch, x, w, e.bias, y, workspace);
  const BatchNormShape shape{batch, g.out_channels, g.out_plane(), g.channels_last};
  if (e.addend != nullptr && e.relu) {  // a residual block's end: one pass (batch_norm_normalize_add_relu)
    batch_norm_normalize_add_relu(Cuda{}, y, shape, e.mean, e.invstd, e.gamma, e.beta, e.addend, y);
    return;
  }
  batch_norm_normalize(Cuda{}, y, shape, e.mean, e.invstd, e.gamma, e.beta, y, e.relu && e.addend == nullptr);
  if (e.addend != nullptr) add(Cuda{}, y, e.addend, shape.numel(), y);
}

}  // namespace tessera
