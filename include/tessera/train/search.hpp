// HyperparameterSearch: trials spread over groups of ranks, each group training one trial at a time
// data-parallel inside itself (Spark/Ray Tune-style search on an MPI-shaped job).
//
//   SearchSpace space;
//   space.add("lr", 1e-3, 0.3, SearchScale::Log).add("momentum", 0.5, 0.99).add("weight_decay", 1e-6, 1e-2, SearchScale::Log);
//   HyperparameterSearch search(world, {.groups = 2, .strategy = SearchStrategy::Evolution, .log_path = "s.jsonl"}, space);
//   auto records = search.run([&](const TrialConfig& c, Comm& group, TrialReport& report) {
//     ... DataParallel over `group`, train with c.at("lr") ...;
//     report.epoch({{"loss", loss}, {"val_accuracy", acc}});
//     return acc;                                       // the score (higher is better)
//   });
//
// Groups. world.split gives `groups` sub-communicators of equal size (world size must divide);
// ranks [g k, (g + 1) k) form group g.
//
// Coordination. Rank 0 of the world is the coordinator. The trials are handed out in rounds, one
// per live group, in trial order: every rank computes the same assignment from what all ranks
// know (the proposals are a pure function of the seed and the results so far, and the results
// reach every rank). The groups train their trials at the same time; the coordinator gathers
// every group's record, appends them to the JSON-lines log in trial order, and publishes them so
// that every rank proposes the same next trials. Two ways to move the records
// (SearchOptions::coordination):
//   Collectives  an all_gather over the world communicator each round. A dead process then ends
//                the world, and with it the search (see Failures).
//   Channel      a SearchChannel: a small key -> text store that every rank reaches and that
//                outlives any one of them (FileSearchChannel: a directory every rank sees). The
//                world communicator is used only at the start (the split, the log, the channel's
//                key prefix); afterwards each rank writes its group's record under its own key
//                and a heartbeat that a background thread rewrites, and the coordinator polls.
// Auto (the default) picks Channel where a rank is a process that can die alone and a shared
// directory is known: Gloo with a file store (TESSERA_STORE=file://DIR: DIR, which every rank
// already shares for the rendezvous), or any backend given coordination_dir or a channel.
// Otherwise Collectives: threads (a thread cannot die alone), MPI (Open MPI without ULFM:
// mpirun kills the whole job when one process dies, so no channel could help), NCCL, and Gloo
// with a Redis store (whose store this header cannot reach: give coordination_dir there).
//
// Strategies. Grid: the cartesian product of each dimension's grid values (`grid` given, or
// `grid_points` points spaced linearly or logarithmically). Random: `trials` draws, uniform or
// log-uniform per dimension. Evolution (a genetic algorithm): generation 0 is `population` random
// draws; each next generation keeps the `elitism` best configurations (not re-trained) and fills
// the rest with children: two parents by tournament selection (best of `tournament_size` random
// members), uniform crossover with probability `crossover` (else a copy of the first parent),
// then each gene mutated with probability `mutation` by a Gaussian step of `mutation_scale`
// times the range, in log space for log-scale dimensions, clipped to the range.
//
// Failures. A trial whose function throws, or whose score or a reported loss is NaN or infinite
// (diverged), is recorded with status "failed" and its error, scores -inf, and the search goes on.
// Every rank of a group must see the same outcome: a group whose ranks disagree (one threw, one
// did not) is detected by a group all-reduce of the status after the trial. When that all-reduce
// itself fails (CommError: a rank of the group died, stalled past the timeout, or left the
// collectives), the group's communicator is broken: the trial is failed with that error, which
// says which world ranks the group's ranks are, and the group is retired. The search goes on
// with the other groups; the ranks of a retired group train nothing more, follow the rounds idle
// and return the same records as every other rank at the end. A failed trial scores -inf however
// it failed, so the best result and every later proposal are the same as if that trial had
// diverged. With no group left, run() throws CommError naming the trials not run.
// Under Channel coordination a dead process (kill -9, a crashed node) costs its group's trial
// only: the survivors of its group report the broken group, or, if none reports, the coordinator
// fails the trial once a member's heartbeat has been silent for heartbeat_timeout (default: the
// communicator's timeout), naming the world rank. A group that sends no record within
// trial_timeout of its round's start is failed and retired likewise. Every wait is bounded:
// polls (kPoll apart), the coordinator's by trial_timeout, the others' by the coordinator's
// heartbeat (a dead coordinator is named within heartbeat_timeout: CommError, the search stops;
// the coordinator's own death cannot be survived, since it holds the log and decides the
// rounds) and by twice trial_timeout plus heartbeat_timeout in all. Under Collectives a dead
// process ends the world communicator in all backends (ThreadComm, MPI, Gloo), so the job then
// stops with that named error.
// Either way the log keeps every finished trial and a rerun resumes from it.
//
// Resume. With log_path set, records already in the file are read back at start (rank 0,
// broadcast): a trial whose id is in the file is not run again and its result is used as if it
// had just finished. The file must come from the same search (same space, strategy, seed):
// a record whose configuration differs from the one proposed under its id is an IoError naming
// the file and line. A trial failed by a dead rank is logged "failed" like any other and is not
// run again on resume: the later generations were proposed from its -inf.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/comm/options.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/random.hpp"
#include "tessera/io/json.hpp"

namespace tessera {

enum class SearchScale { Linear, Log };
enum class SearchStrategy { Grid, Random, Evolution };
// How the ranks exchange records once the search has started (see "Coordination" above).
enum class SearchCoordination { Auto, Collectives, Channel };

// What the ranks of a Channel-coordinated search talk through instead of the world communicator:
// a flat key -> text store that every rank of the job reaches and that outlives any one rank.
// put requires a key with one writer and makes the value appear whole (a reader sees the old
// value, or none, or the new one, never a part); get answers at once (nullopt: no such key);
// erase of an absent key does nothing; where() names the storage in errors. All ranks must reach
// the same storage: a search's keys start with a prefix rank 0 draws, so searches may share it.
// A store-backed channel (Redis, Gloo's store) is a class of a few lines over set/get/delete.
class SearchChannel {
 public:
  virtual ~SearchChannel() = default;
  virtual void put(const std::string& key, const std::string& value) = 0;
  virtual std::optional<std::string> get(const std::string& key) = 0;
  virtual void erase(const std::string& key) = 0;
  virtual std::string where() const = 0;
};

// A SearchChannel as one file per key in a directory that every rank sees (the file store's
// directory, or a shared file system's). put writes "<key>.tmp" and renames it over the key,
// which POSIX makes atomic. On NFS another host may see a file up to the attribute-cache time
// late: keep heartbeat_timeout well above it (actimeo, 3 to 60 s by default).
class FileSearchChannel final : public SearchChannel {
 public:
  explicit FileSearchChannel(std::filesystem::path dir) : dir_(std::move(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    TESSERA_CHECK(std::filesystem::is_directory(dir_), IoError, "FileSearchChannel: '", dir_.string(),
                  "' is not a directory and cannot be made one", ec ? ": " + ec.message() : std::string());
  }
  void put(const std::string& key, const std::string& value) override {
    const std::filesystem::path path = dir_ / key, tmp = dir_ / (key + ".tmp");
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out << value;
      out.close();
      TESSERA_CHECK(static_cast<bool>(out), IoError, "FileSearchChannel: cannot write '", tmp.string(), "'");
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    TESSERA_CHECK(!ec, IoError, "FileSearchChannel: cannot rename '", tmp.string(), "' to '", path.string(),
                  "': ", ec.message());
  }
  std::optional<std::string> get(const std::string& key) override {
    std::ifstream in(dir_ / key, std::ios::binary);
    if (!in) return std::nullopt;
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
  }
  void erase(const std::string& key) override {
    std::error_code ec;  // absent already: nothing to do; a file that stays is litter, not an error
    std::filesystem::remove(dir_ / key, ec);
  }
  std::string where() const override { return "directory " + dir_.string(); }

 private:
  std::filesystem::path dir_;
};

// A configuration: hyper-parameter name -> value.
using TrialConfig = std::map<std::string, double>;

struct SearchDimension {
  std::string name;
  double low = 0, high = 1;
  SearchScale scale = SearchScale::Linear;
  std::vector<double> grid = {};  // Grid strategy: these values, or grid_points spaced values if empty
};

class SearchSpace {
 public:
  SearchSpace& add(std::string name, double low, double high, SearchScale scale = SearchScale::Linear,
                   std::vector<double> grid = {}) {
    TESSERA_CHECK(!name.empty() && low <= high, ArgumentError, "SearchSpace::add('", name, "', ", low, ", ", high,
                  "): needs a name and low <= high");
    TESSERA_CHECK(scale == SearchScale::Linear || low > 0, ArgumentError, "SearchSpace::add('", name,
                  "'): a log-scale range must be positive, got [", low, ", ", high, "]");
    for (const auto& d : dims_)
      TESSERA_CHECK(d.name != name, ArgumentError, "SearchSpace::add: '", name, "' is already a dimension");
    dims_.push_back({std::move(name), low, high, scale, std::move(grid)});
    return *this;
  }
  const std::vector<SearchDimension>& dimensions() const { return dims_; }

 private:
  std::vector<SearchDimension> dims_;
};

struct EvolutionOptions {
  int population = 8;
  int generations = 4;
  int tournament_size = 3;
  double crossover = 0.5;        // probability that a child mixes two parents (uniform crossover)
  double mutation = 0.3;         // per-gene mutation probability
  double mutation_scale = 0.15;  // Gaussian step, as a fraction of the range (log range for SearchScale::Log)
  int elitism = 1;               // best configurations carried into the next generation unchanged
};

struct SearchOptions {
  int groups = 1;
  SearchStrategy strategy = SearchStrategy::Random;
  int trials = 8;       // Random: number of draws
  int grid_points = 3;  // Grid: values per dimension without an explicit grid
  EvolutionOptions evolution = {};
  std::uint64_t seed = 0;
  std::string log_path = {};  // JSON lines, one record per trial; empty: no log (and no resume)
  // Everything else a trial's score depends on (epochs, data size, batch...), as text: recorded
  // with each trial, and a logged trial is reused only under the same settings (a log written
  // with --epochs=1 must not answer a search run with --epochs=5).
  std::string settings = {};
  SearchCoordination coordination = SearchCoordination::Auto;
  // Channel coordination through a FileSearchChannel in this directory (every rank must see it),
  // or through `channel` (the same storage on every rank). Neither: the file store's directory.
  std::string coordination_dir = {};
  std::shared_ptr<SearchChannel> channel = {};
  // Channel: a rank whose heartbeat has not changed for this long is taken for dead (0: the
  // communicator's timeout); a group that has sent no record trial_timeout after its round began
  // is failed and retired (the coordinator's own group is not timed: it reports when it returns).
  std::chrono::milliseconds heartbeat_timeout{0};
  std::chrono::milliseconds trial_timeout = std::chrono::hours(24);
};

struct EpochMetrics {
  std::map<std::string, double> values;
};

// What a trial reports while it runs.
class TrialReport {
 public:
  void epoch(std::map<std::string, double> metrics) { epochs_.push_back({std::move(metrics)}); }
  const std::vector<EpochMetrics>& epochs() const { return epochs_; }
  std::uint64_t seed = 0;  // the trial's seed, for the trial's own random draws

 private:
  std::vector<EpochMetrics> epochs_;
};

struct TrialRecord {
  std::int64_t id = 0;
  std::int64_t generation = 0;
  TrialConfig config;
  std::int64_t group = 0;
  std::uint64_t seed = 0;
  bool failed = false;
  bool carried = false;  // an elite carried over without training (Evolution)
  std::string error;
  std::string settings;  // SearchOptions::settings of the search that ran it
  double score = -std::numeric_limits<double>::infinity();
  double seconds = 0;
  std::vector<EpochMetrics> epochs;

  std::string json() const;
  static TrialRecord from_json(const detail::JsonValue& v);
};

// The trials of one generation (or of the whole search for Grid and Random).
struct Generation {
  std::int64_t index = 0;
  std::vector<TrialRecord> trials;
  double best() const;
  double median() const;
};

namespace detail {

inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);  // round-trips exactly: resume compares configurations
  return buf;
}

// A string as int64 words for the communicators (which move numbers only): [length, bytes...].
inline std::vector<std::int64_t> pack_string(const std::string& s, std::size_t words) {
  std::vector<std::int64_t> out(words, 0);
  TESSERA_CHECK(s.size() + 8 <= words * 8, ArgumentError, "search: a record of ", s.size(),
                " bytes does not fit the exchange buffer of ", words * 8, " bytes");
  out[0] = static_cast<std::int64_t>(s.size());
  std::memcpy(out.data() + 1, s.data(), s.size());
  return out;
}
inline std::string unpack_string(std::span<const std::int64_t> words) {
  // The length word comes from another rank: check it against the buffer before copying.
  TESSERA_CHECK(!words.empty() && words[0] >= 0 && static_cast<std::uint64_t>(words[0]) <= (words.size() - 1) * 8,
                CommError, "search: a record exchange buffer of ", words.size() * 8, " bytes claims a record of ",
                words.empty() ? 0 : words[0], " bytes");
  const auto n = static_cast<std::size_t>(words[0]);
  std::string s(n, '\0');
  std::memcpy(s.data(), words.data() + 1, n);
  return s;
}

// Whether a rank of Comm is a process that can die while the others go on: their collectives
// then fail with CommError instead of the whole job being killed. Gloo's are. MPI's are not
// (Open MPI without ULFM: mpirun kills every process when one dies), ThreadComm's ranks are
// threads of one process, and NCCL's recovery path is untested here.
template <class Comm>
constexpr bool search_rank_can_die_alone() {
  if constexpr (requires { Comm::backend_name; })
    return std::string_view(Comm::backend_name) == "gloo";
  else
    return false;
}

// The directory of a file store (TESSERA_STORE=file://DIR, the variable LaunchEnv reads), which
// every rank of a Gloo job shares; empty for another store or none.
inline std::string file_store_directory() {
  const char* url = std::getenv("TESSERA_STORE");
  const std::string_view scheme = "file://";
  if (url == nullptr || std::string_view(url).substr(0, scheme.size()) != scheme) return {};
  return std::string(url + scheme.size());
}

// Rewrites `key` with a growing count every `period` on a thread of its own until destroyed, so
// that others can tell this process is alive (SearchLiveness) while its trial computes. A failed
// write is skipped: the next one may succeed, and if none does this rank is taken for dead,
// which is what it is to the others.
class SearchHeartbeat {
 public:
  SearchHeartbeat(SearchChannel& channel, std::string key, std::chrono::milliseconds period)
      : thread_([this, &channel, key = std::move(key), period](std::stop_token stop) {
          std::mutex mutex;
          for (std::uint64_t beat = 1; !stop.stop_requested(); ++beat) {
            try {
              channel.put(key, std::to_string(beat));
            } catch (const std::exception&) {
            }
            std::unique_lock lock(mutex);
            wake_.wait_for(lock, stop, period, [] { return false; });
          }
        }) {}

 private:
  std::condition_variable_any wake_;
  std::jthread thread_;  // last: stopped and joined before wake_ goes
};

// How long each rank's heartbeat has been silent, on this rank's clock only (no two hosts' clocks
// are compared): the time since this rank last saw the count change, or since it first looked.
class SearchLiveness {
 public:
  SearchLiveness(SearchChannel& channel, std::string prefix, int ranks)
      : channel_(channel), prefix_(std::move(prefix)),
        seen_(static_cast<std::size_t>(ranks), Seen{{}, std::chrono::steady_clock::now()}) {}

  std::chrono::milliseconds silent(int rank) {
    const auto now = std::chrono::steady_clock::now();
    Seen& s = seen_.at(static_cast<std::size_t>(rank));
    if (auto beat = channel_.get(prefix_ + "alive." + std::to_string(rank)); beat && *beat != s.beat) {
      s.beat = *beat;
      s.changed = now;
    }
    return std::chrono::duration_cast<std::chrono::milliseconds>(now - s.changed);
  }

 private:
  struct Seen {
    std::string beat;
    std::chrono::steady_clock::time_point changed;
  };
  SearchChannel& channel_;
  std::string prefix_;
  std::vector<Seen> seen_;
};

}  // namespace detail

inline std::string TrialRecord::json() const {
  using detail::json_escaped;
  using detail::json_number;
  std::string out = "{\"trial\": " + std::to_string(id) + ", \"generation\": " + std::to_string(generation) +
                    ", \"group\": " + std::to_string(group) + ", \"seed\": " + std::to_string(seed) + ", \"config\": {";
  bool first = true;
  for (const auto& [k, v] : config) {
    out += (first ? "\"" : ", \"") + json_escaped(k) + "\": " + json_number(v);
    first = false;
  }
  out += std::string("}, \"status\": \"") + (failed ? "failed" : carried ? "carried" : "ok") + "\"";
  if (!error.empty()) out += ", \"error\": \"" + json_escaped(error) + "\"";
  out += ", \"settings\": \"" + json_escaped(settings) + "\"";
  out += ", \"score\": " + json_number(score) + ", \"seconds\": " + json_number(seconds) + ", \"epochs\": [";
  for (std::size_t e = 0; e < epochs.size(); ++e) {
    out += e ? ", {" : "{";
    bool f = true;
    for (const auto& [k, v] : epochs[e].values) {
      out += (f ? "\"" : ", \"") + json_escaped(k) + "\": " + json_number(v);
      f = false;
    }
    out += "}";
  }
  return out + "]}";
}

namespace detail {

// An integer field of a search-log record: a whole number in [lo, hi) (a cast of anything else
// to an integer type is undefined behaviour, so a corrupt log must fail here, by name).
inline double json_integral(const JsonValue& v, const char* field, double lo, double hi) {
  const double x = v.at(field).as_number();
  TESSERA_CHECK(x == std::floor(x) && x >= lo && x < hi, IoError, "search log: \"", field, "\" is ", x,
                ", not an integer in [", lo, ", ", hi, ")");
  return x;
}

}  // namespace detail

inline TrialRecord TrialRecord::from_json(const detail::JsonValue& v) {
  TrialRecord r;
  constexpr double two63 = 9223372036854775808.0, two64 = 18446744073709551616.0;
  r.id = static_cast<std::int64_t>(detail::json_integral(v, "trial", -two63, two63));
  r.generation = static_cast<std::int64_t>(detail::json_integral(v, "generation", -two63, two63));
  r.group = static_cast<std::int64_t>(detail::json_integral(v, "group", -two63, two63));
  r.seed = static_cast<std::uint64_t>(detail::json_integral(v, "seed", 0, two64));
  for (const auto& [k, x] : v.at("config").members) r.config[k] = x.as_number();
  const std::string& status = v.at("status").as_string();
  TESSERA_CHECK(status == "ok" || status == "failed" || status == "carried", IoError, "search log: status '", status,
                "' is not ok, failed or carried");
  r.failed = status == "failed";
  r.carried = status == "carried";
  if (v.has("error")) r.error = v.at("error").as_string();
  if (v.has("settings")) r.settings = v.at("settings").as_string();
  r.score = r.failed ? -std::numeric_limits<double>::infinity() : v.at("score").as_number();
  r.seconds = v.at("seconds").as_number();
  for (const auto& e : v.at("epochs").items) {
    EpochMetrics m;
    for (const auto& [k, x] : e.members) m.values[k] = x.as_number();
    r.epochs.push_back(std::move(m));
  }
  return r;
}

inline double Generation::best() const {
  double b = -std::numeric_limits<double>::infinity();
  for (const auto& t : trials) b = std::max(b, t.score);
  return b;
}
inline double Generation::median() const {
  std::vector<double> s;
  for (const auto& t : trials) s.push_back(t.score);
  if (s.empty()) return -std::numeric_limits<double>::infinity();
  std::sort(s.begin(), s.end());
  const std::size_t n = s.size();
  return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

template <class Comm>
class HyperparameterSearch {
 public:
  // fn(config, group communicator, report) -> score (higher is better). Runs on every rank of the
  // group; every rank must return the same score (rank 0 of the group's is recorded).
  using TrialFn = std::function<double(const TrialConfig&, Comm&, TrialReport&)>;
  static constexpr std::size_t kRecordWords = 8192;  // 64 KiB per record in the exchange

  HyperparameterSearch(Comm& world, SearchOptions options, SearchSpace space)
      : world_(world), options_(std::move(options)), space_(std::move(space)),
        group_(world.split(world.rank() / group_size_checked(world, options_.groups), world.rank())),
        mode_(resolve_mode()), retired_(static_cast<std::size_t>(options_.groups), false) {
    TESSERA_CHECK(!space_.dimensions().empty(), ArgumentError, "HyperparameterSearch: the search space is empty");
    const auto& e = options_.evolution;
    TESSERA_CHECK(options_.strategy != SearchStrategy::Evolution ||
                      (e.population >= 2 && e.generations >= 1 && e.tournament_size >= 1 && e.elitism >= 0 &&
                       e.elitism < e.population && e.crossover >= 0 && e.crossover <= 1 && e.mutation >= 0 &&
                       e.mutation <= 1 && e.mutation_scale > 0),
                  ArgumentError,
                  "HyperparameterSearch: evolution needs population >= 2, generations >= 1, tournament_size >= 1, "
                  "0 <= elitism < population, crossover and mutation in [0, 1], mutation_scale > 0");
    TESSERA_CHECK(options_.strategy != SearchStrategy::Random || options_.trials >= 1, ArgumentError,
                  "HyperparameterSearch: trials=", options_.trials, " must be >= 1");
    TESSERA_CHECK(options_.strategy != SearchStrategy::Grid || options_.grid_points >= 1, ArgumentError,
                  "HyperparameterSearch: grid_points=", options_.grid_points, " must be >= 1");
  }

  int group_index() const { return world_.rank() / (world_.size() / options_.groups); }
  Comm& group() { return group_; }

  // Runs the whole search; returns every trial's record in id order (on every rank that is still
  // running, a rank of a retired group included).
  std::vector<TrialRecord> run(const TrialFn& fn) {
    start_coordination();
    load_log();
    try {
      search(fn);
    } catch (...) {
      // The others must not wait out their timeouts for a rank that has left: its heartbeat
      // stops, and the coordinator's error reaches them at once.
      heartbeat_.reset();
      if (channel_ && world_.rank() == 0) {
        std::string what = "an unknown exception";
        try {
          throw;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        try {
          channel_->put(keys_ + "abort", what);
        } catch (const std::exception&) {
          // The channel failed too: the others find the coordinator's heartbeat silent instead.
        }
      }
      throw;
    }
    finish_coordination();
    std::vector<TrialRecord> all;
    for (const auto& gen : generations_)
      for (const auto& t : gen.trials) all.push_back(t);
    return all;
  }

  const std::vector<Generation>& generations() const { return generations_; }

  // The coordination in use, Auto resolved: Collectives or Channel.
  SearchCoordination coordination() const { return mode_; }
  // Whether this rank's group has been retired (a rank of it died, or its communicator broke).
  bool group_retired() const { return retired_[static_cast<std::size_t>(group_index())]; }
  // Whether any group has been retired: every rank knows (it travels with each round's results),
  // and the world communicator is then unusable (a rank of it is dead).
  bool any_group_retired() const { return std::find(retired_.begin(), retired_.end(), true) != retired_.end(); }

  // The best record so far (highest score), or nullptr.
  const TrialRecord* best() const {
    const TrialRecord* b = nullptr;
    for (const auto& gen : generations_)
      for (const auto& t : gen.trials)
        if (!t.failed && (b == nullptr || t.score > b->score)) b = &t;
    return b;
  }

 private:
  void search(const TrialFn& fn) {
    Rng rng(options_.seed ^ 0x5eed5eedULL);
    std::int64_t next_id = 0;
    const int gens = options_.strategy == SearchStrategy::Evolution ? options_.evolution.generations : 1;
    std::vector<TrialRecord> population;
    for (int g = 0; g < gens; ++g) {
      std::vector<TrialRecord> trials;
      if (options_.strategy == SearchStrategy::Grid) {
        for (auto& c : grid()) trials.push_back(proposed(next_id++, g, std::move(c), rng));
      } else if (options_.strategy == SearchStrategy::Random) {
        for (int t = 0; t < options_.trials; ++t) trials.push_back(proposed(next_id++, g, random_config(rng), rng));
      } else if (g == 0) {
        for (int t = 0; t < options_.evolution.population; ++t)
          trials.push_back(proposed(next_id++, g, random_config(rng), rng));
      } else {
        trials = next_generation(population, g, next_id, rng);
      }
      run_trials(trials, fn);
      generations_.push_back({g, trials});
      population = trials;
    }
  }

  static int group_size_checked(Comm& world, int groups) {
    TESSERA_CHECK(groups >= 1 && world.size() % groups == 0, ArgumentError, "HyperparameterSearch: groups=", groups,
                  " must divide the world size ", world.size());
    return world.size() / groups;
  }

  double draw(const SearchDimension& d, Rng& rng) const {
    const double u = rng.uniform();
    if (d.scale == SearchScale::Log) return std::exp(std::log(d.low) + u * (std::log(d.high) - std::log(d.low)));
    return d.low + u * (d.high - d.low);
  }
  TrialConfig random_config(Rng& rng) const {
    TrialConfig c;
    for (const auto& d : space_.dimensions()) c[d.name] = draw(d, rng);
    return c;
  }

  std::vector<TrialConfig> grid() const {
    std::vector<TrialConfig> out = {TrialConfig{}};
    for (const auto& d : space_.dimensions()) {
      std::vector<double> values = d.grid;
      if (values.empty()) {
        const int n = options_.grid_points;
        for (int i = 0; i < n; ++i) {
          const double t = n == 1 ? 0.5 : static_cast<double>(i) / (n - 1);
          values.push_back(d.scale == SearchScale::Log ? std::exp(std::log(d.low) + t * (std::log(d.high) - std::log(d.low)))
                                                 : d.low + t * (d.high - d.low));
        }
      }
      std::vector<TrialConfig> next;
      for (const auto& c : out)
        for (double v : values) {
          TrialConfig x = c;
          x[d.name] = v;
          next.push_back(std::move(x));
        }
      out = std::move(next);
    }
    return out;
  }

  TrialRecord proposed(std::int64_t id, std::int64_t generation, TrialConfig config, Rng& rng) const {
    TrialRecord r;
    r.id = id;
    r.generation = generation;
    r.config = std::move(config);
    r.seed = options_.seed * 1000003ULL + static_cast<std::uint64_t>(id) * 7919ULL + (rng.next_u64() & 0xffff);
    r.settings = options_.settings;
    return r;
  }

  // Tournament selection, uniform crossover, Gaussian mutation in (log) range units, elitism.
  std::vector<TrialRecord> next_generation(const std::vector<TrialRecord>& parents, std::int64_t g,
                                           std::int64_t& next_id, Rng& rng) const {
    const auto& e = options_.evolution;
    std::vector<const TrialRecord*> ranked;
    for (const auto& p : parents) ranked.push_back(&p);
    std::stable_sort(ranked.begin(), ranked.end(), [](auto* a, auto* b) { return a->score > b->score; });
    std::vector<TrialRecord> out;
    for (int i = 0; i < e.elitism && i < static_cast<int>(ranked.size()); ++i) {
      TrialRecord elite = *ranked[static_cast<std::size_t>(i)];
      elite.id = next_id++;
      elite.generation = g;
      elite.carried = true;
      out.push_back(std::move(elite));
    }
    auto pick = [&]() -> const TrialRecord& {
      const TrialRecord* best = nullptr;
      for (int k = 0; k < e.tournament_size; ++k) {
        const auto& c = parents[static_cast<std::size_t>(rng.below(parents.size()))];
        if (best == nullptr || c.score > best->score) best = &c;
      }
      return *best;
    };
    while (static_cast<int>(out.size()) < e.population) {
      const TrialRecord& a = pick();
      const TrialRecord& b = pick();
      const bool cross = rng.uniform() < e.crossover;
      TrialConfig child;
      for (const auto& d : space_.dimensions()) {
        double v = cross && rng.uniform() < 0.5 ? b.config.at(d.name) : a.config.at(d.name);
        if (rng.uniform() < e.mutation) {
          const bool log = d.scale == SearchScale::Log;
          const double lo = log ? std::log(d.low) : d.low, hi = log ? std::log(d.high) : d.high;
          double x = (log ? std::log(v) : v) + rng.normal(0.0, e.mutation_scale * (hi - lo));
          x = std::clamp(x, lo, hi);
          v = log ? std::exp(x) : x;
        }
        child[d.name] = v;
      }
      out.push_back(proposed(next_id++, g, std::move(child), rng));
    }
    return out;
  }

  // Runs `trials` in rounds of one trial per live group; fills in their results on every rank.
  void run_trials(std::vector<TrialRecord>& trials, const TrialFn& fn) {
    std::vector<std::size_t> pending;
    for (std::size_t i = 0; i < trials.size(); ++i) {
      auto it = logged_.find(trials[i].id);
      if (it != logged_.end()) {
        check_logged(trials[i], it->second);
        trials[i] = it->second.record;
        continue;
      }
      if (!trials[i].carried) pending.push_back(i);
      else append_to_log(trials[i]);
    }
    const auto groups = static_cast<std::size_t>(options_.groups);
    std::size_t next = 0;
    // Every round hands out at least one trial (or throws), so pending.size() rounds suffice.
    for (std::size_t round = 0; round < pending.size() && next < pending.size(); ++round) {
      // Trial pending[next] to the first live group, and so on: every rank knows the retired
      // groups (they come with the records), so every rank computes the same assignment.
      std::vector<std::int64_t> assignment(groups, -1);
      for (std::size_t g = 0; g < groups && next < pending.size(); ++g)
        if (!retired_[g]) assignment[g] = static_cast<std::int64_t>(pending[next++]);
      if (std::all_of(assignment.begin(), assignment.end(), [](std::int64_t a) { return a < 0; })) {
        std::string ids;
        for (std::size_t k = next; k < pending.size(); ++k)
          ids += (ids.empty() ? "" : ", ") + std::to_string(trials[pending[k]].id);
        throw CommError(detail::cat("HyperparameterSearch: every group has been retired (each lost a rank or its "
                                    "communicator; see the failed trials in the log), so trial(s) ", ids,
                                    " cannot run; rerun to resume from the log"));
      }
      std::string mine;
      if (const std::int64_t index = assignment[static_cast<std::size_t>(group_index())]; index >= 0)
        mine = run_one(trials[static_cast<std::size_t>(index)], fn);
      const std::string results = mode_ == SearchCoordination::Channel ? round_over_channel(trials, assignment, mine)
                                                                       : round_over_collectives(assignment, mine);
      apply_results(trials, results);
    }
  }

  // A group's record as it travels: "B" when the group's communicator broke (retire it), else "-",
  // then the record's JSON.
  static std::string message(bool group_broke, const TrialRecord& t) { return (group_broke ? "B" : "-") + t.json(); }

  // What every rank applies after a round, the same text on all of them:
  //   retired <0|1 per group>
  //   <trial index> <record JSON>     one line per trial of the round, in trial order
  static std::string results_text(const std::vector<bool>& retired,
                                   const std::vector<std::pair<std::int64_t, std::string>>& records) {
    std::string out = "retired";
    for (bool r : retired) out += r ? " 1" : " 0";
    out += "\n";
    for (const auto& [index, json] : records) out += std::to_string(index) + " " + json + "\n";
    return out;
  }

  void apply_results(std::vector<TrialRecord>& trials, const std::string& results) {
    std::istringstream in(results);
    std::string line, word;
    std::getline(in, line);
    std::istringstream head(line);
    head >> word;
    TESSERA_CHECK(word == "retired", CommError, "HyperparameterSearch: a round's results start with '", line,
                  "', not 'retired'");
    for (std::size_t g = 0; g < retired_.size(); ++g) {
      int r = 0;
      TESSERA_CHECK(static_cast<bool>(head >> r), CommError, "HyperparameterSearch: a round's results name ",
                    g, " groups' states, not ", retired_.size());
      retired_[g] = r != 0;
    }
    while (std::getline(in, line)) {
      const std::size_t space = line.find(' ');
      const std::string number = line.substr(0, space);
      TESSERA_CHECK(space != std::string::npos && !number.empty() && number.size() < 10 &&
                        number.find_first_not_of("0123456789") == std::string::npos &&
                        std::stoull(number) < trials.size(),
                    CommError, "HyperparameterSearch: a round's results name trial index '", number, "' of ",
                    trials.size());
      const std::size_t index = std::stoull(number);
      TrialRecord& t = trials[index];
      t = TrialRecord::from_json(detail::parse_json(line.substr(space + 1)));
      append_to_log(t);
    }
  }

  // Collectives: every group's rank 0 speaks for its group in one all_gather over the world.
  std::string round_over_collectives(const std::vector<std::int64_t>& assignment, const std::string& mine) {
    std::vector<std::int64_t> mine_words = detail::pack_string(group_.rank() == 0 ? mine : std::string(), kRecordWords);
    std::vector<std::int64_t> all(kRecordWords * static_cast<std::size_t>(world_.size()));
    world_.all_gather(std::span<const std::int64_t>(mine_words), std::span<std::int64_t>(all));
    const int group_size = world_.size() / options_.groups;
    std::vector<bool> retired = retired_;
    std::vector<std::pair<std::int64_t, std::string>> records;
    for (std::size_t g = 0; g < assignment.size(); ++g) {
      if (assignment[g] < 0) continue;
      const std::string text = detail::unpack_string(std::span<const std::int64_t>(all).subspan(
          static_cast<std::size_t>(static_cast<int>(g) * group_size) * kRecordWords, kRecordWords));
      TESSERA_CHECK(!text.empty(), CommError, "HyperparameterSearch: group ", g, " sent no record for trial index ",
                    assignment[g]);
      retired[g] = retired[g] || text[0] == 'B';
      records.emplace_back(assignment[g], text.substr(1));
    }
    return results_text(retired, records);
  }

  // Channel: each rank of a group that ran a trial puts its record under record.<round>.<rank>;
  // the coordinator gathers them (coordinate_round) and puts results.<round>, which the others wait for.
  std::string round_over_channel(const std::vector<TrialRecord>& trials, const std::vector<std::int64_t>& assignment,
                                 const std::string& mine) {
    const std::string round = std::to_string(round_);
    if (!mine.empty()) channel_->put(keys_ + "record." + round + "." + std::to_string(world_.rank()), mine);
    std::string results;
    if (world_.rank() == 0) {
      results = coordinate_round(trials, assignment);
      channel_->put(keys_ + "results." + round, results);
    } else {
      results = wait_for_coordinator("results." + round, detail::cat("the results of round ", round_));
    }
    ++round_;
    round_started_ = std::chrono::steady_clock::now();
    return results;
  }

  // The coordinator's side of a round: waits for each assigned group until its record is in, a
  // record says its communicator broke, a member's heartbeat has gone silent, or trial_timeout
  // has passed since the round began, and writes down the outcome for every group.
  std::string coordinate_round(const std::vector<TrialRecord>& trials, const std::vector<std::int64_t>& assignment) {
    const int k = world_.size() / options_.groups;
    const std::string round = std::to_string(round_);
    const auto deadline = round_started_ + options_.trial_timeout;
    std::vector<bool> retired = retired_;
    std::vector<std::string> outcome(assignment.size());
    // Bounded by the deadline: each pass either settles a group or sleeps one poll.
    for (;;) {
      const bool late = std::chrono::steady_clock::now() > deadline;
      bool open = false;
      for (std::size_t g = 0; g < assignment.size(); ++g) {
        if (assignment[g] < 0 || !outcome[g].empty()) continue;
        std::vector<std::optional<std::string>> got(static_cast<std::size_t>(k));
        std::optional<std::size_t> speaker, broken;
        std::vector<int> silent;  // world ranks without a record whose heartbeat is too old
        std::vector<int> missing;  // world ranks without a record
        for (int q = 0; q < k; ++q) {
          const int rank = static_cast<int>(g) * k + q;
          auto& text = got[static_cast<std::size_t>(q)];
          text = channel_->get(keys_ + "record." + round + "." + std::to_string(rank));
          if (!text || text->empty()) {  // put() makes a value appear whole: empty is not one
            text.reset();
            missing.push_back(rank);
            if (liveness_->silent(rank) > heartbeat_timeout_) silent.push_back(rank);
            continue;
          }
          if (!speaker) speaker = static_cast<std::size_t>(q);
          if (!broken && (*text)[0] == 'B') broken = static_cast<std::size_t>(q);
        }
        const TrialRecord& t = trials[static_cast<std::size_t>(assignment[g])];
        const std::string ranks_text = detail::cat("group ", g, " (world ranks ", g * k, " to ", (g + 1) * k - 1, ")");
        if (missing.empty() || broken || !silent.empty() || late) {
          std::string note;
          if (!missing.empty() && (broken || !silent.empty() || late)) {
            retired[g] = true;
            lost_.insert(lost_.end(), missing.begin(), missing.end());
            note = detail::cat("; no record from world rank(s) ", join(missing));
            for (int rank : silent)
              note += detail::cat("; world rank ", rank, " stopped answering: no heartbeat for ",
                                  detail::seconds_text(liveness_->silent(rank)), " (its process died or is stopped)");
          }
          if (broken || speaker) {
            const std::string& text = *got[broken ? *broken : *speaker];
            retired[g] = retired[g] || text[0] == 'B';
            TrialRecord r = TrialRecord::from_json(detail::parse_json(text.substr(1)));
            if (r.failed) r.error += note;
            else if (!note.empty()) r.error = "the trial finished, then the group was retired" + note;
            outcome[g] = r.json();
          } else {
            TrialRecord r = t;
            r.group = static_cast<std::int64_t>(g);
            r.failed = true;
            r.score = -std::numeric_limits<double>::infinity();
            r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - round_started_).count();
            r.error = silent.empty()
                          ? detail::cat(ranks_text, " sent no record of trial ", t.id, " within trial_timeout = ",
                                        detail::seconds_text(options_.trial_timeout), "; the group is retired")
                          : detail::cat(ranks_text, " lost a rank during trial ", t.id, ":", note.substr(1),
                                        "; the group is retired");
            outcome[g] = r.json();
          }
          continue;
        }
        open = true;
      }
      if (!open) break;
      std::this_thread::sleep_for(kPoll);
    }
    std::vector<std::pair<std::int64_t, std::string>> records;
    for (std::size_t g = 0; g < assignment.size(); ++g)
      if (assignment[g] >= 0) records.emplace_back(assignment[g], outcome[g]);
    return results_text(retired, records);
  }

  // A follower's wait for a key the coordinator puts: bounded by the coordinator's heartbeat, by
  // its abort notice, and by twice trial_timeout plus heartbeat_timeout in all.
  std::string wait_for_coordinator(const std::string& key, const std::string& what) {
    const auto limit = 2 * options_.trial_timeout + heartbeat_timeout_;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    const std::string where = detail::cat("HyperparameterSearch on world rank ", world_.rank(), ", waiting for ", what,
                                          " in ", channel_->where());
    for (;;) {
      if (auto text = channel_->get(keys_ + key)) return *text;
      if (auto abort = channel_->get(keys_ + "abort"))
        throw CommError(detail::cat(where, ": the coordinator (world rank 0) stopped the search: ", *abort));
      if (const auto silent = liveness_->silent(0); silent > heartbeat_timeout_)
        throw CommError(detail::cat(where, ": the coordinator (world rank 0) stopped answering (no heartbeat for ",
                                    detail::seconds_text(silent), "): the search cannot go on without it. Rank 0's "
                                    "log keeps every finished trial: rerun to resume"));
      TESSERA_CHECK(std::chrono::steady_clock::now() < deadline, CommError, where, ": nothing after ",
                    detail::seconds_text(std::chrono::duration_cast<std::chrono::milliseconds>(limit)),
                    " (2 x trial_timeout + heartbeat_timeout) although the coordinator is alive");
      std::this_thread::sleep_for(kPoll);
    }
  }

  static std::string join(const std::vector<int>& ranks) {
    std::string out;
    for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
  }

  // Auto resolved (the same on every rank, given the same options and environment).
  SearchCoordination resolve_mode() const {
    if (options_.coordination == SearchCoordination::Collectives) return SearchCoordination::Collectives;
    const bool told = options_.channel != nullptr || !options_.coordination_dir.empty();
    const bool store = detail::search_rank_can_die_alone<Comm>() && !detail::file_store_directory().empty();
    if (options_.coordination == SearchCoordination::Channel) {
      TESSERA_CHECK(told || !detail::file_store_directory().empty(), ArgumentError,
                    "HyperparameterSearch: coordination = Channel needs SearchOptions::coordination_dir (a directory "
                    "every rank sees), SearchOptions::channel, or TESSERA_STORE=file://DIR");
      return SearchCoordination::Channel;
    }
    return told || store ? SearchCoordination::Channel : SearchCoordination::Collectives;
  }

  // With load_log, the only uses of the world after the split: the ranks check that they chose
  // the same coordination and all have a log or none (load_log's broadcasts), and for a channel
  // rank 0 draws the key prefix that keeps this search's keys apart from any other's.
  void start_coordination() {
    const auto mode = static_cast<std::int32_t>(mode_), log = options_.log_path.empty() ? 0 : 1;
    std::vector<std::int32_t> agree = {mode, -mode, log, -log};  // max and -min of each
    world_.all_reduce(std::span<std::int32_t>(agree), ReduceOp::Max);
    TESSERA_CHECK(agree[0] == -agree[1], ArgumentError, "HyperparameterSearch: the ranks chose different "
                  "coordinations (Collectives on some, Channel on others): give every rank the same SearchOptions "
                  "and the same TESSERA_STORE");
    TESSERA_CHECK(agree[2] == -agree[3], ArgumentError, "HyperparameterSearch: some ranks have a log_path and "
                  "some not: give every rank the same one (rank 0 reads and writes it)");
    if (mode_ != SearchCoordination::Channel) return;
    std::string prefix;
    if (world_.rank() == 0) {
      std::random_device device;
      const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
      const std::uint64_t nonce = (static_cast<std::uint64_t>(device()) << 32) ^ device() ^ static_cast<std::uint64_t>(now);
      char text[32];
      std::snprintf(text, sizeof text, "search-%016llx.", static_cast<unsigned long long>(nonce));
      prefix = text;
    }
    std::vector<std::int64_t> words = detail::pack_string(prefix, 8);
    world_.broadcast(std::span<std::int64_t>(words), 0);
    keys_ = detail::unpack_string(words);
    if (options_.channel)
      channel_ = options_.channel;
    else
      channel_ = std::make_shared<FileSearchChannel>(
          options_.coordination_dir.empty() ? detail::file_store_directory() : options_.coordination_dir);
    heartbeat_timeout_ = options_.heartbeat_timeout.count() > 0 ? options_.heartbeat_timeout : comm_timeout();
    heartbeat_ = std::make_unique<detail::SearchHeartbeat>(*channel_, keys_ + "alive." + std::to_string(world_.rank()),
                                                           heartbeat_period());
    liveness_.emplace(*channel_, keys_, world_.size());
    round_started_ = std::chrono::steady_clock::now();
  }

  // After the last round: each rank says it is done; the coordinator waits until every rank has
  // read the last results (a retired group may still be catching up) before it erases the keys.
  // A rank is not waited for once its heartbeat is silent: past heartbeat_timeout, or past four
  // beats for a rank that sent no record when its group was settled (it is most likely dead, and
  // waiting out the timeout would delay every search that lost a rank). All in all at most
  // trial_timeout: a retired group still in a hung trial gets no answer after that.
  void finish_coordination() {
    if (mode_ != SearchCoordination::Channel) return;
    heartbeat_.reset();
    channel_->put(keys_ + "finished." + std::to_string(world_.rank()), "1");
    if (world_.rank() != 0) return;
    const auto deadline = std::chrono::steady_clock::now() + options_.trial_timeout;
    for (int rank = 1; rank < world_.size(); ++rank) {
      const bool lost = std::find(lost_.begin(), lost_.end(), rank) != lost_.end();
      const auto give_up = lost ? std::min(heartbeat_timeout_, 4 * heartbeat_period()) : heartbeat_timeout_;
      while (!channel_->get(keys_ + "finished." + std::to_string(rank)) && liveness_->silent(rank) <= give_up &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(kPoll);
    }
    for (std::int64_t r = 0; r < round_; ++r) {
      channel_->erase(keys_ + "results." + std::to_string(r));
      for (int rank = 0; rank < world_.size(); ++rank)
        channel_->erase(keys_ + "record." + std::to_string(r) + "." + std::to_string(rank));
    }
    for (int rank = 0; rank < world_.size(); ++rank) {
      channel_->erase(keys_ + "alive." + std::to_string(rank));
      channel_->erase(keys_ + "finished." + std::to_string(rank));
    }
  }

  // Five beats per heartbeat_timeout, at most one a second (a file write each).
  std::chrono::milliseconds heartbeat_period() const {
    return std::clamp(heartbeat_timeout_ / 5, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
  }

  std::chrono::milliseconds comm_timeout() const {
    if constexpr (requires { world_.options().timeout; })
      return std::chrono::duration_cast<std::chrono::milliseconds>(world_.options().timeout);
    else
      return std::chrono::minutes(5);  // CommOptions' default
  }

  // Runs trial t on this rank's group; returns its message (see message()).
  std::string run_one(TrialRecord& t, const TrialFn& fn) {
    t.group = group_index();
    TrialReport report;
    report.seed = t.seed;
    const auto start = std::chrono::steady_clock::now();
    double score = -std::numeric_limits<double>::infinity();
    std::string error;
    try {
      score = fn(t.config, group_, report);
      if (!std::isfinite(score)) error = "diverged: score is " + std::to_string(score);
      for (const auto& e : report.epochs())
        for (const auto& [k, v] : e.values)
          if (k.find("loss") != std::string::npos && !std::isfinite(v) && error.empty())
            error = "diverged: " + k + " is " + std::to_string(v) + " in epoch " + std::to_string(&e - &report.epochs()[0] + 1);
    } catch (const std::exception& ex) {
      error = ex.what();
    }
    // The group agrees on the outcome: a rank that failed makes the trial fail on all of them.
    std::vector<std::int32_t> failed = {error.empty() ? 0 : 1};
    bool broke = false;
    try {
      group_.all_reduce(std::span<std::int32_t>(failed), ReduceOp::Max);
    } catch (const CommError& ex) {
      // The group cannot talk any more: a rank died or left. Its error counts ranks within the
      // group; say which world ranks those are.
      broke = true;
      failed[0] = 1;
      const int k = world_.size() / options_.groups, first = group_index() * k;
      error = detail::cat("group ", group_index(), " lost a rank or its communicator (its ranks 0 to ", k - 1,
                          " are world ranks ", first, " to ", first + k - 1, "; the group is retired): ",
                          error.empty() ? ex.what() : error);
    }
    if (failed[0] && error.empty()) error = "another rank of the group failed this trial";
    t.failed = failed[0] != 0;
    t.error = error;
    t.score = t.failed ? -std::numeric_limits<double>::infinity() : score;
    t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    t.epochs = report.epochs();
    return message(broke, t);
  }

  struct Logged {
    TrialRecord record;
    std::int64_t line;
  };

  void load_log() {
    if (options_.log_path.empty()) return;
    std::vector<std::int64_t> words;
    if (world_.rank() == 0) {
      std::ifstream in(options_.log_path);
      std::string text, line;
      while (std::getline(in, line)) text += line + "\n";
      words = detail::pack_string(text, (text.size() + 15) / 8 + 1);
    }
    std::vector<std::int64_t> size = {static_cast<std::int64_t>(words.size())};
    world_.broadcast(std::span<std::int64_t>(size), 0);
    words.resize(static_cast<std::size_t>(size[0]));
    world_.broadcast(std::span<std::int64_t>(words), 0);
    const std::string text = detail::unpack_string(words);
    std::int64_t number = 0;
    std::size_t at = 0;
    while (at < text.size()) {
      const std::size_t end = text.find('\n', at);
      const std::string line = text.substr(at, end - at);
      at = end == std::string::npos ? text.size() : end + 1;
      ++number;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      TrialRecord r;
      try {
        r = TrialRecord::from_json(detail::parse_json(line));
      } catch (const IoError& e) {
        // A crash while writing leaves at most a torn last line: drop it (the trial runs again),
        // and cut it from the file so that the next record starts on a line of its own.
        if (at < text.size()) throw IoError(detail::cat("HyperparameterSearch: ", options_.log_path, ":", number, ": ", e.what()));
        if (world_.rank() == 0) std::filesystem::resize_file(options_.log_path, text.size() - line.size() - 1);
        break;
      }
      logged_[r.id] = {std::move(r), number};
    }
  }

  void check_logged(const TrialRecord& proposed, const Logged& logged) const {
    bool same = proposed.config.size() == logged.record.config.size();
    for (const auto& [k, v] : proposed.config) {
      auto it = logged.record.config.find(k);
      same = same && it != logged.record.config.end() && it->second == v;
    }
    TESSERA_CHECK(same && proposed.generation == logged.record.generation, IoError, "HyperparameterSearch: ",
                  options_.log_path, ":", logged.line, ": trial ", proposed.id,
                  " does not match this search's proposal (another search space, strategy or seed wrote this log; "
                  "use a new log_path)");
    TESSERA_CHECK(proposed.settings == logged.record.settings, IoError, "HyperparameterSearch: ", options_.log_path, ":",
                  logged.line, ": trial ", proposed.id, " was run with the settings '", logged.record.settings,
                  "', this search's are '", proposed.settings, "': its score does not answer this search (use a "
                  "new log path, or remove the old log to start over)");
  }

  void append_to_log(const TrialRecord& r) {
    if (options_.log_path.empty() || world_.rank() != 0 || logged_.count(r.id)) return;
    std::FILE* f = std::fopen(options_.log_path.c_str(), "a");
    TESSERA_CHECK(f != nullptr, IoError, "HyperparameterSearch: cannot append to '", options_.log_path, "'");
    const std::string line = r.json() + "\n";
    const bool ok = std::fwrite(line.data(), 1, line.size(), f) == line.size();
    TESSERA_CHECK(std::fclose(f) == 0 && ok, IoError, "HyperparameterSearch: cannot write '", options_.log_path, "'");
  }

  static constexpr std::chrono::milliseconds kPoll{20};  // how often a channel wait looks again

  Comm& world_;
  SearchOptions options_;
  SearchSpace space_;
  Comm group_;
  SearchCoordination mode_;
  std::vector<bool> retired_;  // by group: retired groups get no more trials
  std::map<std::int64_t, Logged> logged_;
  std::vector<Generation> generations_;
  // Channel coordination only:
  std::shared_ptr<SearchChannel> channel_;
  std::string keys_;  // this search's key prefix
  std::chrono::milliseconds heartbeat_timeout_{0};
  std::optional<detail::SearchLiveness> liveness_;  // the others' heartbeats, as this rank sees them
  std::int64_t round_ = 0;
  std::chrono::steady_clock::time_point round_started_;
  std::vector<int> lost_;  // world ranks the coordinator gave up on (not waited for at the end)
  std::unique_ptr<detail::SearchHeartbeat> heartbeat_;  // last: stops before the channel goes
};

template <class Comm>
HyperparameterSearch(Comm&, SearchOptions, SearchSpace) -> HyperparameterSearch<Comm>;

}  // namespace tessera
