// Fuzz target: parse_json (include/tessera/io/json.hpp), the reader of the hyper-parameter
// search's log. Expected: a value or an IoError. Each parsed document is also walked with the
// accessors the search uses (has, at, as_number, as_string), which throw IoError on a wrong kind,
// and read as a search-log record (TrialRecord::from_json, train/search.hpp); and any bytes
// escaped by json_escaped read back unchanged.
#include <cstdint>
#include <string>

#include "tessera/io/json.hpp"
#include "tessera/train/search.hpp"

namespace {

std::size_t walk(const tessera::detail::JsonValue& v, int depth) {
  using K = tessera::detail::JsonValue::Kind;
  std::size_t n = 1;
  if (v.kind == K::Array)
    for (const auto& item : v.items) n += walk(item, depth + 1);
  if (v.kind == K::Object)
    for (const auto& [key, member] : v.members) {
      n += walk(member, depth + 1);
      if (!v.has(key)) __builtin_trap();  // what the object holds, it must find
    }
  try {
    (void)v.as_number();
  } catch (const tessera::IoError&) {
  }
  try {
    (void)v.as_string();
  } catch (const tessera::IoError&) {
  }
  try {
    (void)v.at("trial");
  } catch (const tessera::IoError&) {
  }
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto doc = tessera::detail::parse_json(text);
    (void)walk(doc, 0);
    const tessera::TrialRecord r = tessera::TrialRecord::from_json(doc);
    (void)tessera::detail::parse_json(r.json());  // what was read writes itself back as JSON
  } catch (const tessera::IoError&) {
  }
  // What the writers escape must read back unchanged: any bytes, through json_escaped (metrics
  // and trace writers) and parse_json. An IoError here escapes and counts as a crash.
  const auto back = tessera::detail::parse_json("\"" + tessera::detail::json_escaped(text) + "\"");
  if (back.kind != tessera::detail::JsonValue::Kind::String || back.text != text) __builtin_trap();
  return 0;
}
