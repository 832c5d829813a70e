// Timeline: a Chrome-trace (Trace Event Format) record of what each rank did when, for
// chrome://tracing or https://ui.perfetto.dev. One file per job: every rank records its own
// events, and write() gathers them to rank 0 through the communicator, which writes
//
//   {"traceEvents": [{"name": "backward", "cat": "compute", "ph": "X", "ts": 1234.5, "dur": 87.0,
//                     "pid": <rank>, "tid": <lane>}, ...], "displayTimeUnit": "ms"}
//
// Each rank is a process row ("rank 0", "rank 1", ...); lanes are rows within it: lane 0 for
// compute (forward, backward, optimizer step), lane 1 for communication (one span per bucket
// all-reduce, from launch to the moment it was seen complete). Times are microseconds since rank
// 0 made its Timeline. Ranks on rank 0's host read the same monotonic clock (threads of one
// process, or processes of one machine), so they take rank 0's zero exactly; a rank on another
// host aligns its own clock by the barrier at construction. (Each rank used to start its clock as
// it left the barrier, and thread ranks leave it far apart on a busy machine: receives were drawn
// ending before their sends began.)
//
//   Timeline timeline(comm);                         // collective: all ranks
//   { auto span = timeline.span("forward"); ... }   // RAII span on lane 0
//   timeline.write(comm, "trace.json");              // collective; rank 0 writes the file
#pragma once

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/linkage.hpp"
#include "tessera/core/span_sink.hpp"
#include "tessera/io/json.hpp"

namespace tessera {

class Timeline final : public SpanSink {
 public:
  template <Communicator Comm>
  explicit Timeline(Comm& comm) : rank_(comm.rank()) {
    comm.barrier();  // a common zero for ranks of other hosts (to within one barrier's skew)
    start_ = Clock::now();
    // Rank 0's zero for every rank of its host: (host id, zero in clock ticks) from every rank.
    const std::array<std::int64_t, 2> mine{host_id(), start_.time_since_epoch().count()};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(comm.size()));
    comm.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
    if (all[0] == mine[0]) start_ = Clock::time_point(Clock::duration(all[1]));
  }

  double now_us() const;

  // This machine, as a number equal on every process of it (a hash of its host name).
  static std::int64_t host_id();

  // A complete event [begin_us, end_us) on a lane. Thread-safe.
  void add(std::string name, const char* category, double begin_us, double end_us, int lane);

  // The same with clock readings (e.g. DataParallel's bucket launch and completion times).
  void add(std::string name, const char* category, Clock::time_point begin, Clock::time_point end,
           int lane) override;

  class Span {
   public:
    Span(Timeline* t, std::string name, const char* category, int lane)
        : t_(t), name_(std::move(name)), category_(category), lane_(lane), begin_(t ? t->now_us() : 0) {}
    Span(Span&& other) noexcept
        : t_(other.t_), name_(std::move(other.name_)), category_(other.category_), lane_(other.lane_), begin_(other.begin_) {
      other.t_ = nullptr;
    }
    Span(const Span&) = delete;
    ~Span() {
      if (t_) t_->add(std::move(name_), category_, begin_, t_->now_us(), lane_);
    }

   private:
    Timeline* t_;
    std::string name_;
    const char* category_;
    int lane_;
    double begin_;
  };
  // RAII: the span runs until the returned object is destroyed.
  [[nodiscard]] Span span(std::string name, const char* category = "compute", int lane = kCompute);

  std::size_t size() const;

  // This rank's events as JSON objects separated by commas (no brackets).
  std::string events_json() const;

  // Collective: gathers every rank's events to rank 0, which writes one trace file (atomically
  // enough for a trace: a temp name, then rename). Other ranks write nothing. `comm`: a
  // communicator, or anything with rank(), size() and an int64 all_gather (a CheckpointGroup).
  template <class Comm>
    requires requires(Comm& c, std::span<const std::int64_t> in, std::span<std::int64_t> out) {
      { c.rank() } -> std::convertible_to<int>;
      { c.size() } -> std::convertible_to<int>;
      c.all_gather(in, out);
    }
  void write(Comm& comm, const std::string& path) const {
    const std::string mine = events_json();
    // Variable-length strings through fixed-size collectives: lengths first, then the bytes
    // packed into int64 words, padded to the longest.
    std::vector<std::int64_t> length = {static_cast<std::int64_t>(mine.size())};
    std::vector<std::int64_t> lengths(static_cast<std::size_t>(comm.size()));
    comm.all_gather(std::span<const std::int64_t>(length), std::span<std::int64_t>(lengths));
    std::int64_t longest = 0;
    for (auto l : lengths) longest = std::max(longest, l);
    const std::size_t words = static_cast<std::size_t>((longest + 7) / 8);
    std::vector<std::int64_t> packed(words, 0), all(words * static_cast<std::size_t>(comm.size()));
    std::memcpy(packed.data(), mine.data(), mine.size());
    comm.all_gather(std::span<const std::int64_t>(packed), std::span<std::int64_t>(all));
    if (comm.rank() != 0) return;
    const std::string tmp = path + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    TESSERA_CHECK(f != nullptr, IoError, "Timeline: cannot write '", tmp, "'");
    std::fprintf(f, "{\"traceEvents\": [\n");
    bool first = true;
    for (int r = 0; r < comm.size(); ++r) {
      std::fprintf(f, "%s{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": \"rank %d\"}}",
                   first ? "" : ",\n", r, r);
      first = false;
      std::fprintf(f, ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, \"args\": {\"name\": \"compute\"}}", r);
      std::fprintf(f, ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 1, \"args\": {\"name\": \"communication\"}}", r);
      const auto* bytes = reinterpret_cast<const char*>(all.data() + static_cast<std::size_t>(r) * words);
      if (lengths[static_cast<std::size_t>(r)] > 0) {
        std::fprintf(f, ",\n");
        std::fwrite(bytes, 1, static_cast<std::size_t>(lengths[static_cast<std::size_t>(r)]), f);
      }
    }
    std::fprintf(f, "\n], \"displayTimeUnit\": \"ms\"}\n");
    const bool ok = std::fclose(f) == 0;
    TESSERA_CHECK(ok && std::rename(tmp.c_str(), path.c_str()) == 0, IoError, "Timeline: cannot write '", path, "'");
  }

 private:
  struct Event {
    std::string name;
    const char* category;
    double begin_us, duration_us;
    int lane;
  };
  static std::string escaped(const std::string& s);

  int rank_;
  Clock::time_point start_;
  mutable std::mutex mutex_;
  std::vector<Event> events_;
};

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE std::int64_t Timeline::host_id() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return 0;
  return static_cast<std::int64_t>(std::hash<std::string>{}(std::string(name)));
}

TESSERA_LINKAGE double Timeline::now_us() const { return std::chrono::duration<double, std::micro>(Clock::now() - start_).count(); }

TESSERA_LINKAGE void Timeline::add(std::string name, const char* category, double begin_us, double end_us, int lane) {
  std::lock_guard lock(mutex_);
  events_.push_back({std::move(name), category, begin_us, end_us - begin_us, lane});
}

TESSERA_LINKAGE void Timeline::add(std::string name, const char* category, Clock::time_point begin, Clock::time_point end,
           int lane) {
  add(std::move(name), category, std::chrono::duration<double, std::micro>(begin - start_).count(),
      std::chrono::duration<double, std::micro>(end - start_).count(), lane);
}

TESSERA_LINKAGE auto Timeline::span(std::string name, const char* category, int lane) -> Span {
  return Span(this, std::move(name), category, lane);
}

TESSERA_LINKAGE std::size_t Timeline::size() const {
  std::lock_guard lock(mutex_);
  return events_.size();
}

TESSERA_LINKAGE std::string Timeline::events_json() const {
  std::lock_guard lock(mutex_);
  std::string out;
  char buf[128];
  for (const auto& e : events_) {
    if (!out.empty()) out += ",\n";
    out += "{\"name\": \"" + escaped(e.name) + "\", \"cat\": \"" + escaped(e.category) + "\", \"ph\": \"X\"";
    std::snprintf(buf, sizeof buf, ", \"ts\": %.3f, \"dur\": %.3f, \"pid\": %d, \"tid\": %d}", e.begin_us, e.duration_us,
                  rank_, e.lane);
    out += buf;
  }
  return out;
}

TESSERA_LINKAGE std::string Timeline::escaped(const std::string& s) { return detail::json_escaped(s); }

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera
