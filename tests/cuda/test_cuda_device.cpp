// The Cuda device on a GPU: device selection, the caching allocator (no cudaMalloc once warm),
// host <-> device copies through pinned memory, cuBLAS on the device's stream against a CPU
// product, a cuDNN handle, and errors that name the library, the call and its file:line.
// Exits 77 (Meson: skipped) when no GPU is visible, after checking that this is reported cleanly.
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <string>
#include <vector>

#include "tessera/device/cuda.cuh"

using namespace tessera;

namespace {
int failures = 0;
void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}
}  // namespace

int main() {
  // The process-wide settings take their defaults from the environment on first read (no device
  // needed), and a set_* call overrides them. Set here before anything reads them.
  setenv("TESSERA_MATH_PRECISION", "tf32", 1);
  setenv("TESSERA_CUDNN_BENCHMARK", "1", 1);
  if (Cuda::math_precision() != MathPrecision::TensorFloat32 || !Cuda::cudnn_benchmark()) {
    std::fprintf(stderr, "FAILED: TESSERA_MATH_PRECISION=tf32 / TESSERA_CUDNN_BENCHMARK=1 not taken as defaults\n");
    return 1;
  }
  Cuda::set_math_precision(MathPrecision::Float32);
  Cuda::set_cudnn_benchmark(false);
  if (Cuda::math_precision() != MathPrecision::Float32 || Cuda::cudnn_benchmark()) {
    std::fprintf(stderr, "FAILED: set_math_precision / set_cudnn_benchmark did not override the environment\n");
    return 1;
  }
  if (Cuda::device_count() == 0) {
    // Without a GPU, selecting one must be an error that says so, not a crash.
    try {
      Cuda::select_device(0);
      std::fprintf(stderr, "FAILED: select_device succeeded without a device\n");
      return 1;
    } catch (const CudaError& e) {
      if (std::string(e.what()).find("no CUDA device is visible") == std::string::npos) {
        std::fprintf(stderr, "FAILED: unexpected message: %s\n", e.what());
        return 1;
      }
    }
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  try {
    const int device = Cuda::select_device(0);
    check(Cuda::current_device() == device, "select_device sets the current device");

    // The cache: the second allocation of a size reuses the first block.
    const auto before = Cuda::allocator().stats();
    void* a = Cuda::allocate(1 << 20);
    Cuda::deallocate(a, 1 << 20);
    void* b = Cuda::allocate(1 << 20);
    const auto after = Cuda::allocator().stats();
    check(a == b, "a freed block is handed out again");
    check(after.system_allocations == before.system_allocations + 1, "one cudaMalloc for two requests");

    // Host -> device -> device -> host through pinned memory.
    const std::size_t n = 1000;
    PinnedBuffer host(n * sizeof(float));
    auto* h = static_cast<float*>(host.data());
    for (std::size_t i = 0; i < n; ++i) h[i] = static_cast<float>(i) * 0.5f;
    auto* d1 = static_cast<float*>(Cuda::allocate(n * sizeof(float)));
    Cuda::copy_to_device(d1, h, n * sizeof(float));
    Cuda::copy(b, d1, n * sizeof(float));
    std::vector<float> back(n);
    Cuda::copy_to_host(back.data(), b, n * sizeof(float));
    Cuda::synchronize();
    check(std::memcmp(back.data(), h, n * sizeof(float)) == 0, "copies round-trip exactly");

    // Staged uploads from pageable memory: three batches through the two staging slots (the
    // third reuses the first slot, after its transfer), each to its own device buffer; the
    // source may change as soon as upload() returns.
    std::vector<float> batch(n);
    std::vector<float*> targets;
    for (int k = 0; k < 3; ++k) {
      for (std::size_t i = 0; i < n; ++i) batch[i] = static_cast<float>(k * 10000 + static_cast<int>(i));
      targets.push_back(static_cast<float*>(Cuda::allocate(n * sizeof(float))));
      Cuda::upload(targets.back(), batch.data(), n * sizeof(float));
      std::fill(batch.begin(), batch.end(), -1.0f);  // overwritten at once: the staging copy must not care
    }
    for (int k = 0; k < 3; ++k) {
      Cuda::copy_to_host(back.data(), targets[static_cast<std::size_t>(k)], n * sizeof(float));
      Cuda::synchronize();
      bool same = true;
      for (std::size_t i = 0; i < n; ++i) same = same && back[i] == static_cast<float>(k * 10000 + static_cast<int>(i));
      check(same, "upload " + std::to_string(k) + " arrived intact through the staging buffers");
      Cuda::deallocate(targets[static_cast<std::size_t>(k)], n * sizeof(float));
    }

    // Uploads on the copy stream into two buffers in turn (upload_rotating's contract), each read on
    // the compute stream right after: every read sees its own batch, so the compute stream waited
    // for the copy, and no copy overwrote a buffer before the read queued ahead of it ran.
    {
      std::array<float*, 2> rotating{static_cast<float*>(Cuda::allocate(n * sizeof(float))),
                                     static_cast<float*>(Cuda::allocate(n * sizeof(float)))};
      std::vector<float*> reads;
      for (int k = 0; k < 6; ++k) {
        for (std::size_t i = 0; i < n; ++i) batch[i] = static_cast<float>(k * 1000 + static_cast<int>(i % 1000));
        Cuda::upload_rotating(rotating[static_cast<std::size_t>(k % 2)], batch.data(), n * sizeof(float), k < 2);
        reads.push_back(static_cast<float*>(Cuda::allocate(n * sizeof(float))));
        Cuda::copy(reads.back(), rotating[static_cast<std::size_t>(k % 2)], n * sizeof(float));  // compute stream
      }
      for (int k = 0; k < 6; ++k) {
        Cuda::copy_to_host(back.data(), reads[static_cast<std::size_t>(k)], n * sizeof(float));
        Cuda::synchronize();
        bool same = true;
        for (std::size_t i = 0; i < n; ++i)
          same = same && back[i] == static_cast<float>(k * 1000 + static_cast<int>(i % 1000));
        check(same, "rotating upload " + std::to_string(k) + " read back intact on the compute stream");
        Cuda::deallocate(reads[static_cast<std::size_t>(k)], n * sizeof(float));
      }
      for (float* p : rotating) Cuda::deallocate(p, n * sizeof(float));
    }

    // cuBLAS on the stream: C = A B for 3x4 times 4x2 (column-major), against the CPU.
    const int m = 3, k = 4, cols = 2;
    std::vector<float> A(m * k), B(k * cols), C(m * cols, 0.0f), expected(m * cols, 0.0f);
    for (int i = 0; i < m * k; ++i) A[i] = 0.25f * static_cast<float>(i + 1);
    for (int i = 0; i < k * cols; ++i) B[i] = 1.0f - 0.1f * static_cast<float>(i);
    for (int j = 0; j < cols; ++j)
      for (int i = 0; i < m; ++i)
        for (int l = 0; l < k; ++l) expected[j * m + i] += A[l * m + i] * B[j * k + l];
    auto* dA = static_cast<float*>(Cuda::allocate(A.size() * sizeof(float)));
    auto* dB = static_cast<float*>(Cuda::allocate(B.size() * sizeof(float)));
    auto* dC = static_cast<float*>(Cuda::allocate(C.size() * sizeof(float)));
    Cuda::copy_to_device(dA, A.data(), A.size() * sizeof(float));
    Cuda::copy_to_device(dB, B.data(), B.size() * sizeof(float));
    const float one = 1.0f, zero = 0.0f;
    TESSERA_CUBLAS_CHECK(cublasSgemm(Cuda::cublas(), CUBLAS_OP_N, CUBLAS_OP_N, m, cols, k, &one, dA, m, dB, k, &zero, dC, m));
    Cuda::copy_to_host(C.data(), dC, C.size() * sizeof(float));
    Cuda::synchronize();
    double worst = 0;
    for (int i = 0; i < m * cols; ++i) worst = std::max(worst, static_cast<double>(std::abs(C[i] - expected[i])));
    check(worst < 1e-5, "cuBLAS sgemm on the device stream equals the CPU product");
    check(Cuda::cudnn() != nullptr, "a cuDNN handle exists for the device");

    // An error names the library, the call and where it was made.
    bool threw = false;
    try {
      TESSERA_CUDA_CHECK(cudaMemcpy(nullptr, h, 16, cudaMemcpyHostToDevice));
    } catch (const CudaError& e) {
      threw = true;
      const std::string text = e.what();
      check(text.find("CUDA error") != std::string::npos && text.find("cudaMemcpy(nullptr") != std::string::npos &&
                text.find("test_cuda_device.cpp:") != std::string::npos,
            "the error names the call and its file:line: " + text);
    }
    check(threw, "a bad cudaMemcpy throws CudaError");
    Cuda::deallocate(d1, n * sizeof(float));
    Cuda::deallocate(dA, A.size() * sizeof(float));
    Cuda::deallocate(dB, B.size() * sizeof(float));
    Cuda::deallocate(dC, C.size() * sizeof(float));
    Cuda::deallocate(b, 1 << 20);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED with an exception: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", failures == 0 ? "all Cuda device checks passed" : "Cuda device checks failed");
  return failures == 0 ? 0 : 1;
}
