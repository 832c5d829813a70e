// Image augmentation as torchvision defines it on PIL images, the recipe of ResNet-50 training:
//
//   train: RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3)) -> RandomHorizontalFlip(0.5)
//          -> ToTensor -> Normalize(mean, std)
//   eval:  Resize(resize) (the shorter side) -> CenterCrop(size) -> ToTensor -> Normalize(mean, std)
//
// Pixels. Resizing is PIL's antialiased bilinear resampling (Image.resize(..., BILINEAR), which
// torchvision calls for PIL images), reproduced operation for operation so the bytes are PIL's:
// for an output column x of an input span [0, in) scaled by s = in / out, the filter is the
// triangle of half-width 1 stretched by max(s, 1) around centre c = (x + 0.5) s, over input
// columns [int(c - support + 0.5), int(c + support + 0.5)) clipped to the image; weights are
// normalised to sum 1, turned into 22-bit fixed point (rounded away from zero), applied to the
// bytes with a 2^21 rounding bias and clipped to [0, 255]. The horizontal pass runs first and
// stores bytes; the vertical pass reads them. A crop followed by a resize resamples the crop
// alone (PIL crops first), so the filter is clipped at the crop's edges, not the image's.
// Only the output pixels a crop keeps are computed: each output pixel depends on its own row and
// column coefficients only, so the window equals the same window of the full resize.
// ToTensor + Normalize become one table per channel: out = (b / 255 - mean) / std, computed in
// float32 with division as torch does, so each byte maps to exactly torch's float.
//
// Randomness. random_resized_crop_box follows torchvision's get_params (10 tries of a scale and a
// log-uniform aspect ratio, in float32 as torch draws them, rounded half to even as Python's
// round; then the centre-crop fallback), drawing from the Rng it is given; the flip is
// rng.uniform() < p after the crop. ImageFolder seeds that Rng from (seed, epoch, sample index),
// so the same sample in the same epoch gets the same crop wherever and whenever it is read.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/random.hpp"
#include "tessera/data/image.hpp"

namespace tessera {

// A rectangle of an image: rows [top, top + height), columns [left, left + width).
struct CropBox {
  std::int64_t top = 0, left = 0, height = 0, width = 0;
  friend bool operator==(const CropBox&, const CropBox&) = default;
};

struct ImageTransform {
  enum class Mode { Train, Eval };
  Mode mode = Mode::Eval;
  std::int64_t channels = 3;         // 3: RGB (convert("RGB")), 1: grey (convert("L"))
  std::int64_t height = 224, width = 224;  // output size
  std::int64_t resize = 256;         // eval: the shorter side's length before the centre crop; 0: no resize
  std::array<double, 2> scale{0.08, 1.0};                 // train: area fraction range
  std::array<double, 2> ratio{3.0 / 4.0, 4.0 / 3.0};      // train: aspect ratio (w / h) range
  double flip = 0.5;                 // train: horizontal flip probability
  std::vector<float> mean, std;      // per channel; empty: ToTensor alone (mean 0, std 1)

  static ImageTransform train(std::int64_t size, std::array<double, 2> scale = {0.08, 1.0},
                              std::array<double, 2> ratio = {3.0 / 4.0, 4.0 / 3.0}, double flip = 0.5) {
    ImageTransform t;
    t.mode = Mode::Train;
    t.height = t.width = size;
    t.scale = scale;
    t.ratio = ratio;
    t.flip = flip;
    return t;
  }
  static ImageTransform eval(std::int64_t resize, std::int64_t crop) {
    ImageTransform t;
    t.mode = Mode::Eval;
    t.resize = resize;
    t.height = t.width = crop;
    return t;
  }
  ImageTransform& normalize(std::vector<float> m, std::vector<float> s) {
    mean = std::move(m);
    std = std::move(s);
    return *this;
  }
  ImageTransform& grey() {
    channels = 1;
    return *this;
  }

  void check(std::string_view what) const {
    TESSERA_CHECK(channels == 1 || channels == 3, ArgumentError, what, ": channels=", channels, " must be 1 or 3");
    TESSERA_CHECK(height > 0 && width > 0, ArgumentError, what, ": output size ", height, "x", width,
                  " must be positive");
    TESSERA_CHECK(resize >= 0, ArgumentError, what, ": resize=", resize, " must be >= 0");
    TESSERA_CHECK(scale[0] > 0 && scale[0] <= scale[1] && ratio[0] > 0 && ratio[0] <= ratio[1], ArgumentError, what,
                  ": need 0 < scale[0] <= scale[1] and 0 < ratio[0] <= ratio[1], got scale (", scale[0], ", ",
                  scale[1], ") ratio (", ratio[0], ", ", ratio[1], ")");
    TESSERA_CHECK(flip >= 0 && flip <= 1, ArgumentError, what, ": flip=", flip, " must be in [0, 1]");
    TESSERA_CHECK(mean.size() == std.size() && (mean.empty() || static_cast<std::int64_t>(mean.size()) == channels),
                  ArgumentError, what, ": need one mean and one std per channel (", channels, "), got ", mean.size(),
                  " and ", std.size());
    for (float s : std) TESSERA_CHECK(s > 0, ArgumentError, what, ": std ", s, " must be positive");
  }
};

namespace detail {

// Python's round(): to nearest, ties to even (the default rounding mode of nearbyint).
inline std::int64_t round_half_even(double x) { return static_cast<std::int64_t>(std::nearbyint(x)); }

inline constexpr int kPrecisionBits = 32 - 8 - 2;  // PIL's PRECISION_BITS

// PIL's precompute_coeffs + normalize_coeffs_8bpc for outputs [first, first + count) of a resize
// of `in` pixels to `out` pixels: bounds (xmin, n) per output and `ksize` fixed-point weights each.
struct ResampleCoeffs {
  int ksize = 0;
  std::vector<int> bounds;          // (count, 2)
  std::vector<std::int32_t> weights;  // (count, ksize)
  std::vector<double> scratch;

  void compute(std::int64_t in, std::int64_t out, std::int64_t first, std::int64_t count) {
    const double scale = static_cast<double>(in) / static_cast<double>(out);
    const double filterscale = std::max(scale, 1.0);
    const double support = 1.0 * filterscale;  // bilinear: support 1
    ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
    bounds.resize(static_cast<std::size_t>(count) * 2);
    weights.assign(static_cast<std::size_t>(count) * ksize, 0);
    scratch.resize(static_cast<std::size_t>(ksize));
    const double ss = 1.0 / filterscale;
    for (std::int64_t i = 0; i < count; ++i) {
      const double center = (static_cast<double>(first + i) + 0.5) * scale;
      int xmin = static_cast<int>(center - support + 0.5);
      if (xmin < 0) xmin = 0;
      int xmax = static_cast<int>(center + support + 0.5);
      if (xmax > in) xmax = static_cast<int>(in);
      xmax -= xmin;
      double ww = 0.0;
      for (int x = 0; x < xmax; ++x) {
        double t = (x + xmin - center + 0.5) * ss;
        if (t < 0.0) t = -t;
        const double w = t < 1.0 ? 1.0 - t : 0.0;
        scratch[static_cast<std::size_t>(x)] = w;
        ww += w;
      }
      std::int32_t* k = weights.data() + i * ksize;
      for (int x = 0; x < xmax; ++x) {
        double w = scratch[static_cast<std::size_t>(x)];
        if (ww != 0.0) w /= ww;
        k[x] = w < 0 ? static_cast<std::int32_t>(-0.5 + w * (1 << kPrecisionBits))
                     : static_cast<std::int32_t>(0.5 + w * (1 << kPrecisionBits));
      }
      bounds[static_cast<std::size_t>(i) * 2] = xmin;
      bounds[static_cast<std::size_t>(i) * 2 + 1] = xmax;
    }
  }
};

inline std::uint8_t clip8(std::int32_t v) {
  if (v >= (1 << kPrecisionBits << 8)) return 255;
  if (v <= 0) return 0;
  return static_cast<std::uint8_t>(v >> kPrecisionBits);
}

// Per-thread buffers of resized_crop: after the first image of the largest size, no allocation.
struct ResampleScratch {
  ResampleCoeffs horizontal, vertical;
  std::vector<std::uint8_t> temp, window;
};

}  // namespace detail

// The output of PIL's img.crop(box).resize((out_w, out_h), BILINEAR), restricted to its window
// rows [wy, wy + wh) and columns [wx, wx + ww), as bytes (wh, ww, channels) in `dst`.
inline void resize_crop_window(const ImageView& img, const CropBox& box, std::int64_t out_h, std::int64_t out_w,
                               std::int64_t wy, std::int64_t wx, std::int64_t wh, std::int64_t ww, std::uint8_t* dst,
                               detail::ResampleScratch& s) {
  using detail::clip8;
  const std::int64_t c = img.channels;
  const bool need_horizontal = out_w != box.width, need_vertical = out_h != box.height;
  // Rows of the crop the vertical pass reads.
  std::int64_t row_first = wy, row_count = wh;
  if (need_vertical) {
    s.vertical.compute(box.height, out_h, wy, wh);
    row_first = s.vertical.bounds[0];
    row_count = s.vertical.bounds[static_cast<std::size_t>(wh - 1) * 2] +
                s.vertical.bounds[static_cast<std::size_t>(wh - 1) * 2 + 1] - row_first;
  }
  // Horizontal pass: crop rows [row_first, row_first + row_count) -> (row_count, ww, c) bytes.
  const std::uint8_t* rows;
  std::int64_t row_stride;
  if (need_horizontal) {
    s.horizontal.compute(box.width, out_w, wx, ww);
    s.temp.resize(static_cast<std::size_t>(row_count * ww * c));
    const int ksize = s.horizontal.ksize;
    constexpr std::int32_t bias = 1 << (detail::kPrecisionBits - 1);
    for (std::int64_t y = 0; y < row_count; ++y) {
      const std::uint8_t* in = img.row(box.top + row_first + y) + box.left * c;
      std::uint8_t* out = s.temp.data() + y * ww * c;
      for (std::int64_t x = 0; x < ww; ++x) {
        const int xmin = s.horizontal.bounds[static_cast<std::size_t>(x) * 2];
        const int n = s.horizontal.bounds[static_cast<std::size_t>(x) * 2 + 1];
        const std::int32_t* k = s.horizontal.weights.data() + x * ksize;
        const std::uint8_t* p = in + static_cast<std::int64_t>(xmin) * c;
        if (c == 3) {
          std::int32_t r = bias, g = bias, b = bias;
          for (int t = 0; t < n; ++t) {
            r += p[t * 3] * k[t];
            g += p[t * 3 + 1] * k[t];
            b += p[t * 3 + 2] * k[t];
          }
          out[x * 3] = clip8(r);
          out[x * 3 + 1] = clip8(g);
          out[x * 3 + 2] = clip8(b);
        } else {
          std::int32_t v = bias;
          for (int t = 0; t < n; ++t) v += p[t] * k[t];
          out[x] = clip8(v);
        }
      }
    }
    rows = s.temp.data();
    row_stride = ww * c;
  } else {
    rows = img.row(box.top + row_first) + (box.left + wx) * c;  // the window's columns, as they are
    row_stride = img.width * c;
  }
  // Vertical pass: (row_count, ww, c) -> (wh, ww, c).
  if (!need_vertical) {
    for (std::int64_t y = 0; y < wh; ++y) std::copy_n(rows + y * row_stride, ww * c, dst + y * ww * c);
    return;
  }
  const int ksize = s.vertical.ksize;
  constexpr std::int32_t bias = 1 << (detail::kPrecisionBits - 1);
  for (std::int64_t y = 0; y < wh; ++y) {
    const int ymin = s.vertical.bounds[static_cast<std::size_t>(y) * 2] - static_cast<int>(row_first);
    const int n = s.vertical.bounds[static_cast<std::size_t>(y) * 2 + 1];
    const std::int32_t* k = s.vertical.weights.data() + y * ksize;
    std::uint8_t* out = dst + y * ww * c;
    for (std::int64_t x = 0; x < ww * c; ++x) {
      std::int32_t v = bias;
      for (int t = 0; t < n; ++t) v += rows[(ymin + t) * row_stride + x] * k[t];
      out[x] = clip8(v);
    }
  }
}

// torchvision's RandomResizedCrop.get_params for an image of height x width.
inline CropBox random_resized_crop_box(std::int64_t height, std::int64_t width, std::array<double, 2> scale,
                                       std::array<double, 2> ratio, Rng& rng) {
  const double area = static_cast<double>(height * width);
  // torch.log(torch.tensor(ratio)) and uniform_ on a float32 tensor: float32 throughout.
  const float log_lo = std::log(static_cast<float>(ratio[0])), log_hi = std::log(static_cast<float>(ratio[1]));
  const auto uniform_f32 = [&](float lo, float hi) { return lo + (hi - lo) * static_cast<float>(rng.uniform()); };
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target_area =
        area * static_cast<double>(uniform_f32(static_cast<float>(scale[0]), static_cast<float>(scale[1])));
    const double aspect = static_cast<double>(std::exp(uniform_f32(log_lo, log_hi)));
    const std::int64_t w = detail::round_half_even(std::sqrt(target_area * aspect));
    const std::int64_t h = detail::round_half_even(std::sqrt(target_area / aspect));
    if (0 < w && w <= width && 0 < h && h <= height) {
      const auto top = static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(height - h + 1)));
      const auto left = static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(width - w + 1)));
      return {top, left, h, w};
    }
  }
  // Fallback: the centre crop with the ratio clamped to the range.
  const double in_ratio = static_cast<double>(width) / static_cast<double>(height);
  std::int64_t w = width, h = height;
  if (in_ratio < ratio[0]) {
    h = detail::round_half_even(static_cast<double>(w) / ratio[0]);
  } else if (in_ratio > ratio[1]) {
    w = detail::round_half_even(static_cast<double>(h) * ratio[1]);
  }
  return {(height - h) / 2, (width - w) / 2, h, w};
}

// torchvision's Resize(shorter) output size: the shorter side becomes `shorter`, the longer
// int(shorter * long / short) (truncated).
inline std::array<std::int64_t, 2> resize_shorter_size(std::int64_t height, std::int64_t width, std::int64_t shorter) {
  if (width <= height) {
    return {static_cast<std::int64_t>(static_cast<double>(shorter) * static_cast<double>(height) /
                                      static_cast<double>(width)),
            shorter};
  }
  return {shorter, static_cast<std::int64_t>(static_cast<double>(shorter) * static_cast<double>(width) /
                                             static_cast<double>(height))};
}

// ToTensor + Normalize as a byte -> float table per channel: (channels, 256).
inline std::vector<float> normalize_table(const ImageTransform& t) {
  std::vector<float> table(static_cast<std::size_t>(t.channels) * 256);
  for (std::int64_t c = 0; c < t.channels; ++c) {
    for (int b = 0; b < 256; ++b) {
      float v = static_cast<float>(b) / 255.0f;
      if (!t.mean.empty()) v = (v - t.mean[static_cast<std::size_t>(c)]) / t.std[static_cast<std::size_t>(c)];
      table[static_cast<std::size_t>(c * 256 + b)] = v;
    }
  }
  return table;
}

// Bytes (wh, ww, c) of a window -> floats (c, oh, ow) through `table`, the window placed at
// (dy, dx) and mirrored when `flip`; the rest of a padded output is byte 0's value.
inline void window_to_tensor(const std::uint8_t* window, std::int64_t wh, std::int64_t ww, std::int64_t c,
                             std::int64_t oh, std::int64_t ow, std::int64_t dy, std::int64_t dx, bool flip,
                             const std::vector<float>& table, float* out) {
  const std::int64_t plane = oh * ow;
  const bool padded = wh != oh || ww != ow;
  for (std::int64_t ch = 0; ch < c; ++ch) {
    const float* lut = table.data() + ch * 256;
    float* o = out + ch * plane;
    if (padded) std::fill(o, o + plane, lut[0]);
    for (std::int64_t y = 0; y < wh; ++y) {
      const std::uint8_t* in = window + y * ww * c + ch;
      float* row = o + (dy + y) * ow + dx;
      if (flip) {
        for (std::int64_t x = 0; x < ww; ++x) row[ww - 1 - x] = lut[in[x * c]];
      } else {
        for (std::int64_t x = 0; x < ww; ++x) row[x] = lut[in[x * c]];
      }
    }
  }
}

// F.resized_crop(img, box, [oh, ow]) -> hflip when `flip` -> ToTensor/Normalize (`table`): (C, oh, ow).
inline void resized_crop_to_tensor(const ImageView& img, const CropBox& box, std::int64_t oh, std::int64_t ow, bool flip,
                                   const std::vector<float>& table, float* out, detail::ResampleScratch& s) {
  TESSERA_CHECK(box.top >= 0 && box.left >= 0 && box.height > 0 && box.width > 0 &&
                    box.top + box.height <= img.height && box.left + box.width <= img.width,
                ArgumentError, "resized_crop: box (top ", box.top, ", left ", box.left, ", ", box.height, "x",
                box.width, ") is not inside the ", img.height, "x", img.width, " image");
  s.window.resize(static_cast<std::size_t>(oh * ow * img.channels));
  resize_crop_window(img, box, oh, ow, 0, 0, oh, ow, s.window.data(), s);
  window_to_tensor(s.window.data(), oh, ow, img.channels, oh, ow, 0, 0, flip, table, out);
}

// Applies `t` to `img` (whose channels must be t.channels) and writes (C, H, W) floats to `out`.
// `table` is normalize_table(t); `rng` is used by the train mode only.
inline void apply_transform(const ImageView& img, const ImageTransform& t, const std::vector<float>& table, Rng& rng,
                            float* out, detail::ResampleScratch& s) {
  const std::int64_t oh = t.height, ow = t.width;
  if (t.mode == ImageTransform::Mode::Train) {
    const CropBox box = random_resized_crop_box(img.height, img.width, t.scale, t.ratio, rng);
    const bool flip = rng.uniform() < t.flip;
    resized_crop_to_tensor(img, box, oh, ow, flip, table, out, s);
    return;
  }
  // Eval: resize the shorter side, then CenterCrop, which pads (the left/top getting the floor
  // half) where the crop is larger than the image, and otherwise crops at round((size - crop) / 2).
  std::int64_t rh = img.height, rw = img.width;
  if (t.resize > 0) {
    const auto size = resize_shorter_size(img.height, img.width, t.resize);
    rh = size[0];
    rw = size[1];
  }
  // The kept window of the resized image (first, count) and its offset in the output, per axis.
  const auto place = [](std::int64_t size, std::int64_t crop) -> std::array<std::int64_t, 3> {
    if (crop > size) return {0, size, (crop - size) / 2};
    return {detail::round_half_even(static_cast<double>(size - crop) / 2.0), crop, 0};
  };
  const auto [wy, wh, dy] = place(rh, oh);
  const auto [wx, ww, dx] = place(rw, ow);
  s.window.resize(static_cast<std::size_t>(wh * ww * img.channels));
  resize_crop_window(img, {0, 0, img.height, img.width}, rh, rw, wy, wx, wh, ww, s.window.data(), s);
  window_to_tensor(s.window.data(), wh, ww, img.channels, oh, ow, dy, dx, false, table, out);
}

}  // namespace tessera
