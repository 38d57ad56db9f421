// Driver-independent parts of the store module (key rules, URL dispatch) and
// file-driver specifics. The shared behaviour of every driver is tested by
// tests/store/conformance_test.cc.
#include "dcr/store.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "testing/temp_dir.h"

namespace dcr {
namespace {

TEST(ValidateKeyTest, AcceptsOrdinaryKeys) {
  for (std::string_view key : {"a", "a/b/c.json", "snapshots/v0/model-00001-of-00002.safetensors", "x..y", ".hidden",
                               "a/.b", "dcr-x", "ü/日本", "with space"}) {
    EXPECT_TRUE(ValidateKey(key).ok()) << key;
  }
  EXPECT_TRUE(ValidateKey(std::string(1024, 'k')).ok());
}

TEST(ValidateKeyTest, RejectsEveryRuleWithAReason) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "empty"},
      {std::string(1025, 'k'), "1024"},
      {"/etc/passwd", "absolute"},
      {"a//b", "empty path component"},
      {"a/", "empty path component"},
      {"..", "'..'"},
      {"a/../../b", "'..'"},
      {"./a", "'.'"},
      {"new\nline", "control"},
      {std::string("nul\0", 4), "control"},
      {"del\x7f", "control"},
      {".dcr-tmp/x", "reserved"},
      {"a/.dcr-anything", "reserved"},
      {"bad\xff"
       "byte",
       "UTF-8"},
      {"receivers/r\xc3.json", "UTF-8"},
      {"\xed\xa0\x80surrogate", "UTF-8"},
  };
  for (const auto& [key, why] : cases) {
    Status s = ValidateKey(key);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << key;
    EXPECT_NE(s.message().find(why), std::string::npos) << key << ": " << s.message();
  }
}

TEST(ValidateKeyPrefixTest, AcceptsTheStartOfAnyValidKey) {
  for (std::string_view prefix : {"", "a", "a/", "a/b", "snapshots/v", "..", "a/.", "a/..b", ".dcr", "x/.dcr"})
    EXPECT_TRUE(ValidateKeyPrefix(prefix).ok()) << prefix << ": " << ValidateKeyPrefix(prefix).ToString();
  EXPECT_TRUE(ValidateKeyPrefix(std::string(1024, 'k')).ok());
}

TEST(ValidateKeyPrefixTest, RejectsPrefixesNoKeyStartsWith) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"../", "'..'"},
      {"../../etc/", "'..'"},
      {"a/../", "'..'"},
      {"./", "'.'"},
      {"/", "absolute"},
      {"/etc", "absolute"},
      {"a//", "empty path"},
      {".dcr-tmp/", "reserved"},
      {".dcr-", "reserved"},
      {"a\nb", "control"},
      {std::string(1025, 'k'), "1024"},
  };
  for (const auto& [prefix, why] : cases) {
    Status s = ValidateKeyPrefix(prefix);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << prefix;
    EXPECT_NE(s.message().find("bad key prefix"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(why), std::string::npos) << prefix << ": " << s.message();
  }
}

TEST(ValidateKeyPrefixTest, EveryDriverRefusesABadPrefixBeforeListing) {
  auto mem = OpenMemStore("bad-prefix-test");
  ASSERT_TRUE(mem->Put("a/k", "v").ok());
  EXPECT_EQ(mem->List("../").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(mem->List("a//").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(mem->List("a/")->size(), 1u);
  ResetMemStore("bad-prefix-test");
}

class OpenStoreTest : public testing::TempDirTest {};

TEST_F(OpenStoreTest, FileUrlsAndBarePathsOpenTheFileDriver) {
  for (const std::string& url : {"file://" + Path("a"), "file://localhost" + Path("b"), Path("c")}) {
    auto store = OpenStore(url);
    ASSERT_TRUE(store.ok()) << url << ": " << store.status().ToString();
    EXPECT_TRUE((*store)->url().starts_with("file:///")) << (*store)->url();
    ASSERT_TRUE((*store)->Put("k", "v").ok());
  }
  EXPECT_TRUE(std::filesystem::exists(Path("a/k")));
  EXPECT_TRUE(std::filesystem::exists(Path("b/k")));
  EXPECT_TRUE(std::filesystem::exists(Path("c/k")));
}

TEST_F(OpenStoreTest, PercentEscapesInFileUrlsAreDecoded) {
  auto store = OpenStore("file://" + Path("with%20space"));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  ASSERT_TRUE((*store)->Put("k", "v").ok());
  EXPECT_TRUE(std::filesystem::exists(Path("with space/k")));
}

TEST_F(OpenStoreTest, RejectsMalformedUrls) {
  for (std::string url : {"", "file://relative/path", "file:///tmp/x?query", "file:///bad%2", "file:///bad%zz",
                          "file:///nul%00byte", "gopher://x", "mem://", "mem://a/b", "://x"}) {
    auto store = OpenStore(url);
    EXPECT_EQ(store.status().code(), Code::kInvalidArgument) << url << ": " << store.status().ToString();
  }
}

TEST_F(OpenStoreTest, MissingRootIsNotFoundWithoutCreate) {
  auto store = OpenStore("file://" + Path("missing"), {.create_root = false});
  EXPECT_EQ(store.status().code(), Code::kNotFound) << store.status().ToString();
  EXPECT_FALSE(std::filesystem::exists(Path("missing")));
  std::ofstream(Path("plain")) << "x";
  EXPECT_EQ(OpenStore("file://" + Path("plain")).status().code(), Code::kInvalidArgument);
}

TEST_F(OpenStoreTest, MemStoresWithOneNameShareObjects) {
  auto a = OpenStore("mem://shared-name-test"), b = OpenStore("mem://shared-name-test");
  auto c = OpenStore("mem://other-name-test");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_TRUE((*a)->Put("k", "v").ok());
  EXPECT_EQ(*(*b)->Get("k"), "v");
  EXPECT_EQ((*c)->Head("k").status().code(), Code::kNotFound);
  ResetMemStore("shared-name-test");
  auto d = OpenStore("mem://shared-name-test");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ((*d)->Head("k").status().code(), Code::kNotFound);  // later opens start empty
  EXPECT_EQ(*(*a)->Get("k"), "v");  // open stores keep theirs
}

class FileStoreTest : public testing::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    auto store = OpenStore("file://" + Path("root"));
    ASSERT_TRUE(store.ok());
    store_ = std::move(*store);
  }
  size_t TmpFiles() {
    size_t n = 0;
    std::error_code ec;
    for (auto it = std::filesystem::directory_iterator(Path("root/.dcr-tmp"), ec);
         !ec && it != std::filesystem::directory_iterator(); ++it)
      ++n;
    return n;
  }
  std::unique_ptr<Store> store_;
};

TEST_F(FileStoreTest, ObjectsAreFilesUnderTheRoot) {
  ASSERT_TRUE(store_->Put("attempts/v1/a/manifest.json", "{}").ok());
  std::ifstream in(Path("root/attempts/v1/a/manifest.json"));
  std::string content((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(content, "{}");
}

TEST_F(FileStoreTest, NoTemporaryFileSurvivesAnyOutcome) {
  ASSERT_TRUE(store_->Put("k", "v").ok());
  EXPECT_EQ(store_->Put("k", "w", WriteMode::kCreateIfAbsent).code(), Code::kAlreadyExists);
  {
    auto w = store_->OpenWriter("aborted", WriteMode::kOverwrite);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write("xyz").ok());
  }
  ASSERT_TRUE(store_->Put("k2", "v2", WriteMode::kCreateIfAbsent).ok());
  EXPECT_EQ(TmpFiles(), 0u);
  // The temporary directory is invisible to List.
  auto keys = store_->List("");
  ASSERT_TRUE(keys.ok());
  ASSERT_EQ(keys->size(), 2u);
  EXPECT_EQ((*keys)[0].key, "k");
  EXPECT_EQ((*keys)[1].key, "k2");
}

TEST_F(FileStoreTest, DeleteRemovesEmptiedDirectoriesButNotTheRoot) {
  ASSERT_TRUE(store_->Put("a/b/c/d", "x").ok());
  ASSERT_TRUE(store_->Put("a/keep", "y").ok());
  ASSERT_TRUE(store_->Delete("a/b/c/d").ok());
  EXPECT_FALSE(std::filesystem::exists(Path("root/a/b")));
  EXPECT_TRUE(std::filesystem::exists(Path("root/a/keep")));
  ASSERT_TRUE(store_->Delete("a/keep").ok());
  EXPECT_FALSE(std::filesystem::exists(Path("root/a")));
  EXPECT_TRUE(std::filesystem::exists(Path("root")));
}

TEST_F(FileStoreTest, AKeyCannotBeBothAnObjectAndADirectoryOfKeys) {
  // S3 allows "a" and "a/b" side by side; a directory tree cannot. Both
  // orders fail cleanly and leave the existing object intact.
  ASSERT_TRUE(store_->Put("a", "object").ok());
  Status s = store_->Put("a/b", "child");
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.ToString();
  ASSERT_TRUE(store_->Put("x/y", "child").ok());
  s = store_->Put("x", "object");
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.ToString();
  EXPECT_EQ(store_->Head("x").status().code(), Code::kNotFound);
  EXPECT_EQ(*store_->Get("a"), "object");
  EXPECT_EQ(TmpFiles(), 0u);
}

TEST_F(FileStoreTest, SymlinksInTheTreeAreNotFollowedByList) {
  ASSERT_TRUE(store_->Put("real/k", "v").ok());
  std::filesystem::create_directory_symlink(Path("root/real"), Path("root/link"));
  auto keys = store_->List("");
  ASSERT_TRUE(keys.ok());
  ASSERT_EQ(keys->size(), 1u);
  EXPECT_EQ((*keys)[0].key, "real/k");
}

// Issue 22: listing never leaves the root, whatever the prefix and whatever
// links someone put in the tree.
TEST_F(FileStoreTest, ListNeverLeavesTheRoot) {
  ASSERT_TRUE(store_->Put("real/k", "v").ok());
  std::filesystem::create_directories(Path("outside/dir"));
  std::ofstream(Path("outside/secret")) << "s";
  std::ofstream(Path("outside/dir/secret")) << "s";
  std::filesystem::create_directory_symlink(Path("outside"), Path("root/out"));
  std::filesystem::create_directory_symlink(Path("outside"), Path("root/real/out"));
  std::filesystem::create_symlink(Path("outside/secret"), Path("root/file-link"));

  // Links in the tree are skipped: a full listing shows the store's objects only.
  auto all = store_->List("");
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].key, "real/k");
  auto under_real = store_->List("real/");
  ASSERT_TRUE(under_real.ok());
  EXPECT_EQ(under_real->size(), 1u);
  EXPECT_EQ(store_->List("file")->size(), 0u);
  EXPECT_EQ(store_->List("o")->size(), 0u);

  // A prefix through a link is refused, naming the link.
  for (std::string prefix : {"out/", "out/dir/", "out/s", "real/out/", "real/out/dir/secret"}) {
    auto list = store_->List(prefix);
    EXPECT_EQ(list.status().code(), Code::kFailedPrecondition) << prefix;
    EXPECT_NE(list.status().message().find("symbolic link"), std::string::npos) << list.status().ToString();
  }
  // Prefixes that are no key's start never reach the filesystem.
  for (std::string prefix : {"../", "../outside/", "real/../../", "/", "//", "./real/"}) {
    auto list = store_->List(prefix);
    EXPECT_EQ(list.status().code(), Code::kInvalidArgument) << prefix;
  }
  // A prefix through a regular file, or a missing directory, lists nothing.
  EXPECT_EQ(store_->List("real/k/")->size(), 0u);
  EXPECT_EQ(store_->List("missing/x")->size(), 0u);
}

}  // namespace
}  // namespace dcr

namespace dcr {
namespace {

TEST(FaultStoreTest, FailBeforeRunsNothing) {
  auto wrapped = WrapWithFaults(OpenMemStore("fault-fail"), "seed=1,fail=1");
  ASSERT_TRUE(wrapped.ok()) << wrapped.status().ToString();
  EXPECT_EQ((*wrapped)->Put("k", "v").code(), Code::kUnavailable);
  EXPECT_EQ((*wrapped)->Get("k").status().code(), Code::kUnavailable);
  EXPECT_EQ((*wrapped)->List("").status().code(), Code::kUnavailable);
  EXPECT_EQ(OpenMemStore("fault-fail")->Head("k").status().code(), Code::kNotFound);
  ResetMemStore("fault-fail");
}

TEST(FaultStoreTest, LostResponsesHappenAfterTheWrite) {
  auto wrapped = WrapWithFaults(OpenMemStore("fault-lost"), "seed=2,lost=1");
  ASSERT_TRUE(wrapped.ok());
  Status s = (*wrapped)->Put("k", "v", WriteMode::kCreateIfAbsent);
  EXPECT_EQ(s.code(), Code::kUnavailable);
  EXPECT_NE(s.message().find("lost response"), std::string::npos) << s.message();
  EXPECT_EQ(*OpenMemStore("fault-lost")->Get("k"), "v");  // it did happen
  EXPECT_EQ(*(*wrapped)->Get("k"), "v");  // reads are not lost
  ResetMemStore("fault-lost");
}

TEST(FaultStoreTest, BandwidthLimitPacesTransfers) {
  auto wrapped = WrapWithFaults(OpenMemStore("fault-mbps"), "mbps=20");
  ASSERT_TRUE(wrapped.ok());
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE((*wrapped)->Put("k", std::string(2'000'000, 'x')).ok());  // 2 MB up
  ASSERT_TRUE((*wrapped)->Get("k").ok());  // 2 MB down
  // 4 MB over a 20 MB/s link takes at least 0.2 s (a lower bound only).
  EXPECT_GE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.19);
  ResetMemStore("fault-mbps");
}

TEST(FaultStoreTest, RejectsMalformedSpecs) {
  for (const char* spec : {"fail", "fail=2", "lost=-1", "bogus=1", "seed=x", "delay_ms=1,,",
                           // Out of range for the integer or the sleep they become (found by
                           // store_config_fuzz: converting them was undefined behaviour).
                           "seed=1e30", "seed=18446744073709551616", "delay_ms=1e10", "delay_ms=nan", "fail=nan",
                           "mbps=inf", "mbps=1e-300", "seed=-0.5"}) {
    EXPECT_EQ(WrapWithFaults(OpenMemStore("fault-bad"), spec).status().code(), Code::kInvalidArgument) << spec;
  }
  for (const char* spec : {"seed=18446744073709549568", "delay_ms=86400000", "mbps=0", "mbps=0.001", "fail=0"})
    EXPECT_TRUE(WrapWithFaults(OpenMemStore("fault-ok"), spec).ok()) << spec;
}

}  // namespace
}  // namespace dcr
