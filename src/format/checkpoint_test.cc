#include "dcr/checkpoint.h"
#include "testing/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace dcr {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

TensorInfo T(const std::string& name, DType dtype, std::vector<uint64_t> shape) {
  auto r = MakeTensorInfo(name, dtype, std::move(shape));
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return *r;
}

// Deterministic content for tensor `name`, byte i.
uint8_t Pattern(const std::string& name, uint64_t i) {
  uint64_t h = 1469598103934665603ull;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return static_cast<uint8_t>((h >> 7) + i * 13);
}

class CheckpointTest : public testing::TempDirTest {
 protected:
  // Tensors given out of name order, with several dtypes and an empty one.
  static std::vector<TensorInfo> SampleTensors() {
    return {T("z.weight", DType::kBF16, {16, 8}), T("a.bias", DType::kF32, {8}), T("m.scale", DType::kF16, {3}),
            T("empty", DType::kF32, {0, 4}),      T("b.ids", DType::kI64, {5}),  T("c.packed", DType::kF4, {6})};
  }

  static void Fill(Checkpoint& c) {
    for (size_t i = 0; i < c.size(); ++i) {
      auto d = c.MutableData(i);
      for (uint64_t k = 0; k < d.size(); ++k) d[k] = Pattern(c.tensors()[i].name, k);
    }
  }
  static void ExpectFilled(const Checkpoint& c) {
    for (size_t i = 0; i < c.size(); ++i) {
      const auto d = c.Data(i);
      ASSERT_EQ(d.size(), c.tensors()[i].nbytes) << c.tensors()[i].name;
      for (uint64_t k = 0; k < d.size(); ++k) ASSERT_EQ(d[k], Pattern(c.tensors()[i].name, k)) << c.tensors()[i].name;
    }
  }
  static void ExpectSameTensors(const Checkpoint& c, std::vector<TensorInfo> expected) {
    std::sort(expected.begin(), expected.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
    ASSERT_EQ(c.tensors(), expected);
    uint64_t bytes = 0, elements = 0;
    for (const auto& t : expected) {
      bytes += t.nbytes;
      elements += t.numel;
    }
    EXPECT_EQ(c.total_bytes(), bytes);
    EXPECT_EQ(c.total_elements(), elements);
  }
  static void WriteText(const std::string& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    ASSERT_TRUE(out.flush());
  }
  static std::string ReadText(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  // Writes a single-file checkpoint holding `tensors` (zero data).
  void WriteFile(const std::string& path, const std::vector<TensorInfo>& tensors) {
    auto c = Checkpoint::Create(path, tensors);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
  }
};

TEST_F(CheckpointTest, CreateSingleFileAndReopen) {
  const std::string path = Path("one.safetensors");
  const auto tensors = SampleTensors();
  CreateOptions opt;
  opt.metadata = {{"format", "pt"}, {"step", "7"}};
  {
    auto c = Checkpoint::Create(path, tensors, opt);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->mode(), OpenMode::kReadWrite);
    EXPECT_EQ(c->path(), path);
    ExpectSameTensors(*c, tensors);
    EXPECT_EQ(c->files(), std::vector<std::string>{path});
    // Zero-filled.
    for (size_t i = 0; i < c->size(); ++i)
      for (uint8_t b : c->Data(i)) ASSERT_EQ(b, 0);
    Fill(*c);
    ASSERT_TRUE(c->Sync().ok());
  }
  EXPECT_TRUE(fs::is_regular_file(path));
  auto r = Checkpoint::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->mode(), OpenMode::kReadOnly);
  ExpectSameTensors(*r, tensors);
  ExpectFilled(*r);
  EXPECT_EQ(r->metadata(), opt.metadata);
  for (size_t i = 0; i < r->size(); ++i) EXPECT_EQ(r->FileOf(i), path);
  EXPECT_TRUE(r->Sync().ok());  // read-only: no-op
  // The file is exactly header + data.
  uint64_t data = 0;
  for (const auto& t : tensors) data += t.nbytes;
  const std::string bytes = ReadText(path);
  auto header = ParseSafetensorsHeader(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), bytes.size());
  ASSERT_TRUE(header.ok()) << header.status().ToString();
  EXPECT_EQ(header->data_bytes, data);
  // Stored in the given order.
  std::vector<std::string> stored;
  for (const auto& e : header->entries)
    if (e.info.nbytes > 0) stored.push_back(e.info.name);
  EXPECT_EQ(stored, (std::vector<std::string>{"z.weight", "a.bias", "m.scale", "b.ids", "c.packed"}));
}

TEST_F(CheckpointTest, CreateDirectoryWithOneFile) {
  const std::string path = Path("dir_ckpt");
  const auto tensors = SampleTensors();
  {
    auto c = Checkpoint::Create(path, tensors);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    Fill(*c);
    ASSERT_TRUE(c->Sync().ok());
  }
  EXPECT_TRUE(fs::is_regular_file(fs::path(path) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(path) / kIndexFileName));
  auto r = Checkpoint::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectSameTensors(*r, tensors);
  ExpectFilled(*r);
  EXPECT_EQ(r->files(), std::vector<std::string>{(fs::path(path) / "model.safetensors").string()});
}

TEST_F(CheckpointTest, CreateShardedWritesIndex) {
  const std::string path = Path("sharded");
  // 4 tensors of 100 bytes with a 250-byte limit: shards of 2, 2.
  // Then one of 300 bytes alone (larger than the limit), then a small one.
  const std::vector<TensorInfo> tensors = {T("t0", DType::kU8, {100}), T("t1", DType::kU8, {100}),
                                           T("t2", DType::kU8, {100}), T("t3", DType::kU8, {100}),
                                           T("t4", DType::kU8, {300}), T("t5", DType::kBF16, {10})};
  CreateOptions opt;
  opt.max_shard_bytes = 250;
  opt.metadata = {{"format", "pt"}};
  {
    auto c = Checkpoint::Create(path, tensors, opt);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_EQ(c->files().size(), 4u);
    Fill(*c);
    ASSERT_TRUE(c->Sync().ok());
  }
  const std::vector<std::string> names = {"model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                                          "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"};
  for (const auto& n : names) EXPECT_TRUE(fs::is_regular_file(fs::path(path) / n)) << n;
  EXPECT_FALSE(fs::exists(fs::path(path) / "model.safetensors"));
  const std::string index = ReadText((fs::path(path) / kIndexFileName).string());
  EXPECT_THAT(index, HasSubstr("\"weight_map\""));
  EXPECT_THAT(index, HasSubstr("\"total_size\": 720"));
  EXPECT_THAT(index, HasSubstr("\"t0\": \"model-00001-of-00004.safetensors\""));
  EXPECT_THAT(index, HasSubstr("\"t1\": \"model-00001-of-00004.safetensors\""));
  EXPECT_THAT(index, HasSubstr("\"t2\": \"model-00002-of-00004.safetensors\""));
  EXPECT_THAT(index, HasSubstr("\"t4\": \"model-00003-of-00004.safetensors\""));
  EXPECT_THAT(index, HasSubstr("\"t5\": \"model-00004-of-00004.safetensors\""));

  auto r = Checkpoint::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectSameTensors(*r, tensors);
  ExpectFilled(*r);
  EXPECT_EQ(r->metadata(), opt.metadata);
  EXPECT_EQ(fs::path(r->FileOf(static_cast<size_t>(r->Find("t3")))).filename(), names[1]);
  EXPECT_EQ(fs::path(r->FileOf(static_cast<size_t>(r->Find("t5")))).filename(), names[3]);
  std::vector<std::string> files = r->files();
  ASSERT_EQ(files.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(fs::path(files[i]).filename(), names[i]);

  // Without the index, the directory's *.safetensors files still open.
  fs::remove(fs::path(path) / kIndexFileName);
  auto no_index = Checkpoint::Open(path);
  ASSERT_TRUE(no_index.ok()) << no_index.status().ToString();
  ExpectSameTensors(*no_index, tensors);
  ExpectFilled(*no_index);
}

TEST_F(CheckpointTest, ShardingWithoutLimitIsOneFile) {
  const std::string path = Path("unsharded");
  CreateOptions opt;
  opt.max_shard_bytes = 1 << 20;
  auto c = Checkpoint::Create(path, SampleTensors(), opt);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->files().size(), 1u);
  EXPECT_TRUE(fs::exists(fs::path(path) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(path) / kIndexFileName));
}

TEST_F(CheckpointTest, SingleFileCannotBeSharded) {
  CreateOptions opt;
  opt.max_shard_bytes = 10;
  auto c = Checkpoint::Create(Path("x.safetensors"), SampleTensors(), opt);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument);
}

TEST_F(CheckpointTest, CreateRejectsDuplicateNames) {
  auto c = Checkpoint::Create(Path("dup.safetensors"), {T("a", DType::kU8, {1}), T("a", DType::kU8, {2})});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("'a'"));
}

TEST_F(CheckpointTest, EmptyCheckpoint) {
  const std::string path = Path("empty.safetensors");
  {
    auto c = Checkpoint::Create(path, {});
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->size(), 0u);
  }
  auto r = Checkpoint::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->size(), 0u);
  EXPECT_EQ(r->total_bytes(), 0u);
  EXPECT_EQ(r->Find("anything"), -1);
}

TEST_F(CheckpointTest, Find) {
  auto c = Checkpoint::Create(Path("f.safetensors"), SampleTensors());
  ASSERT_TRUE(c.ok());
  for (size_t i = 0; i < c->size(); ++i) EXPECT_EQ(c->Find(c->tensors()[i].name), static_cast<int64_t>(i));
  EXPECT_EQ(c->Find("a.bias"), 0);
  EXPECT_EQ(c->Find("z.weight"), static_cast<int64_t>(c->size() - 1));
  EXPECT_EQ(c->Find(""), -1);
  EXPECT_EQ(c->Find("a"), -1);
  EXPECT_EQ(c->Find("a.bias2"), -1);
  EXPECT_EQ(c->Find("zz"), -1);
  EXPECT_EQ(c->Find("m"), -1);
}

// Numbers in names order by value, across shards too, and Find agrees.
TEST_F(CheckpointTest, TensorsOrderNumbersInNamesByValue) {
  CreateOptions opt;
  opt.max_shard_bytes = 16;
  std::vector<TensorInfo> tensors;
  for (const char* name : {"experts.10.w", "experts.9.w", "experts.100.w", "experts.2.w", "layers.11", "layers.1"})
    tensors.push_back(T(name, DType::kU8, {16}));
  ASSERT_TRUE(Checkpoint::Create(Path("n"), tensors, opt).ok());
  auto c = Checkpoint::Open(Path("n"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ(c->files().size(), 6u);
  std::vector<std::string> names;
  for (const TensorInfo& t : c->tensors()) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"experts.2.w", "experts.9.w", "experts.10.w", "experts.100.w", "layers.1",
                                             "layers.11"}));
  for (size_t i = 0; i < c->size(); ++i) EXPECT_EQ(c->Find(c->tensors()[i].name), static_cast<int64_t>(i));
  EXPECT_EQ(c->Find("experts.09.w"), -1);
  EXPECT_EQ(c->Find("experts.3.w"), -1);
}

TEST_F(CheckpointTest, ReadWriteOpenWritesThrough) {
  const std::string path = Path("rw");
  CreateOptions opt;
  opt.max_shard_bytes = 64;
  ASSERT_TRUE(Checkpoint::Create(path, SampleTensors(), opt).ok());
  {
    auto c = Checkpoint::Open(path, OpenMode::kReadWrite);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->mode(), OpenMode::kReadWrite);
    Fill(*c);
    // Reads through Data() see the stores at once.
    ExpectFilled(*c);
    ASSERT_TRUE(c->Sync().ok());
  }
  auto r = Checkpoint::Open(path);
  ASSERT_TRUE(r.ok());
  ExpectFilled(*r);
}

TEST_F(CheckpointTest, MoveKeepsViewsValid) {
  auto c = Checkpoint::Create(Path("mv.safetensors"), SampleTensors());
  ASSERT_TRUE(c.ok());
  Checkpoint a = std::move(c).value();
  Fill(a);
  Checkpoint b = std::move(a);
  ExpectFilled(b);
  EXPECT_EQ(b.size(), SampleTensors().size());
}

// ----- errors -------------------------------------------------------------

TEST_F(CheckpointTest, MissingPathIsNotFound) {
  auto r = Checkpoint::Open(Path("nothing_here"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("nothing_here"));
}

TEST_F(CheckpointTest, DirectoryWithoutSafetensorsIsNotFound) {
  fs::create_directories(Path("emptydir/sub.safetensors"));  // a directory, not a file
  WriteText(Path("emptydir/readme.txt"), "hi");
  auto r = Checkpoint::Open(Path("emptydir"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kNotFound);
}

TEST_F(CheckpointTest, CorruptFileErrorNamesTheFile) {
  const std::string path = Path("bad.safetensors");
  WriteText(path, std::string("\x02\0\0\0\0\0\0\0{}", 10) + "extra");
  auto r = Checkpoint::Open(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("bad.safetensors"));

  WriteText(path, "abc");
  r = Checkpoint::Open(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("bad.safetensors"));

  // A corrupt shard in a directory.
  fs::create_directories(Path("d"));
  WriteFile(Path("d/a.safetensors"), {T("x", DType::kU8, {1})});
  WriteText(Path("d/b.safetensors"), "garbage!garbage!");
  r = Checkpoint::Open(Path("d"));
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("b.safetensors"));
}

// A sharded checkpoint; returns its directory.
std::string MakeSharded(const std::string& path) {
  CreateOptions opt;
  opt.max_shard_bytes = 10;
  auto c = Checkpoint::Create(path, {T("a", DType::kU8, {8}), T("b", DType::kU8, {8})}, opt);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->files().size(), 2u);
  return path;
}

TEST_F(CheckpointTest, IndexNamingMissingFile) {
  const std::string dir = MakeSharded(Path("s"));
  WriteText(dir + "/" + std::string(kIndexFileName),
            R"({"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors",)"
            R"("c":"model-00003-of-00003.safetensors"}})");
  auto r = Checkpoint::Open(dir);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("model-00003-of-00003.safetensors"));
}

TEST_F(CheckpointTest, IndexNamingMissingTensor) {
  const std::string dir = MakeSharded(Path("s"));
  WriteText(dir + "/" + std::string(kIndexFileName),
            R"({"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors",)"
            R"("ghost":"model-00002-of-00002.safetensors"}})");
  auto r = Checkpoint::Open(dir);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("'ghost'"));
}

TEST_F(CheckpointTest, TensorMissingFromWeightMap) {
  const std::string dir = MakeSharded(Path("s"));
  WriteText(dir + "/" + std::string(kIndexFileName),
            R"({"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00001-of-00002.safetensors"}})");
  // Only the first shard is opened; nothing names b's real file, but the map
  // puts b in the first shard, which does not hold it.
  auto r = Checkpoint::Open(dir);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("'b'"));

  // Both files named, but one tensor not listed.
  fs::create_directories(Path("s2"));
  WriteFile(Path("s2/one.safetensors"), {T("a", DType::kU8, {1}), T("extra", DType::kU8, {1})});
  WriteFile(Path("s2/two.safetensors"), {T("b", DType::kU8, {1})});
  WriteText(Path("s2/") + std::string(kIndexFileName),
            R"({"weight_map":{"a":"one.safetensors","b":"two.safetensors"}})");
  r = Checkpoint::Open(Path("s2"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("'extra'"));
  EXPECT_THAT(r.status().message(), HasSubstr("missing from the weight_map"));
}

TEST_F(CheckpointTest, WeightMapPuttingTensorInWrongFile) {
  fs::create_directories(Path("w"));
  WriteFile(Path("w/one.safetensors"), {T("a", DType::kU8, {1})});
  WriteFile(Path("w/two.safetensors"), {T("b", DType::kU8, {1})});
  WriteText(Path("w/") + std::string(kIndexFileName),
            R"({"weight_map":{"a":"two.safetensors","b":"one.safetensors"}})");
  auto r = Checkpoint::Open(Path("w"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
}

TEST_F(CheckpointTest, WeightMapFileOutsideDirectory) {
  const std::string dir = MakeSharded(Path("s"));
  for (const char* file : {"../model-00001-of-00002.safetensors", "sub/x.safetensors", "/etc/passwd", "", ".", ".."}) {
    SCOPED_TRACE(file);
    WriteText(dir + "/" + std::string(kIndexFileName),
              std::string(R"({"weight_map":{"a":")") + file + R"(","b":"model-00002-of-00002.safetensors"}})");
    auto r = Checkpoint::Open(dir);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("'a'"));
  }
}

TEST_F(CheckpointTest, MalformedIndex) {
  const std::string dir = MakeSharded(Path("s"));
  const std::string index = dir + "/" + std::string(kIndexFileName);
  for (const char* text : {"not json", "[]", "{}", R"({"weight_map":[]})", R"({"weight_map":{"a":1}})"}) {
    SCOPED_TRACE(text);
    WriteText(index, text);
    auto r = Checkpoint::Open(dir);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr(std::string(kIndexFileName)));
  }
}

TEST_F(CheckpointTest, SameTensorInTwoShardsWithoutIndex) {
  fs::create_directories(Path("twice"));
  WriteFile(Path("twice/a.safetensors"), {T("w", DType::kU8, {2}), T("only_a", DType::kU8, {1})});
  WriteFile(Path("twice/b.safetensors"), {T("w", DType::kU8, {2})});
  auto r = Checkpoint::Open(Path("twice"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("'w'"));
  EXPECT_THAT(r.status().message(), HasSubstr("a.safetensors"));
  EXPECT_THAT(r.status().message(), HasSubstr("b.safetensors"));
}

TEST_F(CheckpointTest, DirectoryOfLooseShardsIsSortedByName) {
  fs::create_directories(Path("loose"));
  WriteFile(Path("loose/2.safetensors"), {T("y", DType::kU8, {1}), T("a", DType::kU8, {3})});
  WriteFile(Path("loose/1.safetensors"), {T("x", DType::kF32, {2})});
  WriteText(Path("loose/notes.json"), "{}");
  auto r = Checkpoint::Open(Path("loose"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ(r->tensors()[0].name, "a");
  EXPECT_EQ(r->tensors()[1].name, "x");
  EXPECT_EQ(r->tensors()[2].name, "y");
  EXPECT_EQ(fs::path(r->FileOf(0)).filename(), "2.safetensors");
  EXPECT_EQ(fs::path(r->FileOf(1)).filename(), "1.safetensors");
  ASSERT_EQ(r->files().size(), 2u);
  EXPECT_EQ(fs::path(r->files()[0]).filename(), "1.safetensors");
  EXPECT_EQ(r->total_bytes(), 12u);
  EXPECT_EQ(r->total_elements(), 6u);
}

TEST_F(CheckpointTest, CreateRefusesToMixWithAnExistingCheckpoint) {
  const std::string dir = MakeSharded(Path("re"));
  const auto before = Checkpoint::Open(dir);
  ASSERT_TRUE(before.ok());
  auto c = Checkpoint::Create(dir, {T("a", DType::kU8, {8}), T("b", DType::kU8, {8})});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kAlreadyExists);
  EXPECT_NE(c.status().message().find(dir), std::string::npos) << c.status().ToString();
  // The existing checkpoint is untouched.
  auto after = Checkpoint::Open(dir);
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_EQ(after->tensors(), before->tensors());

  const std::string file = Path("one.safetensors");
  ASSERT_TRUE(Checkpoint::Create(file, {T("a", DType::kU8, {8})}).ok());
  auto again = Checkpoint::Create(file, {T("a", DType::kU8, {8})});
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), Code::kAlreadyExists);
}

}  // namespace
}  // namespace dcr
