// Stall reports that name names: which ranks reached a collective and which did not.
//
// A rank stuck in a collective cannot tell, from inside the backend, who is missing: Gloo and MPI
// only know that bytes do not arrive. So every process runs one small status server (a TCP
// listener on an ephemeral port, one thread, started with the first multi-rank communicator),
// and every communicator publishes, in a ProgressBoard, how many collectives it has entered and
// finished and the signature of the last one (a few relaxed atomic stores per call). The ranks
// swap the servers' addresses when the communicator is made. When an operation has waited past
// the stall warning (CommOptions::effective_stall_warning) or failed, the waiting rank asks every
// peer's server about the same communicator and reports, for example:
//
//   reached call #57: ranks 0, 2; not reached: rank 1 (last entered call #56, broadcast(float32 x
//   4, root 0), and finished it 31.0 s ago: busy outside this communicator)
//
// A peer whose process is stopped (SIGSTOP) or hung in the kernel, or whose host the network no
// longer reaches (a link down), does not answer within a second; a dead one refuses the
// connection; a peer with no route to it is unreachable. Each is reported as such. Peers on this
// host (same hostname and network namespace) are asked over 127.0.0.1; others at the address they
// published: TESSERA_MONITOR_HOST, else the address of TESSERA_GLOO_IFACE, else
// TESSERA_GLOO_HOSTNAME, else this host's name resolved when that is an address of this host
// other than loopback, else the first non-loopback IPv4 address of an interface that is up, else
// 127.0.0.1. (Hostnames that resolve to 127.0.x.x, as Debian's /etc/hosts makes them, and
// network namespaces, which share the hostname, would otherwise send peers to their own
// loopback.)
//
// The server answers only "what is your state on communicator <label>" with numbers it already
// holds: nothing is executed on request, and a request is at most 128 bytes.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "tessera/comm/call_check.hpp"
#include "tessera/comm/launch_env.hpp"
#include "tessera/comm/options.hpp"
#include "tessera/core/linkage.hpp"  // non-template functions: defined at the end (inline) or once in tessera_kernels

namespace tessera::detail {

inline std::int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Where a peer's status server listens: [IPv4 address, port, host key] as int64, the form the
// communicators exchange with their own all_gather.
struct MonitorAddress {
  std::int64_t ipv4 = 0;      // host byte order
  std::int64_t port = 0;      // 0: the peer has no server (then it is reported as unknown)
  std::int64_t host_key = 0;  // hash of hostname and network namespace: equal means "ask 127.0.0.1"
};

// The collective this process entered last, on any communicator: what a fatal handler can say
// when a backend's own thread dies (Gloo's I/O thread throws out of reach of any catch).
struct LastEntered {
  std::atomic<const char*> backend{nullptr};
  std::atomic<int> rank{0}, size{1};
  std::atomic<std::int64_t> call{0};
  std::array<std::atomic<std::int64_t>, 4> sig{};
  static LastEntered& get();
};

// One communicator's published progress. Written by the thread that issues its calls, read by
// the status server's thread; relaxed atomics suffice (a report is a snapshot, not a proof).
struct ProgressBoard {
  std::string label;  // the same on every member: backend, world or split path
  const char* backend = "";
  int rank = 0, size = 1;
  std::atomic<std::int64_t> entered{0}, finished{0};
  std::array<std::atomic<std::int64_t>, 4> last{};  // CallSignature::encode of the last entered call
  std::atomic<std::int64_t> entered_ns{0}, finished_ns{0};
  std::atomic<bool> failed{false};  // an operation failed: the communicator is broken
  std::vector<MonitorAddress> peers;  // by rank in this communicator

  // Returns the call's 1-based index.
  std::int64_t enter(const CallSignature& sig);
  void finish() {
    finished_ns.store(steady_ns(), std::memory_order_relaxed);
    finished.fetch_add(1, std::memory_order_relaxed);
  }
};

// Host key: hostname plus the network namespace's inode, so that ranks in separate namespaces of
// one machine (tests) do not take each other for local.
std::int64_t monitor_host_key();

// IPv4 addresses (host byte order) of this network namespace's interfaces that are up: those of
// interface `only` when given, else all but loopback, in the kernel's order.
std::vector<std::uint32_t> monitor_interface_ipv4s(const char* only = nullptr);

std::uint32_t monitor_published_ipv4();

// The process's status server. Boards are held weakly: a destroyed communicator disappears.
class ProgressServer {
 public:
  static ProgressServer& instance();

  // This process's address, starting the server on first use; port 0 if it could not start
  // (then peers report this rank as "no status server", and nothing else changes).
  MonitorAddress address();
  void add(const std::shared_ptr<ProgressBoard>& board);
  // A failed communicator's board stays readable after the communicator is gone, for as long as
  // the process lives: peers that ask later hear "failed at call #n", not "unknown".
  void keep(const std::shared_ptr<ProgressBoard>& board);

 private:
  void start();
  void serve(int listen_fd);

  // Request: "<label>\n" (at most 128 bytes, within 1 s). Reply: one line of numbers, or "unknown".
  void answer(int client);

  std::mutex mutex_;
  bool started_ = false;
  std::int64_t port_ = 0;
  std::vector<std::weak_ptr<ProgressBoard>> boards_;
  std::vector<std::shared_ptr<ProgressBoard>> kept_;
};

// Marks the board's communicator failed (see ProgressServer::keep).
void mark_board_failed(const std::shared_ptr<ProgressBoard>& board);

// Makes a board for a new communicator and swaps status-server addresses with its members
// through `all_gather_int64` (a blocking all_gather of int64 on the new communicator).
template <class Gather>
std::shared_ptr<ProgressBoard> make_progress_board(const char* backend, std::string label, int rank, int size,
                                                  Gather&& all_gather_int64) {
  auto board = std::make_shared<ProgressBoard>();
  board->backend = backend;
  board->label = std::move(label);
  board->rank = rank;
  board->size = size;
  if (size == 1) return board;
  const MonitorAddress mine = ProgressServer::instance().address();
  const std::array<std::int64_t, 3> packed = {mine.ipv4, mine.port, mine.host_key};
  std::vector<std::int64_t> all(3 * static_cast<std::size_t>(size));
  all_gather_int64(std::span<const std::int64_t>(packed), std::span<std::int64_t>(all));
  for (int q = 0; q < size; ++q) board->peers.push_back({all[3 * q], all[3 * q + 1], all[3 * q + 2]});
  ProgressServer::instance().add(board);
  return board;
}

// What one peer said about the communicator.
struct PeerProgress {
  enum class Status { Answered, NoAnswer, Closed, Refused, Unreachable, Unknown, NoServer } status = Status::NoServer;
  int error = 0;  // errno of a failed connect (Refused, Unreachable)
  std::int64_t entered = 0, finished = 0;
  CallSignature last;
  std::int64_t entered_ago_ms = -1, finished_ago_ms = -1;
  bool failed = false;
};

// A refused connection means nothing listens at the peer's address: its process is gone. Any
// other failure (no route, network or host unreachable: a link down on either side) says
// nothing about the process.
inline PeerProgress::Status connect_failure(int error) {
  return error == ECONNREFUSED ? PeerProgress::Status::Refused : PeerProgress::Status::Unreachable;
}

// Asks every peer at once, waiting at most `patience` in all.
std::vector<PeerProgress> ask_peers(const ProgressBoard& board,
                                    std::chrono::milliseconds patience = std::chrono::milliseconds(1000));

std::string rank_list(const std::vector<int>& ranks);

// "reached call #57: ranks 0, 2; not reached: rank 1 (...)" for this rank's call number `call`
// (1-based) on the board's communicator. Asks the peers (up to a second).
std::string stall_report(const ProgressBoard& board, std::int64_t call, const CallSignature& sig);

// A fatal message that must reach the user: stderr, flushed, and a file per rank in
// TESSERA_ERROR_DIR when that is set (under a launcher that may drop a dying process's output).
void report_fatal(int rank, const std::string& text);

// Installs, once per process, a terminate handler that names the collective in flight before the
// program aborts: for exceptions thrown where nothing can catch them (Gloo's I/O thread enforces
// message sizes that way), which would otherwise end the rank with a bare "terminate called".
void install_fatal_handler();

// Says, when the launcher ends this rank with SIGTERM (mpirun and tessera-run stop the other ranks
// that way when one fails), what the rank was doing: otherwise a survivor of a dead peer under
// mpirun disappears without a word. The handler only writes a byte to a pipe (async-signal-safe);
// a thread formats the message, then restores the default action and re-raises the signal.
// Installed only while SIGTERM has its default action, so a program's own handler wins.
void install_sigterm_reporter();

// Watches calls that cannot be interrupted (blocking MPI, Gloo's own collectives): warns once at
// the stall warning, with a stall report, and runs `on_timeout` (MPI: report and abort the job)
// at the timeout if given. begin() takes a slot in a fixed table and end() frees it: nothing is
// formatted or allocated per call, and the thread is only woken when a new deadline is earlier
// than the one it sleeps towards.
class Watchdog {
 public:
  struct Call {
    std::shared_ptr<ProgressBoard> board;
    std::int64_t call = 0;
    CallSignature signature;
    const char* backend = "";
    int rank = 0, size = 1;
    std::chrono::milliseconds timeout{0}, warn_after{0};
    void (*on_timeout)(const std::string& text, int rank) = nullptr;  // null: the backend times out itself
  };

  static Watchdog& instance();
  int begin(Call call);
  void end(int slot);

 private:
  static constexpr int kSlots = 64;
  struct Slot {
    Call call;
    std::chrono::steady_clock::time_point warn_at, fatal_at;
    bool warned = false, active = false;
    std::uint64_t generation = 0;
  };

  void loop();

  std::mutex mutex_;
  std::condition_variable wake_;
  Slot slots_[kSlots];
  std::chrono::steady_clock::time_point sleeping_until_ = std::chrono::steady_clock::time_point::max();
  bool started_ = false;
};

// Watches one call for its scope.
class WatchedCall {
 public:
  explicit WatchedCall(Watchdog::Call call);
  ~WatchedCall();
  WatchedCall(const WatchedCall&) = delete;
  WatchedCall& operator=(const WatchedCall&) = delete;

 private:
  int slot_;
};

#if TESSERA_HEADER_DEFINITIONS

TESSERA_LINKAGE LastEntered& LastEntered::get() {
  static LastEntered* last = new LastEntered();  // leaked: read by handlers at any time
  return *last;
}

TESSERA_LINKAGE std::int64_t ProgressBoard::enter(const CallSignature& sig) {
  const auto e = sig.encode();
  for (int i = 0; i < 4; ++i) last[i].store(e[i], std::memory_order_relaxed);
  entered_ns.store(steady_ns(), std::memory_order_relaxed);
  const std::int64_t call = entered.fetch_add(1, std::memory_order_relaxed) + 1;
  LastEntered& g = LastEntered::get();
  g.backend.store(backend, std::memory_order_relaxed);
  g.rank.store(rank, std::memory_order_relaxed);
  g.size.store(size, std::memory_order_relaxed);
  g.call.store(call, std::memory_order_relaxed);
  for (int i = 0; i < 4; ++i) g.sig[i].store(e[i], std::memory_order_relaxed);
  return call;
}

TESSERA_LINKAGE std::int64_t monitor_host_key() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  struct stat ns {};
  const std::uint64_t inode = ::stat("/proc/self/ns/net", &ns) == 0 ? static_cast<std::uint64_t>(ns.st_ino) : 0;
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const char* c = name; *c; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 0x100000001b3ull;
  h = (h ^ inode) * 0x100000001b3ull;
  return static_cast<std::int64_t>(h & 0x7fffffffffffffffull);
}

TESSERA_LINKAGE std::vector<std::uint32_t> monitor_interface_ipv4s(const char* only) {
  std::vector<std::uint32_t> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET || !(a->ifa_flags & IFF_UP)) continue;
    if (only != nullptr ? std::strcmp(a->ifa_name, only) != 0 : (a->ifa_flags & IFF_LOOPBACK) != 0) continue;
    out.push_back(ntohl(reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr));
  }
  freeifaddrs(list);
  return out;
}

TESSERA_LINKAGE std::uint32_t monitor_published_ipv4() {
  auto resolve = [](const char* host) -> std::uint32_t {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    addrinfo* info = nullptr;
    if (host == nullptr || *host == '\0' || getaddrinfo(host, nullptr, &hints, &info) != 0 || info == nullptr) return 0;
    const std::uint32_t ip = ntohl(reinterpret_cast<sockaddr_in*>(info->ai_addr)->sin_addr.s_addr);
    freeaddrinfo(info);
    return ip;
  };
  if (const std::uint32_t ip = resolve(std::getenv("TESSERA_MONITOR_HOST"))) return ip;
  // Where Gloo binds (gloo.hpp's make_gloo_device), so the monitor is reachable wherever Gloo is.
  if (const char* iface = std::getenv("TESSERA_GLOO_IFACE"); iface != nullptr && *iface != '\0')
    if (const auto ips = monitor_interface_ipv4s(iface); !ips.empty()) return ips.front();
  if (const std::uint32_t ip = resolve(std::getenv("TESSERA_GLOO_HOSTNAME"))) return ip;
  const auto here = monitor_interface_ipv4s();
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0)
    if (const std::uint32_t ip = resolve(name); std::find(here.begin(), here.end(), ip) != here.end()) return ip;
  return here.empty() ? INADDR_LOOPBACK : here.front();
}

TESSERA_LINKAGE ProgressServer& ProgressServer::instance() {
  static ProgressServer* server = new ProgressServer();  // leaked: must outlive static destructors
  return *server;
}

TESSERA_LINKAGE MonitorAddress ProgressServer::address() {
  std::lock_guard lock(mutex_);
  if (!started_) start();
  return {static_cast<std::int64_t>(monitor_published_ipv4()), port_, monitor_host_key()};
}

TESSERA_LINKAGE void ProgressServer::add(const std::shared_ptr<ProgressBoard>& board) {
  std::lock_guard lock(mutex_);
  boards_.push_back(board);
}

TESSERA_LINKAGE void ProgressServer::keep(const std::shared_ptr<ProgressBoard>& board) {
  std::lock_guard lock(mutex_);
  kept_.push_back(board);
}

TESSERA_LINKAGE void ProgressServer::start() {
  started_ = true;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 64) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    return;
  }
  port_ = ntohs(addr.sin_port);
  std::thread([this, fd] { serve(fd); }).detach();
}

TESSERA_LINKAGE void ProgressServer::serve(int listen_fd) {
  for (;;) {
    const int client = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    answer(client);
    ::close(client);
  }
}

TESSERA_LINKAGE void ProgressServer::answer(int client) {
  char request[129] = {};
  std::size_t got = 0;
  const auto deadline = steady_ns() + 1'000'000'000LL;
  while (got < 128 && std::memchr(request, '\n', got) == nullptr && steady_ns() < deadline) {
    pollfd p{client, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(client, request + got, 128 - got, 0);
    if (n < 0 && errno == EINTR) continue;  // a signal (a profiler's timer), not the peer closing
    if (n <= 0) return;
    got += static_cast<std::size_t>(n);
  }
  char* newline = static_cast<char*>(std::memchr(request, '\n', got));
  if (newline == nullptr) return;
  const std::string label(request, newline);
  std::string reply = "unknown\n";
  {
    std::lock_guard lock(mutex_);
    std::erase_if(boards_, [](const std::weak_ptr<ProgressBoard>& w) { return w.expired(); });
    for (const auto& weak : boards_) {
      const auto b = weak.lock();
      if (!b || b->label != label) continue;
      const std::int64_t now = steady_ns();
      const std::int64_t in_ns = b->entered_ns.load(std::memory_order_relaxed);
      const std::int64_t out_ns = b->finished_ns.load(std::memory_order_relaxed);
      reply = cat(b->entered.load(std::memory_order_relaxed), " ", b->finished.load(std::memory_order_relaxed), " ",
                  b->last[0].load(std::memory_order_relaxed), " ", b->last[1].load(std::memory_order_relaxed), " ",
                  b->last[2].load(std::memory_order_relaxed), " ", b->last[3].load(std::memory_order_relaxed), " ",
                  in_ns ? (now - in_ns) / 1'000'000 : -1, " ", out_ns ? (now - out_ns) / 1'000'000 : -1, " ",
                  b->failed.load() ? 1 : 0, "\n");
      break;
    }
  }
  (void)!::send(client, reply.data(), reply.size(), MSG_NOSIGNAL);
}

TESSERA_LINKAGE void mark_board_failed(const std::shared_ptr<ProgressBoard>& board) {
  if (!board || board->failed.exchange(true)) return;
  ProgressServer::instance().keep(board);
}

TESSERA_LINKAGE std::vector<PeerProgress> ask_peers(const ProgressBoard& board, std::chrono::milliseconds patience) {
  const int n = board.size;
  std::vector<PeerProgress> out(static_cast<std::size_t>(n));
  std::vector<int> fds(static_cast<std::size_t>(n), -1);
  std::vector<std::string> replies(static_cast<std::size_t>(n));
  std::vector<bool> sent(static_cast<std::size_t>(n), false), done(static_cast<std::size_t>(n), true);
  const std::int64_t my_key = board.peers.empty() ? 0 : board.peers[board.rank].host_key;
  const std::string request = board.label + "\n";
  for (int q = 0; q < n && q < static_cast<int>(board.peers.size()); ++q) {
    if (q == board.rank || board.peers[q].port == 0) continue;
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(board.peers[q].port));
    const bool local = board.peers[q].host_key == my_key;
    addr.sin_addr.s_addr = htonl(local ? INADDR_LOOPBACK : static_cast<std::uint32_t>(board.peers[q].ipv4));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 && errno != EINPROGRESS) {
      out[q].error = errno;
      out[q].status = connect_failure(errno);
      ::close(fd);
      continue;
    }
    fds[q] = fd;
    done[q] = false;
    out[q].status = PeerProgress::Status::NoAnswer;
  }
  const auto deadline = std::chrono::steady_clock::now() + patience;
  while (std::chrono::steady_clock::now() < deadline) {
    std::vector<pollfd> polls;
    std::vector<int> who;
    for (int q = 0; q < n; ++q) {
      if (done[q]) continue;
      polls.push_back({fds[q], static_cast<short>(sent[q] ? POLLIN : POLLOUT), 0});
      who.push_back(q);
    }
    if (polls.empty()) break;
    if (::poll(polls.data(), polls.size(), 50) <= 0) continue;
    for (std::size_t i = 0; i < polls.size(); ++i) {
      const int q = who[i];
      if (polls[i].revents == 0) continue;
      if (!sent[q]) {
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(fds[q], SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0 || (polls[i].revents & (POLLERR | POLLHUP))) {
          out[q].error = err != 0 ? err : ECONNREFUSED;
          out[q].status = connect_failure(out[q].error);
          done[q] = true;
          continue;
        }
        sent[q] = ::send(fds[q], request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size());
        if (!sent[q]) done[q] = true;
        continue;
      }
      char buf[256];
      const ssize_t got = ::recv(fds[q], buf, sizeof buf, 0);
      if (got < 0 && errno == EINTR) continue;  // interrupted by a signal: poll again
      if (got > 0) replies[q].append(buf, static_cast<std::size_t>(got));
      if (got <= 0 && replies[q].find('\n') == std::string::npos) out[q].status = PeerProgress::Status::Closed;
      if (got <= 0 || replies[q].find('\n') != std::string::npos) done[q] = true;
    }
  }
  for (int q = 0; q < n; ++q) {
    if (fds[q] >= 0) ::close(fds[q]);
    if (replies[q].find('\n') == std::string::npos) continue;
    if (replies[q].rfind("unknown", 0) == 0) {
      out[q].status = PeerProgress::Status::Unknown;
      continue;
    }
    long long v[9] = {};
    if (std::sscanf(replies[q].c_str(), "%lld %lld %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1], &v[2], &v[3],
                    &v[4], &v[5], &v[6], &v[7], &v[8]) != 9)
      continue;
    out[q].failed = v[8] != 0;
    out[q].status = PeerProgress::Status::Answered;
    out[q].entered = v[0];
    out[q].finished = v[1];
    const std::int64_t sig[4] = {v[2], v[3], v[4], v[5]};
    out[q].last = CallSignature::decode(sig);
    out[q].entered_ago_ms = v[6];
    out[q].finished_ago_ms = v[7];
  }
  return out;
}

TESSERA_LINKAGE std::string rank_list(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) text += cat(i ? ", " : "", ranks[i]);
  return text;
}

TESSERA_LINKAGE std::string stall_report(const ProgressBoard& board, std::int64_t call, const CallSignature& sig) {
  if (board.size == 1 || board.peers.empty()) return "";
  const auto peers = ask_peers(board);
  std::vector<int> reached, mismatched;
  std::string behind, silent;  // answered but not there yet; could not tell
  for (int q = 0; q < board.size; ++q) {
    if (q == board.rank) {
      reached.push_back(q);
      continue;
    }
    const PeerProgress& p = peers[q];
    using S = PeerProgress::Status;
    auto note = [&](std::string& list, const std::string& what) {
      list += cat(list.empty() ? "" : "; ", "rank ", q, " (", what, ")");
    };
    switch (p.status) {
      case S::NoServer: note(silent, "no status server"); continue;
      case S::Refused: note(silent, "its status server refuses connections: the process is probably dead"); continue;
      case S::NoAnswer:
        note(silent, "no answer within 1 s: the process is stopped (SIGSTOP?) or hung, or the network to it is down");
        continue;
      case S::Unreachable:
        note(silent, cat("its status server cannot be reached: ", std::strerror(p.error),
                         " (a network link on the way is down)"));
        continue;
      case S::Closed: note(silent, "closed the connection without answering: the process is probably exiting"); continue;
      case S::Unknown: note(silent, "does not know this communicator: not created yet, or already destroyed"); continue;
      case S::Answered: break;
    }
    if (p.failed && p.entered < call) {
      note(behind, cat("failed at call #", p.entered, ", ", p.last.describe(), ": its communicator is broken"));
      continue;
    }
    if (p.entered >= call) {
      reached.push_back(q);
      if (p.entered == call && !(p.last == sig)) mismatched.push_back(q);
      continue;
    }
    if (p.entered == 0) {
      note(behind, "has not entered any collective on this communicator yet");
    } else if (p.finished >= p.entered) {
      note(behind, cat("last entered call #", p.entered, ", ", p.last.describe(), ", and finished it ",
                       p.finished_ago_ms / 1000.0, " s ago: busy outside this communicator"));
    } else {
      note(behind, cat("waiting in call #", p.entered, ", ", p.last.describe(), ", entered ", p.entered_ago_ms / 1000.0,
                       " s ago: the ranks are out of step"));
    }
  }
  std::string text = cat("reached call #", call, ": ", rank_list(reached));
  if (!behind.empty()) text += "; not reached: " + behind;
  if (!silent.empty()) text += "; no answer: " + silent;
  if (behind.empty() && silent.empty()) text += "; every rank reached it";
  for (int q : mismatched)
    text += cat("; rank ", q, " is in call #", call, " as ", peers[q].last.describe(),
                ", not as this rank's ", sig.describe(), ": the ranks called different collectives");
  return text;
}

TESSERA_LINKAGE void report_fatal(int rank, const std::string& text) {
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
  if (const char* dir = std::getenv("TESSERA_ERROR_DIR"); dir != nullptr && *dir != '\0') {
    const std::string path = cat(dir, "/rank", rank, ".txt");
    if (std::FILE* f = std::fopen(path.c_str(), "a")) {
      std::fprintf(f, "%s\n", text.c_str());
      std::fclose(f);
    }
  }
}

TESSERA_LINKAGE void install_fatal_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    static std::terminate_handler previous = nullptr;
    previous = std::set_terminate([] {
      std::string what = "an unknown exception";
      if (const std::exception_ptr error = std::current_exception()) {
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
      }
      const LastEntered& last = LastEntered::get();
      const char* backend = last.backend.load();
      std::string text = cat("tessera: fatal: ", what);
      if (backend != nullptr) {
        std::int64_t sig[4];
        for (int i = 0; i < 4; ++i) sig[i] = last.sig[i].load();
        text += cat("\n  raised where no code can catch it (the communication library's own thread) while rank ",
                    last.rank.load(), " of ", last.size.load(), " was in ", backend, " ",
                    CallSignature::decode(sig).describe(), " (call #", last.call.load(),
                    " on its communicator).\n  The usual cause is ranks calling a collective with different element "
                    "counts at a call the sampled check skipped; TESSERA_COMM_CHECK_EVERY=1 compares every call and "
                    "stops at the first bad one.");
      }
      report_fatal(last.rank.load(), text);
      if (previous) previous();
      std::abort();
    });
  });
}

TESSERA_LINKAGE void install_sigterm_reporter() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGTERM, nullptr, &current) != 0 || current.sa_handler != SIG_DFL || (current.sa_flags & SA_SIGINFO))
      return;
    static int pipe_fds[2] = {-1, -1};
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return;
    std::thread([] {
      char byte = 0;
      while (::read(pipe_fds[0], &byte, 1) < 0 && errno == EINTR) {
      }
      const LastEntered& last = LastEntered::get();
      const char* backend = last.backend.load();
      // Before its first collective LastEntered holds no rank yet: the launcher's variables do.
      int rank = last.rank.load(), size = last.size.load();
      if (backend == nullptr) {
        try {
          const LaunchEnv launch = LaunchEnv::from_environment();
          rank = launch.rank;
          size = launch.size;
        } catch (const std::exception&) {  // unreadable launcher variables: say what is known
        }
      }
      std::string text = cat("tessera: rank ", rank, " of ", size,
                             " received SIGTERM (the launcher is ending the job, usually because another rank failed)");
      if (backend != nullptr) {
        std::int64_t sig[4];
        for (int i = 0; i < 4; ++i) sig[i] = last.sig[i].load();
        text += cat("; its last collective was ", backend, " ", CallSignature::decode(sig).describe(), " (call #",
                    last.call.load(), ")");
      } else {
        text += "; it had not called a collective yet (still starting: reading data, building the model or meeting "
                "its peers)";
      }
      report_fatal(rank, text);
      std::fflush(stdout);
      signal(SIGTERM, SIG_DFL);
      ::raise(SIGTERM);
    }).detach();
    struct sigaction action {};
    action.sa_handler = [](int) {
      const char byte = 1;
      (void)!::write(pipe_fds[1], &byte, 1);
    };
    sigemptyset(&action.sa_mask);
    sigaction(SIGTERM, &action, nullptr);
  });
}

TESSERA_LINKAGE Watchdog& Watchdog::instance() {
  static Watchdog* watchdog = new Watchdog();  // leaked: must outlive static destructors
  return *watchdog;
}

TESSERA_LINKAGE int Watchdog::begin(Call call) {
  std::lock_guard lock(mutex_);
  if (!started_) {
    std::thread([this] { loop(); }).detach();
    started_ = true;
  }
  for (int i = 0; i < kSlots; ++i) {
    if (slots_[i].active) continue;
    const auto now = std::chrono::steady_clock::now();
    Slot& s = slots_[i];
    s.warn_at = now + call.warn_after;
    s.fatal_at = call.on_timeout ? now + call.timeout : std::chrono::steady_clock::time_point::max();
    s.warned = false;
    s.call = std::move(call);
    s.active = true;
    s.generation++;
    if (s.warn_at < sleeping_until_) wake_.notify_one();
    return i;
  }
  return -1;  // more than kSlots threads inside watched calls at once: not watched
}

TESSERA_LINKAGE void Watchdog::end(int slot) {
  if (slot < 0) return;
  std::lock_guard lock(mutex_);
  slots_[slot].active = false;
  slots_[slot].call.board.reset();
}

TESSERA_LINKAGE void Watchdog::loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    auto next = now + std::chrono::hours(1);
    bool handled = false;
    for (int i = 0; i < kSlots && !handled; ++i) {
      Slot& s = slots_[i];
      if (!s.active) continue;
      if (now >= s.fatal_at || (!s.warned && now >= s.warn_at)) {
        // Asking the peers takes up to a second: copy what is needed and let go of the lock.
        const bool fatal = now >= s.fatal_at;
        s.warned = true;
        const Call call = s.call;
        const std::uint64_t generation = s.generation;
        const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - (s.warn_at - call.warn_after));
        lock.unlock();
        const std::string report = call.board ? stall_report(*call.board, call.call, call.signature) : "";
        const std::string head = cat(call.backend, " ", call.signature.describe(), " on rank ", call.rank, " of ",
                                     call.size, " (call #", call.call, ")");
        lock.lock();
        handled = true;  // the table may have changed while unlocked: rescan before sleeping
        if (!s.active || s.generation != generation) break;  // it finished meanwhile: nothing to say
        if (fatal) {
          lock.unlock();
          call.on_timeout(cat("tessera: CommError: ", head, ": timed out after ", seconds_text(call.timeout),
                              report.empty() ? "" : "; " + report),
                          call.rank);
          lock.lock();
        } else {
          std::fprintf(stderr, "tessera: warning: %s has waited %s (timeout %s)%s\n", head.c_str(),
                       seconds_text(waited).c_str(), seconds_text(call.timeout).c_str(),
                       report.empty() ? "" : ("; " + report).c_str());
          std::fflush(stderr);
        }
        break;
      }
      if (!s.warned) next = std::min(next, s.warn_at);
      next = std::min(next, s.fatal_at);
    }
    if (handled) continue;
    sleeping_until_ = next;
    wake_.wait_until(lock, next);
  }
}

TESSERA_LINKAGE WatchedCall::WatchedCall(Watchdog::Call call) : slot_(Watchdog::instance().begin(std::move(call))) {}

TESSERA_LINKAGE WatchedCall::~WatchedCall() { Watchdog::instance().end(slot_); }

#endif  // TESSERA_HEADER_DEFINITIONS

}  // namespace tessera::detail
