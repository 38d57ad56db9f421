// The S3 store (include/dcr/s3.h): the Store interface and its object
// writers over the client (s3_client.h), and opening a store or a bucket.
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <mutex>

#include "dcr/s3.h"
#include "s3_client.h"

namespace dcr {

using namespace s3_internal;

namespace {

constexpr int kMaxParts = 10000;

// Part n (1-based) of a streamed upload: part_size, doubled every 1000 parts.
uint64_t PartSizeFor(uint64_t part_size, int part) {
  const int doublings = std::min((part - 1) / 1000, 20);
  return std::min(part_size << doublings, kMaxSinglePut);
}

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
