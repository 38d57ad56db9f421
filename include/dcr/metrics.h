// Process-wide metrics in the Prometheus text format (version 0.0.4), and the
// HTTP endpoint that serves them (docs/metrics.md lists every metric).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "dcr/status.h"

namespace dcr {

enum class MetricType { kCounter, kGauge, kHistogram };

// One metric family: a name, its help line, its type and its label names.
// Families are declared at namespace scope by the code that records them
// (static storage, registered at construction for the process's lifetime);
// a series appears once its label values are first recorded (an unlabelled
// family shows 0 from the start). Thread-safe. Label values are given in the
// order of the names; a call with another count of values is ignored.
class MetricFamily {
 public:
  MetricFamily(std::string name, std::string help, MetricType type, std::vector<std::string> label_names,
               std::vector<double> buckets = {});
  ~MetricFamily();  // leaves the registry: a scrape during exit never reads it
  MetricFamily(const MetricFamily&) = delete;
  MetricFamily& operator=(const MetricFamily&) = delete;

  const std::string& name() const { return name_; }
  // This family's lines of the exposition (HELP, TYPE, samples).
  std::string Text() const;

 protected:
  struct Series {
    double value = 0;  // counter, gauge; a histogram's sum
    uint64_t count = 0;  // histogram
    std::vector<uint64_t> buckets;  // histogram: observations <= each bound
  };
  using LabelValues = std::initializer_list<std::string_view>;
  // Runs `update` on the series of `values` under the family's lock.
  template <typename F>
  void Update(LabelValues values, F update);
  double BoundAt(size_t b) const { return bounds_[b]; }

 private:
  Series* Find(LabelValues values);  // lock held; null when the count is wrong

  const std::string name_, help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
  const std::vector<double> bounds_;  // histogram bucket upper bounds, ascending
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, Series> series_;
};

class Counter : public MetricFamily {
 public:
  Counter(std::string name, std::string help, std::vector<std::string> label_names = {})
      : MetricFamily(std::move(name), std::move(help), MetricType::kCounter, std::move(label_names)) {}
  void Add(double by, LabelValues values = {});  // a negative `by` is ignored
  // For a count kept elsewhere: the series takes `total` when it is larger.
  void Mirror(double total, LabelValues values = {});
};

class Gauge : public MetricFamily {
 public:
  Gauge(std::string name, std::string help, std::vector<std::string> label_names = {})
      : MetricFamily(std::move(name), std::move(help), MetricType::kGauge, std::move(label_names)) {}
  void Set(double value, LabelValues values = {});
};

// Seconds by default: buckets from 1 ms to 5 min.
class Histogram : public MetricFamily {
 public:
  Histogram(std::string name, std::string help, std::vector<std::string> label_names = {},
            std::vector<double> buckets = SecondsBuckets())
      : MetricFamily(std::move(name), std::move(help), MetricType::kHistogram, std::move(label_names),
                     std::move(buckets)) {}
  void Observe(double value, LabelValues values = {});
  static std::vector<double> SecondsBuckets();
};

// Every registered family's text, ordered by name: what GET /metrics returns.
std::string MetricsText();

// ---- The endpoint -----------------------------------------------------------

// An HTTP/1.x request line and the end of its head, as a client sent them.
struct HttpRequestHead {
  std::string method, target;
};

// Parses a request head: "METHOD SP TARGET SP HTTP/1.x CRLF", header lines
// (each "name: value"), and the blank line that ends the head. Errors
// (kInvalidArgument) say what is malformed. Network input: fuzzed
// (tests/fuzz/http_request_fuzz.cc).
Result<HttpRequestHead> ParseHttpRequestHead(std::string_view head);

// "HOST:PORT" ("[::1]:9400" for IPv6): the host as given, and the port
// (0: any free one). kInvalidArgument when malformed.
Result<std::pair<std::string, uint16_t>> ParseHostPort(std::string_view address);

// Serves MetricsText() at GET /metrics (HEAD too; 404 for other paths, 405
// for other methods, 400 for a malformed request) on one thread, one
// connection at a time, until destroyed. A client has 2 s to send its
// request head (at most 8 KiB).
class MetricsServer {
 public:
  // Binds `address` (ParseHostPort). Errors: kInvalidArgument (malformed),
  // kUnavailable (cannot resolve or bind, naming the address).
  static Result<std::unique_ptr<MetricsServer>> Start(std::string_view address);
  ~MetricsServer();
  uint16_t port() const { return port_; }
  // "http://HOST:PORT/metrics" with the bound port.
  std::string url() const;

 private:
  MetricsServer() = default;
  void Loop();
  void Serve(int fd);

  std::string host_;
  uint16_t port_ = 0;
  int listen_fd_ = -1, wake_[2] = {-1, -1};
  std::thread thread_;
};

}  // namespace dcr
