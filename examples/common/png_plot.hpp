// A line plot written as a PNG with nothing but zlib: for examples that want to show a curve
// without a plotting library. Series are drawn as 2-pixel lines on a light grid (one grid line
// per x unit when there are few, and every 10% of the y range); no text: the caller prints the
// legend (series colour and name) and axis ranges.
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

// Plots the series over x = 1..max length in [y_min, y_max] into a width x height PNG.
inline void plot_png(const std::string& path, const std::vector<Series>& series, double y_min, double y_max,
                     int width = 800, int height = 500) {
  PngImage img(width, height);
  const int left = 40, right = width - 20, top = 20, bottom = height - 40;
  std::size_t points = 1;
  for (const auto& s : series) points = std::max(points, s.y.size());
  auto px = [&](double x) { return left + static_cast<int>((x - 1) / std::max<double>(1, points - 1) * (right - left)); };
  auto py = [&](double y) {
    const double t = std::clamp((y - y_min) / (y_max - y_min), 0.0, 1.0);
    return bottom - static_cast<int>(t * (bottom - top));
  };
  const std::array<std::uint8_t, 3> grid = {225, 225, 225}, axis = {60, 60, 60};
  for (int k = 0; k <= 10; ++k) img.line(left, py(y_min + k * (y_max - y_min) / 10), right, py(y_min + k * (y_max - y_min) / 10), grid);
  for (std::size_t x = 1; x <= points && points <= 100; ++x) img.line(px(x), top, px(x), bottom, grid);
  img.line(left, bottom, right, bottom, axis);
  img.line(left, top, left, bottom, axis);
  for (const auto& s : series)
    for (std::size_t i = 1; i < s.y.size(); ++i)
      img.line(px(static_cast<double>(i)), py(s.y[i - 1]), px(static_cast<double>(i + 1)), py(s.y[i]), s.rgb);
  img.write(path);
}

// Plots each series' points (x[i], y[i]) over [0, x_max] x [y_min, y_max]; grid lines every 10%
// of both ranges.
inline void plot_xy_png(const std::string& path, const std::vector<Series>& series, double x_max, double y_min,
                        double y_max, int width = 800, int height = 500) {
  PngImage img(width, height);
  const int left = 40, right = width - 20, top = 20, bottom = height - 40;
  auto px = [&](double x) { return left + static_cast<int>(std::clamp(x / x_max, 0.0, 1.0) * (right - left)); };
  auto py = [&](double y) {
    const double t = std::clamp((y - y_min) / (y_max - y_min), 0.0, 1.0);
    return bottom - static_cast<int>(t * (bottom - top));
  };
  const std::array<std::uint8_t, 3> grid = {225, 225, 225}, axis = {60, 60, 60};
  for (int k = 0; k <= 10; ++k) {
    img.line(left, py(y_min + k * (y_max - y_min) / 10), right, py(y_min + k * (y_max - y_min) / 10), grid);
    img.line(px(k * x_max / 10), top, px(k * x_max / 10), bottom, grid);
  }
  img.line(left, bottom, right, bottom, axis);
  img.line(left, top, left, bottom, axis);
  for (const auto& s : series)
    for (std::size_t i = 1; i < s.y.size() && i < s.x.size(); ++i)
      img.line(px(s.x[i - 1]), py(s.y[i - 1]), px(s.x[i]), py(s.y[i]), s.rgb);
  img.write(path);
}

}  // namespace examples
