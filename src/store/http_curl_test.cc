// The libcurl transport against a scripted loopback HTTP server: bodies both
// ways, keep-alive reuse, interim responses, and the failures it must
// report as errors (refused, truncated, stalled, abandoned).
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <thread>

#include "dcr/http.h"

namespace dcr {
namespace {

using ::testing::HasSubstr;

struct ReceivedRequest {
  std::string head;  // request line and headers
  std::string body;
};

// What the server does with one request.
struct Action {
  std::string raw;  // bytes to send
  bool close = false;  // then close the connection
  bool stall = false;  // then send nothing more until the server stops
};

class LoopbackServer {
 public:
  explicit LoopbackServer(std::function<Action(const ReceivedRequest&)> respond) : respond_(std::move(respond)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd_, 16) != 0) std::abort();
    socklen_t len = sizeof addr;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }

  ~LoopbackServer() {
    stop_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    accept_thread_.join();
    ::close(fd_);
    std::lock_guard<std::mutex> lock(mu_);
    for (int c : conns_) ::shutdown(c, SHUT_RDWR);
    for (auto& t : threads_) t.join();
    for (int c : conns_) ::close(c);
  }

  std::string url(const std::string& path = "/x") const { return "http://127.0.0.1:" + std::to_string(port_) + path; }
  int connections() const { return accepted_.load(); }
  std::vector<ReceivedRequest> requests() {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }

 private:
  void AcceptLoop() {
    for (;;) {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      if (stop_) {
        ::close(c);
        return;
      }
      ++accepted_;
      std::lock_guard<std::mutex> lock(mu_);
      conns_.push_back(c);
      threads_.emplace_back([this, c] { Serve(c); });
    }
  }

  void Serve(int c) {
    std::string buf;
    char tmp[65536];
    for (;;) {
      size_t end;
      while ((end = buf.find("\r\n\r\n")) == std::string::npos) {
        const ssize_t n = ::recv(c, tmp, sizeof tmp, 0);
        if (n <= 0) return;
        buf.append(tmp, static_cast<size_t>(n));
      }
      ReceivedRequest req;
      req.head = buf.substr(0, end + 2);
      buf.erase(0, end + 4);
      size_t body_len = 0;
      std::string lower = req.head;
      for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      if (size_t at = lower.find("content-length:"); at != std::string::npos)
        body_len = std::stoul(lower.substr(at + 15));
      while (buf.size() < body_len) {
        const ssize_t n = ::recv(c, tmp, sizeof tmp, 0);
        if (n <= 0) return;
        buf.append(tmp, static_cast<size_t>(n));
      }
      req.body = buf.substr(0, body_len);
      buf.erase(0, body_len);
      Action a = respond_(req);
      {
        std::lock_guard<std::mutex> lock(mu_);
        requests_.push_back(req);
      }
      if (!a.raw.empty() && ::send(c, a.raw.data(), a.raw.size(), MSG_NOSIGNAL) < 0) return;
      if (a.stall) {
        while (!stop_ && ::recv(c, tmp, sizeof tmp, 0) > 0) {
        }
        return;
      }
      if (a.close) {
        ::shutdown(c, SHUT_RDWR);
        return;
      }
    }
  }

  std::function<Action(const ReceivedRequest&)> respond_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0};
  std::thread accept_thread_;
  std::mutex mu_;
  std::vector<int> conns_;
  std::vector<std::thread> threads_;
  std::vector<ReceivedRequest> requests_;
};

std::string Response(int status, const std::string& body, const std::string& extra = "") {
  return "HTTP/1.1 " + std::to_string(status) + " X\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" +
         extra + "\r\n" + body;
}

// Collects what the transport hands over.
struct Collector final : HttpResponseHandler {
  int status = 0;
  HttpHeaders headers;
  std::string body;
  int header_calls = 0;
  size_t abandon_after = SIZE_MAX;
  bool OnHeaders(int s, HttpHeaders h) override {
    status = s;
    headers = std::move(h);
    ++header_calls;
    return true;
  }
  bool OnBody(std::string_view b) override {
    body.append(b);
    return body.size() < abandon_after;
  }
};

TEST(CurlTransport, GetReusesTheConnection) {
  LoopbackServer server([](const ReceivedRequest&) { return Action{Response(200, "hello", "X-Thing: a b \r\n")}; });
  auto t = NewCurlTransport();
  for (int i = 0; i < 3; ++i) {
    Collector c;
    HttpRequest req{"GET", server.url("/k%20ey?a=1"), {{"Host", "custom.host"}, {"X-Amz-Date", "d"}}, {}};
    ASSERT_TRUE(t->Send(req, c).ok());
    EXPECT_EQ(c.status, 200);
    EXPECT_EQ(c.body, "hello");
    EXPECT_EQ(c.header_calls, 1);
    ASSERT_NE(FindHeader(c.headers, "x-thing"), nullptr);
    EXPECT_EQ(*FindHeader(c.headers, "X-THING"), "a b");
  }
  EXPECT_EQ(server.connections(), 1);  // keep-alive
  const auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 3u);
  EXPECT_THAT(reqs[0].head, HasSubstr("GET /k%20ey?a=1 HTTP/1.1\r\n"));
  EXPECT_THAT(reqs[0].head, HasSubstr("Host: custom.host\r\n"));
  EXPECT_THAT(reqs[0].head, HasSubstr("X-Amz-Date: d\r\n"));
}

TEST(CurlTransport, PutAndPostSendTheirBodies) {
  LoopbackServer server([](const ReceivedRequest&) { return Action{Response(200, "")}; });
  auto t = NewCurlTransport();
  std::string big(3 << 20, 'z');
  big[12345] = 'a';
  for (const char* method : {"PUT", "POST"}) {
    Collector c;
    HttpRequest req{method, server.url(), {}, big};
    ASSERT_TRUE(t->Send(req, c).ok()) << method;
    EXPECT_EQ(c.status, 200);
  }
  Collector c;
  ASSERT_TRUE(t->Send(HttpRequest{"PUT", server.url(), {}, ""}, c).ok());  // empty body
  const auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 3u);
  EXPECT_THAT(reqs[0].head, HasSubstr("PUT /x HTTP/1.1"));
  EXPECT_THAT(reqs[1].head, HasSubstr("POST /x HTTP/1.1"));
  EXPECT_EQ(reqs[0].body, big);
  EXPECT_EQ(reqs[1].body, big);
  EXPECT_THAT(reqs[2].head, HasSubstr("Content-Length: 0"));
  for (const auto& r : reqs) {
    EXPECT_THAT(r.head, ::testing::Not(HasSubstr("Expect:")));
    EXPECT_THAT(r.head, ::testing::Not(HasSubstr("Content-Type:")));
  }
}

TEST(CurlTransport, HeadAndDelete) {
  LoopbackServer server([](const ReceivedRequest& r) {
    if (r.head.starts_with("HEAD")) return Action{"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nETag: \"e\"\r\n\r\n"};
    return Action{"HTTP/1.1 204 No Content\r\n\r\n"};
  });
  auto t = NewCurlTransport();
  Collector head;
  ASSERT_TRUE(t->Send(HttpRequest{"HEAD", server.url(), {}, {}}, head).ok());
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(*FindHeader(head.headers, "content-length"), "100");
  EXPECT_EQ(head.body, "");
  Collector del;
  ASSERT_TRUE(t->Send(HttpRequest{"DELETE", server.url(), {}, {}}, del).ok());
  EXPECT_EQ(del.status, 204);
  EXPECT_THAT(server.requests()[1].head, HasSubstr("DELETE /x HTTP/1.1"));
}

TEST(CurlTransport, InterimResponsesAreSkipped) {
  LoopbackServer server(
      [](const ReceivedRequest&) { return Action{"HTTP/1.1 100 Continue\r\n\r\n" + Response(201, "made")}; });
  auto t = NewCurlTransport();
  Collector c;
  ASSERT_TRUE(t->Send(HttpRequest{"PUT", server.url(), {}, "abc"}, c).ok());
  EXPECT_EQ(c.status, 201);
  EXPECT_EQ(c.header_calls, 1);
  EXPECT_EQ(c.body, "made");
}

TEST(CurlTransport, ErrorStatusesAreResponsesNotErrors) {
  LoopbackServer server([](const ReceivedRequest&) { return Action{Response(503, "<Error/>")}; });
  auto t = NewCurlTransport();
  Collector c;
  ASSERT_TRUE(t->Send(HttpRequest{"GET", server.url(), {}, {}}, c).ok());
  EXPECT_EQ(c.status, 503);
  EXPECT_EQ(c.body, "<Error/>");
}

TEST(CurlTransport, TruncatedBodyIsUnavailable) {
  LoopbackServer server([](const ReceivedRequest&) {
    return Action{"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + std::string(50, 'x'), /*close=*/true};
  });
  auto t = NewCurlTransport();
  Collector c;
  Status s = t->Send(HttpRequest{"GET", server.url(), {}, {}}, c);
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("GET http://127.0.0.1:"));
}

TEST(CurlTransport, ConnectionClosedWithoutResponseIsUnavailable) {
  LoopbackServer server([](const ReceivedRequest&) { return Action{"", /*close=*/true}; });
  auto t = NewCurlTransport();
  Collector c;
  EXPECT_EQ(t->Send(HttpRequest{"GET", server.url(), {}, {}}, c).code(), Code::kUnavailable);
}

TEST(CurlTransport, StalledBodyIsDeadlineExceeded) {
  LoopbackServer server([](const ReceivedRequest&) {
    return Action{"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", false, /*stall=*/true};
  });
  CurlTransportOptions o;
  o.low_speed_time = std::chrono::seconds(1);
  auto t = NewCurlTransport(o);
  Collector c;
  const auto start = std::chrono::steady_clock::now();
  Status s = t->Send(HttpRequest{"GET", server.url(), {}, {}}, c);
  EXPECT_EQ(s.code(), Code::kDeadlineExceeded) << s.ToString();
  // Not hung on the stalled body (a bound generous for a busy machine).
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
}

TEST(CurlTransport, RequestTimeout) {
  LoopbackServer server([](const ReceivedRequest&) { return Action{"", false, /*stall=*/true}; });
  CurlTransportOptions o;
  o.request_timeout = std::chrono::milliseconds(300);
  auto t = NewCurlTransport(o);
  Collector c;
  EXPECT_EQ(t->Send(HttpRequest{"GET", server.url(), {}, {}}, c).code(), Code::kDeadlineExceeded);
}

TEST(CurlTransport, RefusedConnectionIsUnavailable) {
  // Bind a port without listening: connecting to it is refused.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  auto t = NewCurlTransport();
  Collector c;
  Status s = t->Send(HttpRequest{"GET", "http://127.0.0.1:" + std::to_string(ntohs(addr.sin_port)) + "/", {}, {}}, c);
  ::close(fd);
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.ToString();
}

TEST(CurlTransport, AbandonedByTheHandlerIsAborted) {
  LoopbackServer server([](const ReceivedRequest&) { return Action{Response(200, std::string(1 << 20, 'x'))}; });
  auto t = NewCurlTransport();
  Collector c;
  c.abandon_after = 10;
  EXPECT_EQ(t->Send(HttpRequest{"GET", server.url(), {}, {}}, c).code(), Code::kAborted);
}

TEST(CurlTransport, StaleKeptAliveConnectionIsReplaced) {
  // The server closes after each response without saying so; the next
  // request finds the kept connection dead and must still go through with
  // its whole body.
  LoopbackServer server([](const ReceivedRequest& r) {
    return Action{Response(200, std::to_string(r.body.size())), /*close=*/true};
  });
  auto t = NewCurlTransport();
  const std::string body(200000, 'b');
  for (int i = 0; i < 3; ++i) {
    Collector c;
    ASSERT_TRUE(t->Send(HttpRequest{"PUT", server.url(), {}, body}, c).ok()) << i;
    EXPECT_EQ(c.body, "200000");
  }
}

TEST(CurlTransport, ParallelSends) {
  LoopbackServer server([](const ReceivedRequest& r) { return Action{Response(200, r.body)}; });
  auto t = NewCurlTransport();
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      for (int j = 0; j < 10; ++j) {
        Collector c;
        const std::string body = std::to_string(i * 100 + j);
        if (t->Send(HttpRequest{"PUT", server.url(), {}, body}, c).ok() && c.body == body) ++ok;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), 80);
  EXPECT_LE(server.connections(), 8);
}

TEST(CurlTransport, MalformedUrlIsInvalidArgument) {
  auto t = NewCurlTransport();
  Collector c;
  EXPECT_EQ(t->Send(HttpRequest{"GET", "nope://x", {}, {}}, c).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace dcr
