// A convolution's geometry (shapes, strides, padding) and the CPU kernel's blocking of it: plain
// arithmetic, no Eigen, so both the CPU kernel (kernels/cpu/conv2d.hpp) and the GPU one
// (kernels/cuda/conv2d.cuh) and the Conv2d layer in either kind of translation unit share it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "tessera/core/linkage.hpp"
#include "tessera/device/cpu.hpp"
#include "tessera/kernels/cpu/capability.hpp"

namespace tessera {

// Output extent of a convolution or pooling window along one axis; 0 when the window does not fit.
inline std::int64_t conv_output_extent(std::int64_t in, std::int64_t kernel, std::int64_t stride, std::int64_t pad,
                                       std::int64_t dilation = 1) {
  const std::int64_t span = in + 2 * pad - dilation * (kernel - 1) - 1;
  return span < 0 ? 0 : span / stride + 1;
}

// Everything about one convolution except the batch size and the data.
struct Conv2dGeometry {
  std::int64_t channels = 0, height = 0, width = 0;  // input C, H, W
  std::int64_t out_channels = 0, groups = 1;         // K, G
  std::int64_t kernel_h = 1, kernel_w = 1, stride_h = 1, stride_w = 1;
  std::int64_t pad_h = 0, pad_w = 0, dilation_h = 1, dilation_w = 1;
  std::int64_t out_height = 0, out_width = 0;  // H', W'
  // x and y in NHWC (MemoryFormat::ChannelsLast); the GPU's kernels only: the CPU's are planar.
  bool channels_last = false;

  std::int64_t in_plane() const { return height * width; }
  std::int64_t out_plane() const { return out_height * out_width; }
  std::int64_t taps() const { return kernel_h * kernel_w; }
  std::int64_t col_rows() const { return channels * taps(); }                  // C kh kw
  std::int64_t group_col_rows() const { return channels / groups * taps(); }  // C/G kh kw
  std::int64_t group_out_channels() const { return out_channels / groups; }   // K/G
  std::int64_t weight_elements() const { return out_channels * group_col_rows(); }
  // 1x1, stride 1, no padding: one sample's input is its own column matrix.
  bool pointwise() const {
    return kernel_h == 1 && kernel_w == 1 && stride_h == 1 && stride_w == 1 && pad_h == 0 && pad_w == 0;
  }
};

// How a CPU convolution is computed: im2col + gemm (any geometry), or Winograd F(4x4, 3x3)
// (kernels/cpu/winograd.hpp: 3x3, stride 1, no dilation, no groups, padding up to 2). Auto picks
// Winograd where it applies and saves enough multiply-adds (see conv2d_blocking).
// What a forward-only (Mode::Inference) convolution applies to each output value before it is
// stored, while the block's output is still in cache: an eval-mode BatchNorm, then optionally a
// residual addend, then optionally a ReLU,
//   y = relu(((conv(x) + bias) - mean) gamma invstd + beta + addend)
// with the BatchNorm's own expression (kernels/cpu/batch_norm.hpp: batch_norm_value), so the value
// is the unfused layers' (pass by pass: one rounding per step, in their order). Per-channel arrays
// are (K); addend is (N, K, H', W') like y. Null bias or addend: none.
template <class S>
struct ConvEpilogue {
  const S* bias = nullptr;
  const S* mean = nullptr;
  const S* invstd = nullptr;
  const S* gamma = nullptr;
  const S* beta = nullptr;
  const S* addend = nullptr;
  bool relu = false;
};

enum class ConvAlgorithm { Auto, Im2col, Winograd };

// The geometries F(4x4, 3x3) handles.
inline bool winograd_applies(const Conv2dGeometry& g) {
  return g.kernel_h == 3 && g.kernel_w == 3 && g.stride_h == 1 && g.stride_w == 1 && g.dilation_h == 1 &&
         g.dilation_w == 1 && g.groups == 1 && g.pad_h <= 2 && g.pad_w <= 2;
}

// How the output positions are cut into per-thread blocks (see the header comment).
struct Conv2dBlocking {
  std::int64_t samples = 1;  // whole samples per block; when 1, a block may be a band of rows
  std::int64_t rows = 1;     // output rows per band (out_height when blocks are whole samples; Winograd: 4k)
  std::int64_t threads = 1;  // threads the workspace was sized for
  bool parallel_backward = false;  // sample groups split over threads, each with a private dw
  bool winograd = false;           // F(4x4, 3x3) instead of im2col (kernels/cpu/winograd.hpp)
  // Winograd's forward and dw passes split by position, not by block (kernels/cpu/winograd.hpp,
  // "Blocks split by position"): one block per thread, channel counts multiples of 16, and the
  // transformed filters larger than the blocks' tile matrices. Backward then keeps one dU, not one
  // per thread.
  bool winograd_by_position = false;
  // im2col products in bfloat16 (Env<..., BFloat16>). Winograd's 36 products stay float: they are
  // small (channels x tiles), so packing to bfloat16 eats the gain (measured: ResNet-20 and
  // ResNet-50 b8 no faster), and F(4x4, 3x3)'s transforms would amplify bfloat16's rounding.
  bool bf16 = false;

  std::int64_t bands(const Conv2dGeometry& g) const { return (g.out_height + rows - 1) / rows; }
  std::int64_t groups(std::int64_t batch) const { return (batch + samples - 1) / samples; }
  std::int64_t max_columns(const Conv2dGeometry& g) const { return samples * rows * g.out_width; }
  bool direct(const Conv2dGeometry& g) const { return g.pointwise() && samples == 1; }

  // Per-thread buffers: col (C kh kw, columns) unless direct, and the (K, columns) staging
  // buffer of multi-sample blocks; then (threads - 1) private dw accumulators for backward.
  std::int64_t col_elements(const Conv2dGeometry& g) const {
    return direct(g) ? 0 : g.col_rows() * max_columns(g);
  }
  std::int64_t stage_elements(const Conv2dGeometry& g) const {
    return samples == 1 ? 0 : g.out_channels * max_columns(g);
  }
  std::int64_t thread_elements(const Conv2dGeometry& g) const {
    if (winograd) return 2 * winograd_tile_matrix_elements(g) + winograd_band_elements(g);
    return col_elements(g) + stage_elements(g);
  }
  // Winograd: the transformed filters U (36, K, C), shared by the team, before the threads' buffers.
  std::int64_t shared_elements(const Conv2dGeometry& g) const {
    return winograd ? 36 * g.out_channels * g.channels : 0;
  }
  std::int64_t workspace_elements(const Conv2dGeometry& g, bool backward) const {
    std::int64_t private_gradients = 0;  // per thread but the first (im2col) or every thread (Winograd's dU)
    // (+ 16: whole-vector loads of the last dU row may read past it.)
    if (backward && winograd)
      private_gradients = (winograd_by_position ? 1 : threads) * 36 * g.out_channels * g.channels + 16;
    if (backward && !winograd && parallel_backward) private_gradients = (threads - 1) * g.weight_elements();
    return shared_elements(g) + threads * thread_elements(g) + private_gradients;
  }

  // Winograd's tiles: 4x4 outputs each, over the forward pass (H' x W') and the dx pass (H x W).
  static std::int64_t winograd_tiles_w(const Conv2dGeometry& g) { return (std::max(g.out_width, g.width) + 3) / 4; }
  std::int64_t winograd_max_tiles(const Conv2dGeometry& g) const {
    return samples * ((rows + 3) / 4) * winograd_tiles_w(g);
  }
  // V (36, channels, tiles) or M (36, channels, tiles), channels the larger of C and K.
  std::int64_t winograd_tile_matrix_elements(const Conv2dGeometry& g) const {
    return 36 * std::max(g.channels, g.out_channels) * winograd_max_tiles(g);
  }
  // One channel's input rows of a block for the input transform: 36 column arrays of the block's
  // tiles, each with 16 elements of slack for whole-vector loads; also the output transforms' 16
  // arrays of tiles. The channel-blocked path instead needs a frame of the block's padded input
  // rows, (samples, 4 tile rows + 2, 4 tiles_w + 2) pixels of up to 16 channels.
  std::int64_t winograd_band_elements(const Conv2dGeometry& g) const {
    const std::int64_t frame = samples * (4 * ((rows + 3) / 4) + 2) * (4 * winograd_tiles_w(g) + 2) * 16;
    return std::max(36 * (winograd_max_tiles(g) + 16), frame);
  }
};

namespace detail {

// A block's column buffer stays in the per-core L2 cache (2 MiB on the machines we tune for, with
// room left for gemm's packed panels); below kMinBlockColumns the product gets too narrow.
constexpr std::int64_t kBlockBytes = 512 * 1024;
constexpr std::int64_t kMinBlockColumns = 256;
// Cap on the private dw accumulators of one layer (threads - 1 copies of its weight): beyond it
// (many threads, large late-stage weights) backward runs its gemms parallel inside instead.
constexpr std::int64_t kMaxPrivateGradientBytes = std::int64_t{32} << 20;
// Below this many elements of work a loop runs on one thread: waking the team would cost more.
constexpr std::int64_t kParallelGrain = 32768;
// Winograd pays for transforming the filters (45 values moved per 3x3 filter, each call; twice that
// in backward) with the multiply-adds it saves per filter over the batch, 9 H' W' - 36 tiles per
// sample; below this saving im2col is faster (measured per layer: ResNet-50's 256-channel 14x14
// layer at batch 1, saving 1188, lost to im2col; its 128-channel 28x28 layer, 5292, won; figures
// in bench/README.md, "Figures behind design choices in the headers").
constexpr std::int64_t kWinogradMinSaving = 2048;
// Fewer input channels than this make 36 products of depth C too shallow for the gemm kernel
// (ResNet-20's 1-channel stem); im2col's single product has depth 9 C.
constexpr std::int64_t kWinogradMinChannels = 8;
// Winograd's private dU (36 K C per thread) may pass kMaxPrivateGradientBytes, up to this bound,
// where the layer saves at least kWinogradMinSavingLargeGradient multiply-adds per output channel
// pair: ResNet-50's 512-channel 7x7 layer (2 threads: 2 x 37.7 MB), forward and backward, won
// with Winograd at batch 16 (saving 4752) and above but lost at batch 8 (saving 2376):
// accumulating dU costs the same per block however few tiles the block has (figures in
// bench/README.md, "Inference and training memory"). Split by position
// (Conv2dBlocking::winograd_by_position: one dU, written once, U read once) that layer's backward
// at batch 8 is a third faster than with private dU, yet still no faster than im2col when memory
// is slow: its three filter transforms move 37.7 MB each (bench/README.md, "Figures behind design
// choices"), so the bound stays. That is where im2col's products run on 16-lane (AVX-512) kernels;
// on a CPU without AVX-512 they run at half that rate, and the same layer at batch 8 (saving 2376)
// is faster with Winograd: kWinogradMinSavingLargeGradientNarrow (its backward faster on a Zen 3 at
// one and two threads; bench/README.md, "Figures behind design choices in the headers").
constexpr std::int64_t kMaxPrivateWinogradGradientBytes = std::int64_t{128} << 20;
constexpr std::int64_t kWinogradMinSavingLargeGradient = 4096;
constexpr std::int64_t kWinogradMinSavingLargeGradientNarrow = 2048;

// Range [lo, hi) of output columns ow whose tap ow * stride + offset lies inside [0, extent).
inline void valid_output_range(std::int64_t offset, std::int64_t stride, std::int64_t extent, std::int64_t out,
                               std::int64_t& lo, std::int64_t& hi) {
  lo = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  hi = extent - 1 - offset < 0 ? 0 : (extent - 1 - offset) / stride + 1;
  lo = std::min(lo, out);
  hi = std::clamp(hi, lo, out);
}

// The samples the busiest thread gets when `batch` samples are cut into groups of `size` and the
// groups into contiguous runs, one per thread (OpenMP's static schedule): the first thread's run.
inline std::int64_t busiest_thread_samples(std::int64_t size, std::int64_t batch, std::int64_t threads) {
  const std::int64_t groups = (batch + size - 1) / size;
  return std::min(batch, (groups + threads - 1) / threads * size);
}

// The group size of whole-sample blocks: the largest up to `most` that loads the busiest thread no
// more than groups of one sample would (ceil(batch / threads) samples). Counting groups is not
// enough: 8 samples in groups of 5 make 2 groups, one per thread, but one thread does 5 samples
// and the other 3 (ResNet-50's 7x7 layers at batch 8 ran at the busier thread's pace); groups of
// 4 balance.
inline std::int64_t balanced_group_size(std::int64_t most, std::int64_t batch, std::int64_t threads) {
  const std::int64_t fair = busiest_thread_samples(1, batch, threads);
  for (std::int64_t s = most; s > 1; --s)
    if (busiest_thread_samples(s, batch, threads) <= fair) return s;
  return 1;
}

// Rows of the most loaded thread when `batch` samples of `extent` rows are cut into bands of
// `rows` (the last one shorter) and the batch x bands blocks, sample by sample, are dealt to the
// threads in contiguous runs (OpenMP's static schedule).
inline std::int64_t busiest_thread_rows(std::int64_t extent, std::int64_t rows, std::int64_t batch,
                                        std::int64_t threads) {
  const std::int64_t bands = (extent + rows - 1) / rows, last = extent - (bands - 1) * rows;
  const std::int64_t blocks = batch * bands, per_thread = (blocks + threads - 1) / threads;
  std::int64_t busiest = 0;
  for (std::int64_t t = 0; t < threads; ++t) {
    const std::int64_t a = std::min(blocks, t * per_thread), b = std::min(blocks, a + per_thread);
    // Blocks i in [a, b) with i % bands == bands - 1 are a sample's last, shorter band.
    busiest = std::max(busiest, (b - a) * rows - (b / bands - a / bands) * (rows - last));
  }
  return busiest;
}

// Rows per band for `extent` rows (or Winograd tile rows) and a cache budget of `most`: the height
// in [least, most] whose busiest thread has the fewest rows, the tallest of those (fewer, larger
// blocks), then evened out over its number of bands. Batch 1 at 2 threads: 2 bands of 28 rows, not
// one of 36 and one of 20, which had left a thread idle for a quarter of ResNet-50's 56x56 1x1
// layers.
inline std::int64_t balanced_band_rows(std::int64_t extent, std::int64_t most, std::int64_t least, std::int64_t batch,
                                       std::int64_t threads) {
  std::int64_t best = most, best_load = busiest_thread_rows(extent, most, batch, threads);
  for (std::int64_t rows = most - 1; rows >= std::max<std::int64_t>(least, 1); --rows) {
    const std::int64_t load = busiest_thread_rows(extent, rows, batch, threads);
    if (load < best_load) best = rows, best_load = load;
  }
  const std::int64_t bands = (extent + best - 1) / best;
  return (extent + bands - 1) / bands;
}

// Whether a Winograd pass of `blocks` blocks and `tiles` tiles in all runs split by position
// (kernels/cpu/winograd.hpp, "Blocks split by position"): one block per thread of the team, and the
// transformed filters (K C per position) larger than all blocks' tile matrices (T (C + K)).
inline bool winograd_by_position(std::int64_t blocks, std::int64_t team, std::int64_t tiles, std::int64_t in_ch,
                                 std::int64_t out_ch) {
  return team > 1 && blocks == team && in_ch * out_ch > tiles * (in_ch + out_ch);
}

// Whether Auto picks Winograd for g at this batch (see kWinogradMinSaving, kWinogradMinChannels;
// with a backward, every thread's private dU (36 K C) must also fit kMaxPrivateGradientBytes, or
// kMaxPrivateWinogradGradientBytes for a large saving; `by_position`: the team keeps one dU;
// `forward_only` (Mode::Inference) has no dU: ResNet-50's 512-channel 7x7 layers then take
// Winograd from batch 7 on, faster than im2col there: bench/README.md; `wide_products`: im2col's
// products would run on 16-lane kernels (cpu_avx512), which sets the saving a large dU needs).
inline bool winograd_pays(const Conv2dGeometry& g, std::int64_t batch, std::int64_t scalar_bytes,
                          std::int64_t threads, bool forward_only = false, bool by_position = false,
                          bool wide_products = true) {
  const std::int64_t tiles = ((g.out_height + 3) / 4) * ((g.out_width + 3) / 4);
  const std::int64_t saving = batch * (9 * g.out_plane() - 36 * tiles);
  const std::int64_t private_du = (by_position ? 1 : threads) * 36 * g.out_channels * g.channels * scalar_bytes;
  return g.channels >= kWinogradMinChannels && g.out_channels >= kWinogradMinChannels && saving >= kWinogradMinSaving &&
         (forward_only || private_du <= kMaxPrivateGradientBytes ||
          (private_du <= kMaxPrivateWinogradGradientBytes &&
           saving >= (wide_products ? kWinogradMinSavingLargeGradient : kWinogradMinSavingLargeGradientNarrow)));
}

}  // namespace detail

// Blocking for a batch: blocks of about kBlockBytes of columns (or `block_columns` columns when
// positive: tests and tuning), as bands of rows on large images, else as groups of whole samples
// whose number is rounded to a multiple of the threads so that backward (one group per thread at
// a time) stays balanced. Backward splits the groups over the threads when there are enough of
// them and the private dw copies fit in kMaxPrivateGradientBytes.
// Winograd (where `algorithm` asks for it, or Auto finds it pays) blocks tiles the same way: its
// V and M matrices take the L2 budget, `block_columns` counts tiles, and bands are an even number
// of rows (whole tiles); its backward blocks are all independent (private dU), so it runs them
// over the team whenever there are enough blocks; with exactly one block per thread and filters
// larger than the tiles, forward and backward split by position instead (winograd_by_position).
// `bf16`: the im2col products in bfloat16; Auto still picks (float) Winograd where it pays: since
// the channel-blocked path, float Winograd's 4x fewer multiply-adds beat bfloat16 im2col's
// twice-as-fast ones (ResNet-20 and ResNet-50 b8 under CpuLocalBf16 on Zen 4; bench/README.md,
// "bfloat16"). Before it, bfloat16 im2col won, and Auto did not pick Winograd with bfloat16. `forward_only`: the caller runs no backward (Mode::Inference),
// so Auto ignores the bound on Winograd's private dU.
TESSERA_LINKAGE Conv2dBlocking conv2d_blocking(const Conv2dGeometry& g, std::int64_t batch, std::int64_t scalar_bytes,
                                      std::int64_t block_columns = 0, ConvAlgorithm algorithm = ConvAlgorithm::Auto,
                                      bool bf16 = false, bool forward_only = false);

#if TESSERA_HEADER_DEFINITIONS

namespace detail {

// conv2d_blocking's two halves: the blocking of Winograd's tiles (which Auto then weighs) and
// of im2col's columns; `b` carries the threads and the bfloat16 flag.
TESSERA_LINKAGE Conv2dBlocking winograd_blocking(const Conv2dGeometry& g, std::int64_t batch, std::int64_t scalar_bytes,
                                               std::int64_t block_columns, Conv2dBlocking b) {
  b.winograd = true;
  const std::int64_t tiles_w = Conv2dBlocking::winograd_tiles_w(g);
  const std::int64_t tiles_h = (std::max(g.out_height, g.height) + 3) / 4;
  const std::int64_t tile_bytes = 2 * 36 * std::max(g.channels, g.out_channels) * scalar_bytes;  // V and M
  const std::int64_t target =
      block_columns > 0 ? block_columns : std::max<std::int64_t>(32, detail::kBlockBytes / tile_bytes);
  const std::int64_t per_sample = tiles_h * tiles_w;
  if (per_sample > target) {
    // Not below 2 tile rows: thinner blocks re-read the transformed filters U too often.
    const std::int64_t most = std::clamp<std::int64_t>(target / tiles_w, 1, tiles_h);
    b.rows = 4 * detail::balanced_band_rows(tiles_h, most, std::min<std::int64_t>(2, most),
                                            std::max<std::int64_t>(batch, 1), b.threads);
  } else {
    b.rows = 4 * tiles_h;
    b.samples = detail::balanced_group_size(std::clamp<std::int64_t>(target / per_sample, 1, std::max<std::int64_t>(batch, 1)),
                                            std::max<std::int64_t>(batch, 1), b.threads);
  }
  b.parallel_backward = b.threads > 1 && b.groups(batch) * b.bands(g) >= b.threads;
  // The forward pass's blocks and tiles, as kernels/cpu/winograd.hpp counts them; channel counts
  // that are multiples of 16 run the channel-blocked path whatever the vector width.
  const std::int64_t blocks = b.groups(batch) * ((g.out_height + b.rows - 1) / b.rows);
  const std::int64_t tiles = std::max<std::int64_t>(batch, 1) * ((g.out_height + 3) / 4) * ((g.out_width + 3) / 4);
  b.winograd_by_position = g.channels % 16 == 0 && g.out_channels % 16 == 0 &&
                           winograd_by_position(blocks, b.threads, tiles, g.channels, g.out_channels);
  return b;
}

TESSERA_LINKAGE Conv2dBlocking im2col_blocking(const Conv2dGeometry& g, std::int64_t batch, std::int64_t scalar_bytes,
                                               std::int64_t block_columns, Conv2dBlocking b) {
  const std::int64_t target =
      block_columns > 0
          ? block_columns
          : std::max(detail::kMinBlockColumns, detail::kBlockBytes / std::max<std::int64_t>(g.col_rows() * scalar_bytes, 1));
  const std::int64_t plane = std::max<std::int64_t>(g.out_plane(), 1);
  b.rows = std::max<std::int64_t>(g.out_height, 1);
  if (plane > target) {
    const std::int64_t most = std::clamp<std::int64_t>(target / std::max<std::int64_t>(g.out_width, 1), 1, b.rows);
    b.rows = detail::balanced_band_rows(b.rows, most, (most + 1) / 2, std::max<std::int64_t>(batch, 1), b.threads);
  } else {
    b.samples = detail::balanced_group_size(std::clamp<std::int64_t>(target / plane, 1, std::max<std::int64_t>(batch, 1)),
                                            std::max<std::int64_t>(batch, 1), b.threads);
  }
  b.parallel_backward = b.threads > 1 && b.groups(batch) >= b.threads &&
                        (b.threads - 1) * g.weight_elements() * scalar_bytes <= detail::kMaxPrivateGradientBytes;
  return b;
}

}  // namespace detail

TESSERA_LINKAGE Conv2dBlocking conv2d_blocking(const Conv2dGeometry& g, std::int64_t batch, std::int64_t scalar_bytes,
                                      std::int64_t block_columns, ConvAlgorithm algorithm,
                                      bool bf16, bool forward_only) {
  Conv2dBlocking b;
  b.threads = Cpu::num_threads();
  b.bf16 = bf16;
  if (winograd_applies(g) && algorithm != ConvAlgorithm::Im2col) {
    const Conv2dBlocking w = detail::winograd_blocking(g, batch, scalar_bytes, block_columns, b);
    if (algorithm == ConvAlgorithm::Winograd ||
        detail::winograd_pays(g, batch, scalar_bytes, b.threads, forward_only, w.winograd_by_position,
                              cpu_avx512()))
      return w;
  }
  return detail::im2col_blocking(g, batch, scalar_bytes, block_columns, b);
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
