// The Cuda kernels as a host compiler sees them: the declarations of every launcher that
// kernels/cuda/*.cuh defines (the Cuda overloads of kernels/cpu/*.hpp, same names and arguments),
// and the list of their float and double instances.
//
// Why. A CUDA translation unit compiled by nvcc costs about 2.3 times its host half: cudafe++ and
// cicc parse the whole unit again to find its device code (docs/testing.md). The meson build
// therefore compiles the kernels once, in the library tessera_cuda_kernels (src/kernels_cuda.cu,
// which expands TESSERA_CUDA_KERNEL_INSTANCES), and defines TESSERA_COMPILED_CUDA_KERNELS on
// tessera_cuda_dep: a GPU program is then an ordinary .cpp compiled by the host compiler, which
// sees these declarations (kernels/elementwise.hpp and its siblings include this header) and
// links the instances. A unit compiled by nvcc sees the definitions as before (each .cuh
// includes this header first, so a launcher's declaration and definition cannot drift apart),
// and a program built without meson stays header-only: compile its GPU units with nvcc.
//
// The generic map kernels (map_forward, map_backward) are instantiated for the per-element Ops
// Tessera ships (LeakyReluOp, and GELU's tanh form, detail::GeluTanhMath). A Pointwise layer with
// an Op of your own runs on the GPU from a unit compiled by nvcc, where the kernels are
// instantiated for it; from a host-compiled unit the linker reports map_forward<S, YourOp>
// undefined.
#pragma once

#include <cstdint>

#include "tessera/core/half.hpp"
#include "tessera/core/random.hpp"
#include "tessera/kernels/attention_dims.hpp"
#include "tessera/kernels/conv2d_geometry.hpp"
#include "tessera/kernels/cpu/batch_norm.hpp"
#include "tessera/kernels/cpu/optim.hpp"
#include "tessera/kernels/cpu/pool.hpp"

namespace tessera {

class Cuda;  // device/cuda.cuh; complete wherever a launcher is called

// Elementwise (elementwise.cuh).
template <class S, class Op>
void map_forward(Cuda, const Op& op, const S* x, std::int64_t n, S* y);
template <class S, class Op>
void map_backward(Cuda, const Op& op, const S* dy, const S* x, const S* y, std::int64_t n, S* dx);
template <class S>
void fill_elements(Cuda, S* p, std::int64_t n, S value);
template <class S>
void relu_forward(Cuda, const S* x, std::int64_t n, S* y);
template <class S>
void relu_backward(Cuda, const S* dy, const S* y, std::int64_t n, S* dx);
template <class S>
void gelu_forward(Cuda, const S* x, std::int64_t n, S* y);
template <class S>
void gelu_backward(Cuda, const S* dy, const S* x, std::int64_t n, S* dx);
template <class S>
void multiply(Cuda, const S* a, const S* b, std::int64_t n, S* out);
template <class S>
void add(Cuda, const S* a, const S* b, std::int64_t n, S* out);
template <class S>
void add_relu_forward(Cuda, const S* a, const S* b, std::int64_t n, S* y);
template <class S>
void add_relu_backward(Cuda, const S* a, const S* b, const S* y, std::int64_t n, S* out);
template <class S>
void dropout_mask(Cuda, std::int64_t n, double p, Rng& rng, S* mask);
template <class S>
void dropout_rows(Cuda, const DropoutKey& key, std::int64_t batch, std::int64_t t, std::int64_t width, const S* x,
                  S* y);
template <class S>
void broadcast_rows(Cuda, const S* b, std::int64_t rows, std::int64_t cols, S* y);
template <class S>
void add_column_sums(Cuda, const S* dy, std::int64_t rows, std::int64_t cols, S* db);
template <class S>
void unscale_and_flag(Cuda, S* g, std::int64_t n, S inv_scale, std::int32_t* found_nonfinite);
template <class S>
void scale_elements(Cuda, const S* x, std::int64_t n, S scale, S* out);
template <class S, class W>
void cast_to_wire(Cuda, const S* x, std::int64_t n, W* out);
template <class S, class W>
void cast_from_wire(Cuda, const W* x, std::int64_t n, S* out);
template <class S, class W>
void add_from_wire(Cuda, const W* x, std::int64_t n, S* out);
template <class S>
void copy_2d(Cuda, S* dst, std::int64_t dst_pitch, const S* src, std::int64_t src_pitch, std::int64_t width,
             std::int64_t rows);
template <class S>
void accumulate_2d(Cuda, S* dst, std::int64_t dst_pitch, const S* src, std::int64_t src_pitch, std::int64_t width,
                   std::int64_t rows);
template <class S>
void add_broadcast_rows(Cuda, const S* b, std::int64_t rows, std::int64_t cols, S* y);
template <class S>
void nchw_to_nhwc(Cuda, std::int64_t n, std::int64_t c, std::int64_t hw, const S* x, S* y);
template <class S>
void nhwc_to_nchw(Cuda, std::int64_t n, std::int64_t c, std::int64_t hw, const S* x, S* y);

// Matrix product through cuBLAS (gemm.cuh).
template <class S>
void gemm(Cuda, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, S alpha, const S* a,
          std::int64_t lda, const S* b, std::int64_t ldb, S beta, S* c, std::int64_t ldc);
template <class S>  // float only: bfloat16 products, float sums (TESSERA_CUDA_BF16_INSTANCES)
void gemm_bf16(Cuda, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, S alpha, const S* a,
               std::int64_t lda, const S* b, std::int64_t ldb, S beta, S* c, std::int64_t ldc);

// Convolution through cuDNN (conv2d.cuh): the CPU blocking and workspace arguments are unused.
template <class S>
void conv2d_forward(Cuda, const Conv2dGeometry& g, const Conv2dBlocking& cpu_blocking, std::int64_t batch,
                    const S* x, const S* w, const S* bias, S* y, S* cpu_workspace);
template <class S>
void conv2d_bias_backward(Cuda, std::int64_t batch, std::int64_t channels, std::int64_t plane, const S* dy, S* db);
template <class S>
void conv2d_backward(Cuda, const Conv2dGeometry& g, const Conv2dBlocking& cpu_blocking, std::int64_t batch,
                     const S* x, const S* w, const S* dy, S* dw, S* dx, S* cpu_workspace);
template <class S>
void conv2d_forward_epilogue(Cuda, const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x,
                             const S* w, const ConvEpilogue<S>& e, S* y, S* workspace);

// Batch normalization (batch_norm.cuh).
template <class S>
void batch_norm_local_stats(Cuda, const S* x, BatchNormShape s, double* sum, double* sumsq);
template <class S>
void batch_norm_finalize_stats(Cuda, std::int64_t channels, const double* sum, const double* sumsq,
                               std::int64_t count, double eps, S* mean, S* invstd);
template <class S>
void batch_norm_update_running(Cuda, std::int64_t channels, const double* sum, const double* sumsq,
                               std::int64_t count, double momentum, S* running_mean, S* running_var);
template <class S>
void batch_norm_invstd(Cuda, std::int64_t channels, const S* var, double eps, S* invstd);
template <class S>
void batch_norm_normalize(Cuda, const S* x, BatchNormShape s, const S* mean, const S* invstd, const S* gamma,
                          const S* beta, S* y, bool relu = false);
template <class S>
void batch_norm_normalize_add_relu(Cuda, const S* x, BatchNormShape s, const S* mean, const S* invstd, const S* gamma,
                                   const S* beta, const S* addend, S* y);
template <class S>
void batch_norm_backward_local_sums(Cuda, const S* dy, const S* x, BatchNormShape s, const S* mean,
                                    const S* invstd, double* sum_dy, double* sum_dy_xhat, bool relu = false,
                                    const S* gamma = nullptr, const S* beta = nullptr);
template <class S>
void batch_norm_backward_input(Cuda, const S* dy, const S* x, BatchNormShape s, const S* mean, const S* invstd,
                               const S* gamma, const double* sum_dy, const double* sum_dy_xhat, std::int64_t count,
                               S* dx, bool relu = false, const S* beta = nullptr);
template <class S>
void batch_norm_backward_input_affine(Cuda, const S* dy, BatchNormShape s, const S* invstd, const S* gamma, S* dx,
                                      bool relu = false, const S* x = nullptr, const S* mean = nullptr,
                                      const S* beta = nullptr);
template <class S>
void batch_norm_accumulate_affine_grads(Cuda, std::int64_t channels, const double* sum_dy, const double* sum_dy_xhat,
                                        S* dgamma, S* dbeta);

// Pooling (pool.cuh).
template <class S>
void max_pool2d_forward(Cuda, const Pool2dGeometry& g, std::int64_t planes, const S* x, S* y, std::int32_t* argmax);
template <class S>
void max_pool2d_backward(Cuda, const Pool2dGeometry& g, std::int64_t planes, const S* dy, const std::int32_t* argmax,
                         S* dx);
template <class S>
void avg_pool2d_forward(Cuda, const Pool2dGeometry& g, std::int64_t planes, const S* x, S* y);
template <class S>
void avg_pool2d_backward(Cuda, const Pool2dGeometry& g, std::int64_t planes, const S* dy, S* dx);
template <class S>
void adaptive_avg_pool2d_forward(Cuda, const AdaptivePool2dGeometry& g, std::int64_t planes, const S* x, S* y);
template <class S>
void adaptive_avg_pool2d_backward(Cuda, const AdaptivePool2dGeometry& g, std::int64_t planes, const S* dy, S* dx);
template <class S>
void global_avg_pool_forward(Cuda, std::int64_t planes, std::int64_t plane, const S* x, S* y);
template <class S>
void global_avg_pool_backward(Cuda, std::int64_t planes, std::int64_t plane, const S* dy, S* dx);
template <class S>
void global_avg_pool_channels_last_forward(Cuda, std::int64_t n, std::int64_t c, std::int64_t plane, const S* x, S* y);
template <class S>
void global_avg_pool_channels_last_backward(Cuda, std::int64_t n, std::int64_t c, std::int64_t plane, const S* dy,
                                            S* dx);

// Losses and softmax (loss.cuh, softmax.cuh).
template <class S>
double squared_error_forward(Cuda, const S* y, const S* t, std::int64_t n, S* diff);
template <class S>
void softmax_forward(Cuda, const S* x, std::int64_t outer, std::int64_t dim, std::int64_t inner, bool log, S* y);
template <class S>
void softmax_backward(Cuda, const S* y, const S* dy, std::int64_t outer, std::int64_t dim, std::int64_t inner,
                      bool log, S* dx);
template <class S>
double nll_forward(Cuda, const S* logp, const std::int64_t* labels, std::int64_t n, std::int64_t classes,
                   double smoothing, std::int64_t ignore_index);
template <class S>
void nll_backward(Cuda, const S* logp, const std::int64_t* labels, std::int64_t n, std::int64_t classes,
                  double smoothing, std::int64_t ignore_index, double scale, bool through_softmax, S* dx);

// The transformer layers' kernels (norm.cuh, embedding.cuh, attention.cuh).
template <class S>
void layer_norm_forward(Cuda, const S* x, std::int64_t rows, std::int64_t n, const S* weight, const S* bias, double eps,
                        S* y, S* mean, S* rstd);
template <class S>
void layer_norm_backward(Cuda, const S* x, const S* dy, const S* mean, const S* rstd, const S* weight,
                         std::int64_t rows, std::int64_t n, S* dx, S* dweight, S* dbias);
template <class S>
void rms_norm_forward(Cuda, const S* x, std::int64_t rows, std::int64_t n, const S* weight, double eps, S* y, S* rstd);
template <class S>
void rms_norm_backward(Cuda, const S* x, const S* dy, const S* rstd, const S* weight, std::int64_t rows, std::int64_t n,
                       S* dx, S* dweight);
template <class S>
void embedding_forward(Cuda, const S* weight, std::int64_t dim, const std::int64_t* ids, std::int64_t count, S* y);
template <class S>
void embedding_backward(Cuda, const S* dy, const std::int64_t* ids, std::int64_t count, std::int64_t dim,
                        std::int64_t skip_id, S* dweight);
template <class S>
void attention_forward(Cuda, const AttentionDims& n, const S* q, AttentionLayout ql, const S* k, AttentionLayout kl,
                       const S* v, AttentionLayout vl, double scale, bool causal, S* out, AttentionLayout ol, S* lse);
template <class S>
void attention_backward(Cuda, const AttentionDims& n, const S* q, AttentionLayout ql, const S* k, AttentionLayout kl,
                        const S* v, AttentionLayout vl, const S* out, const S* dout, AttentionLayout ol, const S* lse,
                        double scale, bool causal, S* dq, AttentionLayout dql, S* dk, AttentionLayout dkl, S* dv,
                        AttentionLayout dvl);

// Optimizers (sgd.cuh, adam.cuh, lars.cuh, lamb.cuh).
template <class S>
void sgd_update(Cuda, std::int64_t n, S* p, const S* g, S* buf, const SgdStep& c);
template <class S>
void adam_update(Cuda, std::int64_t n, S* p, const S* g, S* m, S* v, S* v_max, const AdamStep& c);
template <class S>
double l2_norm(Cuda, const S* x, std::int64_t n);
template <class S>
void lars_update(Cuda, std::int64_t n, S* w, const S* g, S* v, S scaled_lr, S m, S decay);
template <class S>
void lamb_moments(Cuda, std::int64_t n, const S* w, const S* g, S* m, S* v, S* r, LambCoefficients<S> c);
template <class S>
void lamb_apply(Cuda, std::int64_t n, S* w, const S* r, S neg_step);

// The instances src/kernels_cuda.cu defines, for S = float and double.
// Adding a launcher above means adding it here, or a host-compiled program fails to link.
#define TESSERA_CUDA_KERNEL_INSTANCES(S)                                                                           \
  template void map_forward<S, LeakyReluOp>(Cuda, const LeakyReluOp&, const S*, std::int64_t, S*);                 \
  template void map_backward<S, LeakyReluOp>(Cuda, const LeakyReluOp&, const S*, const S*, const S*, std::int64_t, \
                                             S*);                                                                  \
  template void map_forward<S, detail::GeluTanhMath>(Cuda, const detail::GeluTanhMath&, const S*, std::int64_t,   \
                                                     S*);                                                          \
  template void map_backward<S, detail::GeluTanhMath>(Cuda, const detail::GeluTanhMath&, const S*, const S*,      \
                                                      const S*, std::int64_t, S*);                                 \
  template void fill_elements<S>(Cuda, S*, std::int64_t, S);                                                       \
  template void relu_forward<S>(Cuda, const S*, std::int64_t, S*);                                                 \
  template void relu_backward<S>(Cuda, const S*, const S*, std::int64_t, S*);                                      \
  template void gelu_forward<S>(Cuda, const S*, std::int64_t, S*);                                                 \
  template void gelu_backward<S>(Cuda, const S*, const S*, std::int64_t, S*);                                      \
  template void multiply<S>(Cuda, const S*, const S*, std::int64_t, S*);                                           \
  template void add<S>(Cuda, const S*, const S*, std::int64_t, S*);                                                \
  template void add_relu_forward<S>(Cuda, const S*, const S*, std::int64_t, S*);                                   \
  template void add_relu_backward<S>(Cuda, const S*, const S*, const S*, std::int64_t, S*);                        \
  template void dropout_mask<S>(Cuda, std::int64_t, double, Rng&, S*);                                             \
  template void dropout_rows<S>(Cuda, const DropoutKey&, std::int64_t, std::int64_t, std::int64_t, const S*, S*);  \
  template void broadcast_rows<S>(Cuda, const S*, std::int64_t, std::int64_t, S*);                                 \
  template void add_column_sums<S>(Cuda, const S*, std::int64_t, std::int64_t, S*);                                \
  template void unscale_and_flag<S>(Cuda, S*, std::int64_t, S, std::int32_t*);                                     \
  template void scale_elements<S>(Cuda, const S*, std::int64_t, S, S*);                                            \
  template void copy_2d<S>(Cuda, S*, std::int64_t, const S*, std::int64_t, std::int64_t, std::int64_t);            \
  template void accumulate_2d<S>(Cuda, S*, std::int64_t, const S*, std::int64_t, std::int64_t, std::int64_t);      \
  template void add_broadcast_rows<S>(Cuda, const S*, std::int64_t, std::int64_t, S*);                             \
  template void nchw_to_nhwc<S>(Cuda, std::int64_t, std::int64_t, std::int64_t, const S*, S*);                    \
  template void nhwc_to_nchw<S>(Cuda, std::int64_t, std::int64_t, std::int64_t, const S*, S*);                    \
  template void gemm<S>(Cuda, bool, bool, std::int64_t, std::int64_t, std::int64_t, S, const S*, std::int64_t,     \
                        const S*, std::int64_t, S, S*, std::int64_t);                                              \
  template void conv2d_forward<S>(Cuda, const Conv2dGeometry&, const Conv2dBlocking&, std::int64_t, const S*,      \
                                  const S*, const S*, S*, S*);                                                     \
  template void conv2d_bias_backward<S>(Cuda, std::int64_t, std::int64_t, std::int64_t, const S*, S*);             \
  template void conv2d_backward<S>(Cuda, const Conv2dGeometry&, const Conv2dBlocking&, std::int64_t, const S*,     \
                                   const S*, const S*, S*, S*, S*);                                                \
  template void conv2d_forward_epilogue<S>(Cuda, const Conv2dGeometry&, const Conv2dBlocking&, std::int64_t,       \
                                           const S*, const S*, const ConvEpilogue<S>&, S*, S*);                    \
  template void batch_norm_local_stats<S>(Cuda, const S*, BatchNormShape, double*, double*);                       \
  template void batch_norm_finalize_stats<S>(Cuda, std::int64_t, const double*, const double*, std::int64_t,       \
                                             double, S*, S*);                                                      \
  template void batch_norm_update_running<S>(Cuda, std::int64_t, const double*, const double*, std::int64_t,       \
                                             double, S*, S*);                                                      \
  template void batch_norm_invstd<S>(Cuda, std::int64_t, const S*, double, S*);                                    \
  template void batch_norm_normalize<S>(Cuda, const S*, BatchNormShape, const S*, const S*, const S*, const S*,    \
                                        S*, bool);                                                                 \
  template void batch_norm_normalize_add_relu<S>(Cuda, const S*, BatchNormShape, const S*, const S*, const S*,   \
                                                 const S*, const S*, S*);                                          \
  template void batch_norm_backward_local_sums<S>(Cuda, const S*, const S*, BatchNormShape, const S*, const S*,    \
                                                  double*, double*, bool, const S*, const S*);                     \
  template void batch_norm_backward_input<S>(Cuda, const S*, const S*, BatchNormShape, const S*, const S*,         \
                                             const S*, const double*, const double*, std::int64_t, S*, bool,       \
                                             const S*);                                                            \
  template void batch_norm_backward_input_affine<S>(Cuda, const S*, BatchNormShape, const S*, const S*, S*, bool,  \
                                                    const S*, const S*, const S*);                                 \
  template void batch_norm_accumulate_affine_grads<S>(Cuda, std::int64_t, const double*, const double*, S*, S*);   \
  template void max_pool2d_forward<S>(Cuda, const Pool2dGeometry&, std::int64_t, const S*, S*, std::int32_t*);     \
  template void max_pool2d_backward<S>(Cuda, const Pool2dGeometry&, std::int64_t, const S*, const std::int32_t*,   \
                                       S*);                                                                        \
  template void avg_pool2d_forward<S>(Cuda, const Pool2dGeometry&, std::int64_t, const S*, S*);                    \
  template void avg_pool2d_backward<S>(Cuda, const Pool2dGeometry&, std::int64_t, const S*, S*);                   \
  template void adaptive_avg_pool2d_forward<S>(Cuda, const AdaptivePool2dGeometry&, std::int64_t, const S*, S*);   \
  template void adaptive_avg_pool2d_backward<S>(Cuda, const AdaptivePool2dGeometry&, std::int64_t, const S*, S*);  \
  template void global_avg_pool_forward<S>(Cuda, std::int64_t, std::int64_t, const S*, S*);                        \
  template void global_avg_pool_backward<S>(Cuda, std::int64_t, std::int64_t, const S*, S*);                       \
  template void global_avg_pool_channels_last_forward<S>(Cuda, std::int64_t, std::int64_t, std::int64_t, const S*, \
                                                        S*);                                                       \
  template void global_avg_pool_channels_last_backward<S>(Cuda, std::int64_t, std::int64_t, std::int64_t,          \
                                                         const S*, S*);                                            \
  template double squared_error_forward<S>(Cuda, const S*, const S*, std::int64_t, S*);                            \
  template void softmax_forward<S>(Cuda, const S*, std::int64_t, std::int64_t, std::int64_t, bool, S*);            \
  template void softmax_backward<S>(Cuda, const S*, const S*, std::int64_t, std::int64_t, std::int64_t, bool, S*); \
  template double nll_forward<S>(Cuda, const S*, const std::int64_t*, std::int64_t, std::int64_t, double,          \
                                 std::int64_t);                                                                    \
  template void nll_backward<S>(Cuda, const S*, const std::int64_t*, std::int64_t, std::int64_t, double,           \
                                std::int64_t, double, bool, S*);                                                   \
  template void layer_norm_forward<S>(Cuda, const S*, std::int64_t, std::int64_t, const S*, const S*, double, S*,   \
                                      S*, S*);                                                                     \
  template void layer_norm_backward<S>(Cuda, const S*, const S*, const S*, const S*, const S*, std::int64_t,       \
                                       std::int64_t, S*, S*, S*);                                                  \
  template void rms_norm_forward<S>(Cuda, const S*, std::int64_t, std::int64_t, const S*, double, S*, S*);          \
  template void rms_norm_backward<S>(Cuda, const S*, const S*, const S*, const S*, std::int64_t, std::int64_t, S*,  \
                                     S*);                                                                          \
  template void embedding_forward<S>(Cuda, const S*, std::int64_t, const std::int64_t*, std::int64_t, S*);          \
  template void embedding_backward<S>(Cuda, const S*, const std::int64_t*, std::int64_t, std::int64_t,             \
                                      std::int64_t, S*);                                                           \
  template void attention_forward<S>(Cuda, const AttentionDims&, const S*, AttentionLayout, const S*,              \
                                     AttentionLayout, const S*, AttentionLayout, double, bool, S*, AttentionLayout, \
                                     S*);                                                                          \
  template void attention_backward<S>(Cuda, const AttentionDims&, const S*, AttentionLayout, const S*,             \
                                      AttentionLayout, const S*, AttentionLayout, const S*, const S*,              \
                                      AttentionLayout, const S*, double, bool, S*, AttentionLayout, S*,            \
                                      AttentionLayout, S*, AttentionLayout);                                       \
  template void sgd_update<S>(Cuda, std::int64_t, S*, const S*, S*, const SgdStep&);                               \
  template void adam_update<S>(Cuda, std::int64_t, S*, const S*, S*, S*, S*, const AdamStep&);                     \
  template double l2_norm<S>(Cuda, const S*, std::int64_t);                                                        \
  template void lars_update<S>(Cuda, std::int64_t, S*, const S*, S*, S, S, S);                                     \
  template void lamb_moments<S>(Cuda, std::int64_t, const S*, const S*, S*, S*, S*, LambCoefficients<S>);          \
  template void lamb_apply<S>(Cuda, std::int64_t, S*, const S*, S);
// The launchers of float only: the bfloat16 products of Env<Cuda, Comm, float, BFloat16>.
#define TESSERA_CUDA_BF16_INSTANCES                                                                                 \
  template void gemm_bf16<float>(Cuda, bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const float*,   \
                                 std::int64_t, const float*, std::int64_t, float, float*, std::int64_t);
// Tensor<T, Cuda>::fill for the integer element types a program keeps on the GPU (GradScaler's
// found-inf flag, labels, masks), and the 16-bit ones of a sharded strategy's wire.
#define TESSERA_CUDA_FILL_INSTANCES(T) template void fill_elements<T>(Cuda, T*, std::int64_t, T);
// The 16-bit wire's casts (FullyShardedDataParallel's param_dtype and reduce_dtype), S float or
// double, W Half or BHalf.
#define TESSERA_CUDA_WIRE_INSTANCES(S, W)                                 \
  template void cast_to_wire<S, W>(Cuda, const S*, std::int64_t, W*);   \
  template void cast_from_wire<S, W>(Cuda, const W*, std::int64_t, S*); \
  template void add_from_wire<S, W>(Cuda, const W*, std::int64_t, S*);

}  // namespace tessera
