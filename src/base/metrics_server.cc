// The metrics endpoint: a small HTTP/1.x server for GET /metrics
// (include/dcr/metrics.h).
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>

#include "dcr/metrics.h"

namespace dcr {

namespace {

constexpr size_t kMaxHead = 8192;
constexpr int kReadMillis = 2000;

bool IsTokenChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
         std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

Status CheckHeaderLine(std::string_view line) {
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos || colon == 0) return InvalidArgument("a header line without a name and a colon");
  for (char c : line.substr(0, colon))
    if (!IsTokenChar(c)) return InvalidArgument("a header name with a character HTTP does not allow");
  for (char c : line.substr(colon + 1))
    if ((c < 0x20 && c != '\t') || c == 0x7f) return InvalidArgument("a header value with a control character");
  return Status::Ok();
}

void WriteAll(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the client left: nothing to tell
    bytes.remove_prefix(static_cast<size_t>(n));
  }
}

std::string Response(int code, std::string_view reason, std::string_view content_type, std::string_view body,
                     bool head_only) {
  return fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}", code,
                     reason, content_type, body.size(), head_only ? std::string_view() : body);
}

// The request head from `fd` (up to and including the blank line), or ""
// when the client sends none within the limits.
std::string ReadHead(int fd) {
  std::string head;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kReadMillis);
  char buf[2048];
  while (head.size() <= kMaxHead && head.find("\r\n\r\n") == std::string::npos) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return "";
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return head;  // closed early: parsed as it is
    head.append(buf, static_cast<size_t>(n));
  }
  return head;
}

}  // namespace

Result<HttpRequestHead> ParseHttpRequestHead(std::string_view head) {
  const size_t end = head.find("\r\n\r\n");
  if (end == std::string_view::npos) return InvalidArgument("the request head does not end with a blank line");
  std::string_view rest = head.substr(0, end + 2);
  const size_t eol = rest.find("\r\n");
  std::string_view line = rest.substr(0, eol);
  rest.remove_prefix(eol + 2);
  const size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
  if (sp1 == std::string_view::npos || sp1 == sp2)
    return InvalidArgument("the request line is not METHOD TARGET VERSION");
  HttpRequestHead out{std::string(line.substr(0, sp1)), std::string(line.substr(sp1 + 1, sp2 - sp1 - 1))};
  const std::string_view version = line.substr(sp2 + 1);
  if (out.method.empty()) return InvalidArgument("the request line has no method");
  for (char c : out.method)
    if (!IsTokenChar(c)) return InvalidArgument("the method has a character HTTP does not allow");
  if (out.target.empty() || out.target.front() != '/') return InvalidArgument("the target is not a path");
  for (char c : out.target)
    if (c <= 0x20 || c == 0x7f) return InvalidArgument("the target has a space or a control character");
  if (version != "HTTP/1.1" && version != "HTTP/1.0") return InvalidArgument("not an HTTP/1.0 or HTTP/1.1 request");
  while (!rest.empty()) {
    const size_t next = rest.find("\r\n");
    DCR_RETURN_IF_ERROR(CheckHeaderLine(rest.substr(0, next)));
    rest.remove_prefix(next + 2);
  }
  return out;
}

Result<std::pair<std::string, uint16_t>> ParseHostPort(std::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos)
    return InvalidArgument(fmt::format("'{}' is not HOST:PORT (e.g. 127.0.0.1:9400)", address));
  std::string_view host = address.substr(0, colon), port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  else if (host.find(':') != std::string_view::npos)
    return InvalidArgument(fmt::format("'{}': write an IPv6 host in brackets ([::1]:9400)", address));
  unsigned value = 0;
  const auto [p, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (host.empty() || port.empty() || ec != std::errc() || p != port.data() + port.size() || value > 65535)
    return InvalidArgument(fmt::format("'{}' is not HOST:PORT with a port from 0 to 65535", address));
  return std::make_pair(std::string(host), static_cast<uint16_t>(value));
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(std::string_view address) {
  DCR_ASSIGN_OR_RETURN(auto host_port, ParseHostPort(address));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port_text = std::to_string(host_port.second);
  if (int rc = ::getaddrinfo(host_port.first.c_str(), port_text.c_str(), &hints, &found); rc != 0)
    return Unavailable(fmt::format("metrics: cannot resolve '{}': {}", host_port.first, ::gai_strerror(rc)));
  std::unique_ptr<MetricsServer> server(new MetricsServer);
  server->host_ = host_port.first;
  int err = 0;
  for (addrinfo* a = found; a && server->listen_fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    const int one = 1;
    if (fd >= 0) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (fd >= 0 && ::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 16) == 0) {
      server->listen_fd_ = fd;
      break;
    }
    err = errno;
    if (fd >= 0) ::close(fd);
  }
  ::freeaddrinfo(found);
  if (server->listen_fd_ < 0)
    return Unavailable(fmt::format("metrics: cannot listen on {}: {}", address, std::strerror(err)));
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(server->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  server->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                    : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (::pipe2(server->wake_, O_CLOEXEC) != 0) return ErrnoError(errno, "metrics: cannot make a pipe");
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

MetricsServer::~MetricsServer() {
  if (wake_[1] >= 0) (void)!::write(wake_[1], "x", 1);
  if (thread_.joinable()) thread_.join();
  for (int fd : {listen_fd_, wake_[0], wake_[1]})
    if (fd >= 0) ::close(fd);
}

std::string MetricsServer::url() const {
  const bool v6 = host_.find(':') != std::string::npos;
  return fmt::format("http://{}{}{}:{}/metrics", v6 ? "[" : "", host_, v6 ? "]" : "", port_);
}

void MetricsServer::Loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0 && errno != EINTR) return;
    if (fds[1].revents) return;
    if (!(fds[0].revents & POLLIN)) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Serve(fd);
    ::close(fd);
  }
}

void MetricsServer::Serve(int fd) {
  const std::string head = ReadHead(fd);
  if (head.empty()) return;
  auto request = ParseHttpRequestHead(head);
  constexpr std::string_view kText = "text/plain; charset=utf-8";
  if (!request.ok()) return WriteAll(fd, Response(400, "Bad Request", kText, request.status().message() + "\n", false));
  const bool head_only = request->method == "HEAD";
  if (request->method != "GET" && !head_only)
    return WriteAll(fd, Response(405, "Method Not Allowed", kText, "only GET and HEAD\n", false));
  const std::string_view path = std::string_view(request->target).substr(0, request->target.find('?'));
  if (path != "/metrics") return WriteAll(fd, Response(404, "Not Found", kText, "see /metrics\n", head_only));
  WriteAll(fd, Response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", MetricsText(), head_only));
}

}  // namespace dcr
