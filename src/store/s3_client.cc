// The S3 client's one signed exchange (Send, and what comes back) and its
// retry policy: which failures are transient, and the backoff between tries.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "s3_client.h"
#include "s3_xml.h"
#include "sigv4.h"

namespace dcr::s3_internal {
namespace {

constexpr size_t kMaxTextBody = size_t{16} << 20;  // XML bodies (listings, errors)

// "bytes 0-9/100"
bool ParseContentRange(std::string_view v, ContentRange* out) {
  if (!v.starts_with("bytes ")) return false;
  v.remove_prefix(6);
  const size_t dash = v.find('-'), slash = v.find('/');
  if (dash == std::string_view::npos || slash == std::string_view::npos || dash > slash) return false;
  return ParseU64(v.substr(0, dash), &out->first) && ParseU64(v.substr(dash + 1, slash - dash - 1), &out->last) &&
         ParseU64(v.substr(slash + 1), &out->total) && out->first <= out->last && out->last < out->total;
}

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

}  // namespace

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

S3Client::S3Client(S3Options options, S3Runtime runtime, std::shared_ptr<HttpTransport> transport)
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

// Runs `attempt` until it is done or transient failures use up
// max_attempts; then the last failure, with the count.
Status S3Client::Retrying(const std::function<Outcome(int attempt)>& attempt) {
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

std::chrono::milliseconds S3Client::Backoff(int n) {
  const int64_t base = o_.initial_backoff.count();
  const int64_t cap =
      std::min<int64_t>(o_.max_backoff.count(), n > 30 ? o_.max_backoff.count() : base << std::min(n - 1, 30));
  std::lock_guard<std::mutex> lock(rng_mu_);
  return std::chrono::milliseconds(cap <= 0 ? 0 : std::uniform_int_distribution<int64_t>(0, cap)(rng_));
}

void S3Client::Sleep(std::chrono::milliseconds d) {
  if (rt_.sleep) rt_.sleep(d);
  else std::this_thread::sleep_for(d);
}

// A transport failure or a non-2xx reply, judged by the rules that hold
// for every operation (operations look at their own special cases first).
Outcome S3Client::Classify(const Status& transport, const Reply& r) {
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

Status S3Client::Send(const Call& c, Reply* reply, const Sink& sink) {
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
Outcome S3Client::CheckLength(const Reply& r) {
  const int64_t len = r.content_length();
  if (len >= 0 && static_cast<uint64_t>(len) != r.body_bytes)
    return Transient(Unavailable(fmt::format("truncated response: {} of {} bytes", r.body_bytes, len)));
  return Done();
}

}  // namespace dcr::s3_internal
