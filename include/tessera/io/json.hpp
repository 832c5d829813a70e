// JSON string escaping shared by the writers of JSON lines and traces (train/metrics.hpp,
// train/timeline.hpp): quotes and backslashes escaped, control characters as \u00XX, which JSON
// forbids raw (RFC 8259, section 7). Bytes >= 0x80 pass through: the strings are UTF-8 already.
//
// And a small reader for the JSON lines Tessera writes itself (the search log of
// train/search.hpp): objects, arrays, strings (escapes \" \\ \/ \b \f \n \r \t \u00XX), numbers,
// true/false/null. parse_json throws IoError naming the offset of the first thing it cannot read.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"

namespace tessera::detail {

TESSERA_LINKAGE std::string json_escaped(const std::string& s);

struct JsonValue {
  enum class Kind { Null, Bool, Number, String, Array, Object } kind = Kind::Null;
  bool boolean = false;
  double number = 0;
  std::string text;
  std::vector<JsonValue> items;               // Array
  std::map<std::string, JsonValue> members;   // Object

  bool has(const std::string& key) const;
  const JsonValue& at(const std::string& key) const;
  double as_number() const;
  const std::string& as_string() const;
};

class JsonReader {
 public:
  explicit JsonReader(const std::string& s);
  JsonValue document();

 private:
  [[noreturn]] void fail(const char* what) const;
  void skip_space();
  bool literal(const char* word);
  // Nesting is bounded so that a corrupt or hostile line fails with an IoError instead of
  // overflowing the stack (Tessera's own lines nest 3 deep).
  static constexpr int kMaxDepth = 256;
  JsonValue value();
  JsonValue element();
  std::string string();

  const std::string& s_;
  std::size_t at_ = 0;
  int depth_ = 0;
};

TESSERA_LINKAGE JsonValue parse_json(const std::string& text);

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE std::string json_escaped(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

TESSERA_LINKAGE JsonValue parse_json(const std::string& text) { return JsonReader(text).document(); }

TESSERA_LINKAGE bool JsonValue::has(const std::string& key) const { return kind == Kind::Object && members.count(key) != 0; }

TESSERA_LINKAGE const JsonValue& JsonValue::at(const std::string& key) const {
  auto it = members.find(key);
  TESSERA_CHECK(kind == Kind::Object && it != members.end(), IoError, "JSON: missing key '", key, "'");
  return it->second;
}

TESSERA_LINKAGE double JsonValue::as_number() const {
  TESSERA_CHECK(kind == Kind::Number || kind == Kind::Null, IoError, "JSON: expected a number");
  return kind == Kind::Null ? std::numeric_limits<double>::quiet_NaN() : number;  // null: a non-finite number
}

TESSERA_LINKAGE const std::string& JsonValue::as_string() const {
  TESSERA_CHECK(kind == Kind::String, IoError, "JSON: expected a string");
  return text;
}

TESSERA_LINKAGE JsonReader::JsonReader(const std::string& s) : s_(s) {}

TESSERA_LINKAGE JsonValue JsonReader::document() {
  JsonValue v = value();
  skip_space();
  if (at_ != s_.size()) fail("trailing characters");
  return v;
}

[[noreturn]] TESSERA_LINKAGE void JsonReader::fail(const char* what) const {
  throw IoError(cat("JSON: ", what, " at offset ", at_, " of '", s_.substr(0, 80), s_.size() > 80 ? "...'" : "'"));
}

TESSERA_LINKAGE void JsonReader::skip_space() {
  while (at_ < s_.size() && (s_[at_] == ' ' || s_[at_] == '\t' || s_[at_] == '\n' || s_[at_] == '\r')) ++at_;
}

TESSERA_LINKAGE bool JsonReader::literal(const char* word) {
  const std::string w(word);
  if (s_.compare(at_, w.size(), w) != 0) return false;
  at_ += w.size();
  return true;
}

TESSERA_LINKAGE JsonValue JsonReader::value() {
  skip_space();
  if (at_ >= s_.size() || (s_[at_] != '{' && s_[at_] != '[')) return element();
  if (depth_ == kMaxDepth) fail("arrays and objects nested deeper than 256");
  ++depth_;
  JsonValue v = element();
  --depth_;
  return v;
}

TESSERA_LINKAGE JsonValue JsonReader::element() {
  if (at_ >= s_.size()) fail("unexpected end");
  JsonValue v;
  const char c = s_[at_];
  if (c == '{') {
    v.kind = JsonValue::Kind::Object;
    ++at_;
    skip_space();
    if (at_ < s_.size() && s_[at_] == '}') return ++at_, v;
    for (;;) {
      skip_space();
      if (at_ >= s_.size() || s_[at_] != '"') fail("expected a key");
      std::string key = string();
      skip_space();
      if (at_ >= s_.size() || s_[at_] != ':') fail("expected ':'");
      ++at_;
      v.members[key] = value();
      skip_space();
      if (at_ < s_.size() && s_[at_] == ',') { ++at_; continue; }
      if (at_ < s_.size() && s_[at_] == '}') return ++at_, v;
      fail("expected ',' or '}'");
    }
  }
  if (c == '[') {
    v.kind = JsonValue::Kind::Array;
    ++at_;
    skip_space();
    if (at_ < s_.size() && s_[at_] == ']') return ++at_, v;
    for (;;) {
      v.items.push_back(value());
      skip_space();
      if (at_ < s_.size() && s_[at_] == ',') { ++at_; continue; }
      if (at_ < s_.size() && s_[at_] == ']') return ++at_, v;
      fail("expected ',' or ']'");
    }
  }
  if (c == '"') {
    v.kind = JsonValue::Kind::String;
    v.text = string();
    return v;
  }
  if (literal("true")) return v.kind = JsonValue::Kind::Bool, v.boolean = true, v;
  if (literal("false")) return v.kind = JsonValue::Kind::Bool, v;
  if (literal("null")) return v;
  const char* begin = s_.c_str() + at_;
  char* end = nullptr;
  v.number = std::strtod(begin, &end);
  if (end == begin) fail("unexpected character");
  at_ += static_cast<std::size_t>(end - begin);
  v.kind = JsonValue::Kind::Number;
  return v;
}

TESSERA_LINKAGE std::string JsonReader::string() {
  ++at_;  // the opening quote
  std::string out;
  while (at_ < s_.size() && s_[at_] != '"') {
    char c = s_[at_++];
    if (c == '\\') {
      if (at_ >= s_.size()) fail("unfinished escape");
      const char e = s_[at_++];
      if (e == 'n') c = '\n';
      else if (e == 't') c = '\t';
      else if (e == 'r') c = '\r';
      else if (e == 'b') c = '\b';
      else if (e == 'f') c = '\f';
      else if (e == 'u') {
        if (at_ + 4 > s_.size()) fail("short \\u escape");
        const unsigned code = static_cast<unsigned>(std::strtoul(s_.substr(at_, 4).c_str(), nullptr, 16));
        if (code >= 0x80) fail("\\u escape beyond ASCII");
        c = static_cast<char>(code);
        at_ += 4;
      } else {
        c = e;  // \" \\ \/
      }
    }
    out += c;
  }
  if (at_ >= s_.size()) fail("unterminated string");
  ++at_;
  return out;
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera::detail
