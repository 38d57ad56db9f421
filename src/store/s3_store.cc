// The S3 driver (include/dcr/s3.h): requests signed with our SigV4 signer,
// sent through an injectable HttpTransport, retried by one policy, and
// interpreted per operation.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include "dcr/s3.h"
#include "s3_xml.h"
#include "sigv4.h"

namespace dcr {
namespace {

using SysClock = std::chrono::system_clock;

constexpr uint64_t kMaxSinglePut = uint64_t{5} << 30;  // S3's limit for PUT and for one part
constexpr int kMaxParts = 10000;
constexpr size_t kMaxTextBody = size_t{16} << 20;  // XML bodies (listings, errors)
constexpr int kConsistentReadTries = 3;  // re-reads when an object changes under a split read

// ---------------------------------------------------------------------------
// Small helpers.

std::string_view Unquote(std::string_view etag) {
  if (etag.size() >= 2 && etag.front() == '"' && etag.back() == '"') return etag.substr(1, etag.size() - 2);
  return etag;
}

bool SameEtag(std::string_view a, std::string_view b) { return !a.empty() && Unquote(a) == Unquote(b); }

bool ParseU64(std::string_view s, uint64_t* out) {
  if (s.empty() || s.size() > 19) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  *out = v;
  return true;
}

struct ContentRange {
  uint64_t first = 0, last = 0, total = 0;
};

// "bytes 0-9/100"
bool ParseContentRange(std::string_view v, ContentRange* out) {
  if (!v.starts_with("bytes ")) return false;
  v.remove_prefix(6);
  const size_t dash = v.find('-'), slash = v.find('/');
  if (dash == std::string_view::npos || slash == std::string_view::npos || dash > slash) return false;
  return ParseU64(v.substr(0, dash), &out->first) && ParseU64(v.substr(dash + 1, slash - dash - 1), &out->last) &&
         ParseU64(v.substr(slash + 1), &out->total) && out->first <= out->last && out->last < out->total;
}

// The ETag S3 gives a multipart object: MD5 of the parts' binary MD5s, "-N".
// nullopt when a part's ETag is not an MD5 (e.g. SSE-KMS).
std::optional<std::string> MultipartEtag(const std::vector<std::string>& part_etags) {
  std::string concat;
  for (const auto& e : part_etags) {
    const std::string_view hex = Unquote(e);
    std::string md5;
    if (hex.size() != 32 || !sigv4::HexDecode(hex, &md5)) return std::nullopt;
    concat += md5;
  }
  const auto md5 = sigv4::Md5(concat);
  return fmt::format("\"{}-{}\"", sigv4::HexEncode(md5.data(), md5.size()), part_etags.size());
}

// Part n (1-based) of a streamed upload: part_size, doubled every 1000 parts.
uint64_t PartSizeFor(uint64_t part_size, int part) {
  const int doublings = std::min((part - 1) / 1000, 20);
  return std::min(part_size << doublings, kMaxSinglePut);
}

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

// Counts down to zero; Wait blocks until then.
class Latch {
 public:
  explicit Latch(size_t n) : n_(n) {}
  void Done() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--n_ == 0) cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return n_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t n_;
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

class ReplyHandler final : public HttpResponseHandler {
 public:
  ReplyHandler(Reply* reply, const Sink& sink) : reply_(reply), sink_(sink) {}

  bool OnHeaders(int status, HttpHeaders headers) override {
    reply_->status = status;
    reply_->headers = std::move(headers);
    if (const std::string* cr = FindHeader(reply_->headers, "content-range"); cr != nullptr && status == 206) {
      if (!ParseContentRange(*cr, &reply_->range)) return Fail("unparsable Content-Range '" + *cr + "'");
      reply_->has_range = true;
    }
    data_ = reply_->ok() && (sink_.use_window || sink_.append != nullptr);
    stream_pos_ = reply_->has_range ? reply_->range.first : 0;
    if (data_ && sink_.append != nullptr) {
      const int64_t len = reply_->content_length();
      if (len > 0 && static_cast<uint64_t>(len) <= kMaxSinglePut) sink_.append->reserve(sink_.append->size() + len);
    }
    return true;
  }

  bool OnBody(std::string_view bytes) override {
    reply_->body_bytes += bytes.size();
    if (!data_) {
      if (reply_->text.size() + bytes.size() > kMaxTextBody) return Fail("response body too large");
      reply_->text.append(bytes);
      return true;
    }
    if (sink_.append != nullptr) {
      sink_.append->append(bytes);
      return true;
    }
    // Copy the overlap of [stream_pos_, +bytes) with the window.
    const uint64_t begin = std::max(stream_pos_, sink_.window_offset);
    const uint64_t end = std::min(stream_pos_ + bytes.size(), sink_.window_offset + sink_.window.size());
    if (begin < end)
      std::memcpy(sink_.window.data() + (begin - sink_.window_offset), bytes.data() + (begin - stream_pos_),
                  end - begin);
    stream_pos_ += bytes.size();
    return true;
  }

 private:
  bool Fail(std::string why) {
    reply_->error = std::move(why);
    return false;
  }

  Reply* reply_;
  Sink sink_;
  bool data_ = false;
  uint64_t stream_pos_ = 0;
};

// What one try concluded: done (OK or a final error), or a transient failure.
struct Outcome {
  Status status;
  bool retry = false;
};
Outcome Done(Status s = Status::Ok()) { return {std::move(s), false}; }
Outcome Transient(Status s) { return {std::move(s), true}; }

// S3's <Error> body, or what the status line says when there is none (HEAD).
struct S3Error {
  std::string code;
  std::string message;
  std::string extra;  // e.g. the endpoint of a redirect
};

S3Error ParseError(const Reply& r) {
  S3Error e;
  if (!r.text.empty()) {
    auto doc = s3xml::Parse(r.text);
    if (doc.ok() && doc->name == "Error") {
      e.code = doc->ChildText("Code");
      e.message = doc->ChildText("Message");
      if (!doc->ChildText("Endpoint").empty()) e.extra = "endpoint " + doc->ChildText("Endpoint");
    }
  }
  if (e.code.empty()) {
    switch (r.status) {
      case 301: e.code = "PermanentRedirect"; break;
      case 304: e.code = "NotModified"; break;
      case 400: e.code = "BadRequest"; break;
      case 403: e.code = "Forbidden"; break;
      case 404: e.code = "NotFound"; break;
      case 412: e.code = "PreconditionFailed"; break;
      case 416: e.code = "InvalidRange"; break;
      case 503: e.code = "ServiceUnavailable"; break;
      default: e.code = "HTTP" + std::to_string(r.status);
    }
  }
  if (e.extra.empty()) {
    if (std::string region = r.Header("x-amz-bucket-region"); !region.empty()) e.extra = "bucket region " + region;
  }
  return e;
}

// S3 error codes that mean "try again" whatever the status line says.
bool RetryableCode(std::string_view code) {
  // Throttling, server trouble, a socket timeout on the server's side, a
  // conflicting concurrent conditional write (AWS: retry it), and bodies
  // damaged in transit (the server checked our SHA-256 / MD5).
  for (std::string_view c :
       {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "ConditionalRequestConflict",
        "OperationAborted", "XAmzContentSHA256Mismatch", "BadDigest", "IncompleteBody"})
    if (code == c) return true;
  return false;
}

std::string Describe(const Reply& r, const S3Error& e) {
  std::string s = fmt::format("HTTP {} {}", r.status, e.code);
  if (!e.message.empty()) s += ": " + e.message;
  if (!e.extra.empty()) s += " (" + e.extra + ")";
  return s;
}

// ---------------------------------------------------------------------------
// The client: shared by the store and its writers.

class S3Client {
 public:
  S3Client(S3Options options, S3Runtime runtime, std::shared_ptr<HttpTransport> transport)
      : o_(std::move(options)),
        rt_(std::move(runtime)),
        transport_(std::move(transport)),
        executor_(o_.threads),
        rng_(std::random_device{}()) {
    if (o_.url.empty()) o_.url = "s3://" + o_.bucket + (o_.prefix.empty() ? "" : "/" + o_.prefix);
    std::string endpoint = o_.endpoint.empty() ? "https://s3." + o_.region + ".amazonaws.com" : o_.endpoint;
    const size_t colon = endpoint.find("://");
    scheme_ = endpoint.substr(0, colon + 3);
    std::string host = endpoint.substr(colon + 3);
    bool virtual_hosted = o_.addressing == S3Addressing::kVirtual;
    if (o_.addressing == S3Addressing::kAuto) {
      const size_t port = host.rfind(':');
      const std::string hostname = port == std::string::npos || host.back() == ']' ? host : host.substr(0, port);
      const bool aws = hostname.ends_with(".amazonaws.com");
      bool dns_safe = o_.bucket.size() >= 3 && o_.bucket.size() <= 63;
      for (char c : o_.bucket) dns_safe = dns_safe && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-');
      virtual_hosted = aws && dns_safe;
    }
    if (virtual_hosted) {
      host_ = o_.bucket + "." + host;
      bucket_path_ = "";
    } else {
      host_ = host;
      bucket_path_ = "/" + sigv4::UriEncode(o_.bucket, true);
    }
  }

  const S3Options& options() const { return o_; }
  const std::string& url() const { return o_.url; }
  Executor& executor() { return executor_; }
  std::string ObjectName(std::string_view key) const { return o_.prefix + std::string(key); }
  std::string Context(std::string_view key) const { return StoreContext(o_.url, key); }

  // ----- the retry policy

  // Runs `attempt` until it is done or transient failures use up
  // max_attempts; then the last failure, with the count.
  Status Retrying(const std::function<Outcome(int attempt)>& attempt) {
    Status last;
    for (int n = 1;; ++n) {
      Outcome out = attempt(n);
      if (!out.retry) return out.status;
      last = std::move(out.status);
      if (n >= o_.max_attempts) break;
      Sleep(Backoff(n));
    }
    return Status(last.code(), fmt::format("{} (gave up after {} attempts)", last.message(), o_.max_attempts));
  }

  std::chrono::milliseconds Backoff(int n) {
    const int64_t base = o_.initial_backoff.count();
    const int64_t cap =
        std::min<int64_t>(o_.max_backoff.count(), n > 30 ? o_.max_backoff.count() : base << std::min(n - 1, 30));
    std::lock_guard<std::mutex> lock(rng_mu_);
    return std::chrono::milliseconds(cap <= 0 ? 0 : std::uniform_int_distribution<int64_t>(0, cap)(rng_));
  }

  void Sleep(std::chrono::milliseconds d) {
    if (rt_.sleep) rt_.sleep(d);
    else std::this_thread::sleep_for(d);
  }

  // A transport failure or a non-2xx reply, judged by the rules that hold
  // for every operation (operations look at their own special cases first).
  Outcome Classify(const Status& transport, const Reply& r) {
    if (!transport.ok()) {
      if (!r.error.empty()) return Done(DataLoss(r.error));
      if (transport.code() == Code::kUnavailable || transport.code() == Code::kDeadlineExceeded)
        return Transient(transport);
      return Done(transport);
    }
    const S3Error e = ParseError(r);
    const std::string what = Describe(r, e);
    const int s = r.status;
    if (s == 500 || s == 502 || s == 503 || s == 504 || s == 429 || s == 408 || RetryableCode(e.code))
      return Transient(Unavailable(what));
    if (e.code == "RequestTimeTooSkewed")
      return Done(
          FailedPrecondition(fmt::format("clock skew: the local clock ({} UTC) is too far from the "
                                         "server's: {}",
                                         sigv4::AmzDate(Now()), what)));
    if (s == 404 && e.code == "NoSuchBucket")
      return Done(NotFound(fmt::format("no such bucket '{}': {}", o_.bucket, what)));
    if (s == 401 || s == 403 || e.code == "ExpiredToken" || e.code == "InvalidToken")
      return Done(PermissionDenied(fmt::format("{} (credentials: {})", what, o_.credentials_source)));
    if (s >= 300 && s < 400)
      return Done(FailedPrecondition(what + "; check the region and endpoint (region " + o_.region + ")"));
    switch (s) {
      case 404: return Done(NotFound(what));
      case 405:
      case 501: return Done(Unimplemented(what));
      case 409: return Done(e.code == "BucketAlreadyExists" ? AlreadyExists(what) : Aborted(what));
      case 412: return Done(FailedPrecondition(what));
      case 416: return Done(OutOfRange(what));
      default: break;
    }
    if (s >= 400 && s < 500) return Done(InvalidArgument(what));
    return Done(Unavailable(what));
  }

  // ----- one signed exchange

  SysClock::time_point Now() const { return rt_.now ? rt_.now() : SysClock::now(); }

  Status Send(const Call& c, Reply* reply, const Sink& sink = {}) {
    *reply = Reply();
    std::string path = bucket_path_;
    if (!c.object.empty()) path += "/" + sigv4::UriEncode(c.object, false);
    if (path.empty()) path = "/";
    const std::string query = sigv4::CanonicalQueryString(c.query);
    const std::string payload_hash = c.body_sha256.empty() ? sigv4::Sha256Hex(c.body) : c.body_sha256;
    const std::string date = sigv4::AmzDate(Now());

    sigv4::Pairs signed_headers = {{"host", host_}, {"x-amz-content-sha256", payload_hash}, {"x-amz-date", date}};
    if (!o_.session_token.empty()) signed_headers.emplace_back("x-amz-security-token", o_.session_token);
    for (const auto& h : c.headers) signed_headers.emplace_back(h.name, h.value);

    HttpRequest req;
    req.method = std::string(c.method);
    req.url = scheme_ + host_ + path + (query.empty() ? "" : "?" + query);
    req.body = c.body;
    req.headers.reserve(signed_headers.size() + 1);
    for (const auto& [k, v] : signed_headers) req.headers.push_back({k, v});
    if (!o_.access_key_id.empty()) {
      sigv4::Request sr{c.method, path, query, &signed_headers, payload_hash};
      req.headers.push_back(
          {"Authorization", sigv4::Authorization(sr, o_.access_key_id, o_.secret_access_key, o_.region, date)});
    }
    ReplyHandler handler(reply, sink);
    return transport_->Send(req, handler);
  }

  // Checks that a 2xx reply's body is as long as its Content-Length said.
  static Outcome CheckLength(const Reply& r) {
    const int64_t len = r.content_length();
    if (len >= 0 && static_cast<uint64_t>(len) != r.body_bytes)
      return Transient(Unavailable(fmt::format("truncated response: {} of {} bytes", r.body_bytes, len)));
    return Done();
  }

  // ----- operations; errors carry the cause, callers add the context

  Result<ObjectInfo> HeadObject(const std::string& name, std::string_view if_match) {
    ObjectInfo info;
    Status s = Retrying([&](int) -> Outcome {
      Call c{"HEAD", name};
      if (!if_match.empty()) c.headers.push_back({"If-Match", std::string(if_match)});
      Reply r;
      Status t = Send(c, &r);
      if (t.ok() && r.ok()) {
        const int64_t len = r.content_length();
        info.etag = r.Header("etag");
        if (len < 0 || info.etag.empty()) return Done(DataLoss("HEAD reply without Content-Length or ETag"));
        info.size = static_cast<uint64_t>(len);
        return Done();
      }
      if (t.ok() && r.status == 404) return Done(MissingObject());
      if (t.ok() && r.status == 412) return Done(Replaced(if_match));
      return Classify(t, r);
    });
    if (!s.ok()) return s;
    return info;
  }

  // kNotFound for a key that is missing; the first time, it checks that the
  // bucket exists so a missing bucket is named as such (HEAD has no body).
  Status MissingObject() {
    if (!bucket_known_.load()) {
      Reply r;
      Status t = Send(Call{"HEAD", ""}, &r);
      if (t.ok() && r.status == 404) return NotFound(fmt::format("no such bucket '{}'", o_.bucket));
      if (t.ok() && r.status < 500) bucket_known_ = true;
    }
    return NotFound("no such key");
  }

  // PUT of a whole object; `if_absent` adds If-None-Match: *, once the
  // server has shown that it honours it (CheckConditionalCreate).
  Status PutObject(const std::string& name, std::string_view body, bool if_absent) {
    if (if_absent) DCR_RETURN_IF_ERROR(CheckConditionalCreate());
    return PutObjectUnprobed(name, body, if_absent);
  }

  // A server that ignores If-None-Match: * on PUT would let a second commit
  // replace the first, and no single write can tell. So before this store's
  // first create-if-absent write, a probe object under the reserved key
  // .dcr-probe/<random> is created twice: the second must be refused. The
  // outcome is kept for the store's life (an error of the probe's own
  // requests is not: it is returned, and the next write probes again).
  // The probe is then deleted; one left behind by a failed delete is
  // invisible to List (reserved name) and harmless.
  Status CheckConditionalCreate() {
    std::lock_guard<std::mutex> lock(probe_mu_);
    if (probed_) return probe_result_;
    uint64_t r;
    {
      std::lock_guard<std::mutex> rng_lock(rng_mu_);
      r = rng_();
    }
    const std::string name = ObjectName(fmt::format(".dcr-probe/{:016x}", r));
    const std::string what = fmt::format("probing whether the server honours If-None-Match: * (object {})", name);
    Status first = PutObjectUnprobed(name, "dcr create-if-absent probe 1\n", true);
    if (!first.ok()) return first.WithContext(what);
    Status second = PutObjectUnprobed(name, "dcr create-if-absent probe 2\n", true);
    DeleteObject(name).IgnoreError();
    if (second.code() == Code::kAlreadyExists) {
      probed_ = true;
      return probe_result_ = Status::Ok();
    }
    if (!second.ok()) return second.WithContext(what);
    probed_ = true;
    return probe_result_ = FailedPrecondition(
               "the server ignores If-None-Match: * on PUT (a second create-if-absent write of a probe object "
               "replaced the first), so create-if-absent writes are not atomic there and a second commit could "
               "overwrite the first; dcr refuses them. Use a server that honours it (AWS S3, Ceph radosgw, MinIO)");
  }

  Status PutObjectUnprobed(const std::string& name, std::string_view body, bool if_absent) {
    if (body.size() > kMaxSinglePut)
      return InvalidArgument(fmt::format("{} bytes is over S3's limit of {} for one PUT", body.size(), kMaxSinglePut));
    Call c{"PUT", name};
    c.body = body;
    c.body_sha256 = sigv4::Sha256Hex(body);
    std::string md5_hex;
    if (if_absent) {
      const auto md5 = sigv4::Md5(body);
      md5_hex = sigv4::HexEncode(md5.data(), md5.size());
      c.headers.push_back({"Content-MD5", sigv4::Base64Encode(md5.data(), md5.size())});
      c.headers.push_back({"If-None-Match", "*"});
    }
    return Retrying([&](int) -> Outcome {
      Reply r;
      Status t = Send(c, &r);
      if (t.ok() && r.ok()) return Done();
      if (t.ok() && r.status == 412 && if_absent) {
        // Present: someone else's object, or ours from a try whose response
        // was lost (curl may also have resent on a stale connection). Ours
        // has our MD5 as its ETag.
        auto head = HeadObject(name, "");
        if (head.ok()) {
          if (SameEtag(head->etag, md5_hex)) return Done();
          return Done(AlreadyExists("already exists"));
        }
        if (head.status().code() == Code::kNotFound)  // deleted since: try again
          return Transient(Unavailable("412 Precondition Failed, then the object was gone"));
        return Done(head.status());
      }
      return Classify(t, r);
    });
  }

  Result<std::string> CreateMultipartUpload(const std::string& name) {
    std::string upload_id;
    Status s = Retrying([&](int) -> Outcome {
      // A lost reply leaves an empty upload behind: invisible, and removed by
      // a bucket's AbortIncompleteMultipartUpload lifecycle rule.
      Call c{"POST", name, {{"uploads", ""}}};
      Reply r;
      Status t = Send(c, &r);
      if (!t.ok() || !r.ok()) return Classify(t, r);
      auto doc = s3xml::Parse(r.text);
      if (!doc.ok()) return Transient(Unavailable("CreateMultipartUpload: " + doc.status().message()));
      upload_id = doc->ChildText("UploadId");
      if (upload_id.empty()) return Done(DataLoss("CreateMultipartUpload reply without an UploadId"));
      return Done();
    });
    if (!s.ok()) return s.WithContext("CreateMultipartUpload");
    return upload_id;
  }

  // Returns the part's ETag.
  Result<std::string> UploadPart(const std::string& name, const std::string& upload_id, int part,
                                 std::string_view body) {
    Call c{"PUT", name, {{"partNumber", std::to_string(part)}, {"uploadId", upload_id}}};
    c.body = body;
    c.body_sha256 = sigv4::Sha256Hex(body);
    std::string etag;
    Status s = Retrying([&](int) -> Outcome {
      Reply r;
      Status t = Send(c, &r);
      if (t.ok() && r.ok()) {
        etag = r.Header("etag");
        if (etag.empty()) return Done(DataLoss("UploadPart reply without an ETag"));
        return Done();
      }
      if (t.ok() && r.status == 404 && ParseError(r).code == "NoSuchUpload")
        return Done(Aborted("the multipart upload was aborted: " + Describe(r, ParseError(r))));
      return Classify(t, r);
    });
    if (!s.ok()) return s.WithContext(fmt::format("UploadPart {}", part));
    return etag;
  }

  Status CompleteMultipartUpload(const std::string& name, const std::string& upload_id,
                                 const std::vector<std::string>& etags) {
    std::string body = "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">";
    for (size_t i = 0; i < etags.size(); ++i)
      body += fmt::format("<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>", i + 1, s3xml::Escape(etags[i]));
    body += "</CompleteMultipartUpload>";
    Call c{"POST", name, {{"uploadId", upload_id}}};
    c.body = body;
    const std::optional<std::string> expected = MultipartEtag(etags);
    auto is_ours = [&](const ObjectInfo& o) { return expected && SameEtag(o.etag, *expected); };
    Status s = Retrying([&](int) -> Outcome {
      Reply r;
      Status t = Send(c, &r);
      if (t.ok() && r.ok()) {
        // 200 can still carry an <Error> (the server failed while it kept
        // the connection alive with whitespace).
        auto doc = s3xml::Parse(r.text);
        if (!doc.ok()) return Transient(Unavailable("CompleteMultipartUpload: " + doc.status().message()));
        if (doc->name == "Error") {
          const std::string code = doc->ChildText("Code");
          Status e = Unavailable(fmt::format("HTTP 200 with error {}: {}", code, doc->ChildText("Message")));
          if (RetryableCode(code)) return Transient(std::move(e));
          return Done(std::move(e));
        }
        return Done();
      }
      if (t.ok() && r.status == 404 && ParseError(r).code == "NoSuchUpload") {
        // Gone: completed by an earlier try whose reply was lost, or aborted.
        auto head = HeadObject(name, "");
        if (head.ok() && is_ours(*head)) return Done();
        if (!head.ok() && head.status().code() != Code::kNotFound) return Done(head.status());
        return Done(
            Aborted(fmt::format("the multipart upload is gone and the object is not its result "
                                "(expected etag {}, found {})",
                                expected.value_or("unknown"), head.ok() ? head->etag : "no object")));
      }
      return Classify(t, r);
    });
    if (s.code() == Code::kUnavailable || s.code() == Code::kDeadlineExceeded) {
      // Retries ran out, but one of them may have landed: if so, say so
      // rather than report a failure for a published object.
      auto head = HeadObject(name, "");
      if (head.ok() && is_ours(*head)) return Status::Ok();
    }
    return s.WithContext("CompleteMultipartUpload");
  }

  // Best effort: the upload's parts are invisible either way.
  void AbortMultipartUpload(const std::string& name, const std::string& upload_id) {
    Retrying([&](int n) -> Outcome {
      Reply r;
      Status t = Send(Call{"DELETE", name, {{"uploadId", upload_id}}}, &r);
      if (t.ok() && (r.ok() || r.status == 404)) return Done();
      Outcome out = Classify(t, r);
      if (n >= 3) out.retry = false;
      return out;
    }).IgnoreError();
  }

  // One GET of bytes [offset, offset + out.size()) into `out`, retried.
  // Reports the object's ETag.
  Status GetRange(const std::string& name, uint64_t offset, std::span<uint8_t> out, std::string_view if_match,
                  std::string* etag) {
    const uint64_t end = offset + out.size();
    return Retrying([&](int) -> Outcome {
      Call c{"GET", name};
      c.headers.push_back({"Range", fmt::format("bytes={}-{}", offset, end - 1)});
      if (!if_match.empty()) c.headers.push_back({"If-Match", std::string(if_match)});
      Reply r;
      Sink sink;
      sink.window = out;
      sink.window_offset = offset;
      sink.use_window = true;
      Status t = Send(c, &r, sink);
      if (t.ok() && r.ok()) {
        Outcome len = CheckLength(r);
        if (len.retry || !len.status.ok()) return len;
        // 206 carries the range; a 200 is the whole object.
        const uint64_t first = r.has_range ? r.range.first : 0;
        const uint64_t total = r.has_range ? r.range.total : r.body_bytes;
        if (r.status == 206 && !r.has_range) return Done(DataLoss("206 reply without Content-Range"));
        if (total < end) return Done(PastEnd(offset, out.size(), total));
        if (first > offset || first + r.body_bytes < end)
          return Transient(Unavailable(fmt::format("short reply: bytes [{}, {}) for a read of [{}, {})", first,
                                                   first + r.body_bytes, offset, end)));
        *etag = r.Header("etag");
        return Done();
      }
      if (t.ok() && r.status == 416) {
        // "Content-Range: bytes */SIZE" tells the size when the server sends it.
        const std::string cr = r.Header("content-range");
        uint64_t total = 0;
        if (cr.starts_with("bytes */") && ParseU64(std::string_view(cr).substr(8), &total))
          return Done(PastEnd(offset, out.size(), total));
        return Done(OutOfRange(fmt::format("read of [{}, {}) is past the end of the object", offset, end)));
      }
      if (t.ok() && r.status == 404 && ParseError(r).code != "NoSuchBucket") return Done(NotFound("no such key"));
      if (t.ok() && r.status == 412) return Done(Replaced(if_match));
      return Classify(t, r);
    });
  }

  static Status Replaced(std::string_view etag) {
    return Aborted(fmt::format("object replaced (its etag is no longer {})", etag));
  }

  static Status PastEnd(uint64_t offset, uint64_t size, uint64_t total) {
    return OutOfRange(fmt::format("read of {} bytes at {} is past the end of the {} byte object", size, offset, total));
  }

  // [offset, offset + out.size()) as parallel ranged GETs of part_size,
  // all of one version of the object.
  Status ReadRange(const std::string& name, uint64_t offset, std::span<uint8_t> out, std::string_view if_match,
                   std::string* etag) {
    const uint64_t chunk = o_.part_size;
    const size_t n = static_cast<size_t>((out.size() + chunk - 1) / chunk);
    if (n <= 1) return GetRange(name, offset, out, if_match, etag);
    for (int round = 1;; ++round) {
      std::vector<Status> status(n);
      std::vector<std::string> etags(n);
      std::atomic<bool> failed{false};
      auto read = [&](size_t i) {
        if (failed.load()) return;
        const uint64_t begin = i * chunk, len = std::min<uint64_t>(chunk, out.size() - begin);
        status[i] = GetRange(name, offset + begin, out.subspan(begin, len), if_match, &etags[i]);
        if (!status[i].ok()) failed = true;
      };
      Latch latch(n - 1);
      for (size_t i = 1; i < n; ++i)
        executor_.Submit([&, i] {
          read(i);
          latch.Done();
        });
      read(0);
      latch.Wait();
      for (const Status& s : status)
        if (!s.ok()) return s;
      bool same = true;
      for (const auto& e : etags) same = same && e == etags[0];
      if (same) {
        *etag = etags[0];
        return Status::Ok();
      }
      if (round >= kConsistentReadTries)
        return Aborted(fmt::format("object replaced during each of {} reads", kConsistentReadTries));
    }
  }

  // The whole object: one GET of the first part_size bytes, then the rest in
  // parallel, pinned to the first reply's ETag.
  Result<std::string> GetObject(const std::string& name, ObjectInfo* info) {
    for (int round = 1;; ++round) {
      std::string data, etag;
      uint64_t total = 0;
      Status s = Retrying([&](int) -> Outcome {
        Reply r;
        Status t;
        for (bool ranged : {true, false}) {
          data.clear();
          Call c{"GET", name};
          if (ranged) c.headers.push_back({"Range", fmt::format("bytes=0-{}", o_.part_size - 1)});
          Sink sink;
          sink.append = &data;
          t = Send(c, &r, sink);
          if (!t.ok() || r.status != 416) break;  // 416: an empty object has no byte 0; read it whole
        }
        if (t.ok() && r.ok()) {
          Outcome len = CheckLength(r);
          if (len.retry || !len.status.ok()) return len;
          if (r.status == 206 && (!r.has_range || r.range.first != 0))
            return Done(DataLoss("206 reply without a Content-Range from byte 0"));
          if (r.status == 206 && r.range.last + 1 != r.body_bytes)
            return Transient(Unavailable(fmt::format("short reply: {} of {} bytes", r.body_bytes, r.range.last + 1)));
          total = r.has_range ? r.range.total : r.body_bytes;
          etag = r.Header("etag");
          return Done();
        }
        if (t.ok() && r.status == 404 && ParseError(r).code != "NoSuchBucket") return Done(NotFound("no such key"));
        return Classify(t, r);
      });
      if (!s.ok()) return s;
      if (total > data.size()) {
        if (total > (uint64_t{1} << 40)) return DataLoss(fmt::format("object of {} bytes is too large to Get", total));
        const size_t got = data.size();
        data.resize(total);
        std::string rest_etag;
        Status rest =
            ReadRange(name, got, {reinterpret_cast<uint8_t*>(data.data()) + got, total - got}, etag, &rest_etag);
        if (rest.code() == Code::kAborted && round < kConsistentReadTries) continue;
        if (!rest.ok()) return rest;
      }
      if (info != nullptr) {
        info->size = data.size();
        info->etag = etag;
      }
      return data;
    }
  }

  // Every object under `prefix` (a full object-name prefix), sorted.
  Result<std::vector<ObjectInfo>> ListObjects(const std::string& prefix) {
    std::vector<ObjectInfo> out;
    std::string token;
    for (;;) {
      std::string next;
      bool truncated = false;
      const size_t page_start = out.size();
      Status s = Retrying([&](int) -> Outcome {
        out.resize(page_start);
        Call c{"GET", "", {{"list-type", "2"}, {"prefix", prefix}}};
        if (!token.empty()) c.query.emplace_back("continuation-token", token);
        Reply r;
        Status t = Send(c, &r);
        if (!t.ok() || !r.ok()) return Classify(t, r);
        if (Outcome len = CheckLength(r); len.retry) return len;
        auto doc = s3xml::Parse(r.text);
        if (!doc.ok()) return Transient(Unavailable("ListObjectsV2: " + doc.status().message()));
        if (doc->name != "ListBucketResult")
          return Done(DataLoss("ListObjectsV2: unexpected reply <" + doc->name + ">"));
        for (const auto& el : doc->children) {
          if (el.name != "Contents") continue;
          ObjectInfo info;
          info.key = el.ChildText("Key");
          info.etag = el.ChildText("ETag");
          if (!ParseU64(el.ChildText("Size"), &info.size))
            return Done(DataLoss("ListObjectsV2: bad Size for '" + info.key + "'"));
          out.push_back(std::move(info));
        }
        truncated = doc->ChildText("IsTruncated") == "true";
        next = doc->ChildText("NextContinuationToken");
        if (truncated && next.empty()) return Done(DataLoss("truncated page without a continuation token"));
        if (truncated && next == token) return Done(DataLoss("the server repeated its continuation token"));
        return Done();
      });
      if (!s.ok()) return s.WithContext("ListObjectsV2");
      if (!truncated) break;
      token = next;
    }
    std::sort(out.begin(), out.end(), [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
    return out;
  }

  Status DeleteObject(const std::string& name) {
    return Retrying([&](int) -> Outcome {
      Reply r;
      Status t = Send(Call{"DELETE", name}, &r);
      if (t.ok() && (r.ok() || (r.status == 404 && ParseError(r).code != "NoSuchBucket"))) return Done();
      return Classify(t, r);
    });
  }

  Status CreateBucket() {
    std::string body;
    if (o_.region != "us-east-1")
      body = "<CreateBucketConfiguration xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><LocationConstraint>" +
             s3xml::Escape(o_.region) + "</LocationConstraint></CreateBucketConfiguration>";
    return Retrying([&](int) -> Outcome {
      Call c{"PUT", ""};
      c.body = body;
      Reply r;
      Status t = Send(c, &r);
      if (t.ok() && (r.ok() || (r.status == 409 && ParseError(r).code == "BucketAlreadyOwnedByYou"))) return Done();
      return Classify(t, r);
    });
  }

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

// ---------------------------------------------------------------------------
// The writer.

class S3Writer final : public ObjectWriter {
 public:
  S3Writer(std::shared_ptr<S3Client> client, std::string key, WriteMode mode)
      : c_(std::move(client)), key_(std::move(key)), name_(c_->ObjectName(key_)), mode_(mode) {}

  ~S3Writer() override { Abort(); }

  Status Write(std::string_view data) override {
    if (state_ != State::kOpen) return NotOpen();
    if (mode_ == WriteMode::kCreateIfAbsent) {
      // Whole-object PUT only (see s3.h): buffer everything.
      const uint64_t limit = std::min(c_->options().create_if_absent_limit, kMaxSinglePut);
      if (buf_.size() + data.size() > limit) {
        return Fail(Context(
            InvalidArgument(fmt::format("a create-if-absent object is written with one PUT and is limited to {} bytes "
                                        "(create_if_absent_limit)",
                                        limit))));
      }
      buf_.append(data);
      return Status::Ok();
    }
    while (!data.empty()) {
      const uint64_t target = PartSizeFor(c_->options().part_size, next_part_);
      if (buf_.capacity() < target && buf_.size() + data.size() >= target) buf_.reserve(target);
      const size_t n = static_cast<size_t>(std::min<uint64_t>(data.size(), target - buf_.size()));
      buf_.append(data.substr(0, n));
      data.remove_prefix(n);
      if (buf_.size() == target) {
        Status s = FlushPart();
        if (!s.ok()) return s;
      }
    }
    return Status::Ok();
  }

  Status Close() override {
    if (state_ != State::kOpen) return NotOpen();
    if (upload_id_.empty()) {
      Status s = c_->PutObject(name_, buf_, mode_ == WriteMode::kCreateIfAbsent);
      if (!s.ok()) return Fail(Context(s));
      state_ = State::kClosed;
      buf_ = std::string();
      return Status::Ok();
    }
    if (!buf_.empty()) {
      Status s = FlushPart();
      if (!s.ok()) return s;
    }
    WaitForParts(0);
    Status err;
    {
      std::lock_guard<std::mutex> lock(mu_);
      err = part_error_;
    }
    if (!err.ok()) return Fail(Context(err));
    Status s = c_->CompleteMultipartUpload(name_, upload_id_, etags_);
    if (!s.ok()) return Fail(Context(s));
    state_ = State::kClosed;
    return Status::Ok();
  }

  void Abort() override {
    if (state_ == State::kClosed || state_ == State::kAborted) return;
    state_ = State::kAborted;
    AbortUpload();
    buf_ = std::string();
  }

 private:
  enum class State { kOpen, kClosed, kFailed, kAborted };

  Status NotOpen() const {
    if (state_ == State::kFailed) return error_;
    return FailedPrecondition(c_->Context(key_) + ": writer already closed or aborted");
  }

  Status Context(const Status& s) const { return s.WithContext(c_->Context(key_)); }

  // Records the first failure, aborts the upload, and returns the failure.
  Status Fail(Status s) {
    if (state_ == State::kOpen) {
      error_ = std::move(s);
      state_ = State::kFailed;
      AbortUpload();
      buf_ = std::string();
    }
    return error_;
  }

  void AbortUpload() {
    WaitForParts(0);
    if (!upload_id_.empty()) c_->AbortMultipartUpload(name_, upload_id_);
    upload_id_.clear();
  }

  void WaitForParts(size_t at_most) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return in_flight_ <= at_most; });
  }

  // Hands the full buffer to a background upload, starting the multipart
  // upload first if needed; blocks while parts_in_flight parts are pending.
  Status FlushPart() {
    Status err;
    {
      std::lock_guard<std::mutex> lock(mu_);
      err = part_error_;
    }
    if (!err.ok()) return Fail(Context(err));
    if (next_part_ > kMaxParts)
      return Fail(Context(InvalidArgument(fmt::format("object needs more than S3's {} parts", kMaxParts))));
    if (upload_id_.empty()) {
      auto id = c_->CreateMultipartUpload(name_);
      if (!id.ok()) return Fail(Context(id.status()));
      upload_id_ = *id;
    }
    const int part = next_part_++;
    auto body = std::make_shared<std::string>(std::move(buf_));
    buf_ = std::string();
    {
      std::lock_guard<std::mutex> lock(mu_);
      etags_.resize(static_cast<size_t>(part));  // running parts write their slots under mu_
      ++in_flight_;
    }
    c_->executor().Submit([this, part, body, upload_id = upload_id_] {
      auto etag = c_->UploadPart(name_, upload_id, part, *body);
      std::lock_guard<std::mutex> lock(mu_);
      if (etag.ok()) etags_[static_cast<size_t>(part - 1)] = std::move(*etag);
      else if (part_error_.ok()) part_error_ = etag.status();
      --in_flight_;
      cv_.notify_all();
    });
    WaitForParts(c_->options().parts_in_flight - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      err = part_error_;
    }
    if (!err.ok()) return Fail(Context(err));
    return Status::Ok();
  }

  std::shared_ptr<S3Client> c_;
  const std::string key_;
  const std::string name_;
  const WriteMode mode_;
  State state_ = State::kOpen;
  Status error_;  // when kFailed
  std::string buf_;  // the part being filled (or, for create-if-absent, everything)
  std::string upload_id_;
  int next_part_ = 1;

  std::mutex mu_;
  std::condition_variable cv_;
  size_t in_flight_ = 0;  // guarded by mu_
  Status part_error_;  // guarded by mu_: the first failed part
  std::vector<std::string> etags_;  // guarded by mu_ once parts run: index part - 1
};

// ---------------------------------------------------------------------------
// The store.

class S3Store final : public Store {
 public:
  explicit S3Store(std::shared_ptr<S3Client> client) : c_(std::move(client)) {}

  const std::string& url() const override { return c_->url(); }

  Result<std::unique_ptr<ObjectWriter>> OpenWriter(std::string_view key, WriteMode mode) override {
    DCR_RETURN_IF_ERROR(Check(key));
    return std::unique_ptr<ObjectWriter>(new S3Writer(c_, std::string(key), mode));
  }

  Status Put(std::string_view key, std::string_view data, WriteMode mode) override {
    DCR_RETURN_IF_ERROR(Check(key));
    const bool single = mode == WriteMode::kCreateIfAbsent
                            ? data.size() <= std::min(c_->options().create_if_absent_limit, kMaxSinglePut)
                            : data.size() <= c_->options().part_size;
    if (!single) return Store::Put(key, data, mode);  // a multipart upload, or the limit's error
    return c_->PutObject(c_->ObjectName(key), data, mode == WriteMode::kCreateIfAbsent).WithContext(c_->Context(key));
  }

  Result<ObjectInfo> Head(std::string_view key) override {
    DCR_RETURN_IF_ERROR(Check(key));
    auto info = c_->HeadObject(c_->ObjectName(key), "");
    if (!info.ok()) return info.status().WithContext(c_->Context(key));
    info->key = std::string(key);
    return info;
  }

  Status ReadRange(std::string_view key, uint64_t offset, std::span<uint8_t> out, const ReadOptions& options) override {
    DCR_RETURN_IF_ERROR(Check(key));
    const std::string name = c_->ObjectName(key);
    Status s;
    if (out.empty()) {  // nothing to fetch; the range still has to exist
      auto info = c_->HeadObject(name, options.if_match);
      s = info.status();
      if (info.ok() && offset > info->size) s = S3Client::PastEnd(offset, 0, info->size);
    } else if (offset + out.size() < offset) {
      s = OutOfRange("offset + size overflows");
    } else {
      std::string etag;
      s = c_->ReadRange(name, offset, out, options.if_match, &etag);
    }
    return s.WithContext(c_->Context(key));
  }

  Result<std::string> Get(std::string_view key, ObjectInfo* info) override {
    DCR_RETURN_IF_ERROR(Check(key));
    auto data = c_->GetObject(c_->ObjectName(key), info);
    if (!data.ok()) return data.status().WithContext(c_->Context(key));
    if (info != nullptr) info->key = std::string(key);
    return data;
  }

  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override {
    DCR_RETURN_IF_ERROR(ValidateKeyPrefix(prefix).WithContext(c_->url()));
    const std::string& store_prefix = c_->options().prefix;
    auto all = c_->ListObjects(store_prefix + std::string(prefix));
    if (!all.ok()) return all.status().WithContext(c_->Context(std::string(prefix) + "*"));
    // Names under the store's prefix become keys; objects that are not valid
    // keys (e.g. "dir/" markers made by other tools), or that a server listed
    // outside the prefix asked for, are not listed.
    std::vector<ObjectInfo> out;
    out.reserve(all->size());
    for (auto& o : *all) {
      if (!o.key.starts_with(store_prefix)) continue;
      o.key.erase(0, store_prefix.size());
      if (o.key.starts_with(prefix) && ValidateKey(o.key).ok()) out.push_back(std::move(o));
    }
    return out;
  }

  Status Delete(std::string_view key) override {
    DCR_RETURN_IF_ERROR(Check(key));
    return c_->DeleteObject(c_->ObjectName(key)).WithContext(c_->Context(key));
  }

 private:
  Status Check(std::string_view key) const { return ValidateKey(key).WithContext(c_->url()); }

  std::shared_ptr<S3Client> c_;
};

Result<std::shared_ptr<S3Client>> MakeClient(const S3Options& options, S3Runtime runtime) {
  auto bad = [&](std::string_view why) {
    return InvalidArgument(fmt::format("{}: {}", options.url.empty() ? "s3://" + options.bucket : options.url, why));
  };
  if (options.bucket.empty()) return bad("no bucket");
  if (!options.prefix.empty() && !options.prefix.ends_with("/")) return bad("the prefix must end with '/'");
  const std::string& e = options.endpoint;
  if (!e.empty() && !e.starts_with("http://") && !e.starts_with("https://"))
    return bad("endpoint must start with http:// or https://");
  if (options.part_size == 0 || options.part_size > kMaxSinglePut) return bad("part_size out of range");
  if (options.parts_in_flight == 0 || options.threads == 0 || options.max_attempts <= 0)
    return bad("parts_in_flight, threads and max_attempts must be positive");
  if (options.access_key_id.empty() && !options.anonymous) {
    // Unsigned requests without a word would look like an access problem
    // on the first write; say so once, at open.
    const std::string line = fmt::format(
        "dcr: warning: {}: no S3 credentials found, requests are anonymous (unsigned); set $AWS_ACCESS_KEY_ID and "
        "$AWS_SECRET_ACCESS_KEY, an AWS profile ($AWS_PROFILE or profile=), or access_key_id= and "
        "secret_access_key= in the URL; add anonymous=1 to the URL if anonymous access is meant",
        options.url.empty() ? "s3://" + options.bucket : options.url);
    if (runtime.warn) runtime.warn(line);
    else std::fprintf(stderr, "%s\n", line.c_str());
  }
  auto transport = runtime.transport ? runtime.transport : NewCurlTransport(options.http);
  return std::make_shared<S3Client>(options, std::move(runtime), std::move(transport));
}

}  // namespace

Result<std::unique_ptr<Store>> OpenS3Store(const S3Options& options, S3Runtime runtime) {
  DCR_ASSIGN_OR_RETURN(auto client, MakeClient(options, std::move(runtime)));
  if (options.create_bucket) DCR_RETURN_IF_ERROR(client->CreateBucket().WithContext(client->url() + ": CreateBucket"));
  return std::unique_ptr<Store>(new S3Store(std::move(client)));
}

Result<std::unique_ptr<Store>> OpenS3Store(std::string_view url) {
  DCR_ASSIGN_OR_RETURN(S3Options options, ParseS3Url(url));
  return OpenS3Store(options);
}

Status CreateS3Bucket(const S3Options& options, S3Runtime runtime) {
  DCR_ASSIGN_OR_RETURN(auto client, MakeClient(options, std::move(runtime)));
  return client->CreateBucket().WithContext(client->url() + ": CreateBucket");
}

Status CreateS3Bucket(std::string_view url) {
  DCR_ASSIGN_OR_RETURN(S3Options options, ParseS3Url(url));
  return CreateS3Bucket(options);
}

}  // namespace dcr
