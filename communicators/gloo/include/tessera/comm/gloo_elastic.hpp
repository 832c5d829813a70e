// GlooElasticGroup: an elastic data-parallel group (comm/elastic.hpp) over Gloo, agreeing on its
// membership through the rendezvous store every rank already has (TESSERA_STORE).
//
//   auto group = GlooElasticGroup::from_env();   // a rank of the launch (TESSERA_RANK), or a
//                                                // replacement when TESSERA_ELASTIC_JOIN=1
//   group.comm()                                 // this generation's GlooComm
//
// Members. A member is "<slot>.<incarnation>": the launch rank it holds (0 .. N-1, N =
// TESSERA_WORLD_SIZE) and how many processes held that slot before it (0 for the launch's own).
// Generation 0 is the launch: the GlooComm every program gets (prefix P, TESSERA_STORE_PREFIX),
// members in slot order. Generation g > 0 connects under prefix "P.g<g>".
//
// The store's keys, under "P.elastic." (every key is written once: Gloo's stores refuse to
// overwrite):
//   id.<member>         host, pid and status-server address, written when the member starts: its
//                       peers on this host can tell at once that it died (its pid is gone), and any
//                       peer can tell whether the network still reaches it
//   g<g>.in.<member>    the member checked in for generation g (it survived and wants to go on),
//                       with the old members whose status server it reached just before
//   g<g>.members        the decision: generation g's members in rank order, "0.0,2.0,1.1"
//   g<g>.grow           "<step>": generation g admits the waiting replacements after that step
//   want.<slot>.<k>     a replacement asks to join as incarnation k of the slot
//
// Failure (reform). Each survivor closes its communicator first (so that peers still blocked in a
// collective with it fail at once instead of at their timeout), tries a TCP connection to every
// old member's status server (comm/monitor.hpp; at most a second), checks in with the list of
// those it reached, and waits until every old member has checked in or is seen dead, at most
// `settle`. The first member in the old order that checked in writes the decision: the largest
// set of checked-in members that all reached each other (ties: the one holding the earliest
// members), in their old order, then the replacements waiting for vacant slots. The store is a
// file system or a server every member reaches even when the network between members is cut, so
// without the reachability lists a member cut off by a link down would check in and be kept, and
// every new mesh would fail to connect. The others read the decision; a member that is not in it
// (it checked in too late: it was stopped; or it is cut off) throws CommError and must exit. If
// the deciding member dies before writing, the next one decides.
//
// Growth. At every join_check_every-th (c-th) step boundary the rank 0 member looks for
// want.<slot>.<k> of each vacant slot (k: the slot's next incarnation, known to every member from
// the decisions); when one is there it writes g<g>.grow = step + 2c and every member, which reads
// that key at every c-th boundary, grows at that step. 2c steps ahead is enough: a member that
// reaches the boundary of step s + 2c has finished that step's all-reduce, which rank 0 entered
// after writing the key, and it reads the key there.
//
// A replacement writes its want key and reads the decisions g1, g2, ... (learning the history
// every member knows) until one lists it; bounded by the communicator's timeout.
//
// Detection of a dead peer on another host relies on the collective's error (a reset connection)
// and on `settle`: a peer on another host is never probed, only waited for.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tessera/comm/elastic.hpp"
#include "tessera/comm/gloo.hpp"

namespace tessera {

class GlooElasticGroup {
 public:
  using Comm = GlooComm;

  // A member of the launch (TESSERA_RANK of TESSERA_WORLD_SIZE), or, with TESSERA_ELASTIC_JOIN=1,
  // a replacement for slot TESSERA_RANK that joins the running group.
  static GlooElasticGroup from_env(CommOptions comm_options = {}, ElasticOptions options = {}) {
    const LaunchEnv env = LaunchEnv::from_environment();
    const char* prefix = std::getenv("TESSERA_STORE_PREFIX");
    const char* join = std::getenv("TESSERA_ELASTIC_JOIN");
    const bool joining = join != nullptr && std::string(join) == "1";
    TESSERA_CHECK(join == nullptr || joining || std::string(join) == "0" || std::string(join).empty(), ArgumentError,
                  "TESSERA_ELASTIC_JOIN='", join, "': must be 1 (join a running group) or 0");
    return GlooElasticGroup(env.store, env.rank, env.size, prefix != nullptr && *prefix ? prefix : "tessera",
                            joining, comm_options, options);
  }

  GlooElasticGroup(std::string store_url, int slot, int slots, std::string prefix, bool joining,
                   CommOptions comm_options = {}, ElasticOptions options = {})
      : url_(std::move(store_url)), prefix_(std::move(prefix)), slots_(slots), comm_options_(comm_options),
        options_(options) {
    TESSERA_CHECK(slots >= 1 && slot >= 0 && slot < slots, ArgumentError, "GlooElasticGroup: slot ", slot,
                  " of ", slots, ": need 0 <= slot < world size");
    TESSERA_CHECK(options.min_size >= 1 && options.max_changes >= 0 && options.join_check_every >= 1 &&
                      options.settle.count() >= 0, ArgumentError, "GlooElasticGroup: options need min_size >= 1, "
                  "max_changes >= 0, join_check_every >= 1 and settle >= 0");
    store_ = std::make_shared<detail::PrefixedStore>(detail::open_gloo_store(url_), prefix_ + ".elastic");
    next_incarnation_.assign(static_cast<std::size_t>(slots), 1);
    if (!joining) {
      me_ = member_id(slot, 0);
      publish_id();
      for (int q = 0; q < slots; ++q) members_.push_back(member_id(q, 0));
      comm_.emplace(url_, slot, slots, comm_options_, prefix_);
      return;
    }
    joined_late_ = true;
    join_running_group(slot);
  }

  GlooComm& comm() {
    TESSERA_CHECK(comm_.has_value(), CommError, "GlooElasticGroup ", me_, ": no communicator (generation ",
                  generation_, " was never connected)");
    return *comm_;
  }
  int rank() const { return index_of(me_); }
  int size() const { return static_cast<int>(members_.size()); }
  std::int64_t generation() const { return generation_; }
  const std::string& member() const { return me_; }
  // This process joined a running group as a replacement (it held no training state then).
  bool joined_late() const { return joined_late_; }
  const std::vector<std::string>& members() const { return members_; }
  const std::vector<MembershipChange>& history() const { return history_; }
  const ElasticOptions& options() const { return options_; }

  // After a CommError: agree with the survivors on the next generation and connect it.
  void reform(const std::string& cause) { change(cause, -1); }

  // At the boundary after `step` optimizer steps (the same on every member).
  // The store is read only every join_check_every-th step (k), and a growth is set 2k steps
  // ahead, at a step every member reads the key on.
  bool growth_due(std::int64_t step) {
    const int k = options_.join_check_every;
    if (grow_at_ < 0 && step % k == 0) {
      const std::string key = cat("g", generation_, ".grow");
      if (rank() == 0 && !waiting_replacements().empty()) {
        grow_at_ = step + 2 * k;
        set(key, std::to_string(grow_at_));
      } else if (has(key)) {
        grow_at_ = std::stoll(get(key));
      }
    }
    return step == grow_at_;
  }
  void grow(std::int64_t step) { change("replacement(s) joined", step); }

  // The training ended after `step` steps (ElasticTrainer, on every member): a replacement still
  // waiting to be admitted learns it and stops at once instead of waiting out its timeout.
  void finished(std::int64_t step) {
    if (rank() != 0) return;
    try {
      set("finished", cat("generation ", generation_, ", after step ", step));
    } catch (const std::exception&) {
      // A member of an earlier group that finished too (a group split by a cut link): theirs holds.
    }
  }

 private:
  static std::string member_id(int slot, std::int64_t incarnation) { return cat(slot, ".", incarnation); }
  static int slot_of(const std::string& id) { return std::stoi(id.substr(0, id.find('.'))); }
  static std::int64_t incarnation_of(const std::string& id) { return std::stoll(id.substr(id.find('.') + 1)); }

  template <class... A>
  static std::string cat(const A&... a) {
    return detail::cat(a...);
  }
  bool has(const std::string& key) { return store_->has({key}); }
  std::string get(const std::string& key) {
    const auto bytes = store_->get(key);
    return std::string(bytes.begin(), bytes.end());
  }
  void set(const std::string& key, const std::string& value) {
    store_->set(key, std::vector<char>(value.begin(), value.end()));
  }
  int index_of(const std::string& id) const {
    const auto at = std::find(members_.begin(), members_.end(), id);
    return at == members_.end() ? -1 : static_cast<int>(at - members_.begin());
  }
  // Twice the timeout by default: a survivor notices a stopped or cut-off peer when a collective
  // times out, and may first wait out one more that was already running on its worker thread.
  std::chrono::milliseconds settle() const {
    return options_.settle.count() > 0 ? options_.settle : 2 * comm_options_.timeout;
  }
  std::string where() const {
    return cat("GlooElasticGroup (member ", me_, ", generation ", generation_, ", store ", url_, ")");
  }

  void publish_id() {
    const detail::MonitorAddress monitor = detail::ProgressServer::instance().address();
    const std::string record = cat(detail::JoinRecord::mine(slots_, false).text(), " monitor=", monitor.ipv4, ":",
                                   monitor.port, ":", monitor.host_key);
    set(cat("id.", me_), record);
  }

  // The status server of member `id`, from its id record (port 0: unknown).
  detail::MonitorAddress monitor_of(const std::string& id) {
    detail::MonitorAddress a;
    if (!has(cat("id.", id))) return a;
    const std::string record = get(cat("id.", id));
    const auto at = record.find(" monitor=");
    if (at == std::string::npos) return a;
    long long ip = 0, port = 0, key = 0;
    if (std::sscanf(record.c_str() + at, " monitor=%lld:%lld:%lld", &ip, &port, &key) == 3) a = {ip, port, key};
    return a;
  }

  // Whether a TCP connection to the status server at `a` opens within `patience`: the network
  // reaches that member (a stopped process's kernel still accepts; a dead one refuses; a cut link
  // or a stopped host does not answer). A member of this host and network namespace is asked on
  // 127.0.0.1, as the monitor does.
  enum class Probe { Reached, Silent, Refused };
  static Probe probe(const detail::MonitorAddress& a, std::chrono::milliseconds patience) {
    if (a.port <= 0) return Probe::Reached;  // no status server: nothing to tell, assume the network is fine
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return Probe::Reached;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(a.port));
    addr.sin_addr.s_addr = htonl(a.host_key == detail::monitor_host_key() ? INADDR_LOOPBACK
                                                                           : static_cast<std::uint32_t>(a.ipv4));
    int error = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 ? 0 : errno;
    if (error == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      socklen_t len = sizeof error;
      if (::poll(&p, 1, static_cast<int>(patience.count())) != 1 ||
          ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0)
        error = ETIMEDOUT;
    }
    ::close(fd);
    // Refused: the host answers and nothing listens there any more, so the process is gone.
    return error == 0 ? Probe::Reached : error == ECONNREFUSED ? Probe::Refused : Probe::Silent;
  }

  // The old members (other than this one) whose status server answers, probed at once; those
  // whose host refused the connection (the process is gone) go to refused_.
  std::vector<std::string> reachable(const std::vector<std::string>& members) {
    std::vector<detail::MonitorAddress> where;
    for (const auto& m : members) where.push_back(m == me_ ? detail::MonitorAddress{} : monitor_of(m));
    std::vector<Probe> answers(members.size(), Probe::Reached);
    const auto patience = std::min(std::chrono::milliseconds(1000), settle() / 2);
    std::vector<std::thread> probes;
    for (std::size_t k = 0; k < members.size(); ++k)
      if (members[k] != me_) probes.emplace_back([&, k] { answers[k] = probe(where[k], patience); });
    for (auto& t : probes) t.join();
    std::vector<std::string> out;
    refused_.clear();
    for (std::size_t k = 0; k < members.size(); ++k) {
      if (members[k] == me_) continue;
      if (answers[k] == Probe::Reached) out.push_back(members[k]);
      if (answers[k] == Probe::Refused) refused_.push_back(members[k]);
    }
    return out;
  }

  // The largest set of `in` (in their order) whose members all reached each other: from each
  // member in turn, add every later-listed one that reaches, and is reached by, all chosen so far;
  // the largest set wins, the earliest start among equals.
  std::vector<std::string> connected_members(const std::vector<std::string>& in, std::int64_t next) {
    std::map<std::string, std::vector<std::string>> reached;
    for (const auto& m : in) {
      std::stringstream list(get(cat("g", next, ".in.", m)));
      for (std::string id; std::getline(list, id, ',');)
        if (!id.empty()) reached[m].push_back(id);
    }
    const auto mutual = [&](const std::string& a, const std::string& b) {
      const auto& ra = reached[a];
      const auto& rb = reached[b];
      return std::find(ra.begin(), ra.end(), b) != ra.end() && std::find(rb.begin(), rb.end(), a) != rb.end();
    };
    std::vector<std::string> best;
    for (std::size_t start = 0; start < in.size(); ++start) {
      std::vector<std::string> chosen{in[start]};
      for (std::size_t k = 0; k < in.size(); ++k) {
        if (k == start) continue;
        bool all = true;
        for (const auto& c : chosen) all = all && mutual(in[k], c);
        if (all) chosen.push_back(in[k]);
      }
      if (chosen.size() > best.size()) best = chosen;
    }
    std::vector<std::string> ordered;  // back in the old order
    for (const auto& m : in)
      if (std::find(best.begin(), best.end(), m) != best.end()) ordered.push_back(m);
    return ordered;
  }

  // False only when `id` surely exited: a process of this host whose pid is gone or a zombie
  // (killed, not yet reaped by its parent).
  bool alive(const std::string& id) {
    if (!has(cat("id.", id))) return true;
    const auto record = detail::JoinRecord::parse(store_->get(cat("id.", id)));
    if (record.pid <= 0 || record.host != detail::JoinRecord::this_host()) return true;
    if (::kill(static_cast<pid_t>(record.pid), 0) != 0 && errno == ESRCH) return false;
    std::ifstream stat("/proc/" + std::to_string(record.pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return true;
    const auto close = line.rfind(')');
    return close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'Z';
  }

  // Replacements asking for a slot no member holds, at the slot's next incarnation, still alive.
  std::vector<std::string> waiting_replacements() {
    std::vector<std::string> found;
    for (int slot = 0; slot < slots_; ++slot) {
      bool held = false;
      for (const auto& m : members_) held = held || slot_of(m) == slot;
      if (held) continue;
      const std::string id = member_id(slot, next_incarnation_[static_cast<std::size_t>(slot)]);
      if (has(cat("want.", id)) && alive(id)) found.push_back(id);
    }
    return found;
  }

  // Reads a decision and learns each slot's next incarnation from it.
  std::vector<std::string> read_decision(std::int64_t generation) {
    std::vector<std::string> ids;
    std::stringstream in(get(cat("g", generation, ".members")));
    for (std::string id; std::getline(in, id, ',');) {
      if (id.empty()) continue;
      ids.push_back(id);
      auto& next = next_incarnation_[static_cast<std::size_t>(slot_of(id))];
      next = std::max(next, incarnation_of(id) + 1);
    }
    return ids;
  }

  // A replacement: claim the slot's next free incarnation, then follow the decisions until one
  // lists this process.
  //
  // It waits the comm timeout for a sign of the group: a decision; the growth scheduled in the
  // latest generation (the group then admits it 2c steps later, however long its steps take, so
  // from then on it waits three timeouts more); or a member's check-in for the next generation,
  // a change under way after a failure, which the group decides within two settles (change()),
  // and whose decision admits the replacements waiting then. A replacement that Slurm starts once
  // a node is marked down arrives in the middle of that change. Every decision without it starts
  // the wait anew.
  void join_running_group(int slot) {
    using Clock = std::chrono::steady_clock;
    const auto started = Clock::now();
    auto deadline = started + comm_options_.timeout;
    std::int64_t k = 1;
    while (has(cat("want.", member_id(slot, k))) && k < 1'000'000) ++k;
    me_ = member_id(slot, k);
    publish_id();
    set(cat("want.", me_), me_);
    std::vector<std::string> before;  // the members of generation g - 1: the launch's for g = 1
    for (int q = 0; q < slots_; ++q) before.push_back(member_id(q, 0));
    for (std::int64_t g = 1;; ++g) {
      bool scheduled = false;
      bool changing = false;
      for (int poll = 0; !has(cat("g", g, ".members")); ++poll) {
        if (!scheduled && g > 1 && has(cat("g", g - 1, ".grow"))) {
          scheduled = true;
          deadline = std::max(deadline, Clock::now() + 3 * comm_options_.timeout);
        }
        TESSERA_CHECK(poll % 20 != 0 || !has("finished"), CommError, where(), ": the group finished training (",
                      get("finished"), ") before it could admit this replacement: nothing is left for it to do");
        // Every 20th poll: a check-in is one store lookup per member.
        if (!changing && poll % 20 == 0 &&
            std::any_of(before.begin(), before.end(), [&](const std::string& m) { return has(cat("g", g, ".in.", m)); })) {
          changing = true;
          deadline = std::max(deadline, Clock::now() + 2 * settle() + comm_options_.timeout);
        }
        TESSERA_CHECK(Clock::now() < deadline, CommError, where(), ": waited ",
                      detail::seconds_text(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started)),
                      " to be admitted and no group admitted it (",
                      scheduled  ? "the group scheduled a growth and did not reach it: stopped or failing?"
                      : changing ? "the group began a change after a failure and did not decide it"
                                 : "is the group running, with the same TESSERA_STORE and TESSERA_STORE_PREFIX?",
                      ")");
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      members_ = read_decision(g);
      before = members_;
      generation_ = g;
      if (index_of(me_) >= 0) break;
      TESSERA_CHECK(g < 1'000'000, CommError, where(), ": no decision admitted it");
      deadline = Clock::now() + comm_options_.timeout;  // the group is alive: wait on
    }
    connect();
  }

  // This generation's communicator, under a key prefix of its own.
  void connect() { comm_.emplace(url_, index_of(me_), size(), comm_options_, cat(prefix_, ".g", generation_)); }

  // One membership change: grow_step >= 0 for a growth at that step, -1 after a failure.
  void change(const std::string& cause, std::int64_t grow_step) {
    const auto start = std::chrono::steady_clock::now();
    TESSERA_CHECK(static_cast<int>(history_.size()) < options_.max_changes, CommError, where(), ": ",
                  options_.max_changes, " membership changes already (ElasticOptions::max_changes); giving up after: ",
                  cause);
    comm_.reset();  // closes this member's sockets: peers blocked on it fail now, not at their timeout
    const std::vector<std::string> before = members_;
    const std::int64_t next = generation_ + 1;
    std::string reached;
    for (const auto& m : reachable(before)) reached += (reached.empty() ? "" : ",") + m;
    set(cat("g", next, ".in.", me_), reached.empty() ? "," : reached);
    // From this member's check-in, not from the failure: its probes took up to a second.
    const auto deadline = std::chrono::steady_clock::now() + settle();
    const std::string decided = cat("g", next, ".members");
    std::vector<std::string> in;
    // Wait for every old member to check in or be seen dead, at most `settle`.
    for (;;) {
      in.clear();
      std::size_t dead = 0;
      for (const auto& m : before) {
        if (has(cat("g", next, ".in.", m))) in.push_back(m);
        else if (!alive(m) || std::find(refused_.begin(), refused_.end(), m) != refused_.end()) ++dead;
      }
      if (in.size() + dead == before.size() || has(decided) || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    // The first checked-in member that reached another member decides (if it dies before deciding,
    // the next one does). A member that reached nobody is most likely the one cut off: it leads
    // only when no connected member has checked in a whole `settle` after its own wait ended.
    const auto decide_by = deadline + settle();
    while (!has(decided)) {
      in.clear();
      for (const auto& m : before)
        if (has(cat("g", next, ".in.", m))) in.push_back(m);
      // Isolated: reached no member although some other is not known to be gone.
      const auto gone = [&](const std::string& m) {
        return m != me_ && (!alive(m) || std::find(refused_.begin(), refused_.end(), m) != refused_.end());
      };
      std::string leader, isolated_leader;
      for (const auto& m : in) {
        if (gone(m)) continue;
        bool others = false;
        for (const auto& o : before) others = others || (o != m && !gone(o));
        const bool isolated = others && get(cat("g", next, ".in.", m)) == ",";
        if (!isolated && leader.empty()) leader = m;
        if (isolated && isolated_leader.empty()) isolated_leader = m;
      }
      const bool late = std::chrono::steady_clock::now() >= decide_by;
      if (leader.empty() && late) leader = isolated_leader;
      if (leader == me_) {
        std::string list;
        for (const auto& m : connected_members(in, next)) list += (list.empty() ? "" : ",") + m;
        for (const auto& j : waiting_replacements()) list += "," + j;
        try {
          set(decided, list);
        } catch (const std::exception&) {
          // Another member decided at the same moment (Gloo's stores refuse a second write): theirs holds.
        }
        break;
      }
      TESSERA_CHECK(std::chrono::steady_clock::now() < decide_by + settle(), CommError, where(), ": member ",
                    leader.empty() ? isolated_leader : leader, " was to decide generation ", next, " and did not "
                    "within ", detail::seconds_text(settle()), " (it is stopped or cut off); giving up after: ", cause);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    members_ = read_decision(next);
    generation_ = next;
    grow_at_ = -1;
    if (index_of(me_) < 0)
      throw CommError(cat(where(), ": this member was left out of generation ", next, " (members ", list_text(members_),
                          "): it did not check in within ", detail::seconds_text(settle()), " of the failure (stopped "
                          "or cut off?), and the others went on without it; after: ", cause));
    TESSERA_CHECK(size() >= options_.min_size, CommError, where(), ": ", size(), " member(s) left (",
                  list_text(members_), "), fewer than ElasticOptions::min_size = ", options_.min_size, "; after: ",
                  cause);
    MembershipChange record = MembershipChange::between(next, grow_step, before, members_, cause);
    connect();
    record.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    history_.push_back(std::move(record));
  }

  static std::string list_text(const std::vector<std::string>& ids) {
    std::string out;
    for (const auto& id : ids) out += (out.empty() ? "" : ", ") + id;
    return out;
  }

  std::string url_, prefix_, me_;
  int slots_ = 1;
  CommOptions comm_options_;
  ElasticOptions options_;
  std::shared_ptr<detail::PrefixedStore> store_;
  std::optional<GlooComm> comm_;
  std::vector<std::string> members_;                 // this generation's, in rank order
  std::vector<std::int64_t> next_incarnation_;       // per slot: the incarnation a replacement takes next
  std::int64_t generation_ = 0;
  std::int64_t grow_at_ = -1;                        // the step this generation grows at (-1: none yet)
  bool joined_late_ = false;
  std::vector<MembershipChange> history_;
  std::vector<std::string> refused_;  // old members whose status server refused this change's probe: gone
};

template <>
struct ElasticGroupFor<GlooComm> {
  using type = GlooElasticGroup;
};

}  // namespace tessera
