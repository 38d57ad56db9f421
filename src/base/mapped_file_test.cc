#include "dcr/mapped_file.h"
#include "testing/temp_dir.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

namespace dcr {
namespace {

namespace fs = std::filesystem;

class MappedFileTest : public testing::TempDirTest {
 protected:
  static void WriteFile(const std::string& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << bytes;
    ASSERT_TRUE(out.flush());
  }
  static std::string ReadFile(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
};

TEST_F(MappedFileTest, DefaultIsEmpty) {
  MappedFile f;
  EXPECT_EQ(f.size(), 0u);
  EXPECT_TRUE(f.data().empty());
  EXPECT_FALSE(f.writable());
  EXPECT_TRUE(f.Sync().ok());
}

TEST_F(MappedFileTest, OpenReadOnlySeesContents) {
  const std::string path = Path("a.bin");
  WriteFile(path, std::string("hello\0world", 11));
  auto f = MappedFile::Open(path, /*writable=*/false);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->size(), 11u);
  EXPECT_FALSE(f->writable());
  EXPECT_EQ(f->path(), path);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(f->data().data()), f->data().size()),
            std::string("hello\0world", 11));
  EXPECT_TRUE(f->Sync().ok());  // read-only: no-op
}

TEST_F(MappedFileTest, CreateIsZeroFilledAndWritesThrough) {
  const std::string path = Path("new.bin");
  const uint64_t size = 3 * 4096 + 123;  // not a whole number of pages
  {
    auto f = MappedFile::Create(path, size);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_TRUE(f->writable());
    ASSERT_EQ(f->size(), size);
    for (uint8_t b : f->data()) ASSERT_EQ(b, 0);
    auto d = f->mutable_data();
    for (uint64_t i = 0; i < size; ++i) d[i] = static_cast<uint8_t>(i * 7 + 1);
    ASSERT_TRUE(f->Sync().ok());
  }
  EXPECT_EQ(fs::file_size(path), size);
  const std::string bytes = ReadFile(path);
  ASSERT_EQ(bytes.size(), size);
  for (uint64_t i = 0; i < size; ++i) ASSERT_EQ(static_cast<uint8_t>(bytes[i]), static_cast<uint8_t>(i * 7 + 1));

  // Reopened read-only, the mapping shows the same bytes.
  auto r = MappedFile::Open(path, false);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), size);
  EXPECT_EQ(0, std::memcmp(r->data().data(), bytes.data(), size));
}

TEST_F(MappedFileTest, WritableOpenWritesThroughAndIsVisibleAfterReopen) {
  const std::string path = Path("rw.bin");
  WriteFile(path, std::string(10000, 'a'));
  {
    auto f = MappedFile::Open(path, /*writable=*/true);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_TRUE(f->writable());
    f->mutable_data()[0] = 'X';
    f->mutable_data()[5000] = 'Y';
    f->mutable_data()[9999] = 'Z';
    ASSERT_TRUE(f->Sync(5000, 1).ok());
    ASSERT_TRUE(f->Sync(4090, 100).ok());  // straddles a page boundary
    ASSERT_TRUE(f->Sync(9000, 1 << 20).ok());  // runs past the end: clamped
    ASSERT_TRUE(f->Sync(0, 0).ok());
    // Another mapping of the same file sees the stores at once (shared).
    auto other = MappedFile::Open(path, false);
    ASSERT_TRUE(other.ok());
    EXPECT_EQ(other->data()[5000], 'Y');
  }
  const std::string bytes = ReadFile(path);
  ASSERT_EQ(bytes.size(), 10000u);
  EXPECT_EQ(bytes[0], 'X');
  EXPECT_EQ(bytes[1], 'a');
  EXPECT_EQ(bytes[5000], 'Y');
  EXPECT_EQ(bytes[9999], 'Z');
}

TEST_F(MappedFileTest, ReadOnlyMappingIsPrivate) {
  // A read-only open never changes the file (MAP_PRIVATE, PROT_READ).
  const std::string path = Path("ro.bin");
  WriteFile(path, "abcdef");
  auto f = MappedFile::Open(path, false);
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE(f->Sync().ok());
  EXPECT_EQ(ReadFile(path), "abcdef");
}

TEST_F(MappedFileTest, SyncWithRangePastTheEndIsHarmless) {
  const std::string path = Path("s.bin");
  auto f = MappedFile::Create(path, 100);
  ASSERT_TRUE(f.ok());
  f->mutable_data()[99] = 1;
  EXPECT_TRUE(f->Sync(50, ~0ull - 10).ok());  // offset + len wraps
  EXPECT_TRUE(f->Sync(100, 10).ok());  // starts at the end
  EXPECT_TRUE(f->Sync(1 << 20, 10).ok());  // starts far past the end
  EXPECT_TRUE(f->Sync().ok());
  EXPECT_EQ(ReadFile(path)[99], '\x01');
}

TEST_F(MappedFileTest, EmptyFiles) {
  const std::string path = Path("empty.bin");
  WriteFile(path, "");
  for (bool writable : {false, true}) {
    auto f = MappedFile::Open(path, writable);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_EQ(f->size(), 0u);
    EXPECT_TRUE(f->data().empty());
    EXPECT_EQ(f->writable(), writable);
    EXPECT_TRUE(f->Sync().ok());
  }
  auto c = MappedFile::Create(Path("created_empty.bin"), 0);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->size(), 0u);
  EXPECT_TRUE(c->mutable_data().empty());
  EXPECT_TRUE(c->Sync().ok());
  EXPECT_TRUE(fs::exists(Path("created_empty.bin")));
  EXPECT_EQ(fs::file_size(Path("created_empty.bin")), 0u);
}

TEST_F(MappedFileTest, CreateTruncatesExistingFile) {
  const std::string path = Path("t.bin");
  WriteFile(path, std::string(5000, 'q'));
  auto f = MappedFile::Create(path, 16);
  ASSERT_TRUE(f.ok());
  ASSERT_EQ(f->size(), 16u);
  for (uint8_t b : f->data()) EXPECT_EQ(b, 0);
  EXPECT_EQ(fs::file_size(path), 16u);
}

TEST_F(MappedFileTest, MissingFileIsNotFound) {
  for (bool writable : {false, true}) {
    auto f = MappedFile::Open(Path("nope.bin"), writable);
    ASSERT_FALSE(f.ok());
    EXPECT_EQ(f.status().code(), Code::kNotFound);
    EXPECT_NE(f.status().message().find("nope.bin"), std::string::npos) << f.status().message();
  }
  auto c = MappedFile::Create(Path("no/such/dir/x.bin"), 8);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kNotFound);
}

TEST_F(MappedFileTest, DirectoryIsInvalidArgument) {
  for (bool writable : {false, true}) {
    auto f = MappedFile::Open(dir_, writable);
    ASSERT_FALSE(f.ok());
    EXPECT_EQ(f.status().code(), Code::kInvalidArgument) << f.status().ToString();
  }
  auto c = MappedFile::Create(dir_, 8);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument) << c.status().ToString();
}

TEST_F(MappedFileTest, MoveTransfersOwnership) {
  const std::string path = Path("m.bin");
  WriteFile(path, "0123456789");
  auto r = MappedFile::Open(path, true);
  ASSERT_TRUE(r.ok());
  MappedFile a = std::move(r).value();
  const uint8_t* addr = a.data().data();
  MappedFile b(std::move(a));
  EXPECT_EQ(b.data().data(), addr);
  EXPECT_EQ(b.size(), 10u);
  EXPECT_TRUE(b.writable());
  EXPECT_EQ(b.path(), path);
  EXPECT_EQ(a.size(), 0u);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_TRUE(a.data().empty());

  auto other = MappedFile::Open(path, false);
  ASSERT_TRUE(other.ok());
  MappedFile c = std::move(other).value();
  c = std::move(b);  // unmaps c's old mapping, takes b's
  EXPECT_EQ(c.data().data(), addr);
  EXPECT_TRUE(c.writable());
  c.mutable_data()[0] = '#';
  EXPECT_TRUE(c.Sync().ok());
  c = MappedFile();
  EXPECT_EQ(c.size(), 0u);
  EXPECT_EQ(ReadFile(path)[0], '#');
}

TEST_F(MappedFileTest, NoPermissionIsPermissionDenied) {
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores file permissions";
  const std::string path = Path("locked.bin");
  WriteFile(path, "secret");
  ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  auto f = MappedFile::Open(path, false);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), Code::kPermissionDenied);
}

}  // namespace
}  // namespace dcr
