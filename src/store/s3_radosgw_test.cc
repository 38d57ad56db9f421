// The S3 driver against a real server: Ceph radosgw started by
// tests/s3/radosgw.sh (its env file exports DCR_S3_ENDPOINT, the keys and
// AWS_REGION). Skipped when DCR_S3_ENDPOINT is not set. The cross-driver
// behaviour is tests/store's conformance suite; these are the S3-specific
// cases: multipart, the server's conditional-write behaviour, and the
// errors for bad credentials, a missing bucket and a skewed clock.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <thread>

#include "dcr/s3.h"

namespace dcr {
namespace {

using ::testing::HasSubstr;

std::string Pattern(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(s.data() + i, &x, std::min<size_t>(8, n - i));
  }
  return s;
}

// Adds headers to matching requests after signing (S3 allows unsigned
// headers), to probe what the server does with them.
class AddHeaderTransport final : public HttpTransport {
 public:
  AddHeaderTransport(std::shared_ptr<HttpTransport> inner, std::string method, std::string url_part, HttpHeader h)
      : inner_(std::move(inner)), method_(std::move(method)), url_part_(std::move(url_part)), header_(std::move(h)) {}
  Status Send(const HttpRequest& request, HttpResponseHandler& handler) override {
    if (request.method != method_ || request.url.find(url_part_) == std::string::npos)
      return inner_->Send(request, handler);
    HttpRequest r = request;
    r.headers.push_back(header_);
    return inner_->Send(r, handler);
  }

 private:
  std::shared_ptr<HttpTransport> inner_;
  std::string method_, url_part_;
  HttpHeader header_;
};

class RadosgwTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* endpoint = std::getenv("DCR_S3_ENDPOINT");
    if (endpoint == nullptr || *endpoint == '\0') return;
    std::random_device rd;
    bucket_ = "dcr-s3-test-" + std::to_string(::getpid()) + "-" + std::to_string(rd() % 100000);
    Status s = CreateS3Bucket("s3://" + bucket_);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }

  void SetUp() override {
    if (bucket_.empty()) GTEST_SKIP() << "DCR_S3_ENDPOINT not set (start tests/s3/radosgw.sh)";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    url_ = "s3://" + bucket_ + "/" + info->name();
    auto store = OpenS3Store(url_);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(*store);
  }

  // The cluster is throw-away, but its memstore is small: leave nothing.
  void TearDown() override {
    if (!store_) return;
    auto all = store_->List("");
    if (all.ok())
      for (const auto& o : *all) store_->Delete(o.key).IgnoreError();
  }

  Result<std::unique_ptr<Store>> OpenWith(const std::string& extra_query, S3Runtime rt = {}) {
    DCR_ASSIGN_OR_RETURN(S3Options o, ParseS3Url(url_ + extra_query));
    return OpenS3Store(o, std::move(rt));
  }

  static std::string bucket_;
  std::string url_;
  std::unique_ptr<Store> store_;
};

std::string RadosgwTest::bucket_;

TEST_F(RadosgwTest, SmallEmptyAndMultipartRoundTrips) {
  ASSERT_TRUE(store_->Put("small", "hello radosgw").ok());
  ASSERT_TRUE(store_->Put("empty", "").ok());
  EXPECT_EQ(*store_->Get("small"), "hello radosgw");
  EXPECT_EQ(*store_->Get("empty"), "");

  // 5 MiB parts (S3's minimum), 3 parts and a tail, uploaded while written.
  auto store = OpenWith("?part_size=5m&parts_in_flight=3");
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const std::string big = Pattern((15 << 20) + 12345, 1);
  auto w = (*store)->OpenWriter("big", WriteMode::kOverwrite);
  ASSERT_TRUE(w.ok());
  for (size_t at = 0; at < big.size(); at += 1 << 20) ASSERT_TRUE((*w)->Write(big.substr(at, 1 << 20)).ok());
  Status closed = (*w)->Close();
  ASSERT_TRUE(closed.ok()) << closed.ToString();
  ObjectInfo info;
  auto got = (*store)->Get("big", &info);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(*got == big);
  EXPECT_EQ(info.size, big.size());
  EXPECT_THAT(info.etag, HasSubstr("-4"));  // a multipart ETag

  // Ranged reads, split and not, at the edges.
  for (auto [off, len] :
       std::vector<std::pair<uint64_t, size_t>>{{0, 1}, {(5 << 20) - 1, 2}, {1000, 11 << 20}, {big.size() - 10, 10}}) {
    std::string out(len, '\0');
    Status s = (*store)->ReadRange("big", off, {reinterpret_cast<uint8_t*>(out.data()), len});
    ASSERT_TRUE(s.ok()) << off << "+" << len << ": " << s.ToString();
    EXPECT_TRUE(out == big.substr(off, len)) << off << "+" << len;
  }
  std::string out(20, '\0');
  Status past = (*store)->ReadRange("big", big.size() - 10, {reinterpret_cast<uint8_t*>(out.data()), out.size()});
  EXPECT_EQ(past.code(), Code::kOutOfRange) << past.ToString();
  EXPECT_EQ((*store)->ReadRange("small", 13, {reinterpret_cast<uint8_t*>(out.data()), 1}).code(), Code::kOutOfRange);
  EXPECT_EQ((*store)->ReadRange("empty", 0, {reinterpret_cast<uint8_t*>(out.data()), 1}).code(), Code::kOutOfRange);
}

TEST_F(RadosgwTest, AbortedMultipartLeavesNothing) {
  auto store = OpenWith("?part_size=5m");
  ASSERT_TRUE(store.ok());
  auto w = (*store)->OpenWriter("aborted", WriteMode::kOverwrite);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Write(Pattern(11 << 20, 2)).ok());
  (*w)->Abort();
  EXPECT_EQ((*store)->Head("aborted").status().code(), Code::kNotFound);
}

TEST_F(RadosgwTest, ConditionalCreate) {
  ASSERT_TRUE(store_->Put("commit", "first", WriteMode::kCreateIfAbsent).ok());
  Status again = store_->Put("commit", "second", WriteMode::kCreateIfAbsent);
  EXPECT_EQ(again.code(), Code::kAlreadyExists) << again.ToString();
  EXPECT_EQ(*store_->Get("commit"), "first");
  // Larger than a part: still one conditional PUT.
  auto store = OpenWith("?part_size=5m");
  ASSERT_TRUE(store.ok());
  const std::string big = Pattern(12 << 20, 3);
  ASSERT_TRUE((*store)->Put("big-commit", big, WriteMode::kCreateIfAbsent).ok());
  EXPECT_EQ((*store)->Put("big-commit", "x", WriteMode::kCreateIfAbsent).code(), Code::kAlreadyExists);
  EXPECT_TRUE(*(*store)->Get("big-commit") == big);
  // The driver probed the server before the first create-if-absent write of
  // each store (issue 22); radosgw passes, and no probe object is left.
  auto probes = OpenS3Store(url_ + "/.dcr-probe");
  ASSERT_TRUE(probes.ok()) << probes.status().ToString();
  auto left = (*probes)->List("");
  ASSERT_TRUE(left.ok()) << left.status().ToString();
  EXPECT_TRUE(left->empty()) << left->size() << " probe objects left, e.g. " << left->front().key;
}

TEST_F(RadosgwTest, ConditionalCreateRace) {
  constexpr int kThreads = 8;
  for (int round = 0; round < 5; ++round) {
    const std::string key = "race-" + std::to_string(round);
    std::atomic<int> won{0}, lost{0}, other{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i)
      threads.emplace_back([&, i] {
        Status s = store_->Put(key, "writer " + std::to_string(i), WriteMode::kCreateIfAbsent);
        if (s.ok()) ++won;
        else if (s.code() == Code::kAlreadyExists) ++lost;
        else ++other;
      });
    for (auto& t : threads) t.join();
    EXPECT_EQ(won.load(), 1) << key;
    EXPECT_EQ(lost.load(), kThreads - 1) << key;
    EXPECT_EQ(other.load(), 0) << key;
  }
}

// Why kCreateIfAbsent never uses multipart: this server ignores
// If-None-Match on CompleteMultipartUpload (the completed upload replaces
// the existing object). If this starts failing, the server honours it now.
TEST_F(RadosgwTest, ServerIgnoresIfNoneMatchOnCompleteMultipart) {
  ASSERT_TRUE(store_->Put("probe", "existing").ok());
  auto base = ParseS3Url(url_ + "?part_size=5m");
  ASSERT_TRUE(base.ok());
  S3Runtime rt;
  rt.transport =
      std::make_shared<AddHeaderTransport>(NewCurlTransport(), "POST", "uploadId=", HttpHeader{"If-None-Match", "*"});
  auto store = OpenS3Store(*base, rt);
  ASSERT_TRUE(store.ok());
  const std::string big = Pattern(6 << 20, 4);
  Status s = (*store)->Put("probe", big);  // multipart, Complete carries If-None-Match: *
  auto now = store_->Get("probe");
  ASSERT_TRUE(now.ok());
  const bool honoured = !s.ok() && *now == "existing";
  std::cout << "[ radosgw ] If-None-Match on CompleteMultipartUpload: " << (honoured ? "honoured" : "IGNORED") << " ("
            << s.ToString() << ")\n";
  EXPECT_FALSE(honoured);
  EXPECT_TRUE(s.ok());
  EXPECT_TRUE(*now == big);
}

TEST_F(RadosgwTest, IfMatchReads) {
  ASSERT_TRUE(store_->Put("obj", "version one").ok());
  auto v1 = store_->Head("obj");
  ASSERT_TRUE(v1.ok());
  ASSERT_TRUE(store_->Put("obj", "version two").ok());
  std::string out(7, '\0');
  Status s = store_->ReadRange("obj", 0, {reinterpret_cast<uint8_t*>(out.data()), out.size()}, {.if_match = v1->etag});
  EXPECT_EQ(s.code(), Code::kAborted) << s.ToString();
}

TEST_F(RadosgwTest, ListingPagesAndPrefixes) {
  // More than one page of 1000.
  constexpr int kKeys = 1005;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      for (int i = t; i < kKeys; i += 8) {
        char key[32];
        std::snprintf(key, sizeof key, "k/%05d", i);
        if (!store_->Put(key, "").ok()) ++failures;
      }
    });
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  ASSERT_TRUE(store_->Put("kk", "x").ok());
  ASSERT_TRUE(store_->Put("odd key/+&=é", "x").ok());
  auto all = store_->List("");
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(all->size(), kKeys + 2u);
  auto k = store_->List("k/");
  ASSERT_TRUE(k.ok());
  ASSERT_EQ(k->size(), size_t{kKeys});
  EXPECT_EQ(k->front().key, "k/00000");
  EXPECT_EQ(k->back().key, "k/01004");
  auto odd = store_->List("odd");
  ASSERT_TRUE(odd.ok());
  ASSERT_EQ(odd->size(), 1u);
  EXPECT_EQ(odd->front().key, "odd key/+&=é");
  EXPECT_EQ(*store_->Get("odd key/+&=é"), "x");
}

TEST_F(RadosgwTest, WrongCredentialsArePermissionDenied) {
  auto store = OpenWith("?access_key_id=DCRNOSUCHKEY&secret_access_key=x");
  ASSERT_TRUE(store.ok());
  Status s = (*store)->Put("k", "v");
  EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("InvalidAccessKeyId"));
  const char* key = std::getenv("AWS_ACCESS_KEY_ID");
  ASSERT_NE(key, nullptr);
  auto bad_secret = OpenWith(std::string("?access_key_id=") + key + "&secret_access_key=wrong");
  ASSERT_TRUE(bad_secret.ok());
  s = (*bad_secret)->Put("k", "v");
  EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("SignatureDoesNotMatch"));
  EXPECT_THAT(s.message(), HasSubstr(url_ + ": k"));
}

TEST_F(RadosgwTest, MissingBucketIsNotFound) {
  auto store = OpenS3Store("s3://dcr-no-such-bucket-" + std::to_string(::getpid()));
  ASSERT_TRUE(store.ok());
  for (Status s : {(*store)->Put("k", "v"), (*store)->Get("k").status(), (*store)->Head("k").status(),
                   (*store)->List("").status()}) {
    EXPECT_EQ(s.code(), Code::kNotFound) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("no such bucket 'dcr-no-such-bucket-"));
  }
}

TEST_F(RadosgwTest, SkewedClockIsFailedPrecondition) {
  S3Runtime rt;
  rt.now = [] { return std::chrono::system_clock::now() + std::chrono::hours(2); };
  auto store = OpenWith("", rt);
  ASSERT_TRUE(store.ok());
  Status s = (*store)->Put("k", "v");
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("clock skew"));
}

// radosgw 16 accepts a signature for any region (AWS answers
// AuthorizationHeaderMalformed); either way the outcome is clear.
TEST_F(RadosgwTest, WrongRegionIsAcceptedOrNamed) {
  auto store = OpenWith("?region=us-west-2");
  ASSERT_TRUE(store.ok());
  Status s = (*store)->Put("k", "v");
  if (!s.ok()) {
    EXPECT_THAT(s.message(), HasSubstr("region")) << s.ToString();
  }
}

TEST_F(RadosgwTest, Throughput) {
  // Not a benchmark (docs/benchmarks.md has those): a smoke check that
  // parallel parts and ranged GETs move a 64 MiB object correctly.
  auto store = OpenWith("?part_size=8m&parts_in_flight=4");
  ASSERT_TRUE(store.ok());
  const std::string data = Pattern(64 << 20, 5);
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE((*store)->Put("64m", data).ok());
  auto t1 = std::chrono::steady_clock::now();
  auto got = (*store)->Get("64m");
  auto t2 = std::chrono::steady_clock::now();
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(*got == data);
  auto mibs = [](auto d) { return 64.0 / std::chrono::duration<double>(d).count(); };
  std::cout << "[ radosgw ] 64 MiB put " << mibs(t1 - t0) << " MiB/s, get " << mibs(t2 - t1) << " MiB/s\n";
  ASSERT_TRUE((*store)->Delete("64m").ok());
}

}  // namespace
}  // namespace dcr
