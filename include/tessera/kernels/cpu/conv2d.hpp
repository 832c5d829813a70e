// 2-D convolution on the CPU by im2col + gemm (the Caffe / PyTorch-THNN formulation), NCHW.
//
//   x (N, C, H, W), w (K, C/G, kh, kw), b (K)  ->  y (N, K, H', W')
//   H' = (H + 2 ph - dh (kh - 1) - 1) / sh + 1      (likewise W')
//   y[n, k, oh, ow] = b[k] + sum_{c in group(k), i, j} w[k, c, i, j] x[n, c, oh sh - ph + i dh, ow sw - pw + j dw]
//
// im2col turns a block of output positions into the matrix col (C kh kw, columns) whose row
// (c, i, j) holds the input pixel each position sees through tap (i, j) of channel c (zero in the
// padding). For group g:   y_g (K/G, columns) = w_g (K/G, C/G kh kw) x col_g.
// Backward with dy (N, K, H', W'):
//   dw_g += dy_g x col_g^T        db += sum over n, oh, ow of dy        dx = col2im(w_g^T dy_g)
// col is recomputed from x in backward (storing it per micro-batch would cost kh kw times the input).
//
// Work is cut into blocks, each handled by one thread with a single-threaded gemm on its own
// column buffer: either a band of output rows of one sample (large images: the band's columns
// fit in L2, so im2col writes and the gemm reads hit the cache) or several whole samples (small
// images such as ResNet's 7x7 stage, where one sample's product would be too narrow; costs a
// copy between the (K, samples H' W') product and NCHW). Forward blocks are independent. In
// backward, bands of one sample overlap in dx, so a thread owns whole samples, and each thread
// accumulates dw privately; the partial sums are added at the end. With fewer sample groups than
// threads, or when the private copies of dw would take too much memory, backward runs the groups
// one after another with gemm parallel inside instead.
// A 1x1, stride-1, unpadded convolution needs no im2col on single-sample blocks: the input of one
// sample already is the (C, H W) matrix.
#pragma once

#include <algorithm>
#include <cstdint>

#include "tessera/device/cpu.hpp"
#include "tessera/kernels/conv2d_geometry.hpp"
#include "tessera/kernels/cpu/compiled.hpp"
#include "tessera/kernels/cpu/conv_epilogue.hpp"
#include "tessera/kernels/cpu/gemm.hpp"
#include "tessera/kernels/cpu/gemm_bf16.hpp"
#include "tessera/kernels/cpu/gemm_unpacked.hpp"
#include "tessera/kernels/cpu/short_rows.hpp"
#include "tessera/kernels/cpu/winograd.hpp"

namespace tessera {

namespace detail {

// Which products conv_gemm gives the unpacked kernel (kernels/cpu/gemm_unpacked.hpp) instead of
// OpenBLAS: from kUnpackedMinColumns columns on (one whole vector; the narrowest product of a
// ResNet-50 at 224x224 and batch 1 is 49 columns, nothing narrower was measured). Below
// kUnpackedWideColumns a product is thin (ResNet-50's 14x14 and 7x7 layers at batch 1: 196 and
// 49 columns) and its weights are the most of what it reads, from memory: it walks k in blocks of
// kUnpackedThinDepth steps, so that each of a tile's six rows is read in runs of 4 KiB, which
// the hardware prefetcher follows, and b's piece (1024 x 64 floats, 256 KiB) stays in L2. With
// the wide products' 64-step blocks (1 KiB to 256 B runs), the unpacked kernel lost to OpenBLAS
// at 196 columns; with deep blocks it wins there, and a ResNet-50 forward at batch 1 is faster
// (figures in bench/README.md, "Figures behind design choices in the headers"). A thin product of
// more than one panel of 64 columns runs in blocks of 96 rows by 512 steps instead, every panel
// inside each block, so the weights are read from memory once rather than once per panel
// (gemm_unpacked.hpp, kThinRowBlock).
constexpr std::int64_t kUnpackedMinColumns = 16;
constexpr std::int64_t kUnpackedWideColumns = 256;
constexpr std::int64_t kUnpackedThinDepth = 1024;
// The depth_block conv_gemm gives the unpacked kernel for a product n columns wide: deep blocks when
// it is thin, the kernel's own default (0) otherwise.
constexpr std::int64_t unpacked_depth_block(std::int64_t n) {
  return n < kUnpackedWideColumns ? kUnpackedThinDepth : 0;
}

// Stride 1 with W' = W (a "same"-width convolution, e.g. 3x3 with padding 1): the columns of one
// sample's rows [oh0, oh1) for tap (i, j) are the input rows [ih0, ih1) read as one run shifted
// by w_offset, except the entries of output columns outside [lo, hi) (they wrap into the
// neighbouring row; their tap lies in the padding). One long contiguous copy instead of one short
// one per row: on ResNet's 28/14/7-wide images the per-row loop cost most of the time.
inline bool contiguous_taps(const Conv2dGeometry& g) {
  return g.stride_h == 1 && g.stride_w == 1 && g.out_width == g.width;
}

// 1x1, stride 2 both ways, unpadded (ResNet's downsampling shortcuts): output (oh, ow) reads input
// (2 oh, 2 ow) and nothing else does, so a col row is a plane's even rows' even columns
// (detail::gather_rows_stride2), and col2im assigns whole input rows, band by band, the pixels no
// output reads set to 0 (detail::scatter_rows_stride2): dx is not zeroed first.
inline bool subsample_taps(const Conv2dGeometry& g) {
  return g.kernel_h == 1 && g.kernel_w == 1 && g.stride_h == 2 && g.stride_w == 2 && g.pad_h == 0 && g.pad_w == 0;
}

// Output rows [a, b) of [oh0, oh1) whose input row oh - pad_h + i dh (stride 1) lies inside [0, H).
inline void valid_row_range(const Conv2dGeometry& g, std::int64_t i, std::int64_t oh0, std::int64_t oh1,
                            std::int64_t& a, std::int64_t& b) {
  const std::int64_t h_offset = i * g.dilation_h - g.pad_h;
  a = std::clamp(-h_offset, oh0, oh1);
  b = std::clamp(g.height - h_offset, a, oh1);
}

// Zeroes columns [0, lo) and [hi, w) of `rows` rows of width w: the entries whose tap lies in the
// horizontal padding. Column by column: the pieces are one or two values wide, and row by row the
// compiler would turn each into a call to memset.
template <class S>
void zero_wrapped_columns(S* m, std::int64_t rows, std::int64_t w, std::int64_t lo, std::int64_t hi) {
  for (std::int64_t ow = 0; ow < lo; ++ow)
    for (std::int64_t row = 0; row < rows; ++row) m[row * w + ow] = S(0);
  for (std::int64_t ow = hi; ow < w; ++ow)
    for (std::int64_t row = 0; row < rows; ++row) m[row * w + ow] = S(0);
}

// The tap (index i kw + j) that sees every input pixel exactly once over a whole sample, on the
// contiguous path (the centre tap of an odd "same" kernel), or -1. col2im copies it into dx instead
// of adding it, so dx need not be zeroed first.
inline std::int64_t covering_tap(const Conv2dGeometry& g) {
  if (!contiguous_taps(g) || g.out_height != g.height) return -1;
  if (g.pad_h % g.dilation_h != 0 || g.pad_w % g.dilation_w != 0) return -1;
  const std::int64_t i = g.pad_h / g.dilation_h, j = g.pad_w / g.dilation_w;
  return i < g.kernel_h && j < g.kernel_w ? i * g.kernel_w + j : -1;
}

// Stride 2 in both directions with more than one tap (ResNet's 7x7 stem and its 3x3
// downsampling layers). Input pixel (2 r + py, 2 q + px) lies in phase (py, px) at (r, q), and tap
// (i, j) of output (oh, ow) reads phase ((i - ph) mod 2, (j - pw) mod 2) at (oh + sy, ow + sx),
// sy = floor((i - ph) / 2), sx = floor((j - pw) / 2). Each channel's input rows are split into the
// four phases once (detail::split_row_stride2); a phase plane W' wide then serves each tap as the
// contiguous path does: one long shifted run per tap instead of a stride-2 gather per output row
// (W' = 28, 14, 7 values; im2col and col2im were most of these layers' time beyond the products).
// Needs every phase column of the input to fit in W' (ceil(W / 2) <= W': padding of at least
// (kw - 1) / 2) and a band of at least one output row in kPhaseElements.
constexpr std::int64_t kPhaseElements = 16384;  // on the stack: 64 KiB of float

inline std::int64_t floor_half(std::int64_t v) { return v >= 0 ? v / 2 : -((1 - v) / 2); }

// Asks for the input rows 2 r0 - 1 .. 2 (r0 + rows) of a channel plane (those a pass splits), one
// cache line at a time, while the pass is still copying the previous channel's taps.
template <class S>
inline void prefetch_rows(const S* plane, const Conv2dGeometry& g, std::int64_t r0, std::int64_t rows) {
  const std::int64_t first = std::max<std::int64_t>(0, 2 * r0), last = std::min(g.height, 2 * (r0 + rows));
  const char* begin = reinterpret_cast<const char*>(plane + first * g.width);
  const char* end = reinterpret_cast<const char*>(plane + last * g.width);
  for (const char* p = begin; p < end; p += 64) __builtin_prefetch(p, 0, 3);
}

// Phase rows a band needs beyond its output rows: sy spans [floor(-ph / 2), floor((kh - 1 - ph) / 2)].
inline std::int64_t phase_extra_rows(const Conv2dGeometry& g) {
  return floor_half(g.kernel_h - 1 - g.pad_h) - floor_half(-g.pad_h);
}

inline bool phase_taps(const Conv2dGeometry& g) {
  return g.stride_h == 2 && g.stride_w == 2 && g.dilation_h == 1 && g.dilation_w == 1 && g.taps() > 1 &&
         (g.width + 1) / 2 <= g.out_width &&
         4 * (1 + phase_extra_rows(g)) * g.out_width <= kPhaseElements;
}

// The output rows of one pass over the phase buffer (all of [oh0, oh1) when they fit).
inline std::int64_t phase_band_rows(const Conv2dGeometry& g) {
  return kPhaseElements / (4 * g.out_width) - phase_extra_rows(g);
}

// Whether col2im of output rows [oh0, oh1) on the phase path may assign dx: whole samples, each in
// one pass over the phase buffer, so that every input row is written by one pass only (bands and
// passes share the rows at their edges).
inline bool phase_assigns(const Conv2dGeometry& g, std::int64_t oh0, std::int64_t oh1) {
  return oh0 == 0 && oh1 == g.out_height && phase_band_rows(g) >= g.out_height;
}

// Tap (i, j)'s phase plane (0 to 3) and its shifts (sy, sx), and the output rows [a, b) of
// [oh0, oh1) and columns [lo, hi) whose input pixel lies inside the image.
struct PhaseTap {
  std::int64_t plane, sy, sx, a, b, lo, hi;
  PhaseTap(const Conv2dGeometry& g, std::int64_t i, std::int64_t j, std::int64_t oh0, std::int64_t oh1) {
    const std::int64_t di = i - g.pad_h, dj = j - g.pad_w;
    sy = floor_half(di), sx = floor_half(dj);
    plane = 2 * (di - 2 * sy) + (dj - 2 * sx);
    valid_output_range(di, 2, g.height, g.out_height, a, b);
    a = std::clamp(a, oh0, oh1);
    b = std::clamp(b, a, oh1);
    valid_output_range(dj, 2, g.width, g.out_width, lo, hi);
  }
  bool empty() const { return a == b || lo == hi; }
};

// One pass over the phase buffer: output rows [b0, b1) of sample s, for which each phase plane
// holds `rows` rows of its phase from row r0 on (`plane` = rows W' values).
struct PhasePass {
  std::int64_t s, b0, b1, r0, rows, plane;
};

template <class Body>
void for_each_phase_pass(const Conv2dGeometry& g, std::int64_t samples, std::int64_t oh0, std::int64_t oh1,
                         const Body& body) {
  const std::int64_t extra = phase_extra_rows(g), band = phase_band_rows(g);
  for (std::int64_t s = 0; s < samples; ++s)
    for (std::int64_t b0 = oh0; b0 < oh1; b0 += band) {
      const std::int64_t b1 = std::min(oh1, b0 + band), rows = b1 - b0 + extra;
      body(PhasePass{s, b0, b1, b0 + floor_half(-g.pad_h), rows, rows * g.out_width});
    }
}

}  // namespace detail

// im2col on the phase path (detail::phase_taps; arguments as im2col's).
template <class S>
void im2col_phases(const Conv2dGeometry& g, const S* x, std::int64_t samples, std::int64_t oh0, std::int64_t oh1,
                   S* col, std::int64_t ldcol, std::int64_t row_begin, std::int64_t row_end) {
  const std::int64_t w = g.out_width, taps = g.taps(), sample_cols = (oh1 - oh0) * w;
  alignas(64) S phases[detail::kPhaseElements];
  detail::for_each_phase_pass(g, samples, oh0, oh1, [&](const detail::PhasePass& pass) {
    const std::int64_t b0 = pass.b0, b1 = pass.b1, r0 = pass.r0, plane = pass.plane;
    for (std::int64_t c = row_begin / taps; c * taps < row_end; ++c) {
      const S* in = x + (pass.s * g.channels + c) * g.in_plane();
      if ((c + 1) * taps < row_end) detail::prefetch_rows(in + g.in_plane(), g, r0, pass.rows);
      // Phase rows whose input row lies inside the image; columns past the input's are only
      // ever read inside a run and then zeroed as wrapped columns, but are set all the same.
      for (std::int64_t r = r0; r < r0 + pass.rows; ++r)
        for (std::int64_t py = 0; py < 2; ++py) {
          const std::int64_t ih = 2 * r + py;
          if (ih < 0 || ih >= g.height) continue;
          S* even = phases + 2 * py * plane + (r - r0) * w;
          S* odd = even + plane;
          detail::split_row_stride2(even, odd, in + ih * g.width, g.width);
          std::fill(even + (g.width + 1) / 2, even + w, S(0));
          std::fill(odd + g.width / 2, odd + w, S(0));
        }
      for (std::int64_t t = std::max(row_begin, c * taps); t < std::min(row_end, (c + 1) * taps); ++t) {
        const std::int64_t tap = t - c * taps;
        const detail::PhaseTap p(g, tap / g.kernel_w, tap % g.kernel_w, b0, b1);
        S* out = col + t * ldcol + pass.s * sample_cols + (b0 - oh0) * w;
        if (p.empty()) {
          std::fill(out, out + (b1 - b0) * w, S(0));
          continue;
        }
        std::fill(out, out + (p.a - b0) * w, S(0));
        std::fill(out + (p.b - b0) * w, out + (b1 - b0) * w, S(0));
        S* dst = out + (p.a - b0) * w;
        const S* src = phases + p.plane * plane + (p.a + p.sy - r0) * w + p.lo + p.sx;
        std::copy(src, src + (p.b - p.a - 1) * w + p.hi - p.lo, dst + p.lo);
        detail::zero_wrapped_columns(dst, p.b - p.a, w, p.lo, p.hi);
      }
    }
  });
}

// col2im_add on the phase path: each channel's taps are added into its phase planes (col's
// entries in the padding zeroed first, as on the contiguous path), then the planes are added onto
// dx row by row, interleaved (detail::interleave_row). With `assign` (whole samples, one pass
// each: detail::phase_assigns) the planes are written onto dx instead, and the input rows no tap
// reads are set to 0, so dx need not be zeroed first.
template <class S>
void col2im_add_phases(const Conv2dGeometry& g, S* col, std::int64_t ldcol, std::int64_t samples, std::int64_t oh0,
                       std::int64_t oh1, S* dx, bool assign = false) {
  const std::int64_t w = g.out_width, taps = g.taps(), sample_cols = (oh1 - oh0) * w;
  alignas(64) S phases[detail::kPhaseElements];
  detail::for_each_phase_pass(g, samples, oh0, oh1, [&](const detail::PhasePass& pass) {
    const std::int64_t r0 = pass.r0, plane = pass.plane;
    for (std::int64_t c = 0; c < g.channels; ++c) {
      if (c + 1 < g.channels)
        detail::prefetch_rows(dx + (pass.s * g.channels + c + 1) * g.in_plane(), g, r0, pass.rows);
      std::fill(phases, phases + 4 * plane, S(0));
      for (std::int64_t tap = 0; tap < taps; ++tap) {
        const detail::PhaseTap p(g, tap / g.kernel_w, tap % g.kernel_w, pass.b0, pass.b1);
        if (p.empty()) continue;
        S* src = col + (c * taps + tap) * ldcol + pass.s * sample_cols + (p.a - oh0) * w;
        detail::zero_wrapped_columns(src, p.b - p.a, w, p.lo, p.hi);
        const S* run = src + p.lo;
        S* dst = phases + p.plane * plane + (p.a + p.sy - r0) * w + p.lo + p.sx;
        const std::int64_t length = (p.b - p.a - 1) * w + p.hi - p.lo;
#pragma omp simd
        for (std::int64_t e = 0; e < length; ++e) dst[e] += run[e];
      }
      S* out = dx + (pass.s * g.channels + c) * g.in_plane();
      for (std::int64_t r = r0; r < r0 + pass.rows; ++r)
        for (std::int64_t py = 0; py < 2; ++py) {
          const std::int64_t ih = 2 * r + py;
          if (ih < 0 || ih >= g.height) continue;
          const S* even = phases + 2 * py * plane + (r - r0) * w;
          if (assign)
            detail::interleave_row<true>(out + ih * g.width, even, even + plane, g.width);
          else
            detail::interleave_row(out + ih * g.width, even, even + plane, g.width);
        }
      if (assign) {  // rows past the pass's (a last input row no tap reaches); none before row 0
        const std::int64_t covered = std::clamp<std::int64_t>(2 * (r0 + pass.rows), 0, g.height);
        std::fill(out + covered * g.width, out + g.in_plane(), S(0));
      }
    }
  });
}

// col (C kh kw, ldcol) <- patches of output rows [oh0, oh1) of `samples` consecutive inputs
// x (samples, C, H, W); sample s fills columns [s (oh1 - oh0) W', (s + 1) (oh1 - oh0) W'). Only
// col rows [row_begin, row_end) when row_end >= 0 (a team fills one block's col together). Serial:
// the callers run one block per thread.
template <class S>
void im2col(Cpu, const Conv2dGeometry& g, const S* x, std::int64_t samples, std::int64_t oh0, std::int64_t oh1, S* col,
            std::int64_t ldcol, std::int64_t row_begin = 0, std::int64_t row_end = -1) {
  const std::int64_t taps = g.taps(), rows = row_end >= 0 ? row_end : g.col_rows(), sample_cols = (oh1 - oh0) * g.out_width;
  const bool contiguous = detail::contiguous_taps(g);
#if TESSERA_X86_DISPATCH
  if constexpr (std::is_same_v<S, float>) {
    // Unpadded, stride 1, output rows short and not adjacent (W' < min(W, 16)): whole col rows
    // gathered 16 (AVX-512) or 8 (AVX2) columns at a time (LeNet-5's second layer; faster than
    // copying row by row).
    const S* end = x + samples * g.channels * g.in_plane();  // this block's input
    auto gather_rows = [&](const auto& gather) {
      gather.run([&](auto write) {
        for (std::int64_t s = 0; s < samples; ++s) {
          // (c, i, j) of row r kept by counting: three divisions per row cost about a row's copy.
          std::int64_t c = row_begin / taps, i = row_begin % taps / g.kernel_w, j = row_begin % g.kernel_w;
          for (std::int64_t r = row_begin; r < rows; ++r) {
            const S* src = x + (s * g.channels + c) * g.in_plane() + (oh0 + i) * g.width + j;
            write(col + r * ldcol + s * sample_cols, src, src + gather.reach() <= end);
            if (++j == g.kernel_w) {
              j = 0;
              if (++i == g.kernel_h) i = 0, ++c;
            }
          }
        }
      });
    };
    const bool short_rows = !contiguous && g.stride_h == 1 && g.stride_w == 1 && g.dilation_h == 1 &&
                            g.dilation_w == 1 && g.pad_h == 0 && g.pad_w == 0;
    if (short_rows && cpu_avx512()) {
      detail::ShortRowGather gather;
      if (gather.build(g.width, g.out_width, sample_cols)) return gather_rows(gather);
    } else if (short_rows && cpu_avx2()) {
      detail::ShortRowGatherAvx2 gather;
      if (gather.build(g.width, g.out_width, sample_cols)) return gather_rows(gather);
    }
  }
#endif
  if (detail::phase_taps(g)) return im2col_phases(g, x, samples, oh0, oh1, col, ldcol, row_begin, rows);
  if (detail::subsample_taps(g)) {  // col row c (one tap per channel) of sample s
    for (std::int64_t s = 0; s < samples; ++s)
      for (std::int64_t c = row_begin; c < rows; ++c)
        detail::gather_rows_stride2(col + c * ldcol + s * sample_cols,
                                    x + (s * g.channels + c) * g.in_plane() + 2 * oh0 * g.width, oh1 - oh0,
                                    g.out_width, g.width);
    return;
  }
  for (std::int64_t s = 0; s < samples; ++s) {
    for (std::int64_t r = row_begin; r < rows; ++r) {
      const std::int64_t c = r / taps, i = r % taps / g.kernel_w, j = r % g.kernel_w;
      const S* in = x + (s * g.channels + c) * g.in_plane();
      S* out = col + r * ldcol + s * sample_cols;
      const std::int64_t w_offset = j * g.dilation_w - g.pad_w;  // iw = ow * stride_w + w_offset
      std::int64_t lo, hi;
      detail::valid_output_range(w_offset, g.stride_w, g.width, g.out_width, lo, hi);
      if (contiguous) {
        const std::int64_t w = g.width;
        std::int64_t a, b;
        detail::valid_row_range(g, i, oh0, oh1, a, b);
        std::fill(out, out + (a - oh0) * w, S(0));
        std::fill(out + (b - oh0) * w, out + (oh1 - oh0) * w, S(0));
        if (a == b || lo == hi) {
          std::fill(out + (a - oh0) * w, out + (b - oh0) * w, S(0));
          continue;
        }
        S* dst = out + (a - oh0) * w;
        // The run [lo, (b - a - 1) W + hi) of dst; its source starts inside the plane.
        const std::int64_t length = (b - a - 1) * w + hi - lo;
        const S* src = in + (a - g.pad_h + i * g.dilation_h) * w + w_offset + lo;
        std::copy(src, src + length, dst + lo);
        detail::zero_wrapped_columns(dst, b - a, w, lo, hi);
        continue;
      }
      for (std::int64_t oh = oh0; oh < oh1; ++oh, out += g.out_width) {
        const std::int64_t ih = oh * g.stride_h - g.pad_h + i * g.dilation_h;
        if (ih < 0 || ih >= g.height) {
          std::fill(out, out + g.out_width, S(0));
          continue;
        }
        const S* row = in + ih * g.width;
        // Guarded: most taps have no padding on either side, and each fill is a call to memset.
        if (lo > 0) std::fill(out, out + lo, S(0));
        if (g.stride_w == 1) {
          detail::copy_row(out + lo, row + lo + w_offset, hi - lo);
        } else if (g.stride_w == 2) {
          detail::copy_row_stride2(out + lo, row + 2 * lo + w_offset, hi - lo);
        } else {
          for (std::int64_t ow = lo; ow < hi; ++ow) out[ow] = row[ow * g.stride_w + w_offset];
        }
        if (hi < g.out_width) std::fill(out + hi, out + g.out_width, S(0));
      }
    }
  }
}

// dx (samples, C, H, W) += col2im(col): the inverse scatter of im2col for the same block, each
// column entry added onto the input pixel it was copied from. Serial, like im2col. col is scratch:
// on the contiguous path the entries that fall into the padding are zeroed first, so that one
// shifted run can be added per tap. With `assign` (whole samples, and detail::covering_tap(g) >= 0)
// dx need not be initialized: each channel starts with a copy of the covering tap. With `assign`
// on the subsample path (detail::subsample_taps, any block) the block's input rows [2 oh0,
// min(H, 2 oh1)) are written whole, 0 where no output reads them.
template <class S>
void col2im_add(Cpu, const Conv2dGeometry& g, S* col, std::int64_t ldcol, std::int64_t samples, std::int64_t oh0,
                std::int64_t oh1, S* dx, bool assign = false) {
  const std::int64_t taps = g.taps(), sample_cols = (oh1 - oh0) * g.out_width;
  const bool contiguous = detail::contiguous_taps(g);
  const std::int64_t first_tap = assign ? detail::covering_tap(g) : -1;
  if (detail::phase_taps(g))
    return col2im_add_phases(g, col, ldcol, samples, oh0, oh1, dx, assign && detail::phase_assigns(g, oh0, oh1));
  if (assign && detail::subsample_taps(g)) {
    const std::int64_t in_rows = std::min(g.height, 2 * oh1) - 2 * oh0;
    for (std::int64_t s = 0; s < samples; ++s)
      for (std::int64_t c = 0; c < g.channels; ++c)
        detail::scatter_rows_stride2(dx + (s * g.channels + c) * g.in_plane() + 2 * oh0 * g.width,
                                     col + c * ldcol + s * sample_cols, in_rows, g.out_width, g.width);
    return;
  }
  if (!contiguous && g.stride_w == 1 && g.pad_w == 0 && g.dilation_w == 1) {
    // Unpadded columns (LeNet's 5x5 on 14x14): all kw taps of a kernel row at once, for the output
    // rows whose input row lies inside the plane (detail::add_shifted_rows).
    for (std::int64_t s = 0; s < samples; ++s)
      for (std::int64_t c = 0; c < g.channels; ++c)
        for (std::int64_t i = 0; i < g.kernel_h; ++i) {
          // ih = oh stride_h + i_offset in [0, H) for oh in [a, b).
          const std::int64_t i_offset = i * g.dilation_h - g.pad_h;
          std::int64_t a = oh0, b = oh1;
          while (a < b && a * g.stride_h + i_offset < 0) ++a;
          while (b > a && (b - 1) * g.stride_h + i_offset >= g.height) --b;
          if (a == b) continue;
          S* out = dx + (s * g.channels + c) * g.in_plane() + (a * g.stride_h + i_offset) * g.width;
          const S* in = col + (c * taps + i * g.kernel_w) * ldcol + s * sample_cols + (a - oh0) * g.out_width;
          detail::add_shifted_rows(out, g.stride_h * g.width, in, g.out_width, b - a, ldcol, g.kernel_w, g.out_width);
        }
    return;
  }
  for (std::int64_t s = 0; s < samples; ++s) {
    for (std::int64_t r = 0; r < g.col_rows(); ++r) {
      // Within a channel, the covering tap (when assigning) first, then the others in order.
      const std::int64_t c = r / taps, order = r % taps;
      std::int64_t tap = order;
      if (first_tap >= 0) tap = order == 0 ? first_tap : order <= first_tap ? order - 1 : order;
      const std::int64_t i = tap / g.kernel_w, j = tap % g.kernel_w;
      S* out = dx + (s * g.channels + c) * g.in_plane();
      S* in = col + (c * taps + tap) * ldcol + s * sample_cols;
      const std::int64_t w_offset = j * g.dilation_w - g.pad_w;
      std::int64_t lo, hi;
      detail::valid_output_range(w_offset, g.stride_w, g.width, g.out_width, lo, hi);
      if (contiguous) {
        const std::int64_t w = g.width;
        std::int64_t a, b;
        detail::valid_row_range(g, i, oh0, oh1, a, b);
        if (a == b || lo == hi) continue;
        S* src = in + (a - oh0) * w;
        detail::zero_wrapped_columns(src, b - a, w, lo, hi);
        const std::int64_t length = (b - a - 1) * w + hi - lo;
        const S* run = src + lo;
        S* dst = out + (a - g.pad_h + i * g.dilation_h) * w + w_offset + lo;
        if (tap == first_tap) {
          std::copy(run, run + length, dst);
        } else {
#pragma omp simd
          for (std::int64_t p = 0; p < length; ++p) dst[p] += run[p];
        }
        continue;
      }
      for (std::int64_t oh = oh0; oh < oh1; ++oh, in += g.out_width) {
        const std::int64_t ih = oh * g.stride_h - g.pad_h + i * g.dilation_h;
        if (ih < 0 || ih >= g.height) continue;
        S* row = out + ih * g.width;
        if (g.stride_w == 1) {
          for (std::int64_t ow = lo; ow < hi; ++ow) row[ow + w_offset] += in[ow];
        } else {
          for (std::int64_t ow = lo; ow < hi; ++ow) row[ow * g.stride_w + w_offset] += in[ow];
        }
      }
    }
  }
}

namespace detail {

// One block of work: samples [n0, n0 + count) and, when count == 1, output rows [oh0, oh1).
struct ConvBlock {
  std::int64_t n0, count, oh0, oh1;
  std::int64_t columns(const Conv2dGeometry& g) const { return count * (oh1 - oh0) * g.out_width; }
};

// Backward blocks of whole samples on a geometry with a covering tap write dx outright (col2im
// copies that tap first), and so do those on the phase path that take one pass per sample, and
// every block on the subsample path: dx is not zeroed beforehand.
inline bool col2im_assigns(const Conv2dGeometry& g, const Conv2dBlocking& b) {
  if (subsample_taps(g)) return true;
  if (b.bands(g) != 1) return false;
  return covering_tap(g) >= 0 || (phase_taps(g) && phase_assigns(g, 0, g.out_height));
}

inline ConvBlock conv_block(const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, std::int64_t group,
                            std::int64_t band) {
  const std::int64_t n0 = group * b.samples;
  const std::int64_t oh0 = band * b.rows;
  return {n0, std::min(b.samples, batch - n0), oh0, std::min(oh0 + b.rows, g.out_height)};
}

// The blocks' products: bfloat16 operands when the layer's Env asks for them (b.bf16, float only)
// and bfloat16 compute is on here (cpu_bf16_active; where it is off, float32's own path below, not
// gemm_bf16's float fallback, which would skip the unpacked kernel); in float with AVX-512,
// products at least kUnpackedMinColumns wide whose second operand is not transposed (forward and
// dx, not dw) by the unpacked kernel (kernels/cpu/gemm_unpacked.hpp), thin ones in deep blocks
// (unpacked_depth_block): OpenBLAS packs a (the weights) again for each block.
template <class S>
void conv_gemm(const Conv2dBlocking& b, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
               const S* a, std::int64_t lda, const S* x, std::int64_t ldx, S beta, S* c, std::int64_t ldc) {
  if constexpr (std::is_same_v<S, float>) {
    if (b.bf16 && cpu_bf16_active())
      return gemm_bf16(Cpu{}, trans_a, trans_b, m, n, k, 1.0f, a, lda, x, ldx, beta, c, ldc);
#if TESSERA_X86_DISPATCH
    if (!trans_b && n >= kUnpackedMinColumns && cpu_avx512()) {
      // On this thread alone the kernel takes beta itself; gemm_split would first zero c in a
      // pass of its own for beta 0.
      const std::int64_t depth_block = unpacked_depth_block(n);
      if (Cpu::team_size() > 1 || Cpu::num_threads() == 1)
        return gemm_unpacked_avx512(trans_a, m, n, k, a, lda, x, ldx, beta, c, ldc, depth_block);
      return gemm_split(trans_a, trans_b, m, n, k, 1.0f, a, lda, x, ldx, beta, c, ldc,
                        [depth_block](bool ta, bool, std::int64_t mm, std::int64_t nn, std::int64_t kk, float,
                                      const float* aa, std::int64_t la, const float* bb, std::int64_t lb, float* cc,
                                      std::int64_t lc) {
                          gemm_unpacked_avx512(ta, mm, nn, kk, aa, la, bb, lb, 1.0f, cc, lc, depth_block);
                        });
    }
#endif
  }
  gemm(Cpu{}, trans_a, trans_b, m, n, k, S(1), a, lda, x, ldx, beta, c, ldc);
}

// `col_filled`: col already holds the block's im2col (the single-block path fills it as a team).
// With an epilogue e (bias then null), the block's output gets it while still in cache; `team`:
// this block is the whole layer, called outside a parallel region, so the epilogue (or the copy
// out of stage) splits its channels over the threads.
template <class S>
void conv2d_forward_block(const Conv2dGeometry& g, const Conv2dBlocking& b, const ConvBlock& blk, const S* x,
                          const S* w, const S* bias, S* y, S* col, S* stage, bool col_filled = false,
                          const ConvEpilogue<S>* e = nullptr, bool team = false) {
  const std::int64_t plane = g.out_plane(), k = g.out_channels, kg = g.group_out_channels();
  const std::int64_t rows_g = g.group_col_rows(), cols = blk.columns(g), first = blk.oh0 * g.out_width;
  const S* in = x + blk.n0 * g.channels * g.in_plane();
  const S* cm = in + first;  // (C kh kw, cols), row stride ldc
  std::int64_t ldc = plane;
  if (!b.direct(g)) {
    if (!col_filled) im2col(Cpu{}, g, in, blk.count, blk.oh0, blk.oh1, col, cols);
    cm = col;
    ldc = cols;
  }
  // A band writes straight into y (row stride H'W'); whole-sample groups go through stage.
  const bool band = blk.count == 1;
  S* out = band ? y + blk.n0 * k * plane + first : stage;
  const std::int64_t ldo = band ? plane : cols;
  if (band && bias != nullptr)
    for (std::int64_t ch = 0; ch < k; ++ch) std::fill(out + ch * ldo, out + ch * ldo + cols, bias[ch]);
  const S beta = band && bias != nullptr ? S(1) : S(0);
  for (std::int64_t grp = 0; grp < g.groups; ++grp)
    conv_gemm(b, false, false, kg, cols, rows_g, w + grp * kg * rows_g, rows_g, cm + grp * rows_g * ldc, ldc, beta,
              out + grp * kg * ldo, ldo);
  if (band) {
    if (e) conv_epilogue_planes(*e, y, blk.n0, 1, k, plane, first, cols, team);
    return;
  }
  for_each_channel(team, k, [&](std::int64_t ch) {
    for (std::int64_t s = 0; s < blk.count; ++s) {
      const std::int64_t offset = ((blk.n0 + s) * k + ch) * plane;
      const S* src = stage + ch * cols + s * plane;
      if (e) {
        conv_epilogue_run(*e, ch, src, y + offset, e->addend ? e->addend + offset : nullptr, plane);
        continue;
      }
      S* dst = y + offset;
      const S add = bias ? bias[ch] : S(0);
      for (std::int64_t p = 0; p < plane; ++p) dst[p] = src[p] + add;
    }
  });
}

// dw_acc += this block's dL/dw; dx block (when non-null) += its dL/dx (the samples' dx must have
// been zeroed unless the direct path writes it outright).
template <class S>
void conv2d_backward_block(const Conv2dGeometry& g, const Conv2dBlocking& b, const ConvBlock& blk, const S* x,
                           const S* w, const S* dy, S* dw_acc, S* dx, S* col, S* stage) {
  const std::int64_t plane = g.out_plane(), k = g.out_channels, kg = g.group_out_channels();
  const std::int64_t rows_g = g.group_col_rows(), cols = blk.columns(g), first = blk.oh0 * g.out_width;
  const std::int64_t in_sample = g.channels * g.in_plane();
  const bool direct = b.direct(g), band = blk.count == 1;
  const S* in = x + blk.n0 * in_sample;
  const S* cm = in + first;
  std::int64_t ldc = plane;
  if (!direct) {
    if (dw_acc != nullptr) im2col(Cpu{}, g, in, blk.count, blk.oh0, blk.oh1, col, cols);
    cm = col;
    ldc = cols;
  }
  const S* dym = dy + blk.n0 * k * plane + first;  // (K, cols), row stride lddy
  std::int64_t lddy = plane;
  if (!band) {
    for (std::int64_t s = 0; s < blk.count; ++s)
      for (std::int64_t ch = 0; ch < k; ++ch)
        std::copy_n(dy + ((blk.n0 + s) * k + ch) * plane, plane, stage + ch * cols + s * plane);
    dym = stage;
    lddy = cols;
  }
  if (dw_acc != nullptr)
    for (std::int64_t grp = 0; grp < g.groups; ++grp)
      conv_gemm(b, false, true, kg, rows_g, cols, dym + grp * kg * lddy, lddy, cm + grp * rows_g * ldc, ldc, S(1),
                dw_acc + grp * kg * rows_g, rows_g);
  if (dx == nullptr) return;
  // w^T dy goes straight into dx on the direct path, else into col (no longer needed) for col2im.
  S* dcol = direct ? dx + blk.n0 * in_sample + first : col;
  for (std::int64_t grp = 0; grp < g.groups; ++grp)
    conv_gemm(b, true, false, rows_g, cols, kg, w + grp * kg * rows_g, rows_g, dym + grp * kg * lddy, lddy, S(0),
              dcol + grp * rows_g * ldc, ldc);
  if (!direct)
    col2im_add(Cpu{}, g, col, cols, blk.count, blk.oh0, blk.oh1, dx + blk.n0 * in_sample, col2im_assigns(g, b));
}

}  // namespace detail

namespace detail {

// conv2d_forward, and with an epilogue (bias then null) conv2d_forward_epilogue.
template <class S>
void conv2d_forward_impl(const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x, const S* w,
                         const S* bias, const ConvEpilogue<S>* e, S* y, S* workspace, const S* winograd_filter) {
  if (b.winograd) return winograd_conv2d_forward(g, b, batch, x, w, bias, y, workspace, e, winograd_filter);
  const std::int64_t bands = b.bands(g), blocks = b.groups(batch) * bands;
  const std::int64_t work = batch * g.out_plane() * g.out_channels * g.group_col_rows();
  if (blocks == 1 && b.threads > 1 && work > kParallelGrain) {
    // One block (ResNet-50's 14x14 and 7x7 layers at batch 1): one parallel region does it all.
    // The team fills col by rows (im2col alone would leave the other threads idle), then each
    // thread multiplies its own output channels and finishes them with the epilogue while they
    // are in its cache. One fork/join per layer instead of three, and no serial epilogue after a
    // split gemm (such layers ran faster at 2 threads once im2col was shared).
    const ConvBlock blk = conv_block(g, b, batch, 0, 0);
    if (blk.count == 1 && g.groups == 1) {
      const bool direct = b.direct(g);
      const std::int64_t rows = g.col_rows(), cols = blk.columns(g), plane = g.out_plane(), k = g.out_channels;
      const S* in = x + blk.n0 * g.channels * g.in_plane();
      const S* cm = direct ? in : workspace;  // (C kh kw, cols): the block is the whole sample
      const std::int64_t ldc = direct ? plane : cols;
      S* out = y + blk.n0 * k * plane;
#pragma omp parallel
      {
        const std::int64_t team = Cpu::team_size(), t = Cpu::thread_index();
        if (!direct) {
          im2col(Cpu{}, g, in, 1, blk.oh0, blk.oh1, workspace, cols, rows * t / team, rows * (t + 1) / team);
#pragma omp barrier
        }
        // Channels in runs of 4 (gemm_split's grain for rows), so panels stay whole.
        const std::int64_t chunk = ((k + team - 1) / team + 3) / 4 * 4;
        const std::int64_t k0 = std::min(k, t * chunk), k1 = std::min(k, k0 + chunk);
        if (k0 < k1) {
          if (bias && !e)
            for (std::int64_t ch = k0; ch < k1; ++ch) std::fill(out + ch * plane, out + ch * plane + cols, bias[ch]);
          conv_gemm(b, false, false, k1 - k0, cols, rows, w + k0 * rows, rows, cm, ldc, bias && !e ? S(1) : S(0),
                    out + k0 * plane, plane);
          if (e)
            for (std::int64_t ch = k0; ch < k1; ++ch)
              conv_epilogue_run(*e, ch, out + ch * plane, out + ch * plane,
                                e->addend ? e->addend + (blk.n0 * k + ch) * plane : nullptr, cols);
        }
      }
      return;
    }
    if (!b.direct(g)) {
      const S* in = x + blk.n0 * g.channels * g.in_plane();
      const std::int64_t rows = g.col_rows(), cols = blk.columns(g);
#pragma omp parallel
      {
        const std::int64_t team = Cpu::team_size(), t = Cpu::thread_index();
        im2col(Cpu{}, g, in, blk.count, blk.oh0, blk.oh1, workspace, cols, rows * t / team, rows * (t + 1) / team);
      }
      return conv2d_forward_block(g, b, blk, x, w, bias, y, workspace, workspace + b.col_elements(g), true, e, true);
    }
  }
  StealRanges ranges(blocks);  // the blocks are independent: a thread done early takes the others' last ones
  const auto run = [&] {  // on each thread of a team, or alone (stealing_for then runs it all)
    S* col = workspace + Cpu::thread_index() * b.thread_elements(g);
    S* stage = col + b.col_elements(g);
    stealing_for(ranges, blocks, [&](std::int64_t t) {
      conv2d_forward_block(g, b, conv_block(g, b, batch, t / bands, t % bands), x, w, bias, y, col, stage, false, e);
    });
  };
  run_in_team_if(blocks > 1 && work > kParallelGrain, run);
}

}  // namespace detail

// y (N, K, H', W') = conv(x (N, C, H, W), w) + b; b may be null. `workspace` holds
// b.workspace_elements(g, false) elements (b from conv2d_blocking for this batch). When
// b.winograd, winograd_filter may be w's transformed filter (winograd_prepare_filter),
// which is then not computed again; it is ignored otherwise.
template <class S>
void conv2d_forward(Cpu, const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x, const S* w,
                    const S* bias, S* y, S* workspace, const S* winograd_filter = nullptr) {
  detail::conv2d_forward_impl(g, b, batch, x, w, bias, static_cast<const ConvEpilogue<S>*>(nullptr), y, workspace,
                              winograd_filter);
}

// Forward only (Mode::Inference): y = the epilogue e of conv(x, w) (ConvEpilogue: the next eval
// BatchNorm, a residual addend, a ReLU), each block's output finished while still in cache.
template <class S>
void conv2d_forward_epilogue(Cpu, const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x,
                             const S* w, const ConvEpilogue<S>& e, S* y, S* workspace,
                             const S* winograd_filter = nullptr) {
  detail::conv2d_forward_impl(g, b, batch, x, w, static_cast<const S*>(nullptr), &e, y, workspace, winograd_filter);
}

// db (K) += sum over n, oh, ow of dy (N, K, H', W').
template <class S>
void conv2d_bias_backward(Cpu, std::int64_t batch, std::int64_t channels, std::int64_t plane, const S* dy, S* db) {
  detail::parallel_for(channels, batch * channels * plane > detail::kParallelGrain, [&](std::int64_t ch) {
    S sum = 0;
    for (std::int64_t n = 0; n < batch; ++n) {
      const S* d = dy + (n * channels + ch) * plane;
      // Vector lanes of partial sums: a sequential float sum is not vectorized (no reassociation
      // without permission), and showed in LeNet-5's profile.
#pragma omp simd reduction(+ : sum)
      for (std::int64_t p = 0; p < plane; ++p) sum += d[p];
    }
    db[ch] += sum;
  });
}

// dw (K, C/G, kh, kw) += dL/dw unless dw is null, and dx (N, C, H, W) = dL/dx unless dx is null,
// from x and dy (N, K, H', W'). `workspace` holds b.workspace_elements(g, true) elements. Either
// half alone (Conv2d::backward_input, backward_weight) runs the same blocks in the same order as
// both together, so its result has the same bits.
template <class S>
void conv2d_backward(Cpu, const Conv2dGeometry& g, const Conv2dBlocking& b, std::int64_t batch, const S* x,
                     const S* w, const S* dy, S* dw, S* dx, S* workspace) {
  if (b.winograd) return winograd_conv2d_backward(g, b, batch, x, w, dy, dw, dx, workspace);
  const std::int64_t bands = b.bands(g), groups = b.groups(batch), in_group = b.samples * g.channels * g.in_plane();
  const std::int64_t weights = g.weight_elements();
  S* partial = workspace + b.threads * b.thread_elements(g);  // (threads - 1) private dw accumulators
  const auto run = [&] {  // a team's threads, or alone with gemm parallel inside
    const std::int64_t t = Cpu::thread_index();
    S* col = workspace + t * b.thread_elements(g);
    S* stage = col + b.col_elements(g);
    S* dw_acc = dw == nullptr ? nullptr : t == 0 ? dw : partial + (t - 1) * weights;
    if (dw_acc != nullptr && t > 0) std::fill(dw_acc, dw_acc + weights, S(0));
    detail::static_for(groups, [&](std::int64_t grp) {
      S* dx_group = dx ? dx + grp * in_group : nullptr;
      if (dx_group && !b.direct(g) && !detail::col2im_assigns(g, b)) {
        const std::int64_t count = std::min(b.samples, batch - grp * b.samples);
        std::fill(dx_group, dx_group + count * g.channels * g.in_plane(), S(0));
      }
      for (std::int64_t band = 0; band < bands; ++band)
        detail::conv2d_backward_block(g, b, detail::conv_block(g, b, batch, grp, band), x, w, dy, dw_acc, dx, col,
                                      stage);
    });
    if (dw == nullptr) return;  // dx only (Conv2d::backward_input): no accumulators to add
    // static_for's barrier has passed: every private accumulator is complete. Each thread adds
    // them into its contiguous share of dw, in runs that stay in L1 while every accumulator
    // passes, as vector loops: written per element (a call per weight), the loop stayed scalar
    // and showed in ResNet-50's two-thread profile (bench/README.md, "Figures behind design
    // choices in the headers"). Per element the order is dw, then accumulators 0, 1, ...
    const std::int64_t team = Cpu::team_size();
    std::int64_t begin, end;
    detail::team_share(weights, begin, end);
    constexpr std::int64_t kRun = 2048;
    for (std::int64_t r0 = begin; r0 < end; r0 += kRun) {
      const std::int64_t r1 = std::min(end, r0 + kRun);
      for (std::int64_t p = 0; p + 1 < team; ++p) {
        const S* acc = partial + p * weights;
#pragma omp simd
        for (std::int64_t i = r0; i < r1; ++i) dw[i] += acc[i];
      }
    }
  };
  detail::run_in_team_if(b.parallel_backward, run);
}

// Compiled once in compiled-kernels mode (kernels/cpu/compiled.hpp).
#define TESSERA_CPU_CONV2D_INSTANCES(PREFIX, S)                                                                   \
  PREFIX template void conv2d_forward<S>(Cpu, const Conv2dGeometry&, const Conv2dBlocking&, std::int64_t, const S*, \
                                         const S*, const S*, S*, S*, const S*);                                    \
  PREFIX template void conv2d_forward_epilogue<S>(Cpu, const Conv2dGeometry&, const Conv2dBlocking&, std::int64_t,   \
                                                  const S*, const S*, const ConvEpilogue<S>&, S*, S*, const S*);   \
  PREFIX template void winograd_prepare_filter<S>(const Conv2dGeometry&, const S*, S*);                              \
  PREFIX template void conv2d_bias_backward<S>(Cpu, std::int64_t, std::int64_t, std::int64_t, const S*, S*);       \
  PREFIX template void conv2d_backward<S>(Cpu, const Conv2dGeometry&, const Conv2dBlocking&, std::int64_t,          \
                                          const S*, const S*, const S*, S*, S*, S*);
TESSERA_CPU_KERNEL_INSTANCES(TESSERA_CPU_CONV2D_INSTANCES)

}  // namespace tessera
