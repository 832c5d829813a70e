// Text data (data/text.hpp): the byte tokenizer, nanoGPT's uint16 token files (layout, corruption,
// shards), random windows, and the Debian text corpus (read, missing package, prepared split).
#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "support/temp_dir.hpp"
#include "tessera/data/text.hpp"

using namespace tessera;

namespace {
std::string text_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void text_write(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}
}  // namespace

TEST_CASE("ByteTokenizer: every byte is a token and decodes back", "[data][text]") {
  const std::string text = std::string("GPT \xC3\xA9t\xC3\xA9\n") + '\0' + "\xFF";
  const auto ids = ByteTokenizer::encode(text);
  REQUIRE(ids.size() == text.size());
  CHECK(ids[0] == 'G');
  CHECK(ids[4] == 0xC3);  // UTF-8: two tokens for the e-acute
  CHECK(ids[ids.size() - 2] == 0);
  CHECK(ids.back() == 255);
  CHECK(ByteTokenizer::decode(ids) == text);
  const std::vector<std::int64_t> bad = {72, 105, 256};
  CHECK_THROWS_WITH(ByteTokenizer::decode(bad), Catch::Contains("ids[2] = 256"));
}

TEST_CASE("Token files: nanoGPT's little-endian uint16 layout, shards and windows", "[data][text]") {
  testing::TempDir dir;
  std::vector<std::int64_t> ids;
  for (std::int64_t i = 0; i < 1000; ++i) ids.push_back((i * 37) % 300);
  ids[1] = 258;  // bytes 02 01
  write_token_file(dir.path / "train.bin", ids);
  const std::string bytes = text_file_bytes(dir / "train.bin");
  REQUIRE(bytes.size() == 2000);
  CHECK(static_cast<unsigned char>(bytes[2]) == 0x02);
  CHECK(static_cast<unsigned char>(bytes[3]) == 0x01);
  const TokenFile file(dir.path / "train.bin", /*vocab_size=*/300);
  REQUIRE(file.size() == 1000);
  for (std::int64_t i = 0; i < 1000; ++i) REQUIRE(file.all()[i] == ids[static_cast<std::size_t>(i)]);
  // Three shards cover the file once, in order.
  std::int64_t next = 0;
  for (int r = 0; r < 3; ++r) {
    const TokenSpan s = file.shard(r, 3);
    CHECK(s.offset == next);
    CHECK(s[0] == ids[static_cast<std::size_t>(s.offset)]);
    next += s.size;
  }
  CHECK(next == 1000);
  CHECK_THROWS_AS(file.shard(3, 3), ArgumentError);
  // Windows: y is x shifted by one, inside the shard; the same seed gives the same windows.
  const TokenSpan shard = file.shard(1, 3);
  TokenWindows windows(shard, 16, 5), again(shard, 16, 5);
  std::vector<std::int64_t> x, y, x2, y2;
  std::set<std::int64_t> starts;
  for (int step = 0; step < 20; ++step) {
    windows.next(4, x, y);
    again.next(4, x2, y2);
    REQUIRE(x == x2);
    REQUIRE(y == y2);
    for (std::int64_t b = 0; b < 4; ++b) {
      // Find the window's offset in the shard from its first two tokens' file positions.
      std::int64_t found = -1;
      for (std::int64_t i = 0; i + 16 < shard.size && found < 0; ++i) {
        bool same = true;
        for (std::int64_t t = 0; t < 16 && same; ++t) same = shard[i + t] == x[static_cast<std::size_t>(b * 16 + t)];
        if (same) found = i;
      }
      REQUIRE(found >= 0);
      starts.insert(found);
      for (std::int64_t t = 0; t < 16; ++t) CHECK(y[static_cast<std::size_t>(b * 16 + t)] == shard[found + t + 1]);
    }
  }
  CHECK(starts.size() > 40);  // 80 draws from 318 offsets
  CHECK_THROWS_WITH(TokenWindows(file.shard(0, 100), 16, 1), Catch::Contains("hold no window of 16"));
}

TEST_CASE("Token files: corrupt or missing files fail, naming the file and the token", "[data][text][errors]") {
  testing::TempDir dir;
  text_write(dir.path / "odd.bin", std::string("\x01\x00\x02", 3));
  CHECK_THROWS_WITH(TokenFile(dir.path / "odd.bin"), Catch::Contains("odd.bin") && Catch::Contains("corrupt") &&
                                                         Catch::Contains("3 bytes"));
  text_write(dir.path / "empty.bin", "");
  CHECK_THROWS_AS(TokenFile(dir.path / "empty.bin"), IoError);
  const std::vector<std::int64_t> ids = {1, 2, 300, 4};
  write_token_file(dir.path / "big.bin", ids);
  CHECK_NOTHROW(TokenFile(dir.path / "big.bin"));
  CHECK_THROWS_WITH(TokenFile(dir.path / "big.bin", 256), Catch::Contains("big.bin") && Catch::Contains("token 2 is 300") &&
                                                              Catch::Contains("vocabulary of 256"));
  CHECK_THROWS_WITH(TokenFile(dir.path / "missing.bin"), Catch::Contains("missing.bin") && Catch::Contains("cannot open"));
  const std::vector<std::int64_t> too_big = {70000};
  CHECK_THROWS_WITH(write_token_file(dir.path / "x.bin", too_big), Catch::Contains("ids[0] = 70000"));
  CHECK_FALSE(std::filesystem::exists(dir.path / "x.bin"));
}

TEST_CASE("Text corpus: files in name order, indexes and links skipped, a missing package named",
          "[data][text]") {
  testing::TempDir dir;
  std::filesystem::create_directories(dir.path / "pkg");
  text_write(dir.path / "pkg" / "b", "second\n%\n");
  text_write(dir.path / "pkg" / "a", "first\n%\n");
  text_write(dir.path / "pkg" / "a.dat", "INDEX");
  std::filesystem::create_symlink(dir.path / "pkg" / "a", dir.path / "pkg" / "a.u8");
  std::filesystem::create_symlink(dir.path / "pkg" / "b", dir.path / "pkg" / "link");
  const TextCorpus corpus{"test", "test-package", dir.path / "pkg"};
  CHECK(read_text_corpus(corpus) == "first\n%\nsecond\n%\n");
  const PreparedCorpus p = prepare_byte_corpus(corpus, dir.path / "out", 0.25);
  CHECK(p.train_tokens + p.val_tokens == 17);
  CHECK(p.val_tokens == 17 - static_cast<std::int64_t>(17 * 0.75));
  const TokenFile train(p.train, 256), val(p.val, 256);
  CHECK(train.size() == p.train_tokens);
  CHECK(ByteTokenizer::decode(std::vector<std::int64_t>{train.all()[0], train.all()[1]}) == "fi");
  const TextCorpus missing{"nowhere", "fortunes", dir.path / "absent"};
  CHECK_THROWS_WITH(read_text_corpus(missing), Catch::Contains("'nowhere' is not installed") &&
                                                   Catch::Contains("apt-get install fortunes"));
  CHECK(TextCorpus::fortunes().package == "fortunes");
}
