// A line plot written as a PNG with nothing but zlib: for examples that want to show a curve
// without a plotting library. Series are drawn as 2-pixel lines on a light grid (one grid line
// per x unit when there are few, and every 10% of the y range), with labelled ticks and axis
// titles in a 5x7 pixel font (digits, a few signs and the lower-case letters); the caller prints
// the legend (series colour and name).
#pragma once

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"

namespace examples {

struct Series {
  std::string name;
  std::array<std::uint8_t, 3> rgb;
  std::vector<double> y;  // y[i] at x = i + 1, or at x[i] when x is given (plot_xy_png)
  std::vector<double> x = {};
};

class PngImage {
 public:
  PngImage(int width, int height) : w_(width), h_(height), pixels_(static_cast<std::size_t>(width) * height * 3, 255) {}

  void set(int x, int y, std::array<std::uint8_t, 3> c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
    auto* p = &pixels_[(static_cast<std::size_t>(y) * w_ + x) * 3];
    p[0] = c[0], p[1] = c[1], p[2] = c[2];
  }
  // Text in the 5x7 font, top-left corner at (x, y), one pixel of space between characters; a
  // character outside the font is a blank. Returns the width drawn.
  int text(int x, int y, const std::string& s, std::array<std::uint8_t, 3> c) {
    for (std::size_t i = 0; i < s.size(); ++i) {
      const std::uint8_t* rows = glyph(s[i]);
      for (int r = 0; r < 7 && rows; ++r)
        for (int col = 0; col < 5; ++col)
          if (rows[r] & (0x10 >> col)) set(x + 6 * static_cast<int>(i) + col, y + r, c);
    }
    return 6 * static_cast<int>(s.size());
  }
  // Bresenham with a 2-pixel pen.
  void line(int x0, int y0, int x1, int y1, std::array<std::uint8_t, 3> c) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    for (int err = dx + dy;;) {
      set(x0, y0, c), set(x0 + 1, y0, c), set(x0, y0 + 1, c), set(x0 + 1, y0 + 1, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) err += dy, x0 += sx;
      if (e2 <= dx) err += dx, y0 += sy;
    }
  }

  void write(const std::string& path) const {
    // Scanlines, each prefixed with filter type 0 (none), deflated into one IDAT chunk.
    std::vector<std::uint8_t> raw;
    raw.reserve(pixels_.size() + static_cast<std::size_t>(h_));
    for (int y = 0; y < h_; ++y) {
      raw.push_back(0);
      raw.insert(raw.end(), pixels_.begin() + static_cast<std::ptrdiff_t>(y) * w_ * 3,
                 pixels_.begin() + static_cast<std::ptrdiff_t>(y + 1) * w_ * 3);
    }
    uLongf packed_size = compressBound(static_cast<uLong>(raw.size()));
    std::vector<std::uint8_t> packed(packed_size);
    TESSERA_CHECK(compress2(packed.data(), &packed_size, raw.data(), static_cast<uLong>(raw.size()), 9) == Z_OK,
                  tessera::IoError, "png: zlib compression failed");
    packed.resize(packed_size);
    std::FILE* f = std::fopen(path.c_str(), "wb");
    TESSERA_CHECK(f != nullptr, tessera::IoError, "png: cannot write '", path, "'");
    static const std::uint8_t signature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    std::fwrite(signature, 1, 8, f);
    std::vector<std::uint8_t> header = be32(static_cast<std::uint32_t>(w_));
    append(header, be32(static_cast<std::uint32_t>(h_)));
    append(header, {8, 2, 0, 0, 0});  // 8 bits per channel, RGB, deflate, no filter choice, no interlace
    chunk(f, "IHDR", header);
    chunk(f, "IDAT", packed);
    chunk(f, "IEND", {});
    TESSERA_CHECK(std::fclose(f) == 0, tessera::IoError, "png: cannot finish '", path, "'");
  }

 private:
  // 7 rows of 5 bits (bit 4 the leftmost pixel) per character; nullptr: not in the font.
  static const std::uint8_t* glyph(char ch) {
    static const char chars[] = "0123456789.%()- abcdefghiklmnoprstuvwxy";
    static const std::uint8_t rows[][7] = {
        {14, 17, 19, 21, 25, 17, 14}, {4, 12, 4, 4, 4, 4, 14},    {14, 17, 1, 2, 4, 8, 31},   {30, 1, 1, 14, 1, 1, 30},
        {2, 6, 10, 18, 31, 2, 2},     {31, 16, 30, 1, 1, 17, 14}, {6, 8, 16, 30, 17, 17, 14}, {31, 1, 2, 4, 8, 8, 8},
        {14, 17, 17, 14, 17, 17, 14}, {14, 17, 17, 15, 1, 2, 12}, {0, 0, 0, 0, 0, 12, 12},    {24, 25, 2, 4, 8, 19, 3},
        {2, 4, 8, 8, 8, 4, 2},        {8, 4, 2, 2, 2, 4, 8},      {0, 0, 0, 31, 0, 0, 0},     {0, 0, 0, 0, 0, 0, 0},
        {0, 0, 14, 1, 15, 17, 15},    {16, 16, 22, 25, 17, 17, 30}, {0, 0, 14, 16, 16, 17, 14}, {1, 1, 13, 19, 17, 17, 15},
        {0, 0, 14, 17, 31, 16, 14},   {6, 9, 8, 28, 8, 8, 8},     {0, 15, 17, 17, 15, 1, 14}, {16, 16, 22, 25, 17, 17, 17},
        {4, 0, 12, 4, 4, 4, 14},      {16, 16, 18, 20, 24, 20, 18}, {12, 4, 4, 4, 4, 4, 14},  {0, 0, 26, 21, 21, 17, 17},
        {0, 0, 22, 25, 17, 17, 17},   {0, 0, 14, 17, 17, 17, 14}, {0, 0, 30, 17, 30, 16, 16}, {0, 0, 22, 25, 16, 16, 16},
        {0, 0, 15, 16, 14, 1, 30},    {8, 8, 28, 8, 8, 9, 6},     {0, 0, 17, 17, 17, 19, 13}, {0, 0, 17, 17, 17, 10, 4},
        {0, 0, 17, 17, 21, 21, 10},   {0, 0, 17, 10, 4, 10, 17},  {0, 0, 17, 17, 15, 1, 14}};
    for (std::size_t i = 0; i + 1 < sizeof chars; ++i)
      if (chars[i] == ch) return rows[i];
    return nullptr;
  }
  static std::vector<std::uint8_t> be32(std::uint32_t v) {
    return {static_cast<std::uint8_t>(v >> 24), static_cast<std::uint8_t>(v >> 16), static_cast<std::uint8_t>(v >> 8),
            static_cast<std::uint8_t>(v)};
  }
  static void append(std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) { a.insert(a.end(), b.begin(), b.end()); }
  static void chunk(std::FILE* f, const char* type, const std::vector<std::uint8_t>& data) {
    const auto length = be32(static_cast<std::uint32_t>(data.size()));
    std::fwrite(length.data(), 1, 4, f);
    std::fwrite(type, 1, 4, f);
    if (!data.empty()) std::fwrite(data.data(), 1, data.size(), f);
    uLong crc = crc32(0, reinterpret_cast<const Bytef*>(type), 4);
    if (!data.empty()) crc = crc32(crc, data.data(), static_cast<uInt>(data.size()));
    const auto c = be32(static_cast<std::uint32_t>(crc));
    std::fwrite(c.data(), 1, 4, f);
  }

  int w_, h_;
  std::vector<std::uint8_t> pixels_;
};

namespace detail {
inline std::string tick(const char* fmt, double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}
// The y axis of an accuracy plot: a grid line every 10% of [y_min, y_max], each labelled in percent,
// and the title above the axis; the x axis's title centred under its tick labels.
inline void accuracy_axes(PngImage& img, int left, int right, int top, int bottom, double y_min, double y_max,
                          const std::string& x_title, const std::string& y_title) {
  const std::array<std::uint8_t, 3> grid = {225, 225, 225}, axis = {60, 60, 60};
  for (int k = 0; k <= 10; ++k) {
    const double y = y_min + k * (y_max - y_min) / 10;
    const int py = bottom - k * (bottom - top) / 10;
    img.line(left, py, right, py, grid);
    const std::string label = detail::tick("%.0f%%", 100 * y);
    img.text(left - 6 - 6 * static_cast<int>(label.size()), py - 3, label, axis);
  }
  img.line(left, bottom, right, bottom, axis);
  img.line(left, top, left, bottom, axis);
  img.text(left, top - 14, y_title, axis);
  img.text((left + right) / 2 - 3 * static_cast<int>(x_title.size()), bottom + 22, x_title, axis);
}
}  // namespace detail

// Plots the series over x = 1..max length in [y_min, y_max] (accuracies: the y labels are in
// percent) into a width x height PNG, with the axes' titles.
inline void plot_png(const std::string& path, const std::vector<Series>& series, double y_min, double y_max,
                     const std::string& x_title, const std::string& y_title, int width = 800, int height = 500) {
  PngImage img(width, height);
  const int left = 60, right = width - 20, top = 30, bottom = height - 40;
  std::size_t points = 1;
  for (const auto& s : series) points = std::max(points, s.y.size());
  auto px = [&](double x) { return left + static_cast<int>((x - 1) / std::max<double>(1, points - 1) * (right - left)); };
  auto py = [&](double y) {
    const double t = std::clamp((y - y_min) / (y_max - y_min), 0.0, 1.0);
    return bottom - static_cast<int>(t * (bottom - top));
  };
  const std::array<std::uint8_t, 3> grid = {225, 225, 225}, axis = {60, 60, 60};
  const std::size_t every = std::max<std::size_t>(1, (points + 9) / 10);  // at most about 10 x labels
  for (std::size_t x = 1; x <= points; ++x) {
    if (points <= 100) img.line(px(static_cast<double>(x)), top, px(static_cast<double>(x)), bottom, grid);
    if ((x - 1) % every == 0 || x == points)
      img.text(px(static_cast<double>(x)) - 3 * static_cast<int>(std::to_string(x).size()), bottom + 6,
               std::to_string(x), axis);
  }
  detail::accuracy_axes(img, left, right, top, bottom, y_min, y_max, x_title, y_title);
  for (const auto& s : series)
    for (std::size_t i = 1; i < s.y.size(); ++i)
      img.line(px(static_cast<double>(i)), py(s.y[i - 1]), px(static_cast<double>(i + 1)), py(s.y[i]), s.rgb);
  img.write(path);
}

// Plots each series' points (x[i], y[i]) over [0, x_max] x [y_min, y_max] (accuracies: the y
// labels are in percent); labelled grid lines, every 10% of the y range and at round steps of x,
// and the axes' titles.
inline void plot_xy_png(const std::string& path, const std::vector<Series>& series, double x_max, double y_min,
                        double y_max, const std::string& x_title, const std::string& y_title, int width = 800,
                        int height = 500) {
  PngImage img(width, height);
  const int left = 60, right = width - 20, top = 30, bottom = height - 40;
  auto px = [&](double x) { return left + static_cast<int>(std::clamp(x / x_max, 0.0, 1.0) * (right - left)); };
  auto py = [&](double y) {
    const double t = std::clamp((y - y_min) / (y_max - y_min), 0.0, 1.0);
    return bottom - static_cast<int>(t * (bottom - top));
  };
  const std::array<std::uint8_t, 3> grid = {225, 225, 225}, axis = {60, 60, 60};
  // x ticks at multiples of a round step (1, 2 or 5 x 10^k) giving at most 10 intervals.
  const double raw = x_max / 10, decade = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw <= decade ? decade : raw <= 2 * decade ? 2 * decade : raw <= 5 * decade ? 5 * decade : 10 * decade;
  for (int k = 0; k * step <= x_max * (1 + 1e-9); ++k) {
    img.line(px(k * step), top, px(k * step), bottom, grid);
    const std::string label = detail::tick(step < 1 ? "%.1f" : "%.0f", k * step);
    img.text(px(k * step) - 3 * static_cast<int>(label.size()), bottom + 6, label, axis);
  }
  detail::accuracy_axes(img, left, right, top, bottom, y_min, y_max, x_title, y_title);
  for (const auto& s : series)
    for (std::size_t i = 1; i < s.y.size() && i < s.x.size(); ++i)
      img.line(px(s.x[i - 1]), py(s.y[i - 1]), px(s.x[i]), py(s.y[i]), s.rgb);
  img.write(path);
}

}  // namespace examples
