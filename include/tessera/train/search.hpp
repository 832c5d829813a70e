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
// Coordination. Rank 0 of the world is the coordinator. Each round it hands out the next trials
// (one per group, broadcast to all ranks), the groups train them at the same time, and it
// gathers every group's record (all_gather), appends them to the JSON-lines log in trial order,
// and decides what comes next. Proposals are a pure function of the seed and the results so far,
// so every rank could compute them; rank 0's are broadcast anyway, so all ranks agree by
// construction.
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
// did not) is detected by a group all-reduce of the status after the trial, which itself fails
// with the communicator's error if a rank died: that error (CommError naming the rank) is
// recorded on the trial where the group can still talk to the coordinator. A dead process ends
// the world communicator in all three backends (ThreadComm, MPI, Gloo), so the job then stops
// with that named error; the log keeps every finished trial and the search resumes from it.
//
// Resume. With log_path set, records already in the file are read back at start (rank 0,
// broadcast): a trial whose id is in the file is not run again and its result is used as if it
// had just finished. The file must come from the same search (same space, strategy, seed):
// a record whose configuration differs from the one proposed under its id is an IoError naming
// the file and line.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/random.hpp"
#include "tessera/io/json.hpp"

namespace tessera {

enum class SearchScale { Linear, Log };
enum class SearchStrategy { Grid, Random, Evolution };

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
        group_(world.split(world.rank() / group_size_checked(world, options_.groups), world.rank())) {
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

  // Runs the whole search; returns every trial's record in id order (on every rank).
  std::vector<TrialRecord> run(const TrialFn& fn) {
    load_log();
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
    std::vector<TrialRecord> all;
    for (const auto& gen : generations_)
      for (const auto& t : gen.trials) all.push_back(t);
    return all;
  }

  const std::vector<Generation>& generations() const { return generations_; }

  // The best record so far (highest score), or nullptr.
  const TrialRecord* best() const {
    const TrialRecord* b = nullptr;
    for (const auto& gen : generations_)
      for (const auto& t : gen.trials)
        if (!t.failed && (b == nullptr || t.score > b->score)) b = &t;
    return b;
  }

 private:
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

  // Runs `trials` in rounds of one trial per group; fills in their results on every rank.
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
    const int groups = options_.groups;
    for (std::size_t start = 0; start < pending.size(); start += static_cast<std::size_t>(groups)) {
      // The coordinator hands out this round: trial pending[start + g] to group g.
      std::vector<std::int64_t> assignment(static_cast<std::size_t>(groups), -1);
      if (world_.rank() == 0)
        for (int g = 0; g < groups && start + static_cast<std::size_t>(g) < pending.size(); ++g)
          assignment[static_cast<std::size_t>(g)] = static_cast<std::int64_t>(pending[start + static_cast<std::size_t>(g)]);
      world_.broadcast(std::span<std::int64_t>(assignment), 0);
      const std::int64_t mine = assignment[static_cast<std::size_t>(group_index())];
      std::string record;
      if (mine >= 0) {
        TrialRecord& t = trials[static_cast<std::size_t>(mine)];
        t.group = group_index();
        run_one(t, fn);
        record = t.json();
      }
      // The coordinator gathers every group's record (each group's rank 0 speaks for it).
      std::vector<std::int64_t> mine_words =
          detail::pack_string(group_.rank() == 0 ? record : std::string(), kRecordWords);
      std::vector<std::int64_t> all(kRecordWords * static_cast<std::size_t>(world_.size()));
      world_.all_gather(std::span<const std::int64_t>(mine_words), std::span<std::int64_t>(all));
      const int group_size = world_.size() / groups;
      for (int g = 0; g < groups; ++g) {
        const std::int64_t index = assignment[static_cast<std::size_t>(g)];
        if (index < 0) continue;
        const std::string text = detail::unpack_string(
            std::span<const std::int64_t>(all).subspan(static_cast<std::size_t>(g * group_size) * kRecordWords, kRecordWords));
        trials[static_cast<std::size_t>(index)] = TrialRecord::from_json(detail::parse_json(text));
        append_to_log(trials[static_cast<std::size_t>(index)]);
      }
    }
  }

  void run_one(TrialRecord& t, const TrialFn& fn) {
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
    try {
      group_.all_reduce(std::span<std::int32_t>(failed), ReduceOp::Max);
    } catch (const CommError& ex) {
      failed[0] = 1;
      if (error.empty()) error = ex.what();
    }
    if (failed[0] && error.empty()) error = "another rank of the group failed this trial";
    t.failed = failed[0] != 0;
    t.error = error;
    t.score = t.failed ? -std::numeric_limits<double>::infinity() : score;
    t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    t.epochs = report.epochs();
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

  Comm& world_;
  SearchOptions options_;
  SearchSpace space_;
  Comm group_;
  std::map<std::int64_t, Logged> logged_;
  std::vector<Generation> generations_;
};

template <class Comm>
HyperparameterSearch(Comm&, SearchOptions, SearchSpace) -> HyperparameterSearch<Comm>;

}  // namespace tessera
