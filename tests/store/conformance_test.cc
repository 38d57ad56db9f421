// One conformance suite for every store driver (DESIGN house rule 3).
//
// Instances: file (a fresh temporary directory per test), mem (a fresh name
// per test), and s3 when DCR_S3_TEST_URL names a bucket on a real server
// (tests/s3/radosgw.sh starts one; scripts/test.sh sets the variable). Each
// s3 test works under its own fresh prefix.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dcr/store.h"

namespace dcr {
namespace {

std::string UniqueName(std::string_view tag) {
  static std::atomic<int> counter{0};
  std::random_device rd;
  return std::string(tag) + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
         std::to_string(rd() % 1000000);
}

// Inserts "/sub" at the end of an s3 URL's path (before any query).
std::string WithSubPrefix(std::string url, const std::string& sub) {
  size_t q = url.find('?');
  std::string path = url.substr(0, q), query = q == std::string::npos ? "" : url.substr(q);
  while (path.ends_with("/")) path.pop_back();
  return path + "/" + sub + query;
}

struct Instance {
  std::string name;
  // Returns a URL for a fresh, empty store; `cleanup` receives what to undo.
  std::function<std::string(std::string* cleanup_dir)> make;
};

std::vector<Instance> Instances() {
  std::vector<Instance> v;
  v.push_back({"file", [](std::string* dir) {
                 std::string tmpl = (std::filesystem::path(::testing::TempDir()) / "dcr_store_XXXXXX").string();
                 if (!::mkdtemp(tmpl.data())) return std::string("file:///nonexistent-mkdtemp-failed");
                 *dir = tmpl;
                 return "file://" + tmpl + "/root";
               }});
  v.push_back({"mem", [](std::string*) { return "mem://" + UniqueName("conformance"); }});
  if (const char* s3 = std::getenv("DCR_S3_TEST_URL"); s3 && *s3) {
    std::string base = s3;
    v.push_back({"s3", [base](std::string*) { return WithSubPrefix(base, UniqueName("conformance")); }});
  }
  return v;
}

class StoreConformance : public ::testing::TestWithParam<Instance> {
 protected:
  void SetUp() override {
    url_ = GetParam().make(&cleanup_dir_);
    auto store = OpenStore(url_);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(*store);
  }
  void TearDown() override {
    if (store_ && GetParam().name == "s3") {  // leave the shared bucket clean
      auto all = store_->List("");
      if (all.ok())
        for (const auto& o : *all) store_->Delete(o.key).IgnoreError();
    }
    if (GetParam().name == "mem") ResetMemStore(url_.substr(6));
    if (!cleanup_dir_.empty()) std::filesystem::remove_all(cleanup_dir_);
  }

  std::string MustGet(const std::string& key) {
    auto r = store_->Get(key);
    EXPECT_TRUE(r.ok()) << key << ": " << r.status().ToString();
    return r.ok() ? *r : std::string("<error>");
  }
  std::vector<std::string> Keys(const std::string& prefix) {
    auto r = store_->List(prefix);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    std::vector<std::string> keys;
    if (r.ok())
      for (const auto& o : *r) keys.push_back(o.key);
    return keys;
  }

  std::string url_, cleanup_dir_;
  std::unique_ptr<Store> store_;
};

std::string Pattern(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

TEST_P(StoreConformance, EmptyObjectRoundTrips) {
  ASSERT_TRUE(store_->Put("empty", "").ok());
  auto head = store_->Head("empty");
  ASSERT_TRUE(head.ok()) << head.status().ToString();
  EXPECT_EQ(head->size, 0u);
  EXPECT_EQ(head->key, "empty");
  EXPECT_EQ(MustGet("empty"), "");
  EXPECT_TRUE(store_->ReadRange("empty", 0, {}).ok());
}

TEST_P(StoreConformance, SmallObjectWithEveryByteValueRoundTrips) {
  std::string data;
  for (int rep = 0; rep < 3; ++rep)
    for (int b = 0; b < 256; ++b) data += static_cast<char>(b);
  ASSERT_TRUE(store_->Put("bytes/all", data).ok());
  ObjectInfo info;
  auto got = store_->Get("bytes/all", &info);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, data);
  EXPECT_EQ(info.size, data.size());
  EXPECT_EQ(info.key, "bytes/all");
  EXPECT_FALSE(info.etag.empty());
}

TEST_P(StoreConformance, StreamedMultiPartObjectRoundTrips) {
  // 21 MiB in uneven writes: several parts for drivers that upload in parts.
  const std::string data = Pattern((21u << 20) + 12345, 7);
  auto writer = store_->OpenWriter("big/object.bin", WriteMode::kOverwrite);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  size_t pos = 0, step = 1;
  while (pos < data.size()) {
    size_t n = std::min(step, data.size() - pos);
    ASSERT_TRUE((*writer)->Write(std::string_view(data).substr(pos, n)).ok());
    pos += n;
    step = step * 3 + 1;  // 1 B ... several MiB
  }
  EXPECT_EQ(store_->Head("big/object.bin").status().code(), Code::kNotFound) << "visible before Close";
  ASSERT_TRUE((*writer)->Close().ok());
  auto head = store_->Head("big/object.bin");
  ASSERT_TRUE(head.ok());
  EXPECT_EQ(head->size, data.size());
  EXPECT_TRUE(MustGet("big/object.bin") == data);
  // A large ranged read spanning parts.
  std::string mid(9u << 20, '\0');
  ASSERT_TRUE(
      store_->ReadRange("big/object.bin", (5u << 20) + 3, {reinterpret_cast<uint8_t*>(mid.data()), mid.size()}).ok());
  EXPECT_TRUE(mid == data.substr((5u << 20) + 3, mid.size()));
}

TEST_P(StoreConformance, AbortedWriterPublishesNothing) {
  ASSERT_TRUE(store_->Put("k", "old").ok());
  {
    auto writer = store_->OpenWriter("k", WriteMode::kOverwrite);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE((*writer)->Write(Pattern(10u << 20, 1)).ok());
    (*writer)->Abort();
    (*writer)->Abort();  // idempotent
    EXPECT_FALSE((*writer)->Close().ok());
  }
  {
    auto writer = store_->OpenWriter("never", WriteMode::kOverwrite);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE((*writer)->Write("partial").ok());
  }  // destroyed without Close
  EXPECT_EQ(MustGet("k"), "old");
  EXPECT_EQ(store_->Head("never").status().code(), Code::kNotFound);
  EXPECT_EQ(Keys(""), std::vector<std::string>{"k"});
}

TEST_P(StoreConformance, WriterRejectsUseAfterClose) {
  auto writer = store_->OpenWriter("w", WriteMode::kOverwrite);
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Close().ok());
  EXPECT_EQ((*writer)->Write("x").code(), Code::kFailedPrecondition);
  EXPECT_EQ((*writer)->Close().code(), Code::kFailedPrecondition);
  EXPECT_EQ(MustGet("w"), "");
}

TEST_P(StoreConformance, OverwriteReplacesAndChangesEtag) {
  ASSERT_TRUE(store_->Put("a/x", "first").ok());
  auto h1 = store_->Head("a/x");
  ASSERT_TRUE(store_->Put("a/x", "second, longer").ok());
  auto h2 = store_->Head("a/x");
  ASSERT_TRUE(h1.ok() && h2.ok());
  EXPECT_NE(h1->etag, h2->etag);
  EXPECT_EQ(h2->size, 14u);
  EXPECT_EQ(MustGet("a/x"), "second, longer");
}

TEST_P(StoreConformance, CreateIfAbsentFailsWhenPresentAndKeepsTheObject) {
  ASSERT_TRUE(store_->Put("commits/v1.json", "winner", WriteMode::kCreateIfAbsent).ok());
  Status again = store_->Put("commits/v1.json", "loser", WriteMode::kCreateIfAbsent);
  EXPECT_EQ(again.code(), Code::kAlreadyExists) << again.ToString();
  EXPECT_NE(again.message().find("commits/v1.json"), std::string::npos) << again.message();
  EXPECT_EQ(MustGet("commits/v1.json"), "winner");
  // After a delete the key can be created again.
  ASSERT_TRUE(store_->Delete("commits/v1.json").ok());
  EXPECT_TRUE(store_->Put("commits/v1.json", "next", WriteMode::kCreateIfAbsent).ok());
  EXPECT_EQ(MustGet("commits/v1.json"), "next");
}

TEST_P(StoreConformance, CreateIfAbsentRaceHasExactlyOneWinner) {
  for (int round = 0; round < 3; ++round) {
    const std::string key = "race/" + std::to_string(round);
    constexpr int kThreads = 8;
    std::atomic<int> wins{0}, exists{0}, other{0};
    std::vector<int> winner_ids;
    std::mutex mu;
    std::vector<std::thread> threads;
    std::atomic<bool> go{false};
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        while (!go.load()) std::this_thread::yield();
        Status s = store_->Put(key, "writer " + std::to_string(t), WriteMode::kCreateIfAbsent);
        if (s.ok()) {
          ++wins;
          std::lock_guard lock(mu);
          winner_ids.push_back(t);
        } else if (s.code() == Code::kAlreadyExists) {
          ++exists;
        } else {
          ++other;
          ADD_FAILURE() << s.ToString();
        }
      });
    }
    go = true;
    for (auto& th : threads) th.join();
    ASSERT_EQ(wins.load(), 1);
    EXPECT_EQ(exists.load(), kThreads - 1);
    EXPECT_EQ(MustGet(key), "writer " + std::to_string(winner_ids.at(0)));
  }
}

TEST_P(StoreConformance, RangedReadsAtBoundaries) {
  const std::string data = Pattern(1000, 3);
  ASSERT_TRUE(store_->Put("r", data).ok());
  auto read = [&](uint64_t off, size_t n) -> Result<std::string> {
    std::string out(n, '\0');
    DCR_RETURN_IF_ERROR(store_->ReadRange("r", off, {reinterpret_cast<uint8_t*>(out.data()), n}));
    return out;
  };
  for (auto [off, n] : std::vector<std::pair<uint64_t, size_t>>{{0, 1}, {0, 1000}, {999, 1}, {500, 500}, {1, 998}}) {
    auto got = read(off, n);
    ASSERT_TRUE(got.ok()) << off << "+" << n << ": " << got.status().ToString();
    EXPECT_EQ(*got, data.substr(off, n)) << off << "+" << n;
  }
  auto empty_at_end = read(1000, 0);
  EXPECT_TRUE(empty_at_end.ok()) << empty_at_end.status().ToString();
  for (auto [off, n] : std::vector<std::pair<uint64_t, size_t>>{{999, 2}, {1000, 1}, {0, 1001}, {5000, 1}, {1001, 0}}) {
    auto got = read(off, n);
    EXPECT_EQ(got.status().code(), Code::kOutOfRange) << off << "+" << n << ": " << got.status().ToString();
  }
}

TEST_P(StoreConformance, IfMatchDetectsReplacement) {
  ASSERT_TRUE(store_->Put("m", "version one").ok());
  auto head = store_->Head("m");
  ASSERT_TRUE(head.ok());
  std::string out(7, '\0');
  std::span<uint8_t> buf{reinterpret_cast<uint8_t*>(out.data()), out.size()};
  ASSERT_TRUE(store_->ReadRange("m", 0, buf, {.if_match = head->etag}).ok());
  EXPECT_EQ(out, "version");
  ASSERT_TRUE(store_->Put("m", "version two").ok());
  EXPECT_EQ(store_->ReadRange("m", 0, buf, {.if_match = head->etag}).code(), Code::kAborted);
}

TEST_P(StoreConformance, MissingKeysAreNotFound) {
  uint8_t b = 0;
  for (Code c : {store_->Head("nope").status().code(), store_->Get("nope").status().code(),
                 store_->ReadRange("nope", 0, {&b, 1}).code(), store_->Head("dir/nope").status().code()}) {
    EXPECT_EQ(c, Code::kNotFound);
  }
  Status s = store_->Get("no/such/key").status();
  EXPECT_NE(s.message().find("no/such/key"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(store_->url()), std::string::npos) << s.message();
  EXPECT_TRUE(store_->Delete("nope").ok());
  EXPECT_TRUE(Keys("").empty());
}

TEST_P(StoreConformance, DeleteRemovesOnlyThatKey) {
  ASSERT_TRUE(store_->Put("d/1", "1").ok());
  ASSERT_TRUE(store_->Put("d/2", "2").ok());
  ASSERT_TRUE(store_->Delete("d/1").ok());
  EXPECT_EQ(store_->Head("d/1").status().code(), Code::kNotFound);
  EXPECT_EQ(Keys("d/"), std::vector<std::string>{"d/2"});
  ASSERT_TRUE(store_->Delete("d/2").ok());
  EXPECT_TRUE(Keys("").empty());
  ASSERT_TRUE(store_->Put("d/3", "3").ok());  // the emptied "directory" is usable again
  EXPECT_EQ(MustGet("d/3"), "3");
}

TEST_P(StoreConformance, ListFiltersByPrefixAndSorts) {
  const std::vector<std::string> keys = {"b", "ab", "a/bc", "a/b/d", "a/b/c", "a-z", "attempts/v1/acks/r0.json"};
  for (const auto& k : keys) ASSERT_TRUE(store_->Put(k, k + k).ok()) << k;
  EXPECT_EQ(Keys(""),
            (std::vector<std::string>{"a-z", "a/b/c", "a/b/d", "a/bc", "ab", "attempts/v1/acks/r0.json", "b"}));
  EXPECT_EQ(Keys("a/b"), (std::vector<std::string>{"a/b/c", "a/b/d", "a/bc"}));
  EXPECT_EQ(Keys("a/b/"), (std::vector<std::string>{"a/b/c", "a/b/d"}));
  EXPECT_EQ(Keys("a"), (std::vector<std::string>{"a-z", "a/b/c", "a/b/d", "a/bc", "ab", "attempts/v1/acks/r0.json"}));
  EXPECT_EQ(Keys("attempts/v1/acks/"), (std::vector<std::string>{"attempts/v1/acks/r0.json"}));
  EXPECT_TRUE(Keys("zz").empty());
  EXPECT_TRUE(Keys("a/b/c/").empty());
  auto listed = store_->List("a/b/c");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].size, 10u);
  EXPECT_FALSE((*listed)[0].etag.empty());
}

TEST_P(StoreConformance, ListsManyKeys) {
  // More than one S3 list page (1000 keys).
  constexpr int kKeys = 1234, kThreads = 8;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < kKeys; i += kThreads) {
        char key[32];
        std::snprintf(key, sizeof key, "many/%05d", i);
        if (!store_->Put(key, std::to_string(i)).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(failures.load(), 0);
  ASSERT_TRUE(store_->Put("other", "x").ok());
  auto keys = Keys("many/");
  ASSERT_EQ(keys.size(), size_t{kKeys});
  for (int i = 0; i < kKeys; ++i) {
    char key[32];
    std::snprintf(key, sizeof key, "many/%05d", i);
    ASSERT_EQ(keys[i], key);
  }
}

TEST_P(StoreConformance, UnusualKeyCharactersRoundTrip) {
  const std::vector<std::string> keys = {"sp ace/file name",
                                         "plus+sign",
                                         "percent%20literal",
                                         "query?x=1&y=2",
                                         "hash#frag",
                                         "tilde~!*'()",
                                         "colon:at@comma,",
                                         "semi;dollar$eq=",
                                         "unicode/üñí©ødé/日本",
                                         "brackets[]{}<>|^`\"\\",
                                         "model.layers.0.mlp.experts.17.down_proj.weight"};
  for (const auto& k : keys) {
    ASSERT_TRUE(store_->Put(k, "v:" + k).ok()) << k;
    EXPECT_EQ(MustGet(k), "v:" + k);
    auto head = store_->Head(k);
    ASSERT_TRUE(head.ok()) << k;
    EXPECT_EQ(head->key, k);
  }
  auto listed = Keys("");
  std::vector<std::string> sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(listed, sorted);
  for (const auto& k : keys) EXPECT_TRUE(store_->Delete(k).ok()) << k;
  EXPECT_TRUE(Keys("").empty());
}

TEST_P(StoreConformance, InvalidKeysAreRejectedBeforeAnyIo) {
  for (const std::string& key :
       std::vector<std::string>{"", "/abs", "a//b", "a/../b", "..", ".", "a/", "tab\there", std::string("nul\0x", 5),
                                ".dcr-tmp/x", "a/.dcr-lock", std::string(1025, 'k')}) {
    EXPECT_EQ(store_->Put(key, "x").code(), Code::kInvalidArgument) << key;
    EXPECT_EQ(store_->Head(key).status().code(), Code::kInvalidArgument) << key;
    EXPECT_EQ(store_->Get(key).status().code(), Code::kInvalidArgument) << key;
    EXPECT_EQ(store_->Delete(key).code(), Code::kInvalidArgument) << key;
  }
  // List's prefix: anything no valid key starts with (issue 22).
  for (std::string_view prefix : {"../", "a/../", "/", "/etc", "a//", "./", ".dcr-tmp/"})
    EXPECT_EQ(store_->List(prefix).status().code(), Code::kInvalidArgument) << prefix;
  EXPECT_TRUE(Keys("").empty());
}

TEST_P(StoreConformance, ConcurrentWritersAndReaders) {
  auto fmt_key = [](int t, int i) {
    char key[32];
    std::snprintf(key, sizeof key, "t%d/%d", t, i);
    return std::string(key);
  };
  constexpr int kThreads = 6, kPerThread = 20;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  ASSERT_TRUE(store_->Put("shared", Pattern(4096, 0)).ok());
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const std::string key = fmt_key(t, i);
        std::string value = Pattern(100 + i * 37, t * 1000 + i);
        if (!store_->Put(key, value).ok()) ++failures;
        auto got = store_->Get(key);
        if (!got.ok() || *got != value) ++failures;
        // Readers of a key being replaced see one whole version or another.
        if (t % 2 == 0) {
          if (!store_->Put("shared", Pattern(4096, t * 1000 + i)).ok()) ++failures;
        } else {
          auto s = store_->Get("shared");
          if (!s.ok() || s->size() != 4096) ++failures;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(Keys("t").size(), size_t{kThreads * kPerThread});
}

INSTANTIATE_TEST_SUITE_P(Drivers, StoreConformance, ::testing::ValuesIn(Instances()),
                         [](const ::testing::TestParamInfo<Instance>& p) { return p.param.name; });

}  // namespace
}  // namespace dcr
