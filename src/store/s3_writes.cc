// The S3 client's writes: PUT (and the probe that create-if-absent writes
// rely on), the multipart upload's requests, DELETE, and bucket creation.
#include <fmt/format.h>

#include <mutex>

#include "s3_client.h"
#include "s3_xml.h"
#include "sigv4.h"

namespace dcr::s3_internal {
namespace {

std::string_view Unquote(std::string_view etag) {
  if (etag.size() >= 2 && etag.front() == '"' && etag.back() == '"') return etag.substr(1, etag.size() - 2);
  return etag;
}

bool SameEtag(std::string_view a, std::string_view b) { return !a.empty() && Unquote(a) == Unquote(b); }

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

}  // namespace

// PUT of a whole object; `if_absent` adds If-None-Match: *, once the
// server has shown that it honours it (CheckConditionalCreate).
Status S3Client::PutObject(const std::string& name, std::string_view body, bool if_absent) {
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
Status S3Client::CheckConditionalCreate() {
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

Status S3Client::PutObjectUnprobed(const std::string& name, std::string_view body, bool if_absent) {
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

Result<std::string> S3Client::CreateMultipartUpload(const std::string& name) {
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
Result<std::string> S3Client::UploadPart(const std::string& name, const std::string& upload_id, int part,
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

Status S3Client::CompleteMultipartUpload(const std::string& name, const std::string& upload_id,
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
void S3Client::AbortMultipartUpload(const std::string& name, const std::string& upload_id) {
  Retrying([&](int n) -> Outcome {
    Reply r;
    Status t = Send(Call{"DELETE", name, {{"uploadId", upload_id}}}, &r);
    if (t.ok() && (r.ok() || r.status == 404)) return Done();
    Outcome out = Classify(t, r);
    if (n >= 3) out.retry = false;
    return out;
  }).IgnoreError();
}

Status S3Client::DeleteObject(const std::string& name) {
  return Retrying([&](int) -> Outcome {
    Reply r;
    Status t = Send(Call{"DELETE", name}, &r);
    if (t.ok() && (r.ok() || (r.status == 404 && ParseError(r).code != "NoSuchBucket"))) return Done();
    return Classify(t, r);
  });
}

Status S3Client::CreateBucket() {
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

}  // namespace dcr::s3_internal
