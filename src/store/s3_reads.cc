// The S3 client's reads: HEAD, ranged and whole-object GETs (large ranges
// as parallel GETs of one version), and listings.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>

#include "s3_client.h"
#include "s3_xml.h"

namespace dcr::s3_internal {
namespace {

constexpr int kConsistentReadTries = 3;  // re-reads when an object changes under a split read

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

}  // namespace

Result<ObjectInfo> S3Client::HeadObject(const std::string& name, std::string_view if_match) {
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
Status S3Client::MissingObject() {
  if (!bucket_known_.load()) {
    Reply r;
    Status t = Send(Call{"HEAD", ""}, &r);
    if (t.ok() && r.status == 404) return NotFound(fmt::format("no such bucket '{}'", o_.bucket));
    if (t.ok() && r.status < 500) bucket_known_ = true;
  }
  return NotFound("no such key");
}

// One GET of bytes [offset, offset + out.size()) into `out`, retried.
// Reports the object's ETag.
Status S3Client::GetRange(const std::string& name, uint64_t offset, std::span<uint8_t> out, std::string_view if_match,
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

Status S3Client::Replaced(std::string_view etag) {
  return Aborted(fmt::format("object replaced (its etag is no longer {})", etag));
}

Status S3Client::PastEnd(uint64_t offset, uint64_t size, uint64_t total) {
  return OutOfRange(fmt::format("read of {} bytes at {} is past the end of the {} byte object", size, offset, total));
}

// [offset, offset + out.size()) as parallel ranged GETs of part_size,
// all of one version of the object.
Status S3Client::ReadRange(const std::string& name, uint64_t offset, std::span<uint8_t> out, std::string_view if_match,
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
Result<std::string> S3Client::GetObject(const std::string& name, ObjectInfo* info) {
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
Result<std::vector<ObjectInfo>> S3Client::ListObjects(const std::string& prefix) {
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
      if (doc->name != "ListBucketResult") return Done(DataLoss("ListObjectsV2: unexpected reply <" + doc->name + ">"));
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

}  // namespace dcr::s3_internal
