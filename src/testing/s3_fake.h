// Test helper: an in-memory S3 server behind the HttpTransport interface,
// with fault injection. It checks what a real server checks (SigV4 signature,
// x-amz-content-sha256, Content-MD5, clock skew, region) and implements the
// operations the driver uses: PUT/GET/HEAD/DELETE object (Range, If-Match,
// If-None-Match), ListObjectsV2 with pages, multipart uploads, and
// PUT/HEAD bucket. Path-style and virtual-hosted requests both work.
//
// Faults: an injector sees each request (with its operation name) before the
// server does and picks what goes wrong: an error status instead of the
// operation, a refused connection or a timeout (nothing happens on the
// server), or, after the operation took effect on the server, a lost
// response, a connection dropped mid-body, or a body truncated without an
// error.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "dcr/http.h"
#include "store/s3_xml.h"
#include "store/sigv4.h"

namespace dcr::testing {

class FakeS3 final : public HttpTransport {
 public:
  struct Object {
    std::string data;
    std::string etag;  // quoted, as S3 sends it
  };

  struct Fault {
    enum Kind {
      kNone,
      kStatus,  // answer `status` with error `code`, do nothing
      kRefuse,  // connection refused: nothing reaches the server
      kTimeout,  // timed out before the server saw it
      kLoseResponse,  // the server acts; the response never arrives
      kDropMidBody,  // the server acts; the connection breaks halfway through the body
      kTruncate,  // the server acts; half the body arrives and the exchange "succeeds"
    } kind = kNone;
    int status = 0;
    std::string code;
  };
  // Called for every request with its operation name ("PutObject",
  // "UploadPart", "CompleteMultipartUpload", "GetObject", ...).
  using Injector = std::function<Fault(const std::string& op, const HttpRequest& request)>;

  std::string host = "s3.fake.test";  // the endpoint's host (virtual-hosted: bucket.host)
  std::string access_key = "AKIDFAKEFAKEFAKE";
  std::string secret_key = "fake/secret+key";
  std::string region = "us-east-1";
  size_t max_keys = 1000;  // page size of ListObjectsV2
  bool honour_if_none_match = true;  // false: PUT ignores If-None-Match: * (a server that overwrites)
  std::chrono::milliseconds part_delay{0};  // real time each UploadPart takes
  std::function<std::chrono::system_clock::time_point()> now = [] { return std::chrono::system_clock::now(); };

  void SetInjector(Injector f) {
    std::lock_guard<std::mutex> lock(mu_);
    injector_ = std::move(f);
  }
  void AddBucket(const std::string& b) {
    std::lock_guard<std::mutex> lock(mu_);
    buckets_[b];
  }
  std::optional<Object> Get(const std::string& bucket, const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto b = buckets_.find(bucket);
    if (b == buckets_.end()) return std::nullopt;
    auto o = b->second.find(key);
    if (o == b->second.end()) return std::nullopt;
    return o->second;
  }
  void PutDirect(const std::string& bucket, const std::string& key, const std::string& data) {
    std::lock_guard<std::mutex> lock(mu_);
    buckets_[bucket][key] = {data, Md5Etag(data)};
  }
  size_t ObjectCount(const std::string& bucket) {
    std::lock_guard<std::mutex> lock(mu_);
    return buckets_[bucket].size();
  }
  size_t OpenUploads() {
    std::lock_guard<std::mutex> lock(mu_);
    return uploads_.size();
  }
  int Count(const std::string& op) {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_[op];
  }
  int MaxPartsInFlight() const { return max_parts_in_flight_.load(); }
  // The headers of the last request of operation `op`.
  HttpHeaders LastHeaders(const std::string& op) {
    std::lock_guard<std::mutex> lock(mu_);
    return last_headers_[op];
  }

  Status Send(const HttpRequest& req, HttpResponseHandler& handler) override {
    Parsed p = ParseRequest(req);
    Injector injector;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++counts_[p.op];
      last_headers_[p.op] = req.headers;
      injector = injector_;
    }
    // Outside the lock: an injector may change the server's state (another
    // writer acting between two tries).
    const Fault fault = injector ? injector(p.op, req) : Fault{};
    switch (fault.kind) {
      case Fault::kRefuse: return Unavailable("fake: connection refused");
      case Fault::kTimeout: return DeadlineExceeded("fake: operation timed out");
      case Fault::kStatus: {
        Response r = Error(fault.status, fault.code, "injected");
        return Deliver(handler, req, r, r.body.size());
      }
      default: break;
    }
    Response r = Serve(p, req);
    switch (fault.kind) {
      case Fault::kLoseResponse: return Unavailable("fake: connection reset before the response");
      case Fault::kDropMidBody: {
        Status s = Deliver(handler, req, r, r.body.size() / 2);
        return s.ok() ? Unavailable("fake: connection reset mid-body") : s;
      }
      case Fault::kTruncate: return Deliver(handler, req, r, r.body.size() / 2);
      default: return Deliver(handler, req, r, r.body.size());
    }
  }

  static std::string Md5Etag(std::string_view data) {
    const auto md5 = sigv4::Md5(data);
    return "\"" + sigv4::HexEncode(md5.data(), md5.size()) + "\"";
  }

 private:
  struct Parsed {
    std::string op;
    std::string bucket, key;
    std::string path;  // as sent (encoded)
    std::map<std::string, std::string> query;
    std::string raw_query;
    bool bad = false;
  };
  struct Response {
    int status = 200;
    HttpHeaders headers;
    std::string body;
  };
  struct Upload {
    std::string bucket, key;
    std::map<int, Object> parts;
  };

  static std::string HeaderOr(const HttpRequest& req, std::string_view name) {
    const std::string* v = FindHeader(req.headers, name);
    return v ? *v : std::string();
  }

  Parsed ParseRequest(const HttpRequest& req) const {
    Parsed p;
    std::string_view url = req.url;
    const size_t scheme = url.find("://");
    url.remove_prefix(scheme == std::string_view::npos ? 0 : scheme + 3);
    const size_t slash = url.find('/');
    std::string_view rest = slash == std::string_view::npos ? "/" : url.substr(slash);
    const size_t q = rest.find('?');
    p.path = std::string(rest.substr(0, q));
    if (q != std::string_view::npos) {
      p.raw_query = std::string(rest.substr(q + 1));
      std::string_view qs = p.raw_query;
      while (!qs.empty()) {
        const size_t amp = qs.find('&');
        const std::string_view item = qs.substr(0, amp);
        const size_t eq = item.find('=');
        std::string k, v;
        p.bad |= !sigv4::UriDecode(item.substr(0, eq), &k);
        if (eq != std::string_view::npos) p.bad |= !sigv4::UriDecode(item.substr(eq + 1), &v);
        p.query[k] = v;
        if (amp == std::string_view::npos) break;
        qs.remove_prefix(amp + 1);
      }
    }
    std::string path;
    p.bad |= !sigv4::UriDecode(p.path, &path);
    const std::string host_header = HeaderOr(req, "host");
    if (host_header != host && host_header.ends_with("." + host)) {
      p.bucket = host_header.substr(0, host_header.size() - host.size() - 1);
      p.key = path.size() > 1 ? path.substr(1) : "";
    } else {
      const size_t s2 = path.find('/', 1);
      p.bucket = path.substr(1, s2 == std::string::npos ? std::string::npos : s2 - 1);
      p.key = s2 == std::string::npos ? "" : path.substr(s2 + 1);
    }
    const std::string& m = req.method;
    const bool has_upload = p.query.count("uploadId") > 0;
    if (p.key.empty()) {
      if (m == "PUT") p.op = "CreateBucket";
      else if (m == "HEAD") p.op = "HeadBucket";
      else if (m == "GET") p.op = "ListObjectsV2";
      else p.op = "Bucket" + m;
    } else if (m == "POST" && p.query.count("uploads")) {
      p.op = "CreateMultipartUpload";
    } else if (m == "PUT" && has_upload) {
      p.op = "UploadPart";
    } else if (m == "POST" && has_upload) {
      p.op = "CompleteMultipartUpload";
    } else if (m == "DELETE" && has_upload) {
      p.op = "AbortMultipartUpload";
    } else if (m == "PUT") {
      p.op = "PutObject";
    } else if (m == "GET") {
      p.op = "GetObject";
    } else if (m == "HEAD") {
      p.op = "HeadObject";
    } else if (m == "DELETE") {
      p.op = "DeleteObject";
    } else {
      p.op = "Unknown" + m;
    }
    return p;
  }

  static Response Error(int status, const std::string& code, const std::string& message) {
    Response r;
    r.status = status;
    r.body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>" + code + "</Code><Message>" +
             s3xml::Escape(message) + "</Message><RequestId>fake</RequestId></Error>";
    return r;
  }

  // What a real server checks before it looks at the operation.
  std::optional<Response> CheckAuth(const Parsed& p, const HttpRequest& req) const {
    const std::string sha = HeaderOr(req, "x-amz-content-sha256");
    if (sha.empty()) return Error(400, "InvalidRequest", "missing x-amz-content-sha256");
    if (sha != "UNSIGNED-PAYLOAD" && sha != sigv4::Sha256Hex(req.body))
      return Error(400, "XAmzContentSHA256Mismatch", "body does not match x-amz-content-sha256");
    const std::string auth = HeaderOr(req, "authorization");
    const std::string date = HeaderOr(req, "x-amz-date");
    auto field = [&](std::string_view name) -> std::string {
      const size_t at = auth.find(name);
      if (at == std::string::npos) return "";
      const size_t end = auth.find(',', at);
      return auth.substr(at + name.size(), end == std::string::npos ? std::string::npos : end - at - name.size());
    };
    const std::string credential = field("Credential="), names = field("SignedHeaders="),
                      signature = field("Signature=");
    if (!auth.starts_with("AWS4-HMAC-SHA256 ") || credential.empty() || names.empty() || signature.empty())
      return Error(403, "AccessDenied", "anonymous or malformed authorization");
    if (credential.substr(0, credential.find('/')) != access_key)
      return Error(403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records.");
    if (credential.find("/" + region + "/s3/aws4_request") == std::string::npos)
      return Error(400, "AuthorizationHeaderMalformed", "the region is wrong; expecting '" + region + "'");
    // Clock skew: more than 15 minutes either way.
    std::tm tm{};
    if (date.size() != 16 || strptime(date.c_str(), "%Y%m%dT%H%M%SZ", &tm) == nullptr)
      return Error(403, "AccessDenied", "bad x-amz-date");
    const auto sent = std::chrono::system_clock::from_time_t(timegm(&tm));
    if (std::chrono::abs(std::chrono::duration_cast<std::chrono::seconds>(now() - sent)) > std::chrono::minutes(15))
      return Error(403, "RequestTimeTooSkewed",
                   "The difference between the request time and the current time is too large.");
    // Recompute the signature from what arrived.
    sigv4::Pairs signed_headers;
    size_t start = 0;
    while (start <= names.size()) {
      size_t end = names.find(';', start);
      if (end == std::string::npos) end = names.size();
      const std::string name = names.substr(start, end - start);
      const std::string* v = FindHeader(req.headers, name);
      if (v == nullptr) return Error(403, "SignatureDoesNotMatch", "signed header " + name + " missing");
      signed_headers.emplace_back(name, *v);
      start = end + 1;
    }
    sigv4::Pairs query(p.query.begin(), p.query.end());
    const std::string canonical_query = sigv4::CanonicalQueryString(query);
    if (canonical_query != p.raw_query) return Error(403, "SignatureDoesNotMatch", "query not in canonical form");
    sigv4::Request sr{req.method, p.path, canonical_query, &signed_headers, sha};
    std::string expected;
    sigv4::Authorization(sr, access_key, secret_key, region, date, "s3", &expected);
    if (expected != signature)
      return Error(403, "SignatureDoesNotMatch",
                   "The request signature we calculated does not match the signature you provided.");
    return std::nullopt;
  }

  static bool EtagMatches(const std::string& condition, const std::string& etag) {
    auto strip = [](std::string s) {
      if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
      return s;
    };
    return condition == "*" || strip(condition) == strip(etag);
  }

  Response Serve(const Parsed& p, const HttpRequest& req) {
    if (p.bad) return Error(400, "InvalidURI", "bad percent-encoding");
    if (auto denied = CheckAuth(p, req)) return *denied;
    if (p.op == "UploadPart") return ServeUploadPart(p, req);

    std::lock_guard<std::mutex> lock(mu_);
    if (p.op == "CreateBucket") {
      if (buckets_.count(p.bucket)) return Error(409, "BucketAlreadyOwnedByYou", "yours already");
      buckets_[p.bucket];
      return Response{};
    }
    auto bit = buckets_.find(p.bucket);
    if (bit == buckets_.end()) {
      Response r = Error(404, "NoSuchBucket", "The specified bucket does not exist");
      if (req.method == "HEAD") r.body.clear();
      return r;
    }
    auto& objects = bit->second;
    if (p.op == "HeadBucket") return Response{};
    if (p.op == "ListObjectsV2") return List(p, objects);
    if (p.op == "CreateMultipartUpload") {
      const std::string id = "upload-" + std::to_string(++next_upload_);
      uploads_[id] = Upload{p.bucket, p.key, {}};
      Response r;
      r.body = "<InitiateMultipartUploadResult><Bucket>" + p.bucket + "</Bucket><Key>" + s3xml::Escape(p.key) +
               "</Key><UploadId>" + id + "</UploadId></InitiateMultipartUploadResult>";
      return r;
    }
    if (p.op == "CompleteMultipartUpload") return Complete(p, req, objects);
    if (p.op == "AbortMultipartUpload") {
      if (uploads_.erase(p.query.at("uploadId")) == 0) return Error(404, "NoSuchUpload", "no such upload");
      return Response{204, {}, {}};
    }
    auto oit = objects.find(p.key);
    if (p.op == "PutObject") {
      const std::string inm = HeaderOr(req, "if-none-match");
      if (inm == "*" && oit != objects.end() && honour_if_none_match)
        return Error(412, "PreconditionFailed", "the key exists");
      if (std::string md5 = HeaderOr(req, "content-md5"); !md5.empty()) {
        const auto got = sigv4::Md5(req.body);
        if (md5 != sigv4::Base64Encode(got.data(), got.size())) return Error(400, "BadDigest", "Content-MD5 mismatch");
      }
      objects[p.key] = {std::string(req.body), Md5Etag(req.body)};
      Response r;
      r.headers.push_back({"ETag", objects[p.key].etag});
      return r;
    }
    if (p.op == "DeleteObject") {
      objects.erase(p.key);
      return Response{204, {}, {}};
    }
    if (p.op == "GetObject" || p.op == "HeadObject") {
      const bool head = p.op == "HeadObject";
      if (oit == objects.end()) {
        Response r = Error(404, "NoSuchKey", "The specified key does not exist.");
        if (head) r.body.clear();
        return r;
      }
      const Object& o = oit->second;
      if (std::string im = HeaderOr(req, "if-match"); !im.empty() && !EtagMatches(im, o.etag)) {
        Response r = Error(412, "PreconditionFailed", "At least one of the pre-conditions you specified did not hold");
        if (head) r.body.clear();
        return r;
      }
      Response r;
      r.headers.push_back({"ETag", o.etag});
      if (head) {
        r.headers.push_back({"Content-Length", std::to_string(o.data.size())});
        return r;
      }
      const std::string range = HeaderOr(req, "range");
      if (range.empty()) {
        r.body = o.data;
        return r;
      }
      uint64_t first = 0, last = 0;
      const size_t dash = range.find('-');
      first = std::stoull(range.substr(6, dash - 6));
      last = dash + 1 < range.size() ? std::stoull(range.substr(dash + 1)) : UINT64_MAX;
      if (first >= o.data.size()) {
        Response e = Error(416, "InvalidRange", "The requested range is not satisfiable");
        e.headers.push_back({"Content-Range", "bytes */" + std::to_string(o.data.size())});
        return e;
      }
      last = std::min<uint64_t>(last, o.data.size() - 1);
      r.status = 206;
      r.body = o.data.substr(first, last - first + 1);
      r.headers.push_back({"Content-Range", "bytes " + std::to_string(first) + "-" + std::to_string(last) + "/" +
                                                std::to_string(o.data.size())});
      return r;
    }
    return Error(405, "MethodNotAllowed", p.op);
  }

  Response ServeUploadPart(const Parsed& p, const HttpRequest& req) {
    const int now_in_flight = ++parts_in_flight_;
    int seen = max_parts_in_flight_.load();
    while (now_in_flight > seen && !max_parts_in_flight_.compare_exchange_weak(seen, now_in_flight)) {
    }
    if (part_delay.count() > 0) std::this_thread::sleep_for(part_delay);
    --parts_in_flight_;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = uploads_.find(p.query.at("uploadId"));
    if (it == uploads_.end()) return Error(404, "NoSuchUpload", "The specified upload does not exist.");
    const int part = std::stoi(p.query.at("partNumber"));
    it->second.parts[part] = {std::string(req.body), Md5Etag(req.body)};
    Response r;
    r.headers.push_back({"ETag", it->second.parts[part].etag});
    return r;
  }

  Response Complete(const Parsed& p, const HttpRequest& req, std::map<std::string, Object>& objects) {
    auto it = uploads_.find(p.query.at("uploadId"));
    if (it == uploads_.end()) return Error(404, "NoSuchUpload", "The specified upload does not exist.");
    auto doc = s3xml::Parse(req.body);
    if (!doc.ok() || doc->name != "CompleteMultipartUpload") return Error(400, "MalformedXML", "bad body");
    std::string data, md5s;
    int expect = 1;
    for (const auto& part : doc->children) {
      const int n = std::stoi(part.ChildText("PartNumber"));
      auto pit = it->second.parts.find(n);
      if (n != expect++ || pit == it->second.parts.end() || pit->second.etag != part.ChildText("ETag"))
        return Error(400, "InvalidPart", "One or more of the specified parts could not be found.");
      data += pit->second.data;
      const auto md5 = sigv4::Md5(pit->second.data);
      md5s.append(reinterpret_cast<const char*>(md5.data()), md5.size());
    }
    const auto md5 = sigv4::Md5(md5s);
    const std::string etag =
        "\"" + sigv4::HexEncode(md5.data(), md5.size()) + "-" + std::to_string(doc->children.size()) + "\"";
    objects[p.key] = {std::move(data), etag};
    uploads_.erase(it);
    Response r;
    r.body = "<CompleteMultipartUploadResult><Key>" + s3xml::Escape(p.key) + "</Key><ETag>" + s3xml::Escape(etag) +
             "</ETag></CompleteMultipartUploadResult>";
    return r;
  }

  Response List(const Parsed& p, const std::map<std::string, Object>& objects) const {
    const std::string prefix = p.query.count("prefix") ? p.query.at("prefix") : "";
    const std::string token = p.query.count("continuation-token") ? p.query.at("continuation-token") : "";
    auto it = token.empty() ? objects.lower_bound(prefix) : objects.upper_bound(token.substr(2));
    std::string contents, last;
    size_t n = 0;
    bool truncated = false;
    for (; it != objects.end() && it->first.starts_with(prefix); ++it) {
      if (n == max_keys) {
        truncated = true;
        break;
      }
      contents += "<Contents><Key>" + s3xml::Escape(it->first) +
                  "</Key><LastModified>2024-01-01T00:00:00.000Z"
                  "</LastModified><ETag>" +
                  s3xml::Escape(it->second.etag) + "</ETag><Size>" + std::to_string(it->second.data.size()) +
                  "</Size><StorageClass>STANDARD</StorageClass></Contents>";
      last = it->first;
      ++n;
    }
    Response r;
    r.body =
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/"
        "2006-03-01/\"><Name>" +
        p.bucket + "</Name><Prefix>" + s3xml::Escape(prefix) + "</Prefix><KeyCount>" + std::to_string(n) +
        "</KeyCount><MaxKeys>" + std::to_string(max_keys) + "</MaxKeys><IsTruncated>" + (truncated ? "true" : "false") +
        "</IsTruncated>" + contents +
        (truncated ? "<NextContinuationToken>t:" + s3xml::Escape(last) + "</NextContinuationToken>" : "") +
        "</ListBucketResult>";
    return r;
  }

  // Hands `r` to the handler with only the first `body_bytes` of its body
  // (Content-Length announces the whole body, as a server would).
  static Status Deliver(HttpResponseHandler& handler, const HttpRequest& req, const Response& r, size_t body_bytes) {
    HttpHeaders headers = r.headers;
    if (req.method != "HEAD") headers.push_back({"Content-Length", std::to_string(r.body.size())});
    headers.push_back({"x-amz-request-id", "fake"});
    if (!handler.OnHeaders(r.status, std::move(headers))) return Aborted("fake: abandoned by the handler");
    if (req.method == "HEAD") return Status::Ok();
    // In pieces, as a socket would deliver it.
    constexpr size_t kPiece = 64 << 10;
    for (size_t at = 0; at < body_bytes; at += kPiece) {
      if (!handler.OnBody(std::string_view(r.body).substr(at, std::min(kPiece, body_bytes - at))))
        return Aborted("fake: abandoned by the handler");
    }
    return Status::Ok();
  }

  std::mutex mu_;
  Injector injector_;
  std::map<std::string, std::map<std::string, Object>> buckets_;
  std::map<std::string, Upload> uploads_;
  int next_upload_ = 0;
  std::map<std::string, int> counts_;
  std::map<std::string, HttpHeaders> last_headers_;
  std::atomic<int> parts_in_flight_{0};
  std::atomic<int> max_parts_in_flight_{0};
};

}  // namespace dcr::testing
