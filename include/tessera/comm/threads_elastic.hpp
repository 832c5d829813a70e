// ThreadElasticGroup: the elastic group (comm/elastic.hpp) of ranks that are threads of one
// process. A rank that dies is a thread whose function threw (the process lives on); a rank that
// stalls is a thread that stops calling collectives past the timeout.
//
//   ThreadElasticHub hub(4);                       // 4 slots, ranks 0..3 of generation 0
//   hub.run([&](ThreadElasticGroup& group) {       // one thread per slot, as ThreadWorld::run
//     ElasticTrainer trainer(group, model, sgd, ...);
//     trainer.fit(...);
//   });
//   hub.replace(2, fn)                             // from any thread: a replacement for slot 2
//                                                  // (vacant), which joins at a step boundary
//
// The hub holds, under one mutex, what Gloo's group keeps in its store: each generation's members
// and ThreadWorld, the check-ins of the next one, the replacements waiting. A decision is written
// under the lock, so it is atomic and every member reads the same one. A member whose function
// throws is marked dead and its generation's world failed, so the others stop waiting at once
// (ThreadWorld::fail); a stalled member is noticed when a collective times out and left out if it
// has not checked in `settle` after the others (it throws CommError "left out" when it runs
// again). Membership ids are "<slot>.<incarnation>", as over Gloo.
//
// hub.run() returns when every thread has ended; it throws only when no member finished (the first
// error), since a member that died and was left behind is what the group survived.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tessera/comm/elastic.hpp"
#include "tessera/comm/threads.hpp"

namespace tessera {

class ThreadElasticGroup;

class ThreadElasticHub {
 public:
  explicit ThreadElasticHub(int slots, CommOptions comm_options = {}, ElasticOptions options = {})
      : slots_(slots), comm_options_(comm_options), options_(options) {
    TESSERA_CHECK(slots >= 1, ArgumentError, "ThreadElasticHub: slots=", slots, " must be >= 1");
    TESSERA_CHECK(options.min_size >= 1 && options.max_changes >= 0 && options.join_check_every >= 1 &&
                      options.settle.count() >= 0, ArgumentError, "ThreadElasticHub: options need min_size >= 1, "
                  "max_changes >= 0, join_check_every >= 1 and settle >= 0");
    std::vector<std::string> first;
    for (int s = 0; s < slots; ++s) first.push_back(std::to_string(s) + ".0");
    generations_.push_back({first, std::make_shared<ThreadWorld>(slots, comm_options)});
    next_incarnation_.assign(static_cast<std::size_t>(slots), 1);
  }
  ThreadElasticHub(const ThreadElasticHub&) = delete;
  ThreadElasticHub& operator=(const ThreadElasticHub&) = delete;
  ~ThreadElasticHub() { join_all(); }

  // Runs fn(group) on one thread per slot and waits for every thread, replacements included.
  template <class Fn>
  void run(Fn&& fn);
  // Starts a replacement for `slot` (no live member may hold it) running fn(group): it joins the
  // running group at its next step boundary (or at a membership change already under way).
  template <class Fn>
  void replace(int slot, Fn&& fn);

  int slots() const { return slots_; }

 private:
  friend class ThreadElasticGroup;
  struct Generation {
    std::vector<std::string> members;  // in rank order
    std::shared_ptr<ThreadWorld> world;
  };

  template <class Fn>
  void start(const std::string& id, bool joining, Fn fn);
  void join_all() {
    for (;;) {
      std::thread t;
      {
        std::lock_guard lock(mutex_);
        if (threads_.empty()) return;
        t = std::move(threads_.back());
        threads_.pop_back();
      }
      t.join();
    }
  }
  std::chrono::milliseconds settle() const {
    return options_.settle.count() > 0 ? options_.settle : 2 * comm_options_.timeout;
  }
  // The member `id`'s thread ended with an error: the others stop waiting for it (its generation's
  // world fails before its communicator goes, whose worker could otherwise wait out the timeout).
  void died(const std::string& id, const std::string& reason) {
    std::lock_guard lock(mutex_);
    if (!first_error_) first_error_ = std::current_exception();
    dead_.insert(id);
    for (auto& g : generations_) {
      const auto at = std::find(g.members.begin(), g.members.end(), id);
      if (at != g.members.end()) g.world->fail(static_cast<int>(at - g.members.begin()), reason);
    }
    changed_.notify_all();
  }

  int slots_;
  CommOptions comm_options_;
  ElasticOptions options_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Generation> generations_;                     // index: generation
  std::map<std::int64_t, std::vector<std::string>> checked_in_;  // generation -> members in
  std::vector<std::string> waiting_;                        // replacements not yet admitted
  std::map<std::int64_t, std::int64_t> grow_at_;            // generation -> step
  std::set<std::string> dead_;
  std::vector<std::int64_t> next_incarnation_;
  std::vector<std::thread> threads_;
  std::exception_ptr first_error_;
  bool someone_finished_ = false;
};

class ThreadElasticGroup {
 public:
  using Comm = ThreadComm;

  ThreadComm& comm() {
    TESSERA_CHECK(comm_.has_value(), CommError, "ThreadElasticGroup ", me_, ": no communicator");
    return *comm_;
  }
  int rank() const { return index_of(me_); }
  int size() const { return static_cast<int>(members_.size()); }
  std::int64_t generation() const { return generation_; }
  const std::string& member() const { return me_; }
  bool joined_late() const { return joined_late_; }
  const std::vector<std::string>& members() const { return members_; }
  const std::vector<MembershipChange>& history() const { return history_; }

  void reform(const std::string& cause) { change(cause, -1); }
  bool growth_due(std::int64_t step) {
    std::lock_guard lock(hub_.mutex_);
    if (rank() == 0 && step % hub_.options_.join_check_every == 0 && !hub_.waiting_.empty() &&
        !hub_.grow_at_.count(generation_))
      hub_.grow_at_[generation_] = step + 2 * hub_.options_.join_check_every;  // as gloo_elastic.hpp's
    const auto at = hub_.grow_at_.find(generation_);
    return at != hub_.grow_at_.end() && at->second == step;
  }
  void grow(std::int64_t step) { change("replacement(s) joined", step); }

 private:
  friend class ThreadElasticHub;
  ThreadElasticGroup(ThreadElasticHub& hub, std::string me, bool joining)
      : hub_(hub), me_(std::move(me)), joined_late_(joining) {
    std::unique_lock lock(hub_.mutex_);
    if (!joining) {
      members_ = hub_.generations_[0].members;
      comm_.emplace(hub_.generations_[0].world->comm(index_of(me_)));
      return;
    }
    // Wait for a generation that admits this replacement: the timeout for a sign of the group (a
    // new generation; a growth scheduled in the latest: then three timeouts more; a member's
    // check-in for the next one, a change under way after a failure: two settles and a timeout
    // more), as the Gloo group's joiner waits.
    using Clock = std::chrono::steady_clock;
    auto deadline = Clock::now() + hub_.comm_options_.timeout;
    std::size_t seen = hub_.generations_.size();
    bool scheduled = false;
    bool changing = false;
    for (;;) {
      for (std::int64_t g = 0; g < static_cast<std::int64_t>(hub_.generations_.size()); ++g) {
        const auto& m = hub_.generations_[static_cast<std::size_t>(g)].members;
        if (std::find(m.begin(), m.end(), me_) == m.end()) continue;
        generation_ = g;
        members_ = m;
        comm_.emplace(hub_.generations_[static_cast<std::size_t>(g)].world->comm(index_of(me_)));
        return;
      }
      if (hub_.generations_.size() != seen) {
        seen = hub_.generations_.size();
        scheduled = false;
        changing = false;
        deadline = std::max(deadline, Clock::now() + hub_.comm_options_.timeout);
      }
      if (!scheduled && hub_.grow_at_.count(static_cast<std::int64_t>(seen) - 1)) {
        scheduled = true;
        deadline = std::max(deadline, Clock::now() + 3 * hub_.comm_options_.timeout);
      }
      if (!changing && hub_.checked_in_.count(static_cast<std::int64_t>(seen))) {
        changing = true;
        deadline = std::max(deadline, Clock::now() + 2 * hub_.settle() + hub_.comm_options_.timeout);
      }
      TESSERA_CHECK(!hub_.someone_finished_, CommError, "ThreadElasticGroup ", me_, ": the group finished "
                    "training before it could admit this replacement: nothing is left for it to do");
      TESSERA_CHECK(Clock::now() < deadline, CommError, "ThreadElasticGroup ", me_,
                    ": no generation admitted it in time (has the group ended?)");
      hub_.changed_.wait_until(lock, deadline);
    }
  }

  int index_of(const std::string& id) const {
    const auto at = std::find(members_.begin(), members_.end(), id);
    return at == members_.end() ? -1 : static_cast<int>(at - members_.begin());
  }

  void change(const std::string& cause, std::int64_t grow_step) {
    const auto start = std::chrono::steady_clock::now();
    TESSERA_CHECK(static_cast<int>(history_.size()) < hub_.options_.max_changes, CommError, "ThreadElasticGroup ",
                  me_, ": ", hub_.options_.max_changes, " membership changes already (ElasticOptions::max_changes); "
                  "giving up after: ", cause);
    const std::vector<std::string> before = members_;
    const std::int64_t next = generation_ + 1;
    {
      std::lock_guard lock(hub_.mutex_);
      // A failure: the generation's world fails, so members still blocked in a collective stop now.
      if (grow_step < 0 && generation_ + 1 == static_cast<std::int64_t>(hub_.generations_.size()))
        hub_.generations_.back().world->fail(rank(), cause);
    }
    comm_.reset();
    std::unique_lock lock(hub_.mutex_);
    hub_.checked_in_[next].push_back(me_);
    hub_.changed_.notify_all();
    const auto deadline = std::chrono::steady_clock::now() + hub_.settle();
    const auto decided = [&] { return static_cast<std::int64_t>(hub_.generations_.size()) > next; };
    const auto everyone = [&] {
      const auto& in = hub_.checked_in_[next];
      for (const auto& m : before)
        if (std::find(in.begin(), in.end(), m) == in.end() && !hub_.dead_.count(m)) return false;
      return true;
    };
    hub_.changed_.wait_until(lock, deadline, [&] { return decided() || everyone(); });
    if (!decided()) {  // this member decides, under the lock: the first to get here
      std::vector<std::string> list;
      const auto& in = hub_.checked_in_[next];
      for (const auto& m : before)
        if (std::find(in.begin(), in.end(), m) != in.end()) list.push_back(m);
      for (const auto& j : hub_.waiting_) list.push_back(j);
      hub_.waiting_.clear();
      hub_.generations_.push_back({list, std::make_shared<ThreadWorld>(static_cast<int>(list.size()),
                                                                        hub_.comm_options_)});
      hub_.changed_.notify_all();
    }
    members_ = hub_.generations_[static_cast<std::size_t>(next)].members;
    generation_ = next;
    if (index_of(me_) < 0)
      throw CommError(detail::cat("ThreadElasticGroup ", me_, ": this member was left out of generation ", next,
                                  ": it did not check in within ", detail::seconds_text(hub_.settle()), " of the "
                                  "others (stalled?), and they went on without it; after: ", cause));
    TESSERA_CHECK(size() >= hub_.options_.min_size, CommError, "ThreadElasticGroup ", me_, ": ", size(),
                  " member(s) left, fewer than ElasticOptions::min_size = ", hub_.options_.min_size, "; after: ", cause);
    comm_.emplace(hub_.generations_[static_cast<std::size_t>(next)].world->comm(index_of(me_)));
    MembershipChange record = MembershipChange::between(next, grow_step, before, members_, cause);
    record.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    history_.push_back(std::move(record));
  }

  ThreadElasticHub& hub_;
  std::string me_;
  bool joined_late_ = false;
  std::optional<ThreadComm> comm_;
  std::vector<std::string> members_;
  std::int64_t generation_ = 0;
  std::vector<MembershipChange> history_;
};

template <class Fn>
void ThreadElasticHub::start(const std::string& id, bool joining, Fn fn) {
  std::lock_guard lock(mutex_);
  threads_.emplace_back([this, id, joining, fn = std::move(fn)]() mutable {
    std::unique_ptr<ThreadElasticGroup> group;  // outlives the catch: destroyed after died()
    try {
      group.reset(new ThreadElasticGroup(*this, id, joining));
      fn(*group);
      std::lock_guard lock(mutex_);
      someone_finished_ = true;
      changed_.notify_all();  // a replacement still waiting to be admitted stops
    } catch (const std::exception& e) {
      died(id, e.what());
    } catch (...) {
      died(id, "unknown exception");
    }
  });
}

template <class Fn>
void ThreadElasticHub::run(Fn&& fn) {
  for (int s = 0; s < slots_; ++s) start(std::to_string(s) + ".0", false, std::function<void(ThreadElasticGroup&)>(fn));
  join_all();
  std::lock_guard lock(mutex_);
  if (!someone_finished_ && first_error_) std::rethrow_exception(first_error_);
}

template <class Fn>
void ThreadElasticHub::replace(int slot, Fn&& fn) {
  std::string id;
  {
    std::lock_guard lock(mutex_);
    TESSERA_CHECK(slot >= 0 && slot < slots_, ArgumentError, "ThreadElasticHub::replace: slot ", slot, " of ", slots_);
    for (const auto& m : generations_.back().members)
      TESSERA_CHECK(m.substr(0, m.find('.')) != std::to_string(slot) || dead_.count(m), ArgumentError,
                    "ThreadElasticHub::replace: slot ", slot, " is held by live member ", m);
    id = std::to_string(slot) + "." + std::to_string(next_incarnation_[static_cast<std::size_t>(slot)]++);
    waiting_.push_back(id);
    changed_.notify_all();
  }
  start(id, true, std::function<void(ThreadElasticGroup&)>(std::forward<Fn>(fn)));
}

template <>
struct ElasticGroupFor<ThreadComm> {
  using type = ThreadElasticGroup;
};

}  // namespace tessera
