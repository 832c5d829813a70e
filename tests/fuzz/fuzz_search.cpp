// Fuzz target: the hyper-parameter search's record exchange and log reader
// (include/tessera/train/search.hpp). Each group's rank 0 packs its trial's record (JSON) into
// int64 words (pack_string) that the coordinator all_gathers and unpacks (unpack_string); the log
// is read back line by line through parse_json and TrialRecord::from_json on resume. The input is
// such a buffer of words as a peer sends it (its first word the record's length), so a hostile
// or corrupt length and every field of the record are reached. Expected: a TrialRecord or a
// tessera error (CommError for a bad buffer, IoError for a bad record); a record that was read
// writes itself back (json()) as JSON that parses again.
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "tessera/train/search.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::int64_t> words((size + 7) / 8);
  if (size > 0) std::memcpy(words.data(), data, size);
  try {
    const std::string text = tessera::detail::unpack_string(words);
    const tessera::TrialRecord r = tessera::TrialRecord::from_json(tessera::detail::parse_json(text));
    (void)tessera::detail::parse_json(r.json());  // what was read writes itself back as JSON
  } catch (const tessera::CommError&) {
  } catch (const tessera::IoError&) {
  }
  return 0;
}
