// The S3 driver's client (include/dcr/s3.h): requests signed with our SigV4
// signer, sent through an injectable HttpTransport, retried by one policy, and
// interpreted per operation. One exchange and the retry policy are in
// s3_client.cc, the reads in s3_reads.cc, the writes in s3_writes.cc, and the
// Store and its writers over the client in s3_store.cc. Internal to src/store.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "dcr/http.h"
#include "dcr/s3.h"
#include "sigv4.h"

namespace dcr::s3_internal {

using SysClock = std::chrono::system_clock;

constexpr uint64_t kMaxSinglePut = uint64_t{5} << 30;  // S3's limit for PUT and for one part

// A decimal number of at most 19 digits.
bool ParseU64(std::string_view s, uint64_t* out);

// A fixed-capacity set of threads running queued tasks; threads start on
// demand. Tasks must not wait for other tasks.
class Executor {
 public:
  explicit Executor(size_t max_threads) : max_threads_(std::max<size_t>(1, max_threads)) {}
  ~Executor() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void Submit(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
    if (queue_.size() > idle_ && threads_.size() < max_threads_) {
      threads_.emplace_back([this] { Loop(); });
    } else {
      cv_.notify_one();
    }
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ++idle_;
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      --idle_;
      if (queue_.empty()) return;  // stopping
      auto task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }

  const size_t max_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  std::vector<std::thread> threads_;  // guarded by mu_
  size_t idle_ = 0;  // guarded by mu_
  bool stop_ = false;  // guarded by mu_
};

// ---------------------------------------------------------------------------
// One exchange: the request, and what came back.

struct Call {
  std::string_view method;
  std::string_view object;  // full object name; empty: the bucket itself
  sigv4::Pairs query;
  HttpHeaders headers;  // beyond host, date, content hash, token, authorization
  std::string_view body;
  std::string body_sha256;  // hex; computed from body when empty
};

// Where a 2xx body goes. Default: Reply::text.
struct Sink {
  // Copy the body bytes that fall in [window_offset, window_offset + window.size())
  // of the object into window (the body's first byte is at the Content-Range start).
  std::span<uint8_t> window;
  uint64_t window_offset = 0;
  bool use_window = false;
  std::string* append = nullptr;  // or append the whole body here
};
struct ContentRange {
  uint64_t first = 0, last = 0, total = 0;
};

struct Reply {
  int status = 0;
  HttpHeaders headers;
  std::string text;  // non-data bodies (XML)
  uint64_t body_bytes = 0;
  bool has_range = false;
  ContentRange range;
  std::string error;  // the handler's own complaint, if it abandoned the exchange

  bool ok() const { return status >= 200 && status < 300; }
  std::string Header(std::string_view name) const {
    const std::string* v = FindHeader(headers, name);
    return v ? *v : std::string();
  }
  // Body bytes the server announced; -1 when unknown.
  int64_t content_length() const {
    uint64_t n = 0;
    const std::string* v = FindHeader(headers, "content-length");
    return v != nullptr && ParseU64(*v, &n) ? static_cast<int64_t>(n) : -1;
  }
};

// What one try concluded: done (OK or a final error), or a transient failure.
struct Outcome {
  Status status;
  bool retry = false;
};
inline Outcome Done(Status s = Status::Ok()) { return {std::move(s), false}; }
inline Outcome Transient(Status s) { return {std::move(s), true}; }

// S3's <Error> body, or what the status line says when there is none (HEAD).
struct S3Error {
  std::string code;
  std::string message;
  std::string extra;  // e.g. the endpoint of a redirect
};
S3Error ParseError(const Reply& r);
bool RetryableCode(std::string_view code);
std::string Describe(const Reply& r, const S3Error& e);

// ---------------------------------------------------------------------------
// The client: shared by the store and its writers. Each function's comment
// is with its definition.

class S3Client {
 public:
  S3Client(S3Options options, S3Runtime runtime, std::shared_ptr<HttpTransport> transport);

  const S3Options& options() const { return o_; }
  const std::string& url() const { return o_.url; }
  Executor& executor() { return executor_; }
  std::string ObjectName(std::string_view key) const { return o_.prefix + std::string(key); }
  std::string Context(std::string_view key) const { return StoreContext(o_.url, key); }

  // ----- the retry policy (s3_client.cc)

  Status Retrying(const std::function<Outcome(int attempt)>& attempt);
  std::chrono::milliseconds Backoff(int n);
  void Sleep(std::chrono::milliseconds d);
  Outcome Classify(const Status& transport, const Reply& r);

  // ----- one signed exchange (s3_client.cc)

  SysClock::time_point Now() const { return rt_.now ? rt_.now() : SysClock::now(); }

  Status Send(const Call& c, Reply* reply, const Sink& sink = {});
  static Outcome CheckLength(const Reply& r);

  // ----- operations; errors carry the cause, callers add the context

  // Reads (s3_reads.cc).
  Result<ObjectInfo> HeadObject(const std::string& name, std::string_view if_match);
  Status MissingObject();
  Status GetRange(const std::string& name, uint64_t offset, std::span<uint8_t> out, std::string_view if_match,
                  std::string* etag);
  static Status Replaced(std::string_view etag);
  static Status PastEnd(uint64_t offset, uint64_t size, uint64_t total);
  Status ReadRange(const std::string& name, uint64_t offset, std::span<uint8_t> out, std::string_view if_match,
                   std::string* etag);
  Result<std::string> GetObject(const std::string& name, ObjectInfo* info);
  Result<std::vector<ObjectInfo>> ListObjects(const std::string& prefix);

  // Writes (s3_writes.cc).
  Status PutObject(const std::string& name, std::string_view body, bool if_absent);
  Status CheckConditionalCreate();
  Status PutObjectUnprobed(const std::string& name, std::string_view body, bool if_absent);
  Result<std::string> CreateMultipartUpload(const std::string& name);
  Result<std::string> UploadPart(const std::string& name, const std::string& upload_id, int part,
                                 std::string_view body);
  Status CompleteMultipartUpload(const std::string& name, const std::string& upload_id,
                                 const std::vector<std::string>& etags);
  void AbortMultipartUpload(const std::string& name, const std::string& upload_id);
  Status DeleteObject(const std::string& name);
  Status CreateBucket();

 private:
  S3Options o_;
  S3Runtime rt_;
  std::shared_ptr<HttpTransport> transport_;
  std::string scheme_;  // "https://"
  std::string host_;  // the Host header: [bucket.]host[:port]
  std::string bucket_path_;  // "/bucket" (path-style) or "" (virtual-hosted)
  std::atomic<bool> bucket_known_{false};
  Executor executor_;
  std::mutex rng_mu_;
  std::mt19937_64 rng_;  // guarded by rng_mu_
  std::mutex probe_mu_;  // guards the two below; held while probing
  bool probed_ = false;
  Status probe_result_;
};

}  // namespace dcr::s3_internal
