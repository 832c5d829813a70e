// Metrics as JSON lines: one object per line, appended and flushed per record, so a crashed run
// keeps every epoch it finished and `jq`/pandas read the file directly.
#pragma once

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"
#include "tessera/io/json.hpp"

namespace tessera {

class JsonRecord {
 public:
  JsonRecord& add(const std::string& key, double v);
  JsonRecord& add(const std::string& key, std::int64_t v);
  JsonRecord& add(const std::string& key, int v);
  JsonRecord& add(const std::string& key, const std::string& v);
  JsonRecord& add(const std::string& key, const char* v);

  std::string str() const;

 private:
  std::vector<std::pair<std::string, std::string>> fields_;
};

class MetricsWriter {
 public:
  MetricsWriter() = default;
  explicit MetricsWriter(const std::string& path);
  void write(const JsonRecord& r);

 private:
  std::string path_;
  std::ofstream out_;
};

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE JsonRecord& JsonRecord::add(const std::string& key, double v) {
  char buf[64];
  if (std::isfinite(v))
    std::snprintf(buf, sizeof buf, "%.9g", v);
  else
    std::snprintf(buf, sizeof buf, "null");
  fields_.emplace_back(key, buf);
  return *this;
}

TESSERA_LINKAGE JsonRecord& JsonRecord::add(const std::string& key, std::int64_t v) {
  fields_.emplace_back(key, std::to_string(v));
  return *this;
}

TESSERA_LINKAGE JsonRecord& JsonRecord::add(const std::string& key, int v) { return add(key, static_cast<std::int64_t>(v)); }

TESSERA_LINKAGE JsonRecord& JsonRecord::add(const std::string& key, const std::string& v) {
  std::string quoted = "\"";  // appended, not `"\"" + s`: GCC 12 warns falsely (-Wrestrict) on that
  quoted += detail::json_escaped(v);
  quoted += '"';
  fields_.emplace_back(key, std::move(quoted));
  return *this;
}

TESSERA_LINKAGE JsonRecord& JsonRecord::add(const std::string& key, const char* v) { return add(key, std::string(v)); }

TESSERA_LINKAGE std::string JsonRecord::str() const {
  std::string out = "{";
  for (std::size_t i = 0; i < fields_.size(); ++i)
    out += (i ? ", \"" : "\"") + detail::json_escaped(fields_[i].first) + "\": " + fields_[i].second;
  return out + "}";
}

TESSERA_LINKAGE MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  if (path.empty()) return;
  out_.open(path, std::ios::app);
  TESSERA_CHECK(out_, IoError, "MetricsWriter: cannot open '", path, "' for appending");
}

TESSERA_LINKAGE void MetricsWriter::write(const JsonRecord& r) {
  if (!out_.is_open()) return;
  out_ << r.str() << '\n';
  out_.flush();
}

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
