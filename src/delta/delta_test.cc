// Deltas (include/dcr/delta.h): make and apply on generated checkpoints in
// both classes, idempotence, refusal of wrong bases without writing, resume
// after a partial apply, verification, manifest parsing, and corrupt delta
// directories.
#include "dcr/delta.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include <fmt/format.h>
#include <random>
#include <string>
#include <vector>

#include "dcr/hash.h"
#include "dcr/synth.h"
#include "dcr/thread_pool.h"
#include "testing/digest_words.h"
#include "testing/temp_dir.h"

namespace dcr {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// Every file of a checkpoint directory, by name.
std::map<std::string, std::string> Files(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) out[e.path().filename().string()] = ReadFile(e.path().string());
  return out;
}

void CopyDir(const std::string& from, const std::string& to) { fs::copy(from, to, fs::copy_options::recursive); }

// Words whose bits differ between the tensors of two checkpoints.
uint64_t ChangedWords(const Checkpoint& a, const Checkpoint& b) {
  uint64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const uint32_t wb = WordBytes(a.tensors()[i].dtype);
    const auto da = a.Data(i), db = b.Data(static_cast<size_t>(b.Find(a.tensors()[i].name)));
    for (size_t w = 0; w < da.size() / wb; ++w) n += std::memcmp(da.data() + w * wb, db.data() + w * wb, wb) != 0;
  }
  return n;
}

Digest TensorDigest(const Checkpoint& c, size_t i) {
  const TensorInfo& t = c.tensors()[i];
  return testing::ChunkDigest(MakeDigestKey(t.name), WordBytes(t.dtype), 0, c.Data(i));
}

// Generated model versions shared by the suite (made once: ~0.2 s).
class DeltaTest : public testing::TempDirTest {
 protected:
  static void SetUpTestSuite() {
    std::string tmpl = (fs::path(::testing::TempDir()) / "dcr_delta_gen_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    gen_ = new std::string(tmpl);
    GenOptions qwen;
    qwen.shape = ShapeForSize(Family::kQwen3Moe, 4 << 20);
    qwen.versions = 2;
    qwen.update = UpdateModel::kTraining;
    qwen.rate = 0.03;
    qwen.seed = 1;
    auto r = GenerateVersions(*gen_ + "/qwen", qwen);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    GenOptions ds;
    ds.shape = ShapeForSize(Family::kDeepseekV3, 2 << 20);
    ds.versions = 1;
    ds.update = UpdateModel::kStress;
    ds.rate = 0.05;
    ds.seed = 2;
    r = GenerateVersions(*gen_ + "/deepseek", ds);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(*gen_, ec);
    delete gen_;
    gen_ = nullptr;
  }
  static std::string Gen(const std::string& model, int v) { return *gen_ + "/" + model + "/v" + std::to_string(v); }

  static DeltaOptions Options(DeltaClass cls, uint64_t chunk = 4096) {
    DeltaOptions o;
    o.encode.delta_class = cls;
    o.chunk_elements = chunk;
    return o;
  }

  // Makes the delta from version `from` to `to` of `model` into `name`.
  DeltaManifest Make(const std::string& model, int from, int to, DeltaClass cls, const std::string& name,
                     uint64_t chunk = 4096) {
    auto base = Checkpoint::Open(Gen(model, from));
    auto next = Checkpoint::Open(Gen(model, to));
    EXPECT_TRUE(base.ok() && next.ok());
    auto m = MakeDelta(*base, *next, Options(cls, chunk), Path(name));
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return m.ok() ? *m : DeltaManifest{};
  }

  // A writable copy of version v of `model`.
  std::string CopyOf(const std::string& model, int v, const std::string& name) {
    CopyDir(Gen(model, v), Path(name));
    return Path(name);
  }

  Result<ApplyReport> Apply(const std::string& target, const std::string& delta) {
    DCR_ASSIGN_OR_RETURN(DeltaReader reader, DeltaReader::Open(delta));
    DCR_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(target, OpenMode::kReadWrite));
    return ApplyDelta(ckpt, reader);
  }

  // Applies frame i of `reader` to `c` as an interrupted apply or a receiver
  // streaming frames would have, one chunk by hand.
  static std::optional<ApplyOutcome> ApplyByHand(Checkpoint& c, const DeltaReader& reader, size_t i) {
    const DeltaManifest& m = reader.manifest();
    const auto& e = m.frames[i];
    auto frame = reader.Frame(i);
    EXPECT_TRUE(frame.ok()) << frame.status().ToString();
    if (!frame.ok()) return std::nullopt;
    uint64_t first_word, words;
    uint32_t elements;
    m.ChunkWords(e.tensor, e.chunk, &first_word, &words, &elements);
    const uint32_t wb = WordBytes(m.tensors[e.tensor].dtype);
    const DigestKey key = MakeDigestKey(m.tensors[e.tensor].name);
    auto data =
        c.MutableData(static_cast<size_t>(c.Find(m.tensors[e.tensor].name))).subspan(first_word * wb, words * wb);
    Digest after;
    ChunkApplier applier;
    auto r = applier.Apply(*frame, key, first_word, data, testing::ChunkDigest(key, wb, first_word, data), &after);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? std::optional<ApplyOutcome>(*r) : std::nullopt;
  }

  static std::string* gen_;
};
std::string* DeltaTest::gen_ = nullptr;

TEST_F(DeltaTest, MakeThenApplyGivesTheNextVersionInBothClasses) {
  for (const std::string model : {"qwen", "deepseek"}) {
    for (DeltaClass cls : {DeltaClass::kXorClass, DeltaClass::kOverwrite}) {
      const std::string tag = model + (cls == DeltaClass::kXorClass ? "-xor" : "-overwrite");
      SCOPED_TRACE(tag);
      const DeltaManifest m = Make(model, 0, 1, cls, "d-" + tag);
      auto v0 = Checkpoint::Open(Gen(model, 0));
      auto v1 = Checkpoint::Open(Gen(model, 1));
      ASSERT_TRUE(v0.ok() && v1.ok());

      // The manifest describes the change exactly.
      EXPECT_NE(m.delta_id, 0u);
      EXPECT_EQ(m.delta_class, cls);
      EXPECT_EQ(m.chunk_elements, 4096u);
      EXPECT_EQ(m.tensors.size(), v1->size());
      EXPECT_EQ(m.total_elements, v1->total_elements());
      EXPECT_EQ(m.total_bytes, v1->total_bytes());
      EXPECT_GT(m.frames.size(), 50u);
      const uint64_t changed = ChangedWords(*v0, *v1);
      ASSERT_GT(changed, 0u);
      EXPECT_EQ(m.changed_words, changed);
      Digest base_sum, target_sum;
      ASSERT_EQ(m.tensor_target_digests.size(), m.tensors.size());
      for (size_t t = 0; t < m.tensors.size(); ++t) {
        EXPECT_EQ(m.tensors[t].name, v1->tensors()[t].name);
        EXPECT_EQ(m.tensor_target_digests[t], TensorDigest(*v1, t)) << m.tensors[t].name;
        base_sum += TensorDigest(*v0, t);
        target_sum += TensorDigest(*v1, t);
      }
      EXPECT_EQ(m.base_digest, base_sum);
      EXPECT_EQ(m.target_digest, target_sum);
      uint64_t offset = 0, payload = 0, changed_sum = 0;
      for (size_t i = 0; i < m.frames.size(); ++i) {
        const auto& f = m.frames[i];
        if (i > 0) {
          EXPECT_LT(std::pair(m.frames[i - 1].tensor, m.frames[i - 1].chunk), std::pair(f.tensor, f.chunk));
        }
        EXPECT_EQ(f.offset, offset);
        offset += f.bytes;
        payload += f.payload_bytes;
        EXPECT_GE(f.bytes - f.payload_bytes, kMinFrameHeaderBytes);
        EXPECT_LE(f.bytes - f.payload_bytes, kMaxFrameHeaderBytes);
        changed_sum += f.changed;
        EXPECT_GT(f.changed, 0u);
        EXPECT_EQ(f.mode == Mode::kOverwrite, cls == DeltaClass::kOverwrite);
      }
      EXPECT_EQ(m.frame_bytes, offset);
      EXPECT_EQ(m.payload_bytes, payload);
      EXPECT_EQ(m.changed_words, changed_sum);
      EXPECT_EQ(fs::file_size(Path("d-" + tag + "/frames.bin")), m.frame_bytes);

      // The directory reads back as the same manifest.
      auto reader = DeltaReader::Open(Path("d-" + tag));
      ASSERT_TRUE(reader.ok()) << reader.status().ToString();
      DeltaManifest stored = m;
      stored.tensor_target_digests.clear();  // not in manifest.bin
      EXPECT_EQ(reader->manifest().ToJson(), stored.ToJson());
      for (size_t i = 0; i < m.frames.size(); ++i) {
        auto f = reader->Frame(i);
        ASSERT_TRUE(f.ok()) << f.status().ToString();
        EXPECT_EQ(f->header.tensor, m.frames[i].tensor);
        EXPECT_EQ(f->header.chunk, m.frames[i].chunk);
      }

      // Applied to a copy of v0: v1, byte for byte (files and all).
      const std::string target = CopyOf(model, 0, "t-" + tag);
      auto report = Apply(target, Path("d-" + tag));
      ASSERT_TRUE(report.ok()) << report.status().ToString();
      EXPECT_EQ(report->frames_applied, m.frames.size());
      EXPECT_EQ(report->frames_already_applied, 0u);
      EXPECT_EQ(report->changed_words, m.changed_words);
      EXPECT_EQ(report->payload_bytes, m.payload_bytes);
      EXPECT_TRUE(Files(target) == Files(Gen(model, 1))) << "the applied checkpoint differs from v1";
      auto t = Checkpoint::Open(target);
      ASSERT_TRUE(t.ok());
      auto verify = VerifyDelta(*t, *reader);
      ASSERT_TRUE(verify.ok());
      EXPECT_TRUE(verify->matches);
    }
  }
}

TEST_F(DeltaTest, ChunkSizesAndNoAdd) {
  // Chunks larger than some tensors and smaller than others, and xor-only.
  for (uint64_t chunk : {64ull, 1000ull, 1ull << 20}) {
    DeltaOptions o = Options(DeltaClass::kXorClass, chunk);
    o.encode.allow_add = chunk != 1000;
    auto base = Checkpoint::Open(Gen("deepseek", 0));
    auto next = Checkpoint::Open(Gen("deepseek", 1));
    const std::string d = Path(fmt::format("d{}", chunk));
    auto m = MakeDelta(*base, *next, o, d);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    if (!o.encode.allow_add) {
      for (const auto& f : m->frames) EXPECT_EQ(f.mode, Mode::kXor);
    }
    const std::string t = CopyOf("deepseek", 0, fmt::format("t{}", chunk));
    auto r = Apply(t, d);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE(Files(t) == Files(Gen("deepseek", 1))) << chunk;
  }
}

TEST_F(DeltaTest, ChainedDeltas) {
  Make("qwen", 0, 1, DeltaClass::kXorClass, "d01");
  Make("qwen", 1, 2, DeltaClass::kXorClass, "d12");
  const std::string t = CopyOf("qwen", 0, "t");
  ASSERT_TRUE(Apply(t, Path("d01")).ok());
  auto r = Apply(t, Path("d12"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(Files(t) == Files(Gen("qwen", 2)));
}

TEST_F(DeltaTest, ApplyingTwiceFindsEveryFrameApplied) {
  for (DeltaClass cls : {DeltaClass::kXorClass, DeltaClass::kOverwrite}) {
    const std::string tag = cls == DeltaClass::kXorClass ? "xor" : "overwrite";
    const DeltaManifest m = Make("qwen", 0, 1, cls, "d-" + tag);
    const std::string t = CopyOf("qwen", 0, "t-" + tag);
    ASSERT_TRUE(Apply(t, Path("d-" + tag)).ok());
    const auto after_first = Files(t);
    auto r = Apply(t, Path("d-" + tag));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->frames_applied, 0u) << tag;
    EXPECT_EQ(r->frames_already_applied, m.frames.size()) << tag;
    EXPECT_EQ(r->changed_words, 0u);
    EXPECT_EQ(r->payload_bytes, 0u);
    EXPECT_TRUE(Files(t) == after_first);
    EXPECT_TRUE(Files(t) == Files(Gen("qwen", 1)));
  }
}

TEST_F(DeltaTest, ApplyToANonBaseIsRefusedWithoutWriting) {
  for (DeltaClass cls : {DeltaClass::kXorClass, DeltaClass::kOverwrite}) {
    const std::string tag = cls == DeltaClass::kXorClass ? "xor" : "overwrite";
    SCOPED_TRACE(tag);
    Make("qwen", 1, 2, cls, "d12-" + tag);
    // v0 is not v1 (the base): every changed chunk holds other bits.
    const std::string t = CopyOf("qwen", 0, "t-" + tag);
    auto r = Apply(t, Path("d12-" + tag));
    ASSERT_FALSE(r.ok()) << "applying v1->v2 to v0 succeeded";
    EXPECT_EQ(r.status().code(), Code::kFailedPrecondition) << r.status().ToString();
    EXPECT_NE(r.status().message().find("tensor '"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("not the base"), std::string::npos) << r.status().message();
    EXPECT_TRUE(Files(t) == Files(Gen("qwen", 0))) << "a refused apply wrote to the target";
  }
}

// A base/next pair whose delta has frames in some chunks only: tensor "w"
// (BF16, 8 chunks of 1024) changes sparsely in chunks 0..3; tensor "n" (F32)
// does not change.
void MakeSparsePair(const std::string& a_path, const std::string& b_path) {
  const std::vector<TensorInfo> infos = {*MakeTensorInfo("n", DType::kF32, {256}),
                                         *MakeTensorInfo("w", DType::kBF16, {64, 128})};
  auto a = Checkpoint::Create(a_path, infos);
  auto b = Checkpoint::Create(b_path, infos);
  ASSERT_TRUE(a.ok() && b.ok());
  std::mt19937_64 rng(17);
  for (size_t i = 0; i < 2; ++i) {
    auto da = a->MutableData(i), db = b->MutableData(i);
    for (size_t k = 0; k < da.size(); ++k) da[k] = db[k] = static_cast<uint8_t>(rng());
  }
  auto w = b->MutableData(1);
  for (int c = 0; c < 4; ++c)
    for (int j = 0; j < 5; ++j) w[2 * (1024 * c + 100 * j + 3)] ^= 1;  // 5 words per chunk
  ASSERT_TRUE(a->Sync().ok() && b->Sync().ok());
}

TEST_F(DeltaTest, ApplyToACheckpointWithOneStrayChangeIsRefused) {
  // The base with one word changed: in a tensor the delta does not touch, in
  // an untouched chunk of a touched tensor, and in a touched chunk at a word
  // the frame does not change. ApplyDelta must refuse without writing, or
  // (an overwrite frame carrying the whole chunk) produce exactly the target.
  MakeSparsePair(Path("a.safetensors"), Path("b.safetensors"));
  struct Stray {
    const char* what;
    const char* tensor;
    uint64_t byte;
    bool frame_covers_chunk;
  };
  const Stray strays[] = {
      {"untouched tensor", "n", 4 * 17, false},
      {"untouched chunk of a touched tensor", "w", 2 * (1024 * 6 + 9), false},
      {"touched chunk, unchanged word", "w", 2 * (1024 * 1 + 50), true},
  };
  for (DeltaClass cls : {DeltaClass::kXorClass, DeltaClass::kOverwrite}) {
    const std::string tag = cls == DeltaClass::kXorClass ? "xor" : "overwrite";
    auto a = Checkpoint::Open(Path("a.safetensors"));
    auto b = Checkpoint::Open(Path("b.safetensors"));
    auto m = MakeDelta(*a, *b, Options(cls, 1024), Path("d-" + tag));
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    ASSERT_EQ(m->frames.size(), 4u);
    for (const auto& f : m->frames) EXPECT_EQ(f.codec, Codec::kSparse);
    for (const Stray& stray : strays) {
      SCOPED_TRACE(tag + ", stray change in " + stray.what);
      const std::string t = Path(fmt::format("t-{}-{}.safetensors", tag, stray.byte));
      fs::copy_file(Path("a.safetensors"), t);
      {
        auto c = Checkpoint::Open(t, OpenMode::kReadWrite);
        ASSERT_TRUE(c.ok());
        c->MutableData(static_cast<size_t>(c->Find(stray.tensor)))[stray.byte] ^= 0x10;
        ASSERT_TRUE(c->Sync().ok());
      }
      const std::string before = ReadFile(t);
      auto r = Apply(t, Path("d-" + tag));
      if (r.ok()) {
        ADD_FAILURE() << "ApplyDelta accepted a target that is not the base; the result is "
                      << (ReadFile(t) == ReadFile(Path("b.safetensors")) ? "the delta's target"
                                                                         : "NOT the delta's target");
        continue;
      }
      EXPECT_EQ(r.status().code(), Code::kFailedPrecondition) << r.status().ToString();
      // A chunk with a frame is named; elsewhere the manifest knows only the sum.
      EXPECT_NE(
          r.status().message().find(stray.frame_covers_chunk ? fmt::format("tensor '{}'", stray.tensor)
                                                             : std::string("outside the chunks the delta changes")),
          std::string::npos)
          << r.status().message();
      EXPECT_NE(r.status().message().find("not the base"), std::string::npos) << r.status().message();
      EXPECT_TRUE(ReadFile(t) == before) << "a refused apply wrote to the target";
    }
  }
}

TEST_F(DeltaTest, OverwriteRepairsAHalfWrittenChunk) {
  // An apply interrupted inside a chunk leaves some of its changes written.
  // An overwrite delta repairs that chunk (and applies the rest); an
  // xor-class delta refuses, without writing.
  MakeSparsePair(Path("a.safetensors"), Path("b.safetensors"));
  const std::string a_bytes = ReadFile(Path("a.safetensors")), b_bytes = ReadFile(Path("b.safetensors"));
  for (DeltaClass cls : {DeltaClass::kXorClass, DeltaClass::kOverwrite}) {
    const std::string tag = cls == DeltaClass::kXorClass ? "xor" : "overwrite";
    SCOPED_TRACE(tag);
    auto a = Checkpoint::Open(Path("a.safetensors"));
    auto b = Checkpoint::Open(Path("b.safetensors"));
    ASSERT_TRUE(MakeDelta(*a, *b, Options(cls, 1024), Path("d-" + tag)).ok());
    const std::string t = Path("t-" + tag + ".safetensors");
    // Chunk 2 of "w" gets two of its five changes.
    std::string half = a_bytes;
    const uint64_t w_offset = a_bytes.size() - 2 * 8192;  // "w" is stored last
    for (int j = 0; j < 2; ++j) {
      const uint64_t at = w_offset + 2 * (1024 * 2 + 100 * j + 3);
      ASSERT_NE(half[at], b_bytes[at]);
      half[at] = b_bytes[at];
    }
    WriteFile(t, half);
    auto r = Apply(t, Path("d-" + tag));
    if (cls == DeltaClass::kOverwrite) {
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_EQ(r->frames_applied, 4u);
      EXPECT_TRUE(ReadFile(t) == b_bytes);
    } else {
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().code(), Code::kFailedPrecondition) << r.status().ToString();
      EXPECT_NE(r.status().message().find("tensor 'w' chunk 2"), std::string::npos) << r.status().message();
      EXPECT_TRUE(ReadFile(t) == half);
    }
  }
}

TEST_F(DeltaTest, ResumesAfterAPartialApply) {
  for (DeltaClass cls : {DeltaClass::kXorClass, DeltaClass::kOverwrite}) {
    const std::string tag = cls == DeltaClass::kXorClass ? "xor" : "overwrite";
    SCOPED_TRACE(tag);
    const DeltaManifest m = Make("qwen", 0, 1, cls, "d-" + tag);
    const std::string t = CopyOf("qwen", 0, "t-" + tag);
    auto reader = DeltaReader::Open(Path("d-" + tag));
    ASSERT_TRUE(reader.ok());
    uint64_t manual = 0;
    {
      // Apply every other frame by hand, as an interrupted apply would have.
      auto c = Checkpoint::Open(t, OpenMode::kReadWrite);
      ASSERT_TRUE(c.ok());
      for (size_t i = 0; i < m.frames.size(); i += 2) {
        EXPECT_EQ(ApplyByHand(*c, *reader, i), ApplyOutcome::kApplied);
        ++manual;
      }
      ASSERT_TRUE(c->Sync().ok());
    }
    auto r = Apply(t, Path("d-" + tag));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->frames_already_applied, manual);
    EXPECT_EQ(r->frames_applied, m.frames.size() - manual);
    EXPECT_TRUE(Files(t) == Files(Gen("qwen", 1)));
  }
}

// A receiver that applied frames as they arrived keeps only their headers:
// the manifest's apply counts those chunks done without their payloads, and
// refuses, before writing, a released frame whose chunk is not at its target.
TEST_F(DeltaTest, ReleasedFramesAreAppliedFromTheirHeadersOnly) {
  const DeltaManifest m = Make("qwen", 0, 1, DeltaClass::kXorClass, "d");
  ASSERT_GT(m.frames.size(), 4u);
  ASSERT_EQ(m.objects.size(), 1u);
  auto reader = DeltaReader::Open(Path("d"));
  ASSERT_TRUE(reader.ok());
  const std::string t = CopyOf("qwen", 0, "t");
  // Every other frame applied by hand, its header kept, its payload spoilt
  // in the object given to the reader (so that reading it would fail).
  auto object = std::make_shared<std::string>(ReadFile(Path("d/frames.bin")));
  ReleasedFrames released;
  {
    auto c = Checkpoint::Open(t, OpenMode::kReadWrite);
    ASSERT_TRUE(c.ok());
    for (size_t i = 0; i < m.frames.size(); i += 2) {
      const auto& e = m.frames[i];
      ASSERT_EQ(ApplyByHand(*c, *reader, i), ApplyOutcome::kApplied);
      const uint64_t header_bytes = e.bytes - e.payload_bytes;
      std::copy_n(object->data() + e.offset, header_bytes, released[i].begin());
      std::fill_n(object->data() + e.offset + header_bytes, e.payload_bytes, '\x5a');
    }
    ASSERT_TRUE(c->Sync().ok());
  }
  auto open_released = [&](ReleasedFrames r) {
    const auto bytes = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(object->data()), object->size());
    return DeltaReader::FromObjects(m, {bytes}, object, Path("d"), std::move(r));
  };
  auto partial = open_released(released);
  ASSERT_TRUE(partial.ok()) << partial.status().ToString();
  auto f0 = partial->Frame(0);
  ASSERT_TRUE(f0.ok()) << f0.status().ToString();
  EXPECT_FALSE(f0->PayloadHeld());
  EXPECT_EQ(f0->header, reader->Frame(0)->header);
  EXPECT_TRUE(partial->Frame(1).ok() && partial->Frame(1)->PayloadHeld());

  // On a fresh base the released chunks are not at their targets: refused, nothing written.
  const std::string fresh = CopyOf("qwen", 0, "fresh");
  const auto before = Files(fresh);
  {
    auto c = Checkpoint::Open(fresh, OpenMode::kReadWrite);
    ASSERT_TRUE(c.ok());
    auto r = ApplyDelta(*c, *partial);
    ASSERT_EQ(r.status().code(), Code::kFailedPrecondition) << r.status().ToString();
    EXPECT_NE(r.status().message().find("payload was dropped"), std::string::npos) << r.status().ToString();
  }
  EXPECT_TRUE(Files(fresh) == before) << "a refused apply wrote to the target";

  // Where they are done, the rest applies and the result is the target's bits.
  {
    auto c = Checkpoint::Open(t, OpenMode::kReadWrite);
    ASSERT_TRUE(c.ok());
    auto r = ApplyDelta(*c, *partial);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->frames_already_applied, released.size());
    EXPECT_EQ(r->frames_applied, m.frames.size() - released.size());
  }
  EXPECT_TRUE(Files(t) == Files(Gen("qwen", 1)));

  // A kept header must still be its manifest entry's frame.
  ReleasedFrames swapped = released;
  std::swap(swapped[0], swapped[2]);
  auto wrong = open_released(swapped);
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ(wrong->Frame(0).status().code(), Code::kDataLoss);
  ReleasedFrames past;
  past[m.frames.size()] = released[0];
  EXPECT_EQ(open_released(past).status().code(), Code::kInvalidArgument);
}

// A rank of a sharded engine skips frame objects without its chunks: their
// frames are never read (the object may be given empty), asking for one is
// refused, and the manifest's totals cannot be checked, so they are not.
TEST_F(DeltaTest, FramesOfSkippedObjectsAreNotRead) {
  const DeltaManifest m = Make("qwen", 0, 1, DeltaClass::kXorClass, "d");
  ASSERT_EQ(m.objects.size(), 1u);
  const auto object = std::make_shared<std::string>(ReadFile(Path("d/frames.bin")));
  const auto bytes = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(object->data()), object->size());
  auto skipped = DeltaReader::FromObjects(m, {std::span<const uint8_t>()}, object, Path("d"), {}, {true});
  ASSERT_TRUE(skipped.ok()) << skipped.status().ToString();
  for (size_t i = 0; i < m.frames.size(); ++i) {
    EXPECT_TRUE(skipped->Skipped(i));
    EXPECT_EQ(skipped->Frame(i).status().code(), Code::kFailedPrecondition);
  }
  auto kept = DeltaReader::FromObjects(m, {bytes}, object, Path("d"), {}, {false});
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  EXPECT_FALSE(kept->Skipped(0));
  EXPECT_TRUE(kept->Frame(0).ok());
  // A checkpoint's apply cannot pass a skipped frame: refused, nothing written.
  const std::string t = CopyOf("qwen", 0, "t");
  const auto before = Files(t);
  {
    auto c = Checkpoint::Open(t, OpenMode::kReadWrite);
    ASSERT_TRUE(c.ok());
    EXPECT_FALSE(ApplyDelta(*c, *skipped).ok());
  }
  EXPECT_TRUE(Files(t) == before);
  EXPECT_EQ(DeltaReader::FromObjects(m, {bytes}, object, Path("d"), {}, {false, true}).status().code(),
            Code::kInvalidArgument);
}

TEST_F(DeltaTest, VerifyAgainstTargetAndBase) {
  const DeltaManifest made = Make("qwen", 0, 1, DeltaClass::kXorClass, "d");
  auto reader = DeltaReader::Open(Path("d"));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  const DeltaReader& m = *reader;
  auto v0 = Checkpoint::Open(Gen("qwen", 0));
  auto v1 = Checkpoint::Open(Gen("qwen", 1));
  auto v2 = Checkpoint::Open(Gen("qwen", 2));
  ASSERT_TRUE(v0.ok() && v1.ok() && v2.ok());
  auto r = VerifyDelta(*v1, m);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->matches);
  EXPECT_TRUE(r->differing.empty());
  r = VerifyDelta(*v0, m, /*against_base=*/true);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->matches);
  r = VerifyDelta(*v0, m);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->matches);
  // Exactly the tensors that changed between v0 and v1 differ.
  std::vector<std::string> changed;
  for (size_t t = 0; t < made.tensors.size(); ++t)
    if (TensorDigest(*v0, t) != TensorDigest(*v1, t)) changed.push_back(made.tensors[t].name);
  EXPECT_FALSE(changed.empty());
  EXPECT_EQ(r->differing, changed);
  r = VerifyDelta(*v1, m, true);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->matches);
  r = VerifyDelta(*v2, m);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->matches);
  // Another model: an error, not a mismatch.
  auto ds = Checkpoint::Open(Gen("deepseek", 0));
  ASSERT_TRUE(ds.ok());
  r = VerifyDelta(*ds, m);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kFailedPrecondition);
}

// ---- every dtype, through checkpoints -------------------------------------------

TEST_F(DeltaTest, EveryDtypeRoundTrips) {
  std::mt19937_64 rng(5);
  std::vector<TensorInfo> infos;
  for (int d = 0; d < kDTypeCount; ++d) {
    auto info =
        MakeTensorInfo(fmt::format("t{:02}.{}", d, Name(static_cast<DType>(d))), static_cast<DType>(d), {7, 40});
    ASSERT_TRUE(info.ok());
    infos.push_back(*info);
  }
  infos.push_back(*MakeTensorInfo("empty", DType::kBF16, {0, 5}));
  infos.push_back(*MakeTensorInfo("scalar", DType::kF32, {}));
  {
    auto a = Checkpoint::Create(Path("a.safetensors"), infos);
    auto b = Checkpoint::Create(Path("b.safetensors"), infos);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
    for (size_t i = 0; i < a->size(); ++i) {
      auto da = a->MutableData(i), db = b->MutableData(i);
      for (size_t k = 0; k < da.size(); ++k) da[k] = db[k] = static_cast<uint8_t>(rng());
      for (size_t k = 0; k < db.size(); ++k)
        if (rng() % 10 == 0) db[k] ^= static_cast<uint8_t>(1u << (rng() % 8));
      if (!db.empty() && a->tensors()[i].name == "scalar") db[0] ^= 0x80;
    }
    ASSERT_TRUE(a->Sync().ok() && b->Sync().ok());
  }
  for (DeltaClass cls : {DeltaClass::kXorClass, DeltaClass::kOverwrite}) {
    for (uint64_t chunk : {8ull, 48ull, 4096ull}) {
      const std::string tag = std::to_string(chunk) + (cls == DeltaClass::kXorClass ? "x" : "o");
      auto a = Checkpoint::Open(Path("a.safetensors"));
      auto b = Checkpoint::Open(Path("b.safetensors"));
      auto m = MakeDelta(*a, *b, Options(cls, chunk), Path("d" + tag));
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      EXPECT_EQ(m->changed_words, ChangedWords(*a, *b));
      fs::copy_file(Path("a.safetensors"), Path("t" + tag + ".safetensors"));
      auto r = Apply(Path("t" + tag + ".safetensors"), Path("d" + tag));
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_EQ(ReadFile(Path("t" + tag + ".safetensors")), ReadFile(Path("b.safetensors"))) << tag;
    }
  }
}

// ---- refusals of MakeDelta -----------------------------------------------------------

TEST_F(DeltaTest, MakeRefusesDifferentTensorsAndExistingDeltas) {
  auto ti = [](const std::string& name, DType dtype, std::vector<uint64_t> shape) {
    return *MakeTensorInfo(name, dtype, std::move(shape));
  };
  const std::vector<TensorInfo> base_t = {ti("a", DType::kBF16, {4, 4}), ti("b", DType::kF32, {8})};
  struct Case {
    std::string name;
    std::vector<TensorInfo> tensors;
    std::string mention;
  };
  const std::vector<Case> cases = {
      {"renamed", {ti("a", DType::kBF16, {4, 4}), ti("c", DType::kF32, {8})}, "'c'"},
      {"extra", {ti("a", DType::kBF16, {4, 4}), ti("b", DType::kF32, {8}), ti("c", DType::kU8, {1})}, "'c'"},
      {"missing", {ti("a", DType::kBF16, {4, 4})}, "'b'"},
      {"reshaped", {ti("a", DType::kBF16, {2, 8}), ti("b", DType::kF32, {8})}, "'a'"},
      {"retyped", {ti("a", DType::kF16, {4, 4}), ti("b", DType::kF32, {8})}, "'a'"},
  };
  { ASSERT_TRUE(Checkpoint::Create(Path("base.safetensors"), base_t).ok()); }
  auto base = Checkpoint::Open(Path("base.safetensors"));
  ASSERT_TRUE(base.ok());
  for (const auto& c : cases) {
    { ASSERT_TRUE(Checkpoint::Create(Path(c.name + ".safetensors"), c.tensors).ok()); }
    auto next = Checkpoint::Open(Path(c.name + ".safetensors"));
    ASSERT_TRUE(next.ok());
    auto m = MakeDelta(*base, *next, Options(DeltaClass::kXorClass), Path("d-" + c.name));
    ASSERT_FALSE(m.ok()) << c.name;
    EXPECT_EQ(m.status().code(), Code::kFailedPrecondition) << c.name << ": " << m.status().ToString();
    EXPECT_NE(m.status().message().find(c.mention), std::string::npos) << c.name << ": " << m.status().message();
    EXPECT_FALSE(fs::exists(Path("d-" + c.name + "/manifest.bin")));
  }
  // An output directory that already holds a delta.
  auto m = MakeDelta(*base, *base, Options(DeltaClass::kXorClass), Path("d"));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_TRUE(m->frames.empty());
  const std::string manifest = ReadFile(Path("d/manifest.bin"));
  m = MakeDelta(*base, *base, Options(DeltaClass::kOverwrite), Path("d"));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), Code::kAlreadyExists) << m.status().ToString();
  EXPECT_EQ(ReadFile(Path("d/manifest.bin")), manifest);
  // Chunk sizes that are not positive multiples of 8.
  for (uint64_t chunk : {0ull, 7ull, 12ull, (1ull << 28) + 8}) {
    auto r = MakeDelta(*base, *base, Options(DeltaClass::kXorClass, chunk), Path(fmt::format("dc{}", chunk)));
    ASSERT_FALSE(r.ok()) << chunk;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << chunk;
  }
}

TEST_F(DeltaTest, EmptyDeltaAppliesAsNoOp) {
  auto v0 = Checkpoint::Open(Gen("qwen", 0));
  ASSERT_TRUE(v0.ok());
  auto m = MakeDelta(*v0, *v0, Options(DeltaClass::kXorClass), Path("d"));
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->frames.size(), 0u);
  EXPECT_EQ(m->base_digest, m->target_digest);
  const std::string t = CopyOf("qwen", 0, "t");
  auto r = Apply(t, Path("d"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->frames_applied + r->frames_already_applied, 0u);
  // ... and is refused on another version.
  const std::string t1 = CopyOf("qwen", 1, "t1");
  r = Apply(t1, Path("d"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kFailedPrecondition);
}

// ---- the manifest -----------------------------------------------------------------------

class ManifestTest : public DeltaTest {
 protected:
  void SetUp() override {
    DeltaTest::SetUp();
    manifest_ = Make("deepseek", 0, 1, DeltaClass::kXorClass, "d", 1024);
    ASSERT_GE(manifest_.frames.size(), 3u);
    doc_ = json::parse(manifest_.ToJson());
  }
  Status Parse(const json& doc) {
    auto r = DeltaManifest::FromJson(doc.dump(), "manifest.json");
    return r.ok() ? Status::Ok() : r.status();
  }
  void ExpectBad(const std::function<void(json&)>& edit, const std::string& what, Code code = Code::kInvalidArgument) {
    json doc = doc_;
    edit(doc);
    const Status s = Parse(doc);
    EXPECT_FALSE(s.ok()) << what << " was accepted";
    EXPECT_EQ(s.code(), code) << what << ": " << s.ToString();
    EXPECT_NE(s.message().find("manifest.json"), std::string::npos) << what << ": " << s.message();
  }
  DeltaManifest manifest_;
  json doc_;
};

TEST_F(ManifestTest, JsonRoundTrip) {
  auto back = DeltaManifest::FromJson(manifest_.ToJson(), "m");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  const DeltaManifest& b = *back;
  EXPECT_EQ(b.ToJson(), manifest_.ToJson());
  EXPECT_EQ(b.delta_id, manifest_.delta_id);
  EXPECT_EQ(b.delta_class, manifest_.delta_class);
  EXPECT_EQ(b.chunk_elements, manifest_.chunk_elements);
  EXPECT_EQ(b.base_digest, manifest_.base_digest);
  EXPECT_EQ(b.target_digest, manifest_.target_digest);
  EXPECT_EQ(b.total_elements, manifest_.total_elements);
  EXPECT_EQ(b.total_bytes, manifest_.total_bytes);
  EXPECT_EQ(b.changed_words, manifest_.changed_words);
  EXPECT_EQ(b.payload_bytes, manifest_.payload_bytes);
  EXPECT_EQ(b.frame_bytes, manifest_.frame_bytes);
  ASSERT_EQ(b.tensors.size(), manifest_.tensors.size());
  for (size_t t = 0; t < b.tensors.size(); ++t) {
    EXPECT_EQ(b.tensors[t].name, manifest_.tensors[t].name);
    EXPECT_EQ(b.tensors[t].dtype, manifest_.tensors[t].dtype);
    EXPECT_EQ(b.tensors[t].shape, manifest_.tensors[t].shape);
    EXPECT_EQ(b.tensors[t].elements, manifest_.tensors[t].elements);
  }
  EXPECT_EQ(b.tensor_target_digests, manifest_.tensor_target_digests);
  ASSERT_EQ(b.frames.size(), manifest_.frames.size());
  for (size_t i = 0; i < b.frames.size(); ++i) {
    const auto &x = b.frames[i], &y = manifest_.frames[i];
    EXPECT_TRUE(x.tensor == y.tensor && x.chunk == y.chunk && x.offset == y.offset && x.bytes == y.bytes &&
                x.mode == y.mode && x.codec == y.codec && x.changed == y.changed)
        << i;
  }
  // The overwrite class too.
  DeltaManifest o = manifest_;
  o.delta_class = DeltaClass::kOverwrite;
  for (auto& f : o.frames) f.mode = Mode::kOverwrite;
  auto ob = DeltaManifest::FromJson(o.ToJson(), "m");
  ASSERT_TRUE(ob.ok());
  EXPECT_EQ(ob->delta_class, DeltaClass::kOverwrite);
  EXPECT_EQ(ob->ToJson(), o.ToJson());
}

TEST_F(ManifestTest, FromJsonRejectsMalformedManifests) {
  ASSERT_TRUE(Parse(doc_).ok());
  for (const std::string text : {"", "[]", "null", "{", "{\"format\": \"dcr-delta\"", "42"}) {
    auto r = DeltaManifest::FromJson(text, "manifest.json");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << text;
  }
  ExpectBad([](json& d) { d["format"] = "dcr-delt"; }, "wrong format");
  ExpectBad([](json& d) { d.erase("format"); }, "no format");
  ExpectBad([](json& d) { d["format_version"] = 1; }, "format version 1", Code::kUnimplemented);
  ExpectBad([](json& d) { d["format_version"] = 3; }, "format version 3", Code::kUnimplemented);
  ExpectBad([](json& d) { d["format_version"] = "1"; }, "format version as a string");
  ExpectBad([](json& d) { d["delta_id"] = "123"; }, "short delta id");
  ExpectBad([](json& d) { d["delta_id"] = "zzzzzzzzzzzzzzzz"; }, "non-hex delta id");
  ExpectBad([](json& d) { d["class"] = "add"; }, "unknown class");
  ExpectBad([](json& d) { d["chunk_elements"] = 0; }, "chunk 0");
  ExpectBad([](json& d) { d["chunk_elements"] = 1020; }, "chunk not a multiple of 8");
  ExpectBad([](json& d) { d["chunk_elements"] = -1024; }, "negative chunk");
  // Digests.
  ExpectBad([](json& d) { d["base_digest"] = "1234"; }, "short base digest");
  ExpectBad([](json& d) { d["target_digest"] = std::string(32, 'g'); }, "non-hex target digest");
  ExpectBad(
      [](json& d) {
        std::string s = d["base_digest"];
        for (auto& ch : s) ch = static_cast<char>(std::toupper(ch));
        if (s == d["base_digest"].get<std::string>()) s[0] = 'X';
        d["base_digest"] = s;
      },
      "uppercase digest");
  ExpectBad([](json& d) { d["tensor_target_digests"][0] = 5; }, "numeric tensor digest");
  ExpectBad([](json& d) { d["tensor_target_digests"][1] = std::string(33, '0'); }, "long tensor digest");
  ExpectBad([](json& d) { d["tensor_target_digests"].erase(0); }, "a tensor digest missing");
  ExpectBad([](json& d) { d["tensor_target_digests"][0] = d["base_digest"]; }, "tensor digests not adding up");
  // Tensors.
  ExpectBad([](json& d) { d["tensors"][0]["dtype"] = "BF17"; }, "unknown dtype");
  ExpectBad([](json& d) { d["tensors"][0]["shape"] = json::array({-1}); }, "negative dimension");
  ExpectBad([](json& d) { d["tensors"][0]["shape"] = "4,4"; }, "shape not an array");
  ExpectBad([](json& d) { std::swap(d["tensors"][0], d["tensors"][1]); }, "unsorted tensors");
  ExpectBad([](json& d) { d["tensors"][1]["name"] = d["tensors"][0]["name"]; }, "duplicate tensors");
  ExpectBad([](json& d) { d["tensors"] = json::object(); }, "tensors not an array");
  // Frames.
  ExpectBad([](json& d) { std::swap(d["frames"][0], d["frames"][1]); }, "unsorted frames");
  ExpectBad([](json& d) { d["frames"][1] = d["frames"][0]; }, "duplicate frames");
  ExpectBad(
      [](json& d) {
        d["frames"][1]["tensor"] = d["frames"][0]["tensor"];
        d["frames"][1]["chunk"] = d["frames"][0]["chunk"];
      },
      "two frames for one chunk");
  ExpectBad([&](json& d) { d["frames"].back()["tensor"] = manifest_.tensors.size(); }, "tensor out of range");
  ExpectBad([](json& d) { d["frames"][0]["tensor"] = -1; }, "negative tensor");
  ExpectBad(
      [&](json& d) {
        const auto& f = manifest_.frames.back();
        d["frames"].back()["chunk"] = manifest_.ChunkCount(f.tensor);
      },
      "chunk out of range");
  ExpectBad([](json& d) { d["frames"][0]["mode"] = "same"; }, "unknown mode");
  ExpectBad([](json& d) { d["frames"][0]["codec"] = "lz4"; }, "unknown codec");
  ExpectBad([](json& d) { d["frames"][0]["bytes"] = 26; }, "frame shorter than a header");
  ExpectBad([](json& d) { d["frames"][0]["payload_bytes"] = d["frames"][0]["bytes"]; },
            "payload as large as the frame");
  ExpectBad([](json& d) { d["frames"][0]["changed"] = 1ull << 32; }, "changed beyond 32 bits");
  ExpectBad([](json& d) { d["frames"][0].erase("offset"); }, "frame without offset");
  ExpectBad([](json& d) { d["frames"][0] = 3; }, "frame not an object");
}

// Tables list tensors with numbers in names ordered by value; a table in byte
// order (as older dcr wrote them) is refused with the reason.
TEST_F(ManifestTest, TensorTablesOrderNumbersByValue) {
  const size_t n = manifest_.tensors.size();
  ASSERT_GE(n, 11u);
  std::vector<std::string> names;
  for (size_t i = 0; i < n; ++i) names.push_back(fmt::format("t.{}", i));  // t.9 before t.10
  json doc = doc_;
  for (size_t i = 0; i < n; ++i) doc["tensors"][i]["name"] = names[i];
  EXPECT_TRUE(Parse(doc).ok()) << Parse(doc).ToString();
  std::sort(names.begin(), names.end());  // byte order: t.10 before t.9
  for (size_t i = 0; i < n; ++i) doc["tensors"][i]["name"] = names[i];
  const Status s = Parse(doc);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
  EXPECT_THAT(s.message(), ::testing::HasSubstr("byte order"));
  EXPECT_THAT(s.message(), ::testing::HasSubstr("remake the delta, or start a new run"));
}

// manifest.bin: every field round-trips; mode, codec and changed are the
// frames' (not stored), so a decoded entry has them at their defaults.
TEST_F(ManifestTest, BinaryRoundTrip) {
  for (const bool several_objects : {false, true}) {
    DeltaManifest m = manifest_;
    if (several_objects) {  // frames spread over objects, offsets not back to back
      m.objects = {"frames/s0-0000.bin", "frames/s1-0000.bin", "x/y"};
      for (size_t i = 0; i < m.frames.size(); ++i)
        m.frames[i].object = static_cast<uint32_t>(i % 3), m.frames[i].offset = 7 * i;
    }
    const std::string bytes = m.Encode();
    auto back = DeltaManifest::Decode(std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), m, "m");
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->delta_id, m.delta_id);
    EXPECT_EQ(back->delta_class, m.delta_class);
    EXPECT_EQ(back->chunk_elements, m.chunk_elements);
    EXPECT_EQ(back->base_digest, m.base_digest);
    EXPECT_EQ(back->target_digest, m.target_digest);
    EXPECT_EQ(back->objects, m.objects);
    EXPECT_EQ(back->changed_words, m.changed_words);
    EXPECT_EQ(back->payload_bytes, m.payload_bytes);
    EXPECT_EQ(back->frame_bytes, m.frame_bytes);
    EXPECT_TRUE(back->tensor_target_digests.empty());
    ASSERT_EQ(back->frames.size(), m.frames.size());
    for (size_t i = 0; i < m.frames.size(); ++i) {
      const auto &x = back->frames[i], &y = m.frames[i];
      EXPECT_TRUE(x.tensor == y.tensor && x.chunk == y.chunk && x.object == y.object && x.offset == y.offset &&
                  x.bytes == y.bytes)
          << i;
    }
    EXPECT_EQ(back->Encode(), bytes);
  }
  // The size follows the frames: a few bytes each besides the fixed part.
  const std::string bytes = manifest_.Encode();
  EXPECT_LT(bytes.size(), kManifestFixedBytes + 64 + 5 * manifest_.frames.size());
}

// Re-checksums `bytes` (its last four) after an edit.
std::string WithCrc(std::string bytes) {
  const uint32_t crc = Crc32c(bytes.data(), bytes.size() - 4);
  for (int i = 0; i < 4; ++i) bytes[bytes.size() - 4 + i] = static_cast<char>(crc >> (8 * i));
  return bytes;
}

TEST_F(ManifestTest, DecodeRejectsMalformedManifests) {
  const std::string good = manifest_.Encode();
  auto decode = [&](const std::string& b) {
    return DeltaManifest::Decode(std::span(reinterpret_cast<const uint8_t*>(b.data()), b.size()), manifest_,
                                 "manifest.bin");
  };
  ASSERT_TRUE(decode(good).ok());
  // Every truncation, and every flipped bit of the first 64 bytes and the
  // last 8: refused, never read past the end.
  for (size_t n = 0; n < good.size(); ++n) {
    auto r = decode(good.substr(0, n));
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_TRUE(r.status().code() == Code::kDataLoss || r.status().code() == Code::kInvalidArgument) << n;
  }
  for (size_t i = 0; i < good.size(); ++i) {
    if (i >= 64 && i < good.size() - 8) continue;
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      EXPECT_FALSE(decode(bad).ok()) << i << ":" << bit;
    }
  }
  // Fields, with the checksum made good again.
  struct Case {
    const char* what;
    size_t at;
    uint8_t value;
    Code code;
  };
  const Case cases[] = {
      {"format version 1", 4, 1, Code::kUnimplemented},
      {"format version 3", 4, 3, Code::kUnimplemented},
      {"class 0", 5, 0, Code::kInvalidArgument},
      {"class 3", 5, 3, Code::kInvalidArgument},
      {"unknown flag", 6, 2, Code::kInvalidArgument},
      {"reserved byte", 7, 1, Code::kInvalidArgument},
      {"another table", 16, static_cast<uint8_t>(good[16] ^ 1), Code::kFailedPrecondition},
      {"digest lane at 2^64-1", 31, 0xff, Code::kInvalidArgument},
  };
  for (const Case& c : cases) {
    std::string bad = good;
    if (c.at == 31) std::memset(bad.data() + 24, 0xff, 8);
    bad[c.at] = static_cast<char>(c.value);
    auto r = decode(WithCrc(bad));
    ASSERT_FALSE(r.ok()) << c.what;
    EXPECT_EQ(r.status().code(), c.code) << c.what << ": " << r.status().ToString();
    EXPECT_NE(r.status().message().find("manifest.bin"), std::string::npos) << c.what;
  }
  // Structure: bad object names, frames past the last chunk or with
  // impossible sizes, bytes after the list.
  auto encoded = [&](const std::function<void(DeltaManifest&)>& edit) {
    DeltaManifest m = manifest_;
    edit(m);
    return m.Encode();
  };
  for (const std::string& name : std::vector<std::string>{"", "../x", "a//b", "./a", "a\\b", "a\x01"}) {
    auto r = decode(encoded([&](DeltaManifest& m) { m.objects = {name}; }));
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << name;
  }
  EXPECT_EQ(decode(encoded([](DeltaManifest& m) { m.frames.back().chunk = 1u << 30; })).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(decode(encoded([](DeltaManifest& m) { m.frames[0].bytes = 3; })).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(decode(encoded([](DeltaManifest& m) { m.frames[0].bytes = 1ull << 40; })).status().code(),
            Code::kInvalidArgument);
  std::string trailing = good;
  trailing.insert(trailing.size() - 4, 1, '\0');
  EXPECT_EQ(decode(WithCrc(trailing)).status().code(), Code::kInvalidArgument);
  // A format version 1 manifest (JSON) names its version.
  auto old = decode(R"({"format": "dcr-delta", "format_version": 1, "tensors": []})");
  EXPECT_EQ(old.status().code(), Code::kUnimplemented);
  EXPECT_NE(old.status().message().find("format version 1"), std::string::npos) << old.status().message();
}

TEST_F(ManifestTest, TableJsonRoundTripAndId) {
  auto back = DeltaManifest::FromTableJson(manifest_.TableJson(), "tensors.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->TableId(), manifest_.TableId());
  EXPECT_EQ(back->TableJson(), manifest_.TableJson());
  EXPECT_EQ(back->total_bytes, manifest_.total_bytes);
  // The id changes with every field it covers.
  DeltaManifest m = manifest_;
  m.chunk_elements *= 2;
  EXPECT_NE(m.TableId(), manifest_.TableId());
  m = manifest_;
  m.tensors[0].name += "x";
  EXPECT_NE(m.TableId(), manifest_.TableId());
  m = manifest_;
  m.tensors[0].dtype = m.tensors[0].dtype == DType::kBF16 ? DType::kF16 : DType::kBF16;
  EXPECT_NE(m.TableId(), manifest_.TableId());
  m = manifest_;
  m.tensors[0].shape.push_back(1);
  EXPECT_NE(m.TableId(), manifest_.TableId());
  for (const std::string text : {"", "{}", R"({"format": "dcr-tensors", "format_version": 1})",
                                 R"({"format": "dcr-delta", "format_version": 2})"})
    EXPECT_FALSE(DeltaManifest::FromTableJson(text, "tensors.json").ok()) << text;
}

// ---- corrupt delta directories ---------------------------------------------------

TEST_F(DeltaTest, ReaderRejectsCorruptFrames) {
  const DeltaManifest m = Make("qwen", 0, 1, DeltaClass::kXorClass, "d");
  ASSERT_GE(m.frames.size(), 3u);
  const std::string frames_path = Path("d/frames.bin");
  const std::string original = ReadFile(frames_path);

  // A flipped byte in the middle frame's payload: only that frame is bad,
  // and applying the delta fails before writing anything.
  const size_t k = m.frames.size() / 2;
  const uint64_t header_bytes = m.frames[k].bytes - m.frames[k].payload_bytes;
  for (uint64_t where :
       {m.frames[k].offset + header_bytes + 1, m.frames[k].offset + 10, m.frames[k].offset + m.frames[k].bytes - 1}) {
    std::string bad = original;
    bad[where] = static_cast<char>(bad[where] ^ 0x20);
    WriteFile(frames_path, bad);
    const std::string t = Path(fmt::format("t{}", where));
    CopyDir(Gen("qwen", 0), t);
    auto reader = DeltaReader::Open(Path("d"));
    if (!reader.ok()) {  // a damaged header is found when the reader opens
      EXPECT_LT(where, m.frames[k].offset + header_bytes);
      EXPECT_EQ(reader.status().code(), Code::kDataLoss) << reader.status().ToString();
      EXPECT_NE(reader.status().message().find("chunk " + std::to_string(m.frames[k].chunk)), std::string::npos)
          << reader.status().message();
      continue;
    }
    for (size_t i = 0; i < m.frames.size(); ++i) {
      auto f = reader->Frame(i);
      if (i != k) {
        EXPECT_TRUE(f.ok()) << i << ": " << f.status().ToString();
        continue;
      }
      ASSERT_FALSE(f.ok());
      EXPECT_EQ(f.status().code(), Code::kDataLoss) << f.status().ToString();
      EXPECT_NE(f.status().message().find("'" + m.tensors[m.frames[k].tensor].name + "'"), std::string::npos)
          << f.status().message();
    }
    auto r = Apply(t, Path("d"));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status().ToString();
    EXPECT_TRUE(Files(t) == Files(Gen("qwen", 0))) << "a corrupt delta wrote to the target";
  }

  // Truncated: the last frame runs past the end of the file.
  for (size_t cut : {size_t{1}, size_t{100}, original.size() / 2}) {
    WriteFile(frames_path, original.substr(0, original.size() - cut));
    auto reader = DeltaReader::Open(Path("d"));
    if (reader.ok()) {
      auto f = reader->Frame(m.frames.size() - 1);
      ASSERT_FALSE(f.ok()) << cut;
      EXPECT_EQ(f.status().code(), Code::kDataLoss);
    } else {
      EXPECT_EQ(reader.status().code(), Code::kDataLoss) << reader.status().ToString();
      EXPECT_NE(reader.status().message().find("frames.bin"), std::string::npos);
    }
  }

  // Frames swapped in place (each intact, at the wrong place): the headers
  // disagree with the manifest.
  {
    std::string swapped = original;
    const auto &f0 = m.frames[0], &f1 = m.frames[1];
    swapped.replace(f0.offset, f0.bytes + f1.bytes,
                    original.substr(f1.offset, f1.bytes) + original.substr(f0.offset, f0.bytes));
    WriteFile(frames_path, swapped);
    auto reader = DeltaReader::Open(Path("d"));
    // Refused when the reader opens (an entry lands mid-frame when the two
    // sizes differ) or when the frame is read.
    const Status s = reader.ok() ? reader->Frame(0).status() : reader.status();
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), Code::kDataLoss) << s.ToString();
  }

  // Missing frames.bin.
  fs::remove(frames_path);
  auto reader = DeltaReader::Open(Path("d"));
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), Code::kNotFound) << reader.status().ToString();
  WriteFile(frames_path, original);
  EXPECT_TRUE(DeltaReader::Open(Path("d")).ok());
}

// manifest.bin edited into one its frames do not match (re-encoded, so
// its checksum holds): refused when opened or when the frame is read.
TEST_F(DeltaTest, ReaderRejectsManifestThatDisagreesWithFrames) {
  Make("qwen", 0, 1, DeltaClass::kXorClass, "d");
  const std::string manifest_path = Path("d/manifest.bin");
  const std::string original = ReadFile(manifest_path);
  auto opened = DeltaReader::Open(Path("d"));
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  const DeltaManifest stored = opened->manifest();
  ASSERT_GE(stored.frames.size(), 2u);
  const std::vector<std::pair<std::string, std::function<void(DeltaManifest&)>>> edits = {
      {"class", [](DeltaManifest& m) { m.delta_class = DeltaClass::kOverwrite; }},
      {"frame size", [](DeltaManifest& m) { m.frames[0].bytes += 1; }},
      {"first frame dropped", [](DeltaManifest& m) { m.frames.erase(m.frames.begin()); }},
      {"totals", [](DeltaManifest& m) { m.changed_words += 1; }},
  };
  for (const auto& [name, edit] : edits) {
    DeltaManifest m = stored;
    edit(m);
    WriteFile(manifest_path, m.Encode());
    auto reader = DeltaReader::Open(Path("d"));
    if (!reader.ok()) {  // also acceptable: refused at open
      EXPECT_TRUE(reader.status().code() == Code::kInvalidArgument || reader.status().code() == Code::kDataLoss)
          << name << ": " << reader.status().ToString();
      continue;
    }
    auto fr = reader->Frame(0);
    ASSERT_FALSE(fr.ok()) << name;
    EXPECT_EQ(fr.status().code(), Code::kDataLoss) << name << ": " << fr.status().ToString();
  }
  // A manifest for another tensor table (here: another chunking).
  DeltaManifest other = stored;
  other.chunk_elements *= 2;
  WriteFile(manifest_path, other.Encode());
  auto reader = DeltaReader::Open(Path("d"));
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), Code::kFailedPrecondition) << reader.status().ToString();
  // Truncated, or missing.
  WriteFile(manifest_path, original.substr(0, original.size() / 2));
  reader = DeltaReader::Open(Path("d"));
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), Code::kDataLoss) << reader.status().ToString();
  fs::remove(manifest_path);
  reader = DeltaReader::Open(Path("d"));
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), Code::kNotFound);
  reader = DeltaReader::Open(Path("no-such-dir"));
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), Code::kNotFound);
  // A delta of format version 1 (manifest.json) is refused, naming the version.
  WriteFile(Path("d/manifest.json"), R"({"format": "dcr-delta", "format_version": 1})");
  reader = DeltaReader::Open(Path("d"));
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), Code::kUnimplemented);
  EXPECT_NE(reader.status().message().find("format version 1"), std::string::npos) << reader.status().message();
}

// Only the manifest says what the whole checkpoint must end as (its frames
// carry their chunks' digests). An altered one is refused before a byte is
// written.
TEST_F(DeltaTest, ApplyRefusesAManifestWhoseTargetDigestTheFramesDoNotMake) {
  Make("qwen", 0, 1, DeltaClass::kXorClass, "d");
  const std::string manifest_path = Path("d/manifest.bin");
  const std::string original = ReadFile(manifest_path);
  auto opened = DeltaReader::Open(Path("d"));
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  const std::string target = CopyOf("qwen", 0, "t");
  DeltaManifest m = opened->manifest();
  m.target_digest = m.base_digest;
  WriteFile(manifest_path, m.Encode());
  auto r = Apply(target, Path("d"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("nothing was written"), std::string::npos) << r.status().message();
  EXPECT_TRUE(Files(target) == Files(Gen("qwen", 0))) << "a refused apply wrote to the target";
  // An altered base digest costs only the shortcut: each frame is checked
  // against its chunk (a dry run), and the target is reached exactly.
  m = opened->manifest();
  m.base_digest = m.target_digest;
  WriteFile(manifest_path, m.Encode());
  r = Apply(target, Path("d"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(Files(target) == Files(Gen("qwen", 1)));
  // The original, once more: every frame is found done.
  WriteFile(manifest_path, original);
  r = Apply(target, Path("d"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(Files(target) == Files(Gen("qwen", 1)));
}

TEST_F(DeltaTest, ApplyWithSmallThreadPoolsMatches) {
  // Output and behaviour do not depend on the thread count.
  DeltaOptions o = Options(DeltaClass::kXorClass);
  o.delta_id = 77;
  auto v0 = Checkpoint::Open(Gen("qwen", 0));
  auto v1 = Checkpoint::Open(Gen("qwen", 1));
  ThreadPool none(0), three(3);
  auto a = MakeDelta(*v0, *v1, o, Path("a"), nullptr, &none);
  auto b = MakeDelta(*v0, *v1, o, Path("b"), nullptr, &three);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(ReadFile(Path("a/frames.bin")), ReadFile(Path("b/frames.bin")));
  EXPECT_EQ(ReadFile(Path("a/manifest.bin")), ReadFile(Path("b/manifest.bin")));
  EXPECT_EQ(ReadFile(Path("a/tensors.json")), ReadFile(Path("b/tensors.json")));
  const std::string t = CopyOf("qwen", 0, "t");
  auto reader = DeltaReader::Open(Path("a"));
  auto ckpt = Checkpoint::Open(t, OpenMode::kReadWrite);
  ASSERT_TRUE(reader.ok() && ckpt.ok());
  auto r = ApplyDelta(*ckpt, *reader, nullptr, &none);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(Files(t) == Files(Gen("qwen", 1)));
  // A read-only target is refused.
  auto ro = Checkpoint::Open(Gen("qwen", 0));
  r = ApplyDelta(*ro, *reader);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace dcr
