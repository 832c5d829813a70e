// Cuda: the GPU device of the policy bundle (CUDA runtime, cuBLAS, cuDNN). Included only from
// CUDA translation units (.cu, compiled by nvcc); Eigen never enters them.
//
//   Cuda::select_device(local_rank);        // rank r of a node -> device r mod devices
//   float* p = static_cast<float*>(Cuda::allocate(bytes));   // cached: no cudaMalloc once warm
//   Cuda::copy_to_device(p, host, bytes);   // async on the device's stream
//   cublasSgemm(Cuda::cublas(), ...);       // handles bound to that stream
//   Cuda::synchronize();
//
// One stream per device (created non-blocking on first use, so work on it never serializes with
// the legacy default stream), one cuBLAS and one cuDNN handle per device bound to that stream, and
// one caching allocator per device, the host allocator's size classes and segment pool over
// cudaMalloc (like PyTorch's CUDA caching allocator: freed blocks are kept and handed out again,
// so a steady-state training step calls cudaMalloc zero times; core/allocator.hpp). Blocks are freed to the cache without waiting: every
// kernel of this device runs on its one stream, so a later user of the block is ordered after
// the earlier one.
//
// Errors throw CudaError with the library's own name and message, the failing call's text and
// its file:line (TESSERA_CUDA_CHECK, TESSERA_CUBLAS_CHECK, TESSERA_CUDNN_CHECK).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "tessera/core/allocator.hpp"
#include "tessera/core/error.hpp"

namespace tessera {

class CudaError : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] inline void throw_cuda_error(const std::string& library, const std::string& name, const std::string& text,
                                          const char* call, const char* file, int line) {
  throw CudaError(detail::cat(library, " error ", name, " (", text, ") in ", call, " at ", file, ":", line));
}
inline void cuda_check(cudaError_t status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();  // reset a non-sticky error so the next call does not report it again
  throw_cuda_error("CUDA", cudaGetErrorName(status), cudaGetErrorString(status), call, file, line);
}
inline void cublas_check(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw_cuda_error("cuBLAS", cublasGetStatusName(status), cublasGetStatusString(status), call, file, line);
}
inline void cudnn_check(cudnnStatus_t status, const char* call, const char* file, int line) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  throw_cuda_error("cuDNN", std::to_string(static_cast<int>(status)), cudnnGetErrorString(status), call, file, line);
}
}  // namespace detail

#define TESSERA_CUDA_CHECK(call) ::tessera::detail::cuda_check((call), #call, __FILE__, __LINE__)
#define TESSERA_CUBLAS_CHECK(call) ::tessera::detail::cublas_check((call), #call, __FILE__, __LINE__)
#define TESSERA_CUDNN_CHECK(call) ::tessera::detail::cudnn_check((call), #call, __FILE__, __LINE__)

// Device memory of the current device, for the caching allocator. A failed cudaMalloc returns
// nullptr (the allocator then empties its cache and tries once more, then reports).
struct CudaMemory {
  static constexpr const char* kName = "GPU";
  static constexpr std::size_t kSegmentBytes = 0;  // cudaMalloc commits: a segment is the request alone
  static void* allocate(std::size_t bytes) noexcept {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return p;
  }
  static void release(void* p) noexcept { (void)cudaFree(p); }
};

using CudaCachingAllocator = BasicCachingAllocator<CudaMemory>;

// The precision of the GPU's matrix products and convolutions (storage stays Env's Scalar):
// Float32 computes in fp32 (no TF32); TensorFloat32 lets cuBLAS and cuDNN run fp32 products on
// tensor cores with the inputs rounded to TF32 (10-bit mantissa, fp32 range; fp32 sums), which is
// PyTorch's default for convolutions (torch.backends.cudnn.allow_tf32) and what
// torch.backends.cuda.matmul.allow_tf32 = True adds for matrix products; Float16 and BFloat16 let
// cuBLAS round the fp32 inputs of every product to fp16 / bf16 on tensor cores, accumulating in
// fp32 (CUBLAS_COMPUTE_32F_FAST_16F / _16BF), and cuDNN's convolutions do the same (Float16:
// CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION; BFloat16: bf16 copies of the operands, as a layer of
// Env<Cuda, Comm, float, BFloat16> always does, kernels/cuda/conv2d.cuh). Pair Float16 with
// GradScaler (train/grad_scaler.hpp); bf16 and TF32 have fp32's range.
enum class MathPrecision { Float32, Float16, BFloat16, TensorFloat32 };
static_assert(static_cast<int>(MathPrecision::Float32) == 0, "Cuda::setting defaults to 0: Float32");

class Cuda {
 public:
  static constexpr int kMaxDevices = 64;
  static constexpr std::string_view name = "cuda";
  static constexpr bool host_accessible = false;  // device pointers: the host copies, never reads

  // Devices this process can see; 0 when there is no GPU or no driver (never throws, so a
  // program can decide to skip or fall back).
  static int device_count() noexcept {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return n;
  }

  // One process per GPU: local rank r uses device r mod device_count() (several ranks may share
  // a device, as the tests do on one GPU). Sets the device for the calling thread.
  static int select_device(int local_rank) {
    const int n = device_count();
    TESSERA_CHECK(n > 0, CudaError, "Cuda::select_device(", local_rank, "): no CUDA device is visible (",
                  "cudaGetDeviceCount found none; check CUDA_VISIBLE_DEVICES and the driver)");
    TESSERA_CHECK(local_rank >= 0, ArgumentError, "Cuda::select_device: local rank ", local_rank, " is negative");
    const int device = local_rank % n;
    TESSERA_CUDA_CHECK(cudaSetDevice(device));
    return device;
  }
  static int current_device() {
    int d = 0;
    TESSERA_CUDA_CHECK(cudaGetDevice(&d));
    return d;
  }

  // The Device concept: device memory through the cache, device-to-device copies, synchronize.
  static void* allocate(std::size_t bytes) { return state().allocator.allocate(bytes); }
  // Never throws (tensors free from destructors): without a current device or its state, which
  // only happens while the process tears down, the block is left to the driver.
  static void deallocate(void* p, std::size_t bytes) noexcept {
    if (p == nullptr) return;
    if (DeviceState* s = existing_state()) s->allocator.deallocate(p, bytes);
  }
  static void copy(void* dst, const void* src, std::size_t bytes) {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()));
  }
  static void synchronize() { TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream())); }

  // Host <-> device, asynchronous on the device's stream (truly asynchronous from pinned memory).
  static void copy_to_device(void* dst, const void* host, std::size_t bytes) {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream()));
  }
  static void copy_to_host(void* host, const void* src, std::size_t bytes) {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream()));
  }

  // Process-wide, read at each product (convolution plans are cached per precision). The default
  // is Float32, or what the environment variable TESSERA_MATH_PRECISION names (float32, tf32,
  // float16, bfloat16), so a program's precision can change without a code change.
  static void set_math_precision(MathPrecision p) { precision_slot().store(static_cast<int>(p)); }
  static MathPrecision math_precision() {
    return static_cast<MathPrecision>(setting(precision_slot(), "TESSERA_MATH_PRECISION", [](std::string_view t) {
      const std::pair<std::string_view, MathPrecision> names[] = {{"float32", MathPrecision::Float32},
                                                                  {"tf32", MathPrecision::TensorFloat32},
                                                                  {"float16", MathPrecision::Float16},
                                                                  {"bfloat16", MathPrecision::BFloat16}};
      const auto* it = std::find_if(std::begin(names), std::end(names), [&](const auto& n) { return n.first == t; });
      TESSERA_CHECK(it != std::end(names), ArgumentError, "TESSERA_MATH_PRECISION='", t,
                    "': expected float32, tf32, float16 or bfloat16");
      return static_cast<int>(it->second);
    }));
  }

  // PyTorch's torch.backends.cudnn.benchmark: when on, each new convolution shape times cuDNN's
  // algorithms once (cudnnFind*, on the first call with that shape) and keeps the fastest, in
  // place of the first fit among cuDNN's heuristics, which prefers deterministic algorithms. Off
  // by default, as in PyTorch; the environment variable TESSERA_CUDNN_BENCHMARK=1 turns it on
  // without a code change. Plans are cached per setting (kernels/cuda/conv2d.cuh).
  static void set_cudnn_benchmark(bool on) { benchmark_slot().store(on ? 1 : 0); }
  static bool cudnn_benchmark() {
    return setting(benchmark_slot(), "TESSERA_CUDNN_BENCHMARK", [](std::string_view t) {
             TESSERA_CHECK(t == "0" || t == "1", ArgumentError, "TESSERA_CUDNN_BENCHMARK='", t,
                           "': expected 1 (time cuDNN's algorithms) or 0 (cuDNN's heuristics)");
             return t == "1" ? 1 : 0;
           }) == 1;
  }

  // Host -> device for the data loader's batches, from ordinary (pageable) host memory: the bytes
  // are copied into one of two page-locked staging buffers and sent from there asynchronously,
  // so the call returns before the transfer ends and the next batch can be prepared meanwhile.
  // A slot is reused only after its previous transfer completed (an event per slot).
  static void upload(void* dst, const void* host, std::size_t bytes) {
    if (bytes == 0) return;
    DeviceState& s = state();
    std::lock_guard lock(s.staging_mutex);
    auto& slot = staged(s, host, bytes);
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, slot.host, bytes, cudaMemcpyHostToDevice, s.stream));
    TESSERA_CUDA_CHECK(cudaEventRecord(slot.done, s.stream));
    slot.in_flight = true;
  }

  // upload, with the transfer on the device's copy stream, so that it overlaps the kernels queued
  // before it (the previous step's backward and optimizer step) instead of waiting behind them.
  // The compute stream waits for the transfer before anything queued after this call. The contract
  // that makes the overlap safe: the caller rotates between two destination buffers (the Trainer's
  // on_device), so dst was last read by work queued before the *previous* call; the copy waits for
  // exactly that work (an event recorded on the compute stream at each call), not for the work
  // queued since. The Trainer keeps to it: each of its uploads is a micro-batch (or an evaluation
  // batch) whose forward and backward are queued before the next upload. A caller with one buffer,
  // or whose reads of a buffer are queued after the next upload (examples/common's reports upload
  // twice per step), uses upload.
  // `fresh_destination`: dst was (re)allocated since the previous call. The caching allocator may
  // have handed it a block whose last users, on the compute stream, are still queued, so the copy
  // then waits for everything queued so far, as upload's does.
  static void upload_rotating(void* dst, const void* host, std::size_t bytes, bool fresh_destination) {
    if (bytes == 0) return;
    DeviceState& s = state();
    std::lock_guard lock(s.staging_mutex);
    auto& slot = staged(s, host, bytes);
    if (s.copy_stream == nullptr) {
      TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&s.copy_stream, cudaStreamNonBlocking));
      TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&s.queued_before_upload, cudaEventDisableTiming));
      TESSERA_CUDA_CHECK(cudaEventRecord(s.queued_before_upload, s.stream));  // nothing to wait for yet
    }
    // dst's last readers were queued before the previous call: wait for them (the event), then copy.
    if (fresh_destination) TESSERA_CUDA_CHECK(cudaEventRecord(s.queued_before_upload, s.stream));
    TESSERA_CUDA_CHECK(cudaStreamWaitEvent(s.copy_stream, s.queued_before_upload, 0));
    TESSERA_CUDA_CHECK(cudaEventRecord(s.queued_before_upload, s.stream));  // the next call's wait
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, slot.host, bytes, cudaMemcpyHostToDevice, s.copy_stream));
    TESSERA_CUDA_CHECK(cudaEventRecord(slot.done, s.copy_stream));
    TESSERA_CUDA_CHECK(cudaStreamWaitEvent(s.stream, slot.done, 0));  // kernels after this call see dst
    slot.in_flight = true;
  }

  static cudaStream_t stream() { return state().stream; }
  static cublasHandle_t cublas() { return state().cublas; }
  static cudnnHandle_t cudnn() { return state().cudnn; }
  static CudaCachingAllocator& allocator() { return state().allocator; }

 private:
  // A process-wide setting held in `slot` (-1 until read or set): on the first read, parse(value)
  // of the environment variable `var` when it is set and not empty, else 0 (the default: Float32,
  // benchmark off). Later reads are one atomic load; set_* stores over it.
  template <class Parse>
  static int setting(std::atomic<int>& slot, const char* var, const Parse& parse) {
    int v = slot.load();
    if (v >= 0) return v;
    const char* text = std::getenv(var);
    const int from_env = text != nullptr && *text != '\0' ? parse(std::string_view(text)) : 0;
    slot.compare_exchange_strong(v, from_env);  // a concurrent set_* wins
    return slot.load();
  }
  static std::atomic<int>& precision_slot() {  // a MathPrecision; -1 until read or set
    static std::atomic<int> precision{-1};
    return precision;
  }
  static std::atomic<int>& benchmark_slot() {  // -1 until read or set
    static std::atomic<int> benchmark{-1};
    return benchmark;
  }
  // Everything per device, created on the first use of that device and kept for the process's
  // life (like PyTorch's: freeing CUDA objects during static destruction races the driver).
  struct DeviceState {
    cudaStream_t stream = nullptr;
    cublasHandle_t cublas = nullptr;
    cudnnHandle_t cudnn = nullptr;
    CudaCachingAllocator allocator;
    struct Staging {
      void* host = nullptr;  // page-locked, grown to the largest upload
      std::size_t bytes = 0;
      cudaEvent_t done = nullptr;
      bool in_flight = false;
    };
    std::array<Staging, 2> staging{};
    std::size_t next_staging = 0;
    std::mutex staging_mutex;
    // upload_rotating's: the copy stream, and the compute stream's work queued before the last call.
    cudaStream_t copy_stream = nullptr;
    cudaEvent_t queued_before_upload = nullptr;
    explicit DeviceState(int device) {
      TESSERA_CUDA_CHECK(cudaSetDevice(device));
      TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      TESSERA_CUBLAS_CHECK(cublasCreate(&cublas));
      TESSERA_CUBLAS_CHECK(cublasSetStream(cublas, stream));
      TESSERA_CUDNN_CHECK(cudnnCreate(&cudnn));
      TESSERA_CUDNN_CHECK(cudnnSetStream(cudnn, stream));
    }
  };
  // The next staging slot, once its previous transfer is done, grown to `bytes` and holding a copy
  // of host (upload and upload_rotating; s.staging_mutex held).
  static DeviceState::Staging& staged(DeviceState& s, const void* host, std::size_t bytes) {
    auto& slot = s.staging[s.next_staging];
    s.next_staging = (s.next_staging + 1) % s.staging.size();
    if (slot.in_flight) TESSERA_CUDA_CHECK(cudaEventSynchronize(slot.done));
    if (slot.bytes < bytes) {
      if (slot.host) TESSERA_CUDA_CHECK(cudaFreeHost(slot.host));
      slot.host = nullptr;
      TESSERA_CUDA_CHECK(cudaMallocHost(&slot.host, bytes));
      slot.bytes = bytes;
    }
    if (slot.done == nullptr) TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
    std::memcpy(slot.host, host, bytes);
    return slot;
  }
  struct States {
    std::array<DeviceState*, kMaxDevices> of_device{};
    std::mutex mutex;
  };
  static States& states() {
    static States all;  // the DeviceStates themselves are never destroyed, see above
    return all;
  }
  static DeviceState& state() {
    const int device = current_device();
    TESSERA_CHECK(device >= 0 && device < kMaxDevices, CudaError, "Cuda: device ", device, " beyond ", kMaxDevices);
    auto& all = states();
    std::lock_guard lock(all.mutex);
    auto& slot = all.of_device[static_cast<std::size_t>(device)];
    if (slot == nullptr) slot = new DeviceState(device);
    return *slot;
  }
  static DeviceState* existing_state() noexcept {
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    if (device < 0 || device >= kMaxDevices) return nullptr;
    auto& all = states();
    std::lock_guard lock(all.mutex);
    return all.of_device[static_cast<std::size_t>(device)];
  }
};

// Page-locked host memory for the data loader's staging buffers: copies from it to the device
// are asynchronous and run at full bus speed.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes > 0) TESSERA_CUDA_CHECK(cudaMallocHost(&data_, bytes));
  }
  PinnedBuffer(PinnedBuffer&& other) noexcept : data_(other.data_), bytes_(other.bytes_) {
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (data_) (void)cudaFreeHost(data_);
  }
  void* data() const { return data_; }
  std::size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace tessera
