#include "dcr/metrics.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

namespace dcr {
namespace {

Counter test_counter("dcr_test_events_total", "Events of the test.", {"kind"});
Gauge test_gauge("dcr_test_level", "A level.");
Histogram test_histogram("dcr_test_seconds", "Seconds of the test.", {"stage"}, {0.5, 1});

bool Contains(const std::string& text, const std::string& line) { return text.find(line + "\n") != std::string::npos; }

TEST(MetricsTest, FamiliesAreExposedInTheTextFormat) {
  test_counter.Add(2, {"a"});
  test_counter.Add(1.5, {"a"});
  test_counter.Add(-1, {"a"});  // a counter never goes down
  test_counter.Add(1, {"quote\"back\\slash\nnewline"});
  test_counter.Add(1, {});  // wrong label count: ignored
  test_gauge.Set(7);
  test_histogram.Observe(0.25, {"encode"});
  test_histogram.Observe(0.75, {"encode"});
  test_histogram.Observe(3, {"encode"});
  const std::string text = MetricsText();
  EXPECT_TRUE(Contains(text, "# HELP dcr_test_events_total Events of the test.")) << text;
  EXPECT_TRUE(Contains(text, "# TYPE dcr_test_events_total counter")) << text;
  EXPECT_TRUE(Contains(text, "dcr_test_events_total{kind=\"a\"} 3.5")) << text;
  EXPECT_TRUE(Contains(text, "dcr_test_events_total{kind=\"quote\\\"back\\\\slash\\nnewline\"} 1")) << text;
  EXPECT_TRUE(Contains(text, "# TYPE dcr_test_level gauge")) << text;
  EXPECT_TRUE(Contains(text, "dcr_test_level 7")) << text;
  EXPECT_TRUE(Contains(text, "# TYPE dcr_test_seconds histogram")) << text;
  EXPECT_TRUE(Contains(text, "dcr_test_seconds_bucket{stage=\"encode\",le=\"0.5\"} 1")) << text;
  EXPECT_TRUE(Contains(text, "dcr_test_seconds_bucket{stage=\"encode\",le=\"1\"} 2")) << text;
  EXPECT_TRUE(Contains(text, "dcr_test_seconds_bucket{stage=\"encode\",le=\"+Inf\"} 3")) << text;
  EXPECT_TRUE(Contains(text, "dcr_test_seconds_sum{stage=\"encode\"} 4")) << text;
  EXPECT_TRUE(Contains(text, "dcr_test_seconds_count{stage=\"encode\"} 3")) << text;
  // Families in name order.
  EXPECT_LT(text.find("dcr_test_events_total"), text.find("dcr_test_level"));
}

TEST(MetricsTest, RequestHeadsAreParsedAndMalformedOnesRefused) {
  auto ok = ParseHttpRequestHead("GET /metrics?x=1 HTTP/1.1\r\nHost: a:1\r\nAccept: */*\r\n\r\n");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->method, "GET");
  EXPECT_EQ(ok->target, "/metrics?x=1");
  EXPECT_TRUE(ParseHttpRequestHead("HEAD / HTTP/1.0\r\n\r\n").ok());
  for (const char* bad :
       {"GET /metrics HTTP/1.1\r\n", "GET /metrics\r\n\r\n", " /metrics HTTP/1.1\r\n\r\n",
        "GET metrics HTTP/1.1\r\n\r\n", "GET /a b HTTP/1.1\r\n\r\n", "GET /m HTTP/2\r\n\r\n", "G(T /m HTTP/1.1\r\n\r\n",
        "GET /m HTTP/1.1\r\nno colon\r\n\r\n", "GET /m HTTP/1.1\r\n: empty\r\n\r\n",
        "GET /m HTTP/1.1\r\nA b: c\r\n\r\n", "GET /m HTTP/1.1\r\nA: \x01\r\n\r\n", "GET /\x7f HTTP/1.1\r\n\r\n", ""})
    EXPECT_EQ(ParseHttpRequestHead(bad).status().code(), Code::kInvalidArgument) << bad;
}

TEST(MetricsTest, AddressesAreHostAndPort) {
  EXPECT_EQ(*ParseHostPort("127.0.0.1:9400"), std::make_pair(std::string("127.0.0.1"), uint16_t{9400}));
  EXPECT_EQ(*ParseHostPort("[::1]:0"), std::make_pair(std::string("::1"), uint16_t{0}));
  for (const char* bad : {"", "9400", ":9400", "host:", "host:65536", "host:-1", "host:9x", "::1:9400"})
    EXPECT_EQ(ParseHostPort(bad).status().code(), Code::kInvalidArgument) << bad;
}

// One request over a real socket; the whole response.
std::string Exchange(uint16_t port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

TEST(MetricsTest, TheServerAnswersScrapesAndRefusesOtherRequests) {
  auto server = MetricsServer::Start("127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const uint16_t port = (*server)->port();
  ASSERT_NE(port, 0);
  EXPECT_EQ((*server)->url(), "http://127.0.0.1:" + std::to_string(port) + "/metrics");
  test_gauge.Set(42);
  const std::string scrape = Exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_TRUE(scrape.starts_with("HTTP/1.1 200 OK\r\n")) << scrape;
  EXPECT_NE(scrape.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << scrape;
  EXPECT_NE(scrape.find("\r\n\r\n# HELP "), std::string::npos) << scrape;
  EXPECT_TRUE(Contains(scrape, "dcr_test_level 42")) << scrape;
  const std::string head = Exchange(port, "HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_TRUE(head.starts_with("HTTP/1.1 200 OK\r\n")) << head;
  EXPECT_TRUE(head.ends_with("\r\n\r\n")) << head;  // no body
  EXPECT_TRUE(Exchange(port, "GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
  EXPECT_TRUE(Exchange(port, "POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));
  EXPECT_TRUE(Exchange(port, "GET /metrics SPDY\r\n\r\n").starts_with("HTTP/1.1 400 "));
  EXPECT_EQ(Exchange(port, std::string(9000, 'a')).substr(0, 13), "HTTP/1.1 400 ");  // no blank line in 8 KiB
  // A second server cannot take the same port.
  EXPECT_EQ(MetricsServer::Start("127.0.0.1:" + std::to_string(port)).status().code(), Code::kUnavailable);
}

}  // namespace
}  // namespace dcr
