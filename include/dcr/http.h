// The HTTP layer under the S3 driver: one exchange at a time, no retries, no
// interpretation of status codes. It is an interface so tests can put a fake
// server or a fault injector (dropped connections, 5xx, stalls, truncated
// bodies) in place of libcurl.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/status.h"

namespace dcr {

struct HttpHeader {
  std::string name;
  std::string value;
};
using HttpHeaders = std::vector<HttpHeader>;

// The value of the first header named `name` (ASCII case-insensitive), or
// nullptr.
const std::string* FindHeader(const HttpHeaders& headers, std::string_view name);

struct HttpRequest {
  std::string method;  // "GET", "HEAD", "PUT", "POST", "DELETE"
  std::string url;  // absolute; path and query already percent-encoded, sent as is
  HttpHeaders headers;  // sent as given (a Host header here replaces the one derived from url)
  // The body, sent with a Content-Length (PUT and POST always carry one, even
  // when empty). The caller keeps it alive until Send returns. Bodies are in
  // memory because SigV4 signs their SHA-256 before the first byte goes out.
  std::string_view body;
};

// Receives one response as it arrives. Called on the thread inside Send.
class HttpResponseHandler {
 public:
  virtual ~HttpResponseHandler() = default;
  // The final status and headers (never a 1xx), once, before any body byte.
  // Return false to abandon the exchange.
  virtual bool OnHeaders(int status, HttpHeaders headers) = 0;
  // The body in order, in pieces. Return false to abandon the exchange.
  virtual bool OnBody(std::string_view bytes) = 0;
};

class HttpTransport {
 public:
  virtual ~HttpTransport() = default;

  // Performs one request/response exchange. OK means a whole response (of any
  // status code) arrived and its body was handed to `handler`. Otherwise:
  //   kUnavailable       connecting failed, or the connection broke, or the
  //                      body ended short of its Content-Length
  //   kDeadlineExceeded  a connect, stall or request timeout passed
  //   kAborted           the handler returned false
  //   kInvalidArgument   the request is malformed (bad URL)
  // The handler may have seen part of a response before any error. Never
  // retries. Thread-safe: many Sends may run at once.
  virtual Status Send(const HttpRequest& request, HttpResponseHandler& handler) = 0;
};

struct CurlTransportOptions {
  std::chrono::milliseconds connect_timeout{10'000};
  // A transfer that moves fewer than low_speed_bytes per second for
  // low_speed_time has stalled and fails with kDeadlineExceeded (libcurl
  // averages the speed over a few seconds, so detection can take that much
  // longer).
  long low_speed_bytes = 1;
  std::chrono::seconds low_speed_time{30};
  std::chrono::milliseconds request_timeout{0};  // whole exchange; 0: no limit
  // Idle handles (each holding its kept-alive connection) kept for reuse.
  size_t max_idle_connections = 64;
  // Peer and host verification against $SSL_CERT_FILE, else libcurl's CA
  // bundle, else the distribution's (http_curl.cc).
  bool verify_tls = true;
};

// The libcurl transport: keep-alive connections reused across requests (a
// pool of easy handles sharing DNS and TLS session caches), TLS through
// libcurl's defaults, no redirects followed, no Expect: 100-continue.
std::shared_ptr<HttpTransport> NewCurlTransport(const CurlTransportOptions& options = {});

}  // namespace dcr
