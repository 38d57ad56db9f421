// The S3 driver against an in-memory fake server (testing/s3_fake.h) with faults
// injected, and a fake clock: every operation either succeeds with the right
// bytes or fails with the right code, and nothing partial becomes visible.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "dcr/s3.h"
#include "testing/s3_fake.h"

namespace dcr {
namespace {

using testing::FakeS3;
using ::testing::HasSubstr;
using Fault = FakeS3::Fault;
using std::chrono::milliseconds;

std::string Pattern(size_t n, uint32_t seed = 1) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (auto& c : s) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  return s;
}

std::span<uint8_t> Bytes(std::string& s) { return {reinterpret_cast<uint8_t*>(s.data()), s.size()}; }

class S3StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fake_ = std::make_shared<FakeS3>();
    fake_->now = [this] { return ServerNow(); };
    fake_->AddBucket("bkt");
    store_ = Open(Options());
  }

  std::chrono::system_clock::time_point ServerNow() const {
    return std::chrono::system_clock::time_point(std::chrono::seconds(1'700'000'000)) + milliseconds(clock_ms_.load());
  }

  S3Options Options() const {
    S3Options o;
    o.bucket = "bkt";
    o.prefix = "run/";
    o.endpoint = "http://" + fake_->host;
    o.access_key_id = fake_->access_key;
    o.secret_access_key = fake_->secret_key;
    o.credentials_source = "the test";
    o.part_size = 1024;
    o.parts_in_flight = 3;
    o.threads = 8;
    o.max_attempts = 5;
    o.url = "s3://bkt/run";
    return o;
  }

  S3Runtime Runtime() {
    S3Runtime rt;
    rt.transport = fake_;
    rt.now = [this] { return ServerNow() + client_skew_; };
    rt.sleep = [this](milliseconds d) {
      std::lock_guard<std::mutex> lock(mu_);
      sleeps_.push_back(d);
      clock_ms_ += d.count();
    };
    return rt;
  }

  std::unique_ptr<Store> Open(const S3Options& o) {
    auto s = OpenS3Store(o, Runtime());
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(*s) : nullptr;
  }

  // Faults for the first `n` requests of operation `op`, then none.
  void FailFirst(const std::string& op, int n, Fault fault) {
    auto left = std::make_shared<std::atomic<int>>(n);
    fake_->SetInjector([op, left, fault](const std::string& o, const HttpRequest&) {
      if (o == op && left->fetch_sub(1) > 0) return fault;
      return Fault{};
    });
  }

  // The store's first create-if-absent write probes the server first; tests
  // that count a create-if-absent write's requests get that done before.
  void Probe() { ASSERT_TRUE(store_->Put("probed", "x", WriteMode::kCreateIfAbsent).ok()); }

  std::optional<std::string> Stored(const std::string& key) {
    auto o = fake_->Get("bkt", "run/" + key);
    if (!o) return std::nullopt;
    return o->data;
  }

  size_t Sleeps() {
    std::lock_guard<std::mutex> lock(mu_);
    return sleeps_.size();
  }

  std::shared_ptr<FakeS3> fake_;
  std::unique_ptr<Store> store_;
  std::atomic<int64_t> clock_ms_{0};
  std::chrono::system_clock::duration client_skew_{0};
  std::mutex mu_;
  std::vector<milliseconds> sleeps_;
};

// ---------------------------------------------------------------------------
// Round trips.

TEST_F(S3StoreTest, SmallObjectRoundTrip) {
  ASSERT_TRUE(store_->Put("a/b.bin", "hello").ok());
  EXPECT_EQ(Stored("a/b.bin"), "hello");
  EXPECT_EQ(fake_->Count("PutObject"), 1);
  ObjectInfo info;
  auto got = store_->Get("a/b.bin", &info);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, "hello");
  EXPECT_EQ(info.key, "a/b.bin");
  EXPECT_EQ(info.size, 5u);
  EXPECT_EQ(info.etag, FakeS3::Md5Etag("hello"));
  auto head = store_->Head("a/b.bin");
  ASSERT_TRUE(head.ok());
  EXPECT_EQ(head->size, 5u);
  EXPECT_EQ(head->etag, info.etag);
  EXPECT_EQ(store_->url(), "s3://bkt/run");
}

TEST_F(S3StoreTest, EmptyObject) {
  ASSERT_TRUE(store_->Put("empty", "").ok());
  auto got = store_->Get("empty");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, "");
  auto head = store_->Head("empty");
  ASSERT_TRUE(head.ok());
  EXPECT_EQ(head->size, 0u);
  EXPECT_TRUE(store_->ReadRange("empty", 0, {}).ok());
  EXPECT_EQ(store_->ReadRange("empty", 1, {}).code(), Code::kOutOfRange);
  std::string one(1, '\0');
  EXPECT_EQ(store_->ReadRange("empty", 0, Bytes(one)).code(), Code::kOutOfRange);
}

TEST_F(S3StoreTest, MultipartStreamsPartsWhileWriting) {
  fake_->part_delay = milliseconds(20);
  const std::string data = Pattern(10 * 1024 + 100);
  auto w = store_->OpenWriter("big", WriteMode::kOverwrite);
  ASSERT_TRUE(w.ok());
  for (size_t at = 0; at < data.size(); at += 300) ASSERT_TRUE((*w)->Write(data.substr(at, 300)).ok());
  // Parts went out while the producer was still writing.
  EXPECT_GE(fake_->Count("UploadPart"), 8);
  EXPECT_FALSE(Stored("big").has_value());  // nothing visible before Close
  ASSERT_TRUE((*w)->Close().ok());
  EXPECT_EQ(Stored("big"), data);
  EXPECT_EQ(fake_->Count("UploadPart"), 11);
  EXPECT_EQ(fake_->Count("CompleteMultipartUpload"), 1);
  EXPECT_EQ(fake_->OpenUploads(), 0u);
  // Parallel, but never more than parts_in_flight at once (bounded memory).
  EXPECT_GE(fake_->MaxPartsInFlight(), 2);
  EXPECT_LE(fake_->MaxPartsInFlight(), 3);

  auto got = store_->Get("big");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, data);
}

TEST_F(S3StoreTest, ExactlyOnePartIsASinglePut) {
  ASSERT_TRUE(store_->Put("one", Pattern(1024)).ok());
  EXPECT_EQ(fake_->Count("PutObject"), 1);
  EXPECT_EQ(fake_->Count("CreateMultipartUpload"), 0);
  auto w = store_->OpenWriter("one-w", WriteMode::kOverwrite);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Write(Pattern(1024)).ok());
  ASSERT_TRUE((*w)->Close().ok());
  // A writer whose first part exactly fills starts multipart at once; the
  // result is the same object.
  EXPECT_EQ(Stored("one-w"), Pattern(1024));
}

TEST_F(S3StoreTest, PartSizeDoublesEvery1000Parts) {
  S3Options o = Options();
  o.part_size = 1;
  o.parts_in_flight = 8;
  auto store = Open(o);
  const std::string data = Pattern(1000 + 2 * 3);
  ASSERT_TRUE(store->Put("many", data).ok());
  EXPECT_EQ(fake_->Count("UploadPart"), 1003);
  EXPECT_EQ(Stored("many"), data);
}

TEST_F(S3StoreTest, ParallelRangedReads) {
  const std::string data = Pattern(10 * 1024 + 7);
  fake_->PutDirect("bkt", "run/obj", data);
  std::string out(8 * 1024 + 10, '\0');
  ASSERT_TRUE(store_->ReadRange("obj", 1000, Bytes(out)).ok());
  EXPECT_EQ(out, data.substr(1000, out.size()));
  EXPECT_EQ(fake_->Count("GetObject"), 9);  // ceil(8202 / 1024)
  // The whole object: one GET for the first part, the rest in parallel.
  auto got = store_->Get("obj");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, data);
  EXPECT_EQ(fake_->Count("GetObject"), 9 + 11);
}

TEST_F(S3StoreTest, RangesAtTheBoundaries) {
  const std::string data = Pattern(3000);
  fake_->PutDirect("bkt", "run/obj", data);
  for (uint64_t off : {0u, 1u, 1023u, 1024u, 2999u}) {
    for (size_t len : {size_t{1}, size_t{1024}, size_t{3000 - off}}) {
      if (off + len > 3000) continue;
      std::string out(len, '\0');
      ASSERT_TRUE(store_->ReadRange("obj", off, Bytes(out)).ok()) << off << "+" << len;
      EXPECT_EQ(out, data.substr(off, len));
    }
  }
  std::string out(10, '\0');
  Status past = store_->ReadRange("obj", 2995, Bytes(out));
  EXPECT_EQ(past.code(), Code::kOutOfRange);
  EXPECT_THAT(past.message(), HasSubstr("3000 byte object"));
  EXPECT_EQ(store_->ReadRange("obj", 3000, Bytes(out)).code(), Code::kOutOfRange);
  EXPECT_EQ(store_->ReadRange("obj", 5000, Bytes(out)).code(), Code::kOutOfRange);
  std::string big(4000, '\0');
  EXPECT_EQ(store_->ReadRange("obj", 0, Bytes(big)).code(), Code::kOutOfRange);  // split read
  EXPECT_TRUE(store_->ReadRange("obj", 3000, {}).ok());
  EXPECT_EQ(store_->ReadRange("obj", 3001, {}).code(), Code::kOutOfRange);
}

TEST_F(S3StoreTest, IfMatchDetectsReplacement) {
  ASSERT_TRUE(store_->Put("obj", "version one").ok());
  auto head = store_->Head("obj");
  ASSERT_TRUE(head.ok());
  ASSERT_TRUE(store_->Put("obj", "version two").ok());
  std::string out(7, '\0');
  Status s = store_->ReadRange("obj", 0, Bytes(out), {.if_match = head->etag});
  EXPECT_EQ(s.code(), Code::kAborted) << s.ToString();
  EXPECT_EQ(store_->ReadRange("obj", 0, {}, {.if_match = head->etag}).code(), Code::kAborted);
  auto now = store_->Head("obj");
  ASSERT_TRUE(now.ok());
  EXPECT_TRUE(store_->ReadRange("obj", 0, Bytes(out), {.if_match = now->etag}).ok());
  EXPECT_EQ(out, "version");
}

TEST_F(S3StoreTest, SplitReadsAreOfOneVersion) {
  const std::string v1 = Pattern(5000, 1), v2 = Pattern(5000, 2);
  fake_->PutDirect("bkt", "run/obj", v1);
  // The object is replaced right after the first GET of the first read.
  auto replaced = std::make_shared<std::atomic<bool>>(false);
  fake_->SetInjector([this, replaced, v2](const std::string& op, const HttpRequest&) {
    if (op == "GetObject" && !replaced->exchange(true)) fake_->PutDirect("bkt", "run/obj", v2);
    return Fault{};
  });
  auto got = store_->Get("obj");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, v2);  // re-read whole, never a mix
  replaced->store(false);
  std::string out(5000, '\0');
  ASSERT_TRUE(store_->ReadRange("obj", 0, Bytes(out)).ok());
  EXPECT_EQ(out, v2);
}

TEST_F(S3StoreTest, ListPagesPrefixesAndSkipsForeignNames) {
  fake_->max_keys = 3;
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(store_->Put("a/" + std::to_string(i), std::string(i, 'x')).ok());
  ASSERT_TRUE(store_->Put("ab", "").ok());
  ASSERT_TRUE(store_->Put("b/c", "").ok());
  fake_->PutDirect("bkt", "other/x", "not ours");
  fake_->PutDirect("bkt", "run/dir/", "");  // a console's folder marker: not a valid key
  fake_->PutDirect("bkt", "run/.dcr-tmp/x", "");  // reserved
  auto all = store_->List("");
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->size(), 12u);
  EXPECT_EQ((*all)[0].key, "a/0");
  EXPECT_EQ((*all)[10].key, "ab");
  EXPECT_EQ((*all)[11].key, "b/c");
  EXPECT_EQ((*all)[5].size, 5u);
  EXPECT_EQ((*all)[5].etag, FakeS3::Md5Etag("xxxxx"));
  auto a = store_->List("a/");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->size(), 10u);
  auto a_any = store_->List("a");
  ASSERT_TRUE(a_any.ok());
  EXPECT_EQ(a_any->size(), 11u);
  auto none = store_->List("zzz");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  EXPECT_GE(fake_->Count("ListObjectsV2"), 5);
}

TEST_F(S3StoreTest, UnusualKeyCharacters) {
  const std::vector<std::string> keys = {
      "sp ace/x",   "plus+eq=amp&q?hash#", "pct%20lit",           "utf8/\xc3\xa9\xe2\x82\xac",
      "quote'\"<>", "tilde~star*(paren)",  "colon:semi;comma,at@"};
  for (const auto& k : keys) ASSERT_TRUE(store_->Put(k, "v:" + k).ok()) << k;
  for (const auto& k : keys) {
    auto got = store_->Get(k);
    ASSERT_TRUE(got.ok()) << k << ": " << got.status().ToString();
    EXPECT_EQ(*got, "v:" + k);
    EXPECT_EQ(Stored(k), "v:" + k);
  }
  auto all = store_->List("");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), keys.size());
}

TEST_F(S3StoreTest, DeleteIsIdempotent) {
  ASSERT_TRUE(store_->Put("x", "1").ok());
  ASSERT_TRUE(store_->Delete("x").ok());
  EXPECT_FALSE(Stored("x").has_value());
  EXPECT_TRUE(store_->Delete("x").ok());
  EXPECT_EQ(store_->Head("x").status().code(), Code::kNotFound);
  EXPECT_EQ(store_->Get("x").status().code(), Code::kNotFound);
}

TEST_F(S3StoreTest, BadKeysAreRejectedBeforeAnyRequest) {
  for (const std::string& k : std::vector<std::string>{"", "/abs", "a//b", "../x", "a/./b", ".dcr-tmp", "a\x01"}) {
    EXPECT_EQ(store_->Put(k, "x").code(), Code::kInvalidArgument) << k;
    EXPECT_EQ(store_->Head(k).status().code(), Code::kInvalidArgument) << k;
  }
  EXPECT_EQ(fake_->Count("PutObject") + fake_->Count("HeadObject"), 0);
}

TEST_F(S3StoreTest, VirtualHostedAddressing) {
  S3Options o = Options();
  o.addressing = S3Addressing::kVirtual;
  auto store = Open(o);
  ASSERT_TRUE(store->Put("k", "virtual").ok());
  EXPECT_EQ(Stored("k"), "virtual");
  EXPECT_EQ(*FindHeader(fake_->LastHeaders("PutObject"), "host"), "bkt.s3.fake.test");
  auto got = store->Get("k");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  auto list = store->List("");
  ASSERT_TRUE(list.ok()) << list.status().ToString();
  EXPECT_EQ(list->size(), 1u);
}

TEST_F(S3StoreTest, SessionTokenIsSentAndSigned) {
  S3Options o = Options();
  o.session_token = "token/with+chars=";
  auto store = Open(o);
  ASSERT_TRUE(store->Put("k", "v").ok());
  const HttpHeaders h = fake_->LastHeaders("PutObject");
  ASSERT_NE(FindHeader(h, "x-amz-security-token"), nullptr);
  EXPECT_EQ(*FindHeader(h, "x-amz-security-token"), "token/with+chars=");
  EXPECT_THAT(*FindHeader(h, "authorization"), HasSubstr("x-amz-security-token"));
  EXPECT_NE(FindHeader(h, "x-amz-content-sha256"), nullptr);
}

// ---------------------------------------------------------------------------
// Conditional create.

TEST_F(S3StoreTest, CreateIfAbsent) {
  ASSERT_TRUE(store_->Put("commit", "mine", WriteMode::kCreateIfAbsent).ok());
  Status again = store_->Put("commit", "theirs", WriteMode::kCreateIfAbsent);
  EXPECT_EQ(again.code(), Code::kAlreadyExists) << again.ToString();
  EXPECT_THAT(again.message(), HasSubstr("s3://bkt/run: commit"));
  EXPECT_EQ(Stored("commit"), "mine");
  EXPECT_EQ(*FindHeader(fake_->LastHeaders("PutObject"), "if-none-match"), "*");
  // Through a writer too.
  auto w = store_->OpenWriter("commit", WriteMode::kCreateIfAbsent);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Write("theirs").ok());
  EXPECT_EQ((*w)->Close().code(), Code::kAlreadyExists);
  EXPECT_EQ(Stored("commit"), "mine");
}

TEST_F(S3StoreTest, LargeCreateIfAbsentIsOneConditionalPut) {
  const std::string data = Pattern(5000);
  auto w = store_->OpenWriter("big-commit", WriteMode::kCreateIfAbsent);
  ASSERT_TRUE(w.ok());
  for (size_t at = 0; at < data.size(); at += 700) ASSERT_TRUE((*w)->Write(data.substr(at, 700)).ok());
  ASSERT_TRUE((*w)->Close().ok());
  EXPECT_EQ(Stored("big-commit"), data);
  EXPECT_EQ(fake_->Count("CreateMultipartUpload"), 0);
  EXPECT_EQ(store_->Put("big-commit", data + "x", WriteMode::kCreateIfAbsent).code(), Code::kAlreadyExists);
  EXPECT_EQ(fake_->Count("CreateMultipartUpload"), 0);
}

TEST_F(S3StoreTest, CreateIfAbsentOverTheLimitFailsAndWritesNothing) {
  S3Options o = Options();
  o.create_if_absent_limit = 4096;
  auto store = Open(o);
  auto w = store->OpenWriter("huge", WriteMode::kCreateIfAbsent);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Write(Pattern(4000)).ok());
  Status s = (*w)->Write(Pattern(200));
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("create_if_absent_limit"));
  EXPECT_EQ((*w)->Close().code(), Code::kInvalidArgument);
  EXPECT_FALSE(Stored("huge").has_value());
  EXPECT_EQ(store->Put("huge", Pattern(5000), WriteMode::kCreateIfAbsent).code(), Code::kInvalidArgument);
  EXPECT_EQ(fake_->Count("PutObject") + fake_->Count("CreateMultipartUpload"), 0);
}

TEST_F(S3StoreTest, ConditionalPutWhoseResponseWasLostIsOurs) {
  Probe();
  const int puts = fake_->Count("PutObject"), heads = fake_->Count("HeadObject");
  FailFirst("PutObject", 1, {Fault::kLoseResponse});
  Status s = store_->Put("commit", "mine", WriteMode::kCreateIfAbsent);
  EXPECT_TRUE(s.ok()) << s.ToString();  // the retry's 412 is our own write
  EXPECT_EQ(Stored("commit"), "mine");
  EXPECT_EQ(fake_->Count("PutObject") - puts, 2);
  EXPECT_EQ(fake_->Count("HeadObject") - heads, 1);
}

TEST_F(S3StoreTest, ConditionalPutLosingARaceDuringRetryIsAlreadyExists) {
  // The first try never lands; another writer creates the key; the retry
  // finds it and its ETag is not ours.
  Probe();
  auto first = std::make_shared<std::atomic<bool>>(true);
  fake_->SetInjector([this, first](const std::string& op, const HttpRequest&) {
    if (op == "PutObject" && first->exchange(false)) {
      fake_->PutDirect("bkt", "run/commit", "theirs");
      return Fault{Fault::kRefuse};
    }
    return Fault{};
  });
  EXPECT_EQ(store_->Put("commit", "mine", WriteMode::kCreateIfAbsent).code(), Code::kAlreadyExists);
  EXPECT_EQ(Stored("commit"), "theirs");
}

TEST_F(S3StoreTest, LostCompleteResponseIsConfirmedByEtag) {
  FailFirst("CompleteMultipartUpload", 1, {Fault::kLoseResponse});
  const std::string data = Pattern(3000);
  Status s = store_->Put("big", data);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(Stored("big"), data);
  EXPECT_EQ(fake_->Count("CompleteMultipartUpload"), 2);  // the retry found NoSuchUpload, then HEAD
  EXPECT_EQ(fake_->OpenUploads(), 0u);
}

TEST_F(S3StoreTest, CompleteThatLandedBeforeRetriesRanOutIsConfirmed) {
  // The first Complete lands but its reply is lost; every retry times out
  // before reaching the server. The object is ours: Close must say so.
  fake_->SetInjector([this](const std::string& op, const HttpRequest&) {
    if (op != "CompleteMultipartUpload") return Fault{};
    return fake_->Count(op) == 1 ? Fault{Fault::kLoseResponse} : Fault{Fault::kTimeout};
  });
  const std::string data = Pattern(3000);
  Status s = store_->Put("big", data);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(Stored("big"), data);
  EXPECT_EQ(fake_->Count("CompleteMultipartUpload"), 5);
}

TEST_F(S3StoreTest, LostCompleteThenReplacedIsAborted) {
  auto first = std::make_shared<std::atomic<bool>>(true);
  fake_->SetInjector([this, first](const std::string& op, const HttpRequest&) {
    if (op == "CompleteMultipartUpload" && !first->exchange(false)) fake_->PutDirect("bkt", "run/big", "other");
    return op == "CompleteMultipartUpload" && fake_->Count(op) == 1 ? Fault{Fault::kLoseResponse} : Fault{};
  });
  EXPECT_EQ(store_->Put("big", Pattern(3000)).code(), Code::kAborted);
}

// ---------------------------------------------------------------------------
// Transient failures are retried; persistent ones end with the right code.

struct TransientCase {
  std::string op;
  Fault fault;
};

class S3TransientTest : public S3StoreTest, public ::testing::WithParamInterface<TransientCase> {};

std::string CaseName(const ::testing::TestParamInfo<TransientCase>& info) {
  static const char* kinds[] = {"none", "status", "refuse", "timeout", "lost", "drop", "truncate"};
  const Fault& f = info.param.fault;
  return info.param.op + "_" + kinds[f.kind] + (f.status ? std::to_string(f.status) : "");
}

TEST_P(S3TransientTest, RetriedUntilSuccess) {
  const TransientCase& c = GetParam();
  const std::string big = Pattern(3000), small = "small object";
  fake_->PutDirect("bkt", "run/existing", big);
  FailFirst(c.op, 2, c.fault);
  // Exercise every operation; each must succeed with the right bytes.
  ASSERT_TRUE(store_->Put("small", small).ok());
  ASSERT_TRUE(store_->Put("big", big).ok());
  ASSERT_TRUE(store_->Put("cond", small, WriteMode::kCreateIfAbsent).ok());
  auto got = store_->Get("existing");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, big);
  std::string out(2500, '\0');
  ASSERT_TRUE(store_->ReadRange("existing", 300, Bytes(out)).ok());
  EXPECT_EQ(out, big.substr(300, 2500));
  auto head = store_->Head("existing");
  ASSERT_TRUE(head.ok());
  EXPECT_EQ(head->size, big.size());
  auto list = store_->List("");
  ASSERT_TRUE(list.ok()) << list.status().ToString();
  EXPECT_EQ(list->size(), 4u);
  ASSERT_TRUE(store_->Delete("small").ok());
  EXPECT_EQ(Stored("big"), big);
  EXPECT_EQ(Stored("cond"), small);
  EXPECT_FALSE(Stored("small").has_value());
  EXPECT_EQ(fake_->OpenUploads(), 0u);
  EXPECT_GE(Sleeps(), 2u);
}

INSTANTIATE_TEST_SUITE_P(
    Faults, S3TransientTest,
    ::testing::Values(TransientCase{"PutObject", {Fault::kStatus, 503, "SlowDown"}},
                      TransientCase{"PutObject", {Fault::kStatus, 500, "InternalError"}},
                      TransientCase{"PutObject", {Fault::kLoseResponse}}, TransientCase{"PutObject", {Fault::kTimeout}},
                      TransientCase{"UploadPart", {Fault::kStatus, 503, "SlowDown"}},
                      TransientCase{"UploadPart", {Fault::kDropMidBody}}, TransientCase{"UploadPart", {Fault::kRefuse}},
                      TransientCase{"CreateMultipartUpload", {Fault::kStatus, 502, "BadGateway"}},
                      TransientCase{"CompleteMultipartUpload", {Fault::kStatus, 500, "InternalError"}},
                      TransientCase{"CompleteMultipartUpload", {Fault::kTimeout}},
                      TransientCase{"GetObject", {Fault::kDropMidBody}}, TransientCase{"GetObject", {Fault::kTruncate}},
                      TransientCase{"GetObject", {Fault::kStatus, 429, "TooManyRequests"}},
                      TransientCase{"GetObject", {Fault::kStatus, 504, "GatewayTimeout"}},
                      TransientCase{"GetObject", {Fault::kTimeout}},
                      TransientCase{"HeadObject", {Fault::kStatus, 503, "SlowDown"}},
                      TransientCase{"ListObjectsV2", {Fault::kTruncate}},
                      TransientCase{"ListObjectsV2", {Fault::kStatus, 400, "RequestTimeout"}},
                      TransientCase{"DeleteObject", {Fault::kRefuse}}),
    CaseName);

TEST_F(S3StoreTest, PersistentThrottlingGivesUpUnavailable) {
  fake_->PutDirect("bkt", "run/obj", "data");
  FailFirst("GetObject", 1000, {Fault::kStatus, 503, "SlowDown"});
  auto got = store_->Get("obj");
  EXPECT_EQ(got.status().code(), Code::kUnavailable);
  EXPECT_THAT(got.status().message(), HasSubstr("s3://bkt/run: obj"));
  EXPECT_THAT(got.status().message(), HasSubstr("SlowDown"));
  EXPECT_THAT(got.status().message(), HasSubstr("gave up after 5 attempts"));
  EXPECT_EQ(fake_->Count("GetObject"), 5);
  // Full jitter within an exponentially growing, capped window.
  std::lock_guard<std::mutex> lock(mu_);
  ASSERT_EQ(sleeps_.size(), 4u);
  for (size_t i = 0; i < sleeps_.size(); ++i) EXPECT_LE(sleeps_[i].count(), 100 << i);
}

TEST_F(S3StoreTest, PersistentTimeoutsGiveUpDeadlineExceeded) {
  FailFirst("PutObject", 1000, {Fault::kTimeout});
  Status s = store_->Put("k", "v");
  EXPECT_EQ(s.code(), Code::kDeadlineExceeded) << s.ToString();
  EXPECT_FALSE(Stored("k").has_value());
}

TEST_F(S3StoreTest, PersistentTruncationNeverReturnsShortData) {
  fake_->PutDirect("bkt", "run/obj", Pattern(3000));
  FailFirst("GetObject", 1000, {Fault::kTruncate});
  auto got = store_->Get("obj");
  EXPECT_EQ(got.status().code(), Code::kUnavailable);
  EXPECT_THAT(got.status().message(), HasSubstr("truncated"));
  std::string out(2000, '\0');
  Status s = store_->ReadRange("obj", 0, Bytes(out));
  EXPECT_EQ(s.code(), Code::kUnavailable);
}

TEST_F(S3StoreTest, FailedPartAbortsTheUploadAndPublishesNothing) {
  FailFirst("UploadPart", 1000, {Fault::kStatus, 403, "AccessDenied"});
  auto w = store_->OpenWriter("big", WriteMode::kOverwrite);
  ASSERT_TRUE(w.ok());
  Status s;
  for (int i = 0; i < 10 && s.ok(); ++i) s = (*w)->Write(Pattern(1000));
  if (s.ok()) s = (*w)->Close();
  EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("s3://bkt/run: big"));
  EXPECT_EQ((*w)->Close().code(), Code::kPermissionDenied);  // stays failed
  EXPECT_FALSE(Stored("big").has_value());
  EXPECT_EQ(fake_->Count("AbortMultipartUpload"), 1);
  EXPECT_EQ(fake_->OpenUploads(), 0u);
}

TEST_F(S3StoreTest, AbortAndDestructionDiscardTheUpload) {
  {
    auto w = store_->OpenWriter("aborted", WriteMode::kOverwrite);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write(Pattern(5000)).ok());
    (*w)->Abort();
    (*w)->Abort();  // idempotent
    EXPECT_EQ((*w)->Close().code(), Code::kFailedPrecondition);
    EXPECT_EQ((*w)->Write("x").code(), Code::kFailedPrecondition);
  }
  {
    auto w = store_->OpenWriter("dropped", WriteMode::kOverwrite);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write(Pattern(5000)).ok());
  }  // destroyed without Close
  {
    auto w = store_->OpenWriter("small-dropped", WriteMode::kOverwrite);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write("x").ok());
  }
  EXPECT_FALSE(Stored("aborted").has_value());
  EXPECT_FALSE(Stored("dropped").has_value());
  EXPECT_FALSE(Stored("small-dropped").has_value());
  EXPECT_EQ(fake_->OpenUploads(), 0u);
  EXPECT_EQ(fake_->Count("AbortMultipartUpload"), 2);
}

TEST_F(S3StoreTest, FailedCompleteAbortsTheUpload) {
  FailFirst("CompleteMultipartUpload", 1000, {Fault::kStatus, 400, "InvalidPart"});
  EXPECT_EQ(store_->Put("big", Pattern(3000)).code(), Code::kInvalidArgument);
  EXPECT_FALSE(Stored("big").has_value());
  EXPECT_EQ(fake_->OpenUploads(), 0u);
}

// ---------------------------------------------------------------------------
// Bad input: each gives a clear error naming the store, the key and the cause.

TEST_F(S3StoreTest, WrongSecretIsPermissionDenied) {
  S3Options o = Options();
  o.secret_access_key = "wrong";
  auto store = Open(o);
  Status s = store->Put("k", "v");
  EXPECT_EQ(s.code(), Code::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("s3://bkt/run: k"));
  EXPECT_THAT(s.message(), HasSubstr("SignatureDoesNotMatch"));
  EXPECT_THAT(s.message(), HasSubstr("credentials: the test"));
  EXPECT_EQ(fake_->Count("PutObject"), 1);  // not retried
}

TEST_F(S3StoreTest, UnknownAccessKeyIsPermissionDenied) {
  S3Options o = Options();
  o.access_key_id = "AKIDUNKNOWN";
  auto store = Open(o);
  auto s = store->Head("k");
  EXPECT_EQ(s.status().code(), Code::kPermissionDenied);
  EXPECT_THAT(store->Get("k").status().message(), HasSubstr("InvalidAccessKeyId"));
}

TEST_F(S3StoreTest, SkewedClockIsFailedPrecondition) {
  client_skew_ = std::chrono::hours(1);
  Status s = store_->Put("k", "v");
  EXPECT_EQ(s.code(), Code::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("clock skew"));
  EXPECT_THAT(s.message(), HasSubstr("RequestTimeTooSkewed"));
}

TEST_F(S3StoreTest, WrongRegionIsInvalidArgument) {
  S3Options o = Options();
  o.region = "eu-west-1";
  auto store = Open(o);
  Status s = store->Put("k", "v");
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("AuthorizationHeaderMalformed"));
}

TEST_F(S3StoreTest, MissingBucketIsNotFoundNamingIt) {
  S3Options o = Options();
  o.bucket = "nob";
  o.url = "s3://nob/run";
  auto store = Open(o);
  for (Status s : {store->Put("k", "v"), store->Get("k").status(), store->Head("k").status(), store->List("").status(),
                   store->Delete("k"), store->Put("k", Pattern(3000))}) {
    EXPECT_EQ(s.code(), Code::kNotFound) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("bucket 'nob'"));
    EXPECT_THAT(s.message(), HasSubstr("s3://nob/run"));
  }
}

TEST_F(S3StoreTest, MissingKeyIsNotFound) {
  auto head = store_->Head("missing/key");
  EXPECT_EQ(head.status().code(), Code::kNotFound);
  EXPECT_THAT(head.status().message(), HasSubstr("s3://bkt/run: missing/key: no such key"));
  std::string out(4, '\0');
  EXPECT_EQ(store_->ReadRange("missing/key", 0, Bytes(out)).code(), Code::kNotFound);
  EXPECT_EQ(store_->Get("missing/key").status().code(), Code::kNotFound);
}

TEST_F(S3StoreTest, CreateBucket) {
  S3Options o = Options();
  o.bucket = "fresh";
  o.create_bucket = true;
  auto store = Open(o);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Put("k", "v").ok());
  EXPECT_TRUE(CreateS3Bucket(o, Runtime()).ok());  // ours already: fine
  EXPECT_EQ(fake_->Count("CreateBucket"), 2);
}

TEST_F(S3StoreTest, ConcurrentCreateIfAbsentHasOneWinner) {
  constexpr int kThreads = 8;
  std::atomic<int> won{0}, lost{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] {
      Status s = store_->Put("race", "writer " + std::to_string(i), WriteMode::kCreateIfAbsent);
      if (s.ok()) ++won;
      else if (s.code() == Code::kAlreadyExists) ++lost;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(won.load(), 1);
  EXPECT_EQ(lost.load(), kThreads - 1);
}

// Issue 22: a server that ignores If-None-Match: * would let a second commit
// overwrite the first; the store's first create-if-absent write finds out.
TEST_F(S3StoreTest, ProbeOfConditionalCreateRunsOnceAndLeavesNothing) {
  std::vector<std::string> put_urls;
  std::mutex mu;
  fake_->SetInjector([&](const std::string& op, const HttpRequest& req) {
    std::lock_guard<std::mutex> lock(mu);
    if (op == "PutObject") put_urls.push_back(req.url);
    return Fault{};
  });
  ASSERT_TRUE(store_->Put("plain", "v").ok());  // overwrites do not probe
  EXPECT_EQ(fake_->Count("PutObject"), 1);
  ASSERT_TRUE(store_->Put("commit", "mine", WriteMode::kCreateIfAbsent).ok());
  EXPECT_EQ(fake_->Count("PutObject"), 4);  // the probe twice, then the write
  EXPECT_EQ(fake_->Count("DeleteObject"), 1);
  ASSERT_EQ(put_urls.size(), 4u);
  EXPECT_THAT(put_urls[1], HasSubstr("/bkt/run/.dcr-probe/"));
  EXPECT_EQ(put_urls[1], put_urls[2]);
  EXPECT_EQ(fake_->ObjectCount("bkt"), 2u);  // plain and commit: the probe is gone
  EXPECT_EQ(store_->Put("commit", "theirs", WriteMode::kCreateIfAbsent).code(), Code::kAlreadyExists);
  EXPECT_EQ(fake_->Count("PutObject"), 5);  // once per store
  EXPECT_EQ(store_->List("")->size(), 2u);
}

TEST_F(S3StoreTest, ServerIgnoringIfNoneMatchIsRefusedBeforeAnyCreate) {
  fake_->honour_if_none_match = false;
  for (int i = 0; i < 2; ++i) {
    Status s = store_->Put("commit", "mine", WriteMode::kCreateIfAbsent);
    EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("ignores If-None-Match: *"));
    EXPECT_THAT(s.message(), HasSubstr("s3://bkt/run: commit"));
  }
  auto w = store_->OpenWriter("commit", WriteMode::kCreateIfAbsent);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Write("mine").ok());
  EXPECT_EQ((*w)->Close().code(), Code::kFailedPrecondition);
  EXPECT_FALSE(Stored("commit").has_value());
  EXPECT_EQ(fake_->Count("PutObject"), 2);  // one probe; its outcome is kept
  EXPECT_EQ(fake_->ObjectCount("bkt"), 0u);  // and deleted
  EXPECT_TRUE(store_->Put("plain", "v").ok());  // overwrites never relied on it
}

TEST_F(S3StoreTest, ProbeThatCannotRunIsRetriedByTheNextWrite) {
  FailFirst("PutObject", 5, {Fault::kStatus, 503, "SlowDown"});  // max_attempts tries of the probe
  Status s = store_->Put("commit", "mine", WriteMode::kCreateIfAbsent);
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("probing whether the server honours If-None-Match"));
  EXPECT_FALSE(Stored("commit").has_value());
  ASSERT_TRUE(store_->Put("commit", "mine", WriteMode::kCreateIfAbsent).ok());
  EXPECT_EQ(Stored("commit"), "mine");
}

TEST_F(S3StoreTest, OpeningWithoutCredentialsWarnsOnceUnlessAnonymousIsAsked) {
  std::vector<std::string> warnings;
  S3Runtime rt = Runtime();
  rt.warn = [&](std::string_view line) { warnings.emplace_back(line); };
  S3Options o = Options();
  ASSERT_TRUE(OpenS3Store(o, rt).ok());
  EXPECT_TRUE(warnings.empty());  // credentials: nothing to say
  o.access_key_id.clear();
  o.secret_access_key.clear();
  ASSERT_TRUE(OpenS3Store(o, rt).ok());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("s3://bkt/run: no S3 credentials found, requests are anonymous"));
  EXPECT_THAT(warnings[0], HasSubstr("AWS_ACCESS_KEY_ID"));
  EXPECT_THAT(warnings[0], HasSubstr("anonymous=1"));
  EXPECT_EQ(warnings[0].find('\n'), std::string::npos);
  o.anonymous = true;
  ASSERT_TRUE(OpenS3Store(o, rt).ok());
  EXPECT_EQ(warnings.size(), 1u);
}

TEST(S3Curl, UnreachableEndpointIsUnavailable) {
  // A port nothing listens on (bound, never listened).
  S3Options o;
  o.bucket = "bkt";
  o.endpoint = "http://127.0.0.1:9";
  o.max_attempts = 2;
  o.url = "s3://bkt?endpoint=http://127.0.0.1:9";
  o.http.connect_timeout = milliseconds(2000);
  S3Runtime rt;
  rt.sleep = [](milliseconds) {};
  auto store = OpenS3Store(o, rt);
  ASSERT_TRUE(store.ok());
  Status s = (*store)->Put("k", "v");
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("s3://bkt?endpoint=http://127.0.0.1:9: k"));
  EXPECT_THAT(s.message(), HasSubstr("gave up after 2 attempts"));
}

}  // namespace
}  // namespace dcr
