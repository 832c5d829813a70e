// Built without TESSERA_WITH_JPEG / TESSERA_WITH_PNG (meson: tessera_no_image_deps): what a user
// gets whose machine lacks libturbojpeg0-dev and libpng-dev. The pipeline compiles; every decode
// and encode throws an IoError saying which library the build lacks, naming the file.
#include <cstdio>
#include <string>

#include "tessera/data/image_folder.hpp"

using namespace tessera;

namespace {

int failures = 0;

void expect_error(const char* what, auto f, const std::string& needle1, const std::string& needle2) {
  try {
    f();
    std::printf("FAIL %s: no error\n", what);
    ++failures;
  } catch (const IoError& e) {
    const std::string message = e.what();
    const bool ok = message.find(needle1) != std::string::npos && message.find(needle2) != std::string::npos;
    std::printf("%s %s: %s\n", ok ? "ok  " : "FAIL", what, e.what());
    failures += ok ? 0 : 1;
  }
}

}  // namespace

int main() {
  static_assert(!kHaveJpeg && !kHavePng, "this program is built without the image decoders");
  const std::string dir = std::string(TESSERA_REFERENCE_DATA_DIR) + "/images/";
  std::printf("decoders: %s\n", image_decoders().c_str());
  expect_error("decode a JPEG", [&] { read_image(dir + "rgb_420.jpg", 3); }, "rgb_420.jpg", "without JPEG support");
  expect_error("decode a PNG", [&] { read_image(dir + "grey.png", 1); }, "grey.png", "without PNG support");
  expect_error("encode a PNG", [] { encode_png(Image{}); }, "encode_png", "libpng-dev");
  expect_error("encode a JPEG", [] { encode_jpeg(Image{}); }, "encode_jpeg", "libturbojpeg0-dev");
  // The folder is listed as usual (listing needs no decoder); reading a sample names the file.
  const std::string folder = std::string(TESSERA_REFERENCE_DATA_DIR);
  try {
    ImageFolder images(folder, {.transform = ImageTransform::eval(0, 8)});
    std::vector<float> out(3 * 8 * 8);
    expect_error("read an ImageFolder sample", [&] { images.read(0, 0, out.data()); }, "images/", "without");
  } catch (const std::exception& e) {
    std::printf("FAIL listing %s: %s\n", folder.c_str(), e.what());
    ++failures;
  }
  std::printf("%s\n", failures == 0 ? "all checks passed" : "some checks failed");
  return failures == 0 ? 0 : 1;
}
