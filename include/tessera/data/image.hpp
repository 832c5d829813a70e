// Image files: decoding JPEG (libjpeg-turbo's TurboJPEG API) and PNG (libpng) into 8-bit pixels,
// and writing them (for tools/idx-to-image-folder and the tests).
//
// Image: height x width x channels bytes, interleaved (HWC), channels 1 (grey) or 3 (RGB).
// decode_image(bytes, channels, what) -> Image with the requested channel count, converted as
// PIL's Image.convert does, so that a torchvision pipeline (`pil_loader`: convert("RGB")) and this
// one see the same pixels:
//   grey -> RGB       R = G = B = grey
//   RGB -> grey       (19595 R + 38470 G + 7471 B + 0x8000) >> 16   (ITU-R 601-2 luma, PIL's "L")
//   alpha             dropped (not composited), as convert("RGB") does
//   CMYK / YCCK JPEG  nk = 255 - K, R = nk - nk C / 255 (PIL's cmyk2rgb, MULDIV255 rounding); Adobe
//                     JPEGs store CMYK inverted, and libjpeg returns them as stored, as PIL reads them
//   palette PNG       expanded through the palette (transparency dropped)
//   16-bit PNG        the high byte of each sample (PIL's "RGB;16B" unpacking; PIL itself clips
//                     16-bit grey to 255 instead, which is a bug not copied here)
// JPEG decoding uses libjpeg's defaults (accurate integer DCT, fancy upsampling), as PIL does, so
// the pixels are PIL's exactly.
// Errors name `what` (the file) and the reason: empty, truncated or corrupt data (libjpeg's
// warnings, such as a premature end of data, count as errors, as in PIL), a format that is
// neither JPEG nor PNG, detected from the first bytes whatever the file's extension, or a header
// that declares more than kMaxImagePixels (checked before anything is allocated: a 69-byte PNG can
// declare 65535 x 65535 pixels, 12 GiB of RGB). A build
// without libjpeg-turbo or libpng (meson found neither, or -Djpeg=disabled / -Dpng=disabled)
// still compiles; decoding that format then throws an error saying so.
//
// encode_png / encode_jpeg(image, quality): the file's bytes (JPEG 4:2:0 for RGB, as PIL's default).
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <csetjmp>
#include <fstream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#if defined(TESSERA_WITH_JPEG)
#include <turbojpeg.h>
#endif
#if defined(TESSERA_WITH_PNG)
#include <png.h>
#endif

#include "tessera/core/error.hpp"

namespace tessera {

// The most pixels a decoded image may have: PIL's decompression-bomb error threshold
// (2 x Image.MAX_IMAGE_PIXELS = 2 x 89,478,485), about 512 MiB of RGB. Larger headers are refused
// as corrupt (IoError, which ImageFolder's skip_corrupt skips) before any pixel is allocated.
inline constexpr std::int64_t kMaxImagePixels = 178956970;

// A read-only view of HWC bytes that live elsewhere (an Image, a memory-mapped cache file).
struct ImageView {
  const std::uint8_t* data = nullptr;
  std::int64_t height = 0, width = 0, channels = 0;
  const std::uint8_t* row(std::int64_t y) const { return data + y * width * channels; }
};

struct Image {
  std::int64_t height = 0, width = 0, channels = 0;
  std::vector<std::uint8_t> pixels;  // (height, width, channels)

  void resize(std::int64_t h, std::int64_t w, std::int64_t c) {
    height = h;
    width = w;
    channels = c;
    pixels.resize(static_cast<std::size_t>(h * w * c));  // keeps its capacity: reuse does not allocate
  }
  std::uint8_t* row(std::int64_t y) { return pixels.data() + y * width * channels; }
  const std::uint8_t* row(std::int64_t y) const { return pixels.data() + y * width * channels; }
  operator ImageView() const { return {pixels.data(), height, width, channels}; }  // NOLINT: a view of it
};

enum class ImageFormat { Unknown, Jpeg, Png };

inline constexpr bool kHaveJpeg =
#if defined(TESSERA_WITH_JPEG)
    true;
#else
    false;
#endif
inline constexpr bool kHavePng =
#if defined(TESSERA_WITH_PNG)
    true;
#else
    false;
#endif

// "jpeg (libjpeg-turbo) png (libpng 1.6.39)", or what is missing.
inline std::string image_decoders() {
  std::string out;
#if defined(TESSERA_WITH_JPEG)
  out += "jpeg (libjpeg-turbo)";
#else
  out += "no jpeg (built without libjpeg-turbo)";
#endif
#if defined(TESSERA_WITH_PNG)
  out += detail::cat(", png (libpng ", PNG_LIBPNG_VER_STRING, ")");
#else
  out += ", no png (built without libpng)";
#endif
  return out;
}

// From the first bytes: JPEG starts FF D8 FF, PNG with its 8-byte signature.
inline ImageFormat sniff_image_format(std::span<const std::uint8_t> bytes) {
  static constexpr std::uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (bytes.size() >= 3 && bytes[0] == 0xff && bytes[1] == 0xd8 && bytes[2] == 0xff) return ImageFormat::Jpeg;
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kPng, 8) == 0) return ImageFormat::Png;
  return ImageFormat::Unknown;
}

// Reads a whole file into `out` (reusing its capacity).
inline void read_file_bytes(const std::string& path, std::vector<std::uint8_t>& out) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  TESSERA_CHECK(f != nullptr, IoError, path, ": cannot open: ", std::strerror(errno));
  std::fseek(f, 0, SEEK_END);
  const long size = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  if (size < 0) {
    std::fclose(f);
    throw IoError(detail::cat(path, ": cannot read its size"));
  }
  out.resize(static_cast<std::size_t>(size));
  const std::size_t got = size > 0 ? std::fread(out.data(), 1, out.size(), f) : 0;
  std::fclose(f);
  TESSERA_CHECK(got == out.size(), IoError, path, ": read ", got, " of ", out.size(), " bytes");
}

namespace detail {

// PIL's MULDIV255: a * b / 255 rounded, in integers.
inline int muldiv255(int a, int b) {
  const int t = a * b + 128;
  return ((t >> 8) + t) >> 8;
}

// Converts `in` (1, 3 or 4 = CMYK channels) to `channels` (1 or 3) into `out`, as PIL does.
inline void convert_channels(const std::uint8_t* in, std::int64_t pixels, int in_channels, bool cmyk,
                             std::uint8_t* out, std::int64_t channels) {
  for (std::int64_t p = 0; p < pixels; ++p) {
    int r, g, b;
    const std::uint8_t* px = in + p * in_channels;
    if (cmyk) {
      const int nk = 255 - px[3];
      r = nk - muldiv255(px[0], nk);
      g = nk - muldiv255(px[1], nk);
      b = nk - muldiv255(px[2], nk);
    } else if (in_channels == 1) {
      r = g = b = px[0];
    } else {
      r = px[0];
      g = px[1];
      b = px[2];
    }
    if (channels == 3) {
      out[p * 3] = static_cast<std::uint8_t>(r);
      out[p * 3 + 1] = static_cast<std::uint8_t>(g);
      out[p * 3 + 2] = static_cast<std::uint8_t>(b);
    } else if (in_channels == 1) {
      out[p] = px[0];
    } else {
      out[p] = static_cast<std::uint8_t>((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16);
    }
  }
}

#if defined(TESSERA_WITH_JPEG)
// Whether the JPEG has an Adobe APP14 marker (before its first scan). Adobe's CMYK JPEGs store
// inverted values, and PIL (like Photoshop) inverts them back when it sees the marker; libjpeg
// returns the stored values, so the same inversion is applied here.
inline bool jpeg_has_adobe_marker(std::span<const std::uint8_t> b) {
  std::size_t i = 2;
  while (i + 4 <= b.size() && b[i] == 0xff) {
    const std::uint8_t marker = b[i + 1];
    if (marker == 0xda || marker == 0xd9) break;  // start of scan, end of image
    const std::size_t length = (static_cast<std::size_t>(b[i + 2]) << 8) | b[i + 3];
    if (marker == 0xee && length >= 7 && i + 9 <= b.size() && std::memcmp(&b[i + 4], "Adobe", 5) == 0) return true;
    i += 2 + length;
  }
  return false;
}

struct TurboJpeg {
  tjhandle decoder = nullptr, encoder = nullptr;
  ~TurboJpeg() {
    if (decoder) tjDestroy(decoder);
    if (encoder) tjDestroy(encoder);
  }
  // One handle per thread: TurboJPEG handles are not thread-safe, and making one per image would
  // repeat its set-up on every decode.
  static TurboJpeg& local() {
    thread_local TurboJpeg handles;
    return handles;
  }
  // After a failed decode: libjpeg can be left inside a decompression (seen after "Maximum
  // supported image dimension"), and the next file on this thread then fails with "two SOI
  // markers". A fresh handle starts clean.
  void reset_decoder() {
    if (decoder) tjDestroy(decoder);
    decoder = nullptr;
  }
};

inline void decode_jpeg(std::span<const std::uint8_t> bytes, std::int64_t channels, std::string_view what,
                        Image& out, std::vector<std::uint8_t>& scratch) {
  TurboJpeg& tj = TurboJpeg::local();
  if (!tj.decoder) tj.decoder = tjInitDecompress();
  TESSERA_CHECK(tj.decoder != nullptr, IoError, what, ": cannot start the JPEG decoder: ", tjGetErrorStr2(nullptr));
  int w = 0, h = 0, subsampling = 0, colorspace = 0;
  auto* data = const_cast<unsigned char*>(bytes.data());  // TurboJPEG 2.x takes a non-const pointer
  const auto size = static_cast<unsigned long>(bytes.size());
  if (tjDecompressHeader3(tj.decoder, data, size, &w, &h, &subsampling, &colorspace) != 0) {
    const std::string reason = tjGetErrorStr2(tj.decoder);
    tj.reset_decoder();
    throw IoError(cat(what, ": corrupt JPEG header: ", reason));
  }
  TESSERA_CHECK(w > 0 && h > 0, IoError, what, ": JPEG header declares an empty image (", w, "x", h, ")");
  TESSERA_CHECK(static_cast<std::int64_t>(w) * h <= kMaxImagePixels, IoError, what, ": JPEG header declares ", w, "x",
                h, " = ", static_cast<std::int64_t>(w) * h, " pixels, more than the decoder's limit of ",
                kMaxImagePixels, " (PIL's decompression-bomb limit): a corrupt or hostile file");
  const bool cmyk = colorspace == TJCS_CMYK || colorspace == TJCS_YCCK;
  const bool grey = colorspace == TJCS_GRAY;
  // Decode straight into `out` where no conversion is needed.
  const int native = cmyk ? 4 : grey ? 1 : 3;
  const int pixel_format = cmyk ? TJPF_CMYK : grey ? TJPF_GRAY : TJPF_RGB;
  const bool direct = !cmyk && native == channels;
  std::uint8_t* target;
  out.resize(h, w, channels);
  if (direct) {
    target = out.pixels.data();
  } else {
    scratch.resize(static_cast<std::size_t>(w) * h * native);
    target = scratch.data();
  }
  // libjpeg finishes a truncated stream with grey and calls it a warning: that is an error here, as
  // in PIL ("image file is truncated"). Other warnings (extraneous bytes before a marker) leave a
  // complete image, which PIL accepts too.
  if (tjDecompress2(tj.decoder, data, size, target, w, 0, h, pixel_format, 0) != 0) {
    const std::string reason = tjGetErrorStr2(tj.decoder);
    const bool warning = tjGetErrorCode(tj.decoder) == TJERR_WARNING;
    if (!warning || reason.find("Premature end") != std::string::npos) {
      tj.reset_decoder();
      throw IoError(cat(what, warning ? ": truncated JPEG: " : ": corrupt JPEG: ", reason));
    }
  }
  if (cmyk && jpeg_has_adobe_marker(bytes)) {
    for (std::size_t i = 0; i < scratch.size(); ++i) scratch[i] = static_cast<std::uint8_t>(255 - scratch[i]);
  }
  if (!direct) convert_channels(target, static_cast<std::int64_t>(w) * h, native, cmyk, out.pixels.data(), channels);
}
#endif

#if defined(TESSERA_WITH_PNG)
struct PngReader {
  std::span<const std::uint8_t> bytes;
  std::size_t offset = 0;
  char message[256] = {};
  bool too_large = false;  // the header declares more than kMaxImagePixels
};

inline void png_read_from_memory(png_structp png, png_bytep dst, png_size_t n) {
  auto* reader = static_cast<PngReader*>(png_get_io_ptr(png));
  if (reader->bytes.size() - reader->offset < n) png_error(png, "truncated file (ends before the image data does)");
  std::memcpy(dst, reader->bytes.data() + reader->offset, n);
  reader->offset += n;
}

inline void png_record_error(png_structp png, png_const_charp message) {
  auto* reader = static_cast<PngReader*>(png_get_error_ptr(png));
  std::snprintf(reader->message, sizeof reader->message, "%s", message);
  png_longjmp(png, 1);
}

inline void png_ignore_warning(png_structp, png_const_charp) {}

// libpng reports errors by longjmp: everything that owns memory lives outside this function or
// was sized before setjmp, and `rows` is filled after it, so nothing is skipped by the jump.
inline bool decode_png_raw(PngReader& reader, std::vector<std::uint8_t>& raw, std::vector<png_bytep>& rows,
                           int& width, int& height, int& native) {
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &reader, png_record_error, png_ignore_warning);
  if (!png) {
    std::snprintf(reader.message, sizeof reader.message, "cannot start the PNG decoder");
    return false;
  }
  png_infop info = png_create_info_struct(png);
  if (!info || setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, info ? &info : nullptr, nullptr);
    return false;
  }
  png_set_read_fn(png, &reader, png_read_from_memory);
  png_set_user_limits(png, 1 << 16, 1 << 16);
  png_read_info(png, info);
  const int color = png_get_color_type(png, info);
  const int depth = png_get_bit_depth(png, info);
  if (depth == 16) png_set_strip_16(png);  // the high byte, as PIL's ";16B" unpacking
  if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  png_set_strip_alpha(png);  // an alpha channel, or the one a palette's or grey's tRNS would add
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  width = static_cast<int>(png_get_image_width(png, info));
  height = static_cast<int>(png_get_image_height(png, info));
  native = png_get_channels(png, info);
  if (static_cast<std::int64_t>(width) * height > kMaxImagePixels) {
    std::snprintf(reader.message, sizeof reader.message,
                  "PNG header declares %dx%d = %lld pixels, more than the decoder's limit of %lld (PIL's "
                  "decompression-bomb limit): a corrupt or hostile file",
                  width, height, static_cast<long long>(width) * height, static_cast<long long>(kMaxImagePixels));
    reader.too_large = true;
    png_destroy_read_struct(&png, &info, nullptr);
    return false;
  }
  if (native != 1 && native != 3) {
    std::snprintf(reader.message, sizeof reader.message, "unexpected %d channels after expansion", native);
    png_destroy_read_struct(&png, &info, nullptr);
    return false;
  }
  raw.resize(static_cast<std::size_t>(width) * height * native);
  rows.resize(static_cast<std::size_t>(height));
  for (int y = 0; y < height; ++y) rows[static_cast<std::size_t>(y)] = raw.data() + static_cast<std::size_t>(y) * width * native;
  png_read_image(png, rows.data());
  png_read_end(png, nullptr);
  png_destroy_read_struct(&png, &info, nullptr);
  return true;
}

inline void decode_png(std::span<const std::uint8_t> bytes, std::int64_t channels, std::string_view what, Image& out,
                       std::vector<std::uint8_t>& scratch) {
  PngReader reader{bytes};
  thread_local std::vector<png_bytep> rows;
  int w = 0, h = 0, native = 0;
  if (!decode_png_raw(reader, scratch, rows, w, h, native)) {
    throw IoError(cat(what, reader.too_large ? ": " : ": corrupt or truncated PNG: ", reader.message));
  }
  out.resize(h, w, channels);
  if (native == channels) {
    std::memcpy(out.pixels.data(), scratch.data(), out.pixels.size());
  } else {
    convert_channels(scratch.data(), static_cast<std::int64_t>(w) * h, native, false, out.pixels.data(), channels);
  }
}
#endif

}  // namespace detail

// Decodes a JPEG or PNG file's bytes into `out` with `channels` (1 or 3) channels. `scratch` holds
// an intermediate image where a conversion is needed; reusing both across calls avoids allocating.
inline void decode_image(std::span<const std::uint8_t> bytes, std::int64_t channels, std::string_view what,
                         [[maybe_unused]] Image& out, [[maybe_unused]] std::vector<std::uint8_t>& scratch) {
  TESSERA_CHECK(channels == 1 || channels == 3, ArgumentError, what, ": decode to ", channels,
                " channels: need 1 (grey) or 3 (RGB)");
  TESSERA_CHECK(!bytes.empty(), IoError, what, ": empty file (0 bytes)");
  switch (sniff_image_format(bytes)) {
    case ImageFormat::Jpeg:
#if defined(TESSERA_WITH_JPEG)
      detail::decode_jpeg(bytes, channels, what, out, scratch);
      return;
#else
      throw IoError(detail::cat(what, ": is a JPEG, but Tessera was built without JPEG support (install "
                                      "libturbojpeg0-dev and reconfigure meson)"));
#endif
    case ImageFormat::Png:
#if defined(TESSERA_WITH_PNG)
      detail::decode_png(bytes, channels, what, out, scratch);
      return;
#else
      throw IoError(detail::cat(what, ": is a PNG, but Tessera was built without PNG support (install libpng-dev "
                                      "and reconfigure meson)"));
#endif
    case ImageFormat::Unknown:
      break;
  }
  throw IoError(detail::cat(what, ": unsupported image format (not JPEG or PNG; the first bytes are ",
                            bytes.size() >= 2 ? std::to_string(bytes[0]) + " " + std::to_string(bytes[1]) : "too few",
                            ")"));
}

inline Image decode_image(std::span<const std::uint8_t> bytes, std::int64_t channels, std::string_view what) {
  Image out;
  std::vector<std::uint8_t> scratch;
  decode_image(bytes, channels, what, out, scratch);
  return out;
}

inline Image read_image(const std::string& path, std::int64_t channels) {
  std::vector<std::uint8_t> bytes;
  read_file_bytes(path, bytes);
  return decode_image(bytes, channels, path);
}

// ---- Encoding -------------------------------------------------------------------------------

inline std::vector<std::uint8_t> encode_png(const Image& image) {
#if defined(TESSERA_WITH_PNG)
  TESSERA_CHECK(image.channels == 1 || image.channels == 3, ArgumentError, "encode_png: ", image.channels,
                " channels, need 1 or 3");
  png_image desc{};
  desc.version = PNG_IMAGE_VERSION;
  desc.width = static_cast<png_uint_32>(image.width);
  desc.height = static_cast<png_uint_32>(image.height);
  desc.format = image.channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;
  png_alloc_size_t size = 0;
  TESSERA_CHECK(png_image_write_get_memory_size(desc, size, 0, image.pixels.data(), 0, nullptr) != 0, IoError,
                "encode_png: ", desc.message);
  std::vector<std::uint8_t> out(size);
  TESSERA_CHECK(png_image_write_to_memory(&desc, out.data(), &size, 0, image.pixels.data(), 0, nullptr) != 0,
                IoError, "encode_png: ", desc.message);
  out.resize(size);
  return out;
#else
  (void)image;
  throw IoError("encode_png: Tessera was built without PNG support (install libpng-dev and reconfigure meson)");
#endif
}

inline std::vector<std::uint8_t> encode_jpeg(const Image& image, int quality = 90) {
#if defined(TESSERA_WITH_JPEG)
  TESSERA_CHECK(image.channels == 1 || image.channels == 3, ArgumentError, "encode_jpeg: ", image.channels,
                " channels, need 1 or 3");
  TESSERA_CHECK(quality >= 1 && quality <= 100, ArgumentError, "encode_jpeg: quality=", quality,
                " must be in [1, 100]");
  detail::TurboJpeg& tj = detail::TurboJpeg::local();
  if (!tj.encoder) tj.encoder = tjInitCompress();
  TESSERA_CHECK(tj.encoder != nullptr, IoError, "encode_jpeg: cannot start the encoder");
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  const bool grey = image.channels == 1;
  if (tjCompress2(tj.encoder, image.pixels.data(), static_cast<int>(image.width), 0, static_cast<int>(image.height),
                  grey ? TJPF_GRAY : TJPF_RGB, &buffer, &size, grey ? TJSAMP_GRAY : TJSAMP_420, quality, 0) != 0) {
    const std::string reason = tjGetErrorStr2(tj.encoder);
    tjFree(buffer);
    throw IoError(detail::cat("encode_jpeg: ", reason));
  }
  std::vector<std::uint8_t> out(buffer, buffer + size);
  tjFree(buffer);
  return out;
#else
  (void)image;
  (void)quality;
  throw IoError("encode_jpeg: Tessera was built without JPEG support (install libturbojpeg0-dev and reconfigure)");
#endif
}

inline void write_file_bytes(const std::string& path, std::span<const std::uint8_t> bytes) {
  std::ofstream f(path, std::ios::binary);
  TESSERA_CHECK(f.good(), IoError, path, ": cannot create: ", std::strerror(errno));
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  TESSERA_CHECK(f.good(), IoError, path, ": write failed");
}

}  // namespace tessera
