// Fuzz target: the status-server protocol of include/tessera/comm/monitor.hpp, both ends, over
// real loopback TCP (the parsers are private to the socket code, so they are reached as a peer
// reaches them):
//   first byte even: the input is a request sent to this process's ProgressServer (answer()),
//     which must reply "unknown\n" or one line of 9 integers, or close without a reply, within 5 s;
//   first byte odd: the input is a peer's reply to ask_peers (a fake peer sends it), parsed and
//     turned into a stall report by stall_report() (decoding the peer's call signature).
// Neither end throws by design: any exception, crash, sanitizer report or hang is a bug.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "tessera/comm/monitor.hpp"

namespace {

using namespace tessera::detail;

int connect_loopback(std::int64_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) std::abort();
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    // Interrupted (libFuzzer's timer signal): the connection goes on; wait for it to finish.
    int err = errno;
    if (err == EINTR) {
      pollfd p{fd, POLLOUT, 0};
      while (::poll(&p, 1, 5000) < 0 && errno == EINTR) {
      }
      socklen_t len = sizeof err;
      if (!(p.revents & POLLOUT) || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = ETIMEDOUT;
    }
    if (err != 0) {
      std::fprintf(stderr, "fuzz_monitor: connect: %s\n", std::strerror(err));
      std::abort();
    }
  }
  return fd;
}

// Everything the peer sends until it closes; aborts (a hang) after 5 s (the server answers at
// once; the margin is for a loaded CI machine). `reset`: the peer closed
// with our bytes unread (a request longer than it reads), which may drop its reply in transit.
std::string read_all(int fd, bool& reset) {
  std::string got;
  reset = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (;;) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "fuzz_monitor: the status server did not answer or close within 5 s\n");
      std::abort();
    }
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    char buf[512];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) reset = true;
    if (n <= 0) return got;
    got.append(buf, static_cast<std::size_t>(n));
  }
}

// This process's own status server, knowing one communicator "fuzz:world" with some progress.
struct Server {
  std::shared_ptr<ProgressBoard> board = std::make_shared<ProgressBoard>();
  std::int64_t port = 0;
  Server() {
    board->label = "fuzz:world";
    board->backend = "fuzz";
    board->rank = 0;
    board->size = 2;
    board->enter({CollectiveKind::AllReduce, tessera::CommDType::F32, 1024, 0});
    board->finish();
    port = ProgressServer::instance().address().port;
    if (port == 0) std::abort();
    ProgressServer::instance().add(board);
  }
};

void fuzz_server(const std::uint8_t* data, std::size_t size) {
  static Server* server = new Server();
  const int fd = connect_loopback(server->port);
  for (std::size_t sent = 0; sent < size;) {
    const ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the server closed early (it reads at most 128 bytes)
    sent += static_cast<std::size_t>(n);
  }
  ::shutdown(fd, SHUT_WR);
  bool reset = false;
  const std::string reply = read_all(fd, reset);
  ::close(fd);
  if (reply.empty() || reply == "unknown\n" || (reset && reply.back() != '\n')) return;
  long long v[9];
  int used = 0;
  if (std::sscanf(reply.c_str(), "%lld %lld %lld %lld %lld %lld %lld %lld %lld%n", &v[0], &v[1], &v[2], &v[3], &v[4],
                  &v[5], &v[6], &v[7], &v[8], &used) != 9 ||
      reply.substr(static_cast<std::size_t>(used)) != "\n") {
    std::fprintf(stderr, "fuzz_monitor: malformed reply '%s'\n", reply.c_str());
    std::abort();
  }
}

// A peer that answers each connection's request (one line) with the current input, then closes.
struct FakePeer {
  int listen_fd = -1;
  std::int64_t port = 0;
  std::mutex mutex;
  std::string reply;
  FakePeer() {
    listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (listen_fd < 0 || ::bind(listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::listen(listen_fd, 16) != 0 || ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
      std::abort();
    port = ntohs(addr.sin_port);
    std::thread([this] { serve(); }).detach();
  }
  void serve() {
    for (;;) {
      const int c = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      std::string request;
      char buf[256];
      while (request.find('\n') == std::string::npos) {
        const ssize_t n = ::recv(c, buf, sizeof buf, 0);
        if (n <= 0) break;
        request.append(buf, static_cast<std::size_t>(n));
      }
      std::string r;
      {
        std::lock_guard lock(mutex);
        r = reply;
      }
      (void)!::send(c, r.data(), r.size(), MSG_NOSIGNAL);
      ::close(c);
    }
  }
};

void fuzz_client(const std::uint8_t* data, std::size_t size) {
  static FakePeer* peer = new FakePeer();
  {
    std::lock_guard lock(peer->mutex);
    peer->reply.assign(reinterpret_cast<const char*>(data), size);
  }
  ProgressBoard board;
  board.label = "fuzz:client";
  board.rank = 0;
  board.size = 2;
  board.peers = {{0x7f000001, 0, 1}, {0x7f000001, peer->port, 1}};  // same host key: asked on 127.0.0.1
  const CallSignature mine{CollectiveKind::Broadcast, tessera::CommDType::F64, 16, 0};
  const auto start = std::chrono::steady_clock::now();
  const std::string text = stall_report(board, 5, mine);
  if (text.rfind("reached call #5: ", 0) != 0) {
    std::fprintf(stderr, "fuzz_monitor: stall report '%s'\n", text.c_str());
    std::abort();
  }
  // ask_peers waits at most 1 s in all, whatever the peer sends (3 s: margin for a loaded machine).
  if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(3000)) {
    std::fprintf(stderr, "fuzz_monitor: stall_report took over 3 s\n");
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 0)
    fuzz_server(data + 1, size - 1);
  else
    fuzz_client(data + 1, size - 1);
  return 0;
}
