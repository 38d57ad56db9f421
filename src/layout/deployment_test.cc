// A deployment played in one process: Megatron-style trainer ranks project
// their shard changes into canonical chunks (merging across senders), and
// vLLM-style engines place the frames into their fused, sharded buffers.
// Every engine's buffers must equal, byte for byte, a dense load of the new
// checkpoint through the same maps.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "dcr/checkpoint.h"
#include "dcr/contribution.h"
#include "dcr/delta.h"
#include "dcr/layout_apply.h"
#include "dcr/layout_families.h"
#include "layout/test_shapes.h"
#include "testing/temp_dir.h"

namespace dcr {
namespace {

using ::testing::HasSubstr;

// Buffers of one rank, owned.
struct Buffers {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::span<uint8_t>> spans;
  std::vector<std::span<const uint8_t>> const_spans;
  explicit Buffers(const CompiledLayout& l, uint8_t fill = 0) {
    for (size_t b = 0; b < l.map().buffers.size(); ++b) bytes.emplace_back(l.BufferBytes(b), fill);
    for (auto& v : bytes) spans.emplace_back(v), const_spans.emplace_back(v);
  }
};

std::vector<CompiledLayout> Compile(std::vector<LayoutMap> maps) {
  std::vector<CompiledLayout> out;
  for (LayoutMap& m : maps) {
    auto c = CompiledLayout::Compile(std::move(m));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (c.ok()) out.push_back(std::move(*c));
  }
  return out;
}

std::vector<TensorInfo> TensorsOf(const Checkpoint& ckpt) { return ckpt.tensors(); }

// Loads `ckpt` into fresh buffers of every rank.
std::vector<Buffers> DenseLoad(const std::vector<CompiledLayout>& ranks, const Checkpoint& ckpt, uint8_t fill = 0) {
  std::vector<Buffers> out;
  for (const CompiledLayout& l : ranks) {
    out.emplace_back(l, fill);
    PlacedRank p{&l, out.back().spans};
    Status s = LoadDense(CheckpointBytes(ckpt), p);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return out;
}

// One frame through the engine target of `ranks` (their digests of its
// chunk computed first), as ApplyEngineDelta applies each.
Status ApplyOneFrame(std::span<PlacedRank* const> ranks, const DeltaManifest& m, const FrameView& frame) {
  Digest current;
  for (PlacedRank* r : ranks) current += (*RankChunkDigests(*r, m))[frame.header.tensor][frame.header.chunk];
  PlacedTarget target(ranks, m, /*partial=*/false);
  const FrameView frames[] = {frame};
  const Digest now[] = {current};
  return ApplyFrames(target, m, frames, now)[0].status;
}

void ExpectSameBuffers(const std::vector<CompiledLayout>& ranks, const std::vector<Buffers>& got,
                       const std::vector<Buffers>& want, const std::string& what) {
  for (size_t r = 0; r < ranks.size(); ++r)
    for (size_t b = 0; b < got[r].bytes.size(); ++b)
      EXPECT_TRUE(got[r].bytes[b] == want[r].bytes[b])
          << what << ": rank " << r << " buffer '" << ranks[r].map().buffers[b].id << "' differs from a dense load";
}

// A delta projected from trainer shards: every sender diffs its shards,
// hands each contribution to the chunk's owner, owners encode.
struct Projected {
  DeltaManifest manifest;
  std::shared_ptr<std::string> bytes;
  uint64_t contributions = 0, handed_over = 0;  // records, and those sent to another owner
  uint64_t direct = 0;  // records that were spans (with `direct`)
};

// With `direct`, each sender gives the chunks it owns itself as direct
// contributions where it holds them whole (as a trainer process does).
Projected Project(const std::vector<CompiledLayout>& senders, const std::vector<Buffers>& baseline,
                  const std::vector<Buffers>& current, const std::vector<TensorInfo>& tensors, const DeltaOptions& opt,
                  bool direct = false) {
  Projected out;
  out.manifest = StartLayoutDelta(tensors, opt);
  std::vector<const CompiledLayout*> maps;
  for (const auto& l : senders) maps.push_back(&l);
  std::map<uint32_t, std::vector<ChunkContribution>> to_owner;
  for (uint32_t s = 0; s < senders.size(); ++s) {
    SenderRank rank{&senders[s], baseline[s].const_spans, current[s].const_spans};
    const auto own = [&](uint32_t tensor, uint32_t chunk) {
      auto owner = ChunkOwner(maps, out.manifest, tensor, chunk);
      return direct && owner.ok() && *owner == s;
    };
    auto contributions = ProjectSender(rank, s, out.manifest, own);
    EXPECT_TRUE(contributions.ok()) << contributions.status().ToString();
    if (!contributions.ok()) return out;
    for (ChunkContribution& c : *contributions) {
      auto owner = ChunkOwner(maps, out.manifest, c.tensor, c.chunk);
      EXPECT_TRUE(owner.ok()) << owner.status().ToString();
      ++out.contributions;
      out.direct += c.direct();
      if (*owner != s) ++out.handed_over;
      to_owner[*owner].push_back(std::move(c));
    }
  }
  std::vector<OwnedFrames> owned;
  for (auto& [owner, records] : to_owner) {
    auto frames = EncodeOwnedChunks(out.manifest, records, opt.encode);
    EXPECT_TRUE(frames.ok()) << frames.status().ToString();
    if (frames.ok()) owned.push_back(std::move(*frames));
  }
  auto bytes = AssembleLayoutDelta(out.manifest, owned);
  EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
  out.bytes = std::make_shared<std::string>(bytes.ok() ? std::move(*bytes) : std::string());
  return out;
}

// The same delta encoded the canonical way, from assembled checkpoints.
std::string CanonicalFrames(const Checkpoint& base, const Checkpoint& next, const DeltaOptions& opt, DeltaManifest* m) {
  auto started = StartDelta(base, next, opt);
  EXPECT_TRUE(started.ok());
  *m = *started;
  std::string bytes;
  auto enc = EncodeFrames(base, next, *m, AllChunks(*m), opt.encode, [&](std::string_view f) {
    bytes += f;
    return Status::Ok();
  });
  EXPECT_TRUE(enc.ok()) << enc.status().ToString();
  m->frames = enc->frames;
  m->objects = {std::string(kFramesFileName)};
  FinishDelta(*m, enc->base_digests, enc->target_digests);
  return bytes;
}

Result<DeltaReader> Reader(const Projected& p) {
  std::vector<std::span<const uint8_t>> objects = {
      {reinterpret_cast<const uint8_t*>(p.bytes->data()), p.bytes->size()}};
  return DeltaReader::FromObjects(p.manifest, objects, p.bytes, "projected delta");
}

// Special bit patterns (old, new) written into the first elements of a
// BF16 and (where the family has one) an F32 tensor of both versions:
// +0 -> -0, NaN payload changes, subnormals, +inf -> -inf, an unchanged NaN.
void PokeSpecials(Checkpoint& base, Checkpoint& next, const std::string& name) {
  const int64_t i = base.Find(name), j = next.Find(name);
  ASSERT_GE(i, 0);
  auto b = base.MutableData(static_cast<size_t>(i));
  auto n = next.MutableData(static_cast<size_t>(j));
  const DType dtype = base.tensors()[static_cast<size_t>(i)].dtype;
  if (dtype == DType::kBF16) {
    const uint16_t pairs[][2] = {{0x0000, 0x8000}, {0x8000, 0x0000}, {0x7FC1, 0x7FC3}, {0xFFC1, 0x7FC1},
                                 {0x0001, 0x0002}, {0x807F, 0x0001}, {0x7F80, 0xFF80}, {0x7FC1, 0x7FC1}};
    for (size_t k = 0; k < std::size(pairs); ++k) {
      std::memcpy(b.data() + 2 * k, &pairs[k][0], 2);
      std::memcpy(n.data() + 2 * k, &pairs[k][1], 2);
    }
  } else {
    ASSERT_EQ(dtype, DType::kF32);
    const uint32_t pairs[][2] = {{0x00000000, 0x80000000}, {0x7FC00001, 0x7FC00002}, {0x00000001, 0x807FFFFF},
                                 {0x7F800000, 0x7F800001}, {0xFF800000, 0x7F800000}, {0x7FC00000, 0x7FC00000}};
    for (size_t k = 0; k < std::size(pairs); ++k) {
      std::memcpy(b.data() + 4 * k, &pairs[k][0], 4);
      std::memcpy(n.data() + 4 * k, &pairs[k][1], 4);
    }
  }
}

struct Scenario {
  std::string name;
  ModelShape shape;
  TrainerParallel trainer;
  std::vector<ServingParallel> engines;
  DeltaClass delta_class;
  UpdateModel update;
};

class DeploymentTest : public testing::TempDirTest, public ::testing::WithParamInterface<Scenario> {};
class DeploymentOwnerTest : public testing::TempDirTest {};

TEST_P(DeploymentTest, EveryEngineEqualsADenseLoad) {
  const Scenario& sc = GetParam();
  GenOptions gen;
  gen.shape = sc.shape;
  gen.versions = 2;
  gen.update = sc.update;
  gen.rate = 0.2;
  gen.seed = 7;
  ASSERT_TRUE(GenerateVersions(Path("gen"), gen).ok());
  std::vector<Checkpoint> versions;
  for (int v = 0; v <= 2; ++v) {
    auto c = Checkpoint::Open(Path(fmt::format("gen/v{}", v)), OpenMode::kReadWrite);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    versions.push_back(std::move(*c));
  }
  PokeSpecials(versions[0], versions[1], "model.embed_tokens.weight");
  PokeSpecials(versions[1], versions[2], "lm_head.weight");
  if (sc.shape.family == Family::kDeepseekV3) PokeSpecials(versions[0], versions[1], "model.norm.weight");
  const std::vector<TensorInfo> tensors = TensorsOf(versions[0]);

  // The trainer: shards of v0 as the baseline, of v1 as the current state.
  std::vector<LayoutMap> trainer_maps;
  for (const TrainerRank& r : TrainerRanks(sc.trainer)) {
    auto m = MegatronLayout(sc.shape, sc.trainer, r);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    trainer_maps.push_back(std::move(*m));
  }
  const std::vector<CompiledLayout> senders = Compile(std::move(trainer_maps));
  {
    std::vector<const CompiledLayout*> ptrs;
    for (const auto& l : senders) ptrs.push_back(&l);
    ASSERT_TRUE(ValidateEngine(ptrs, tensors).ok());
  }
  std::vector<Buffers> baseline = DenseLoad(senders, versions[0]);

  // The engines, loaded with v0.
  struct Engine {
    ServingParallel parallel;
    std::vector<CompiledLayout> ranks;
    std::vector<Buffers> buffers;
  };
  std::vector<Engine> engines;
  for (const ServingParallel& p : sc.engines) {
    std::vector<LayoutMap> maps;
    for (uint32_t r = 0; r < p.tp; ++r) {
      auto m = VllmLayout(sc.shape, p, r);
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      maps.push_back(std::move(*m));
    }
    Engine e{p, Compile(std::move(maps)), {}};
    e.buffers = DenseLoad(e.ranks, versions[0]);
    engines.push_back(std::move(e));
  }

  for (int v = 1; v <= 2; ++v) {
    const std::string what = fmt::format("{} v{}", sc.name, v);
    std::vector<Buffers> current = DenseLoad(senders, versions[v]);
    DeltaOptions opt;
    opt.encode.delta_class = sc.delta_class;
    opt.chunk_elements = 24;  // chunks straddle rows, boxes and ranks
    opt.delta_id = 100 + v;
    Projected projected = Project(senders, baseline, current, tensors, opt);
    EXPECT_GT(projected.handed_over, 0u) << what << ": no chunk needed another sender's changes";

    // Byte for byte what a canonical encoder makes from assembled tensors;
    // and so with the chunks a sender holds whole given as spans.
    DeltaManifest canonical;
    const std::string canonical_frames = CanonicalFrames(versions[v - 1], versions[v], opt, &canonical);
    EXPECT_EQ(projected.manifest.ToJson(), canonical.ToJson()) << what;
    EXPECT_TRUE(*projected.bytes == canonical_frames) << what << ": projected frames differ from canonical ones";
    EXPECT_EQ(projected.direct, 0u);
    const Projected spans = Project(senders, baseline, current, tensors, opt, /*direct=*/true);
    EXPECT_GT(spans.direct, 0u) << what << ": no chunk was held whole by its owner";
    EXPECT_LT(spans.direct, spans.contributions) << what << ": every chunk was held whole by its owner";
    EXPECT_EQ(spans.manifest.ToJson(), canonical.ToJson()) << what << " (direct)";
    EXPECT_TRUE(*spans.bytes == canonical_frames) << what << ": frames with direct contributions differ";
    EXPECT_GT(projected.manifest.frames.size(), 0u);
    auto reader = Reader(projected);
    ASSERT_TRUE(reader.ok()) << reader.status().ToString();

    for (Engine& e : engines) {
      const std::string ew = fmt::format("{} engine tp {} ep {}", what, e.parallel.tp, e.parallel.expert_parallel);
      std::vector<PlacedRank> placed;
      for (size_t r = 0; r < e.ranks.size(); ++r) placed.push_back({&e.ranks[r], e.buffers[r].spans});
      std::vector<PlacedRank*> ptrs;
      for (auto& p : placed) ptrs.push_back(&p);
      if (e.parallel.tp > 1) {
        // A rank alone refuses chunks it holds only part of, and writes nothing.
        uint64_t partial = 0;
        const std::vector<uint8_t> before = e.buffers[1].bytes[0];
        for (size_t f = 0; f < reader->manifest().frames.size(); ++f) {
          auto frame = reader->Frame(f);
          ASSERT_TRUE(frame.ok());
          PlacedRank* alone[] = {ptrs[1]};
          // Probe only chunks rank 1 holds part of (a whole chunk it could apply alone).
          uint64_t first_word, words;
          uint32_t elements;
          reader->manifest().ChunkWords(frame->header.tensor, frame->header.chunk, &first_word, &words, &elements);
          const auto& t = reader->manifest().tensors[frame->header.tensor];
          const int64_t lt = e.ranks[1].FindTensor(t.name);
          if (lt < 0) continue;
          std::vector<CopyRun> runs;
          uint64_t held = 0;
          for (uint32_t c : e.ranks[1].CopiesOf(static_cast<size_t>(lt)))
            if (e.ranks[1].map().copies[c].primary) {
              runs.clear();
              e.ranks[1].RunsInRange(c, uint64_t{frame->header.chunk} * opt.chunk_elements, elements, &runs);
              for (const auto& run : runs) held += run.length;
            }
          if (held == 0 || held == elements) continue;
          const Status r = ApplyOneFrame(alone, reader->manifest(), *frame);
          ASSERT_FALSE(r.ok()) << ew;
          EXPECT_EQ(r.code(), Code::kFailedPrecondition);
          EXPECT_THAT(r.message(), HasSubstr("apply it with every rank of the engine"));
          ++partial;
        }
        EXPECT_GT(partial, 0u) << ew;
        EXPECT_TRUE(e.buffers[1].bytes[0] == before);
      }
      auto report = ApplyEngineDelta(ptrs, *reader);
      ASSERT_TRUE(report.ok()) << ew << ": " << report.status().ToString();
      EXPECT_EQ(report->frames_applied, reader->manifest().frames.size()) << ew;
      ExpectSameBuffers(e.ranks, e.buffers, DenseLoad(e.ranks, versions[v]), ew);
      // The ranks' partial digests add up to the version's digest.
      Digest sum;
      for (auto* p : ptrs) sum += *RankDigest(*p);
      EXPECT_EQ(sum, reader->manifest().target_digest) << ew;
      // Applying again changes nothing: every frame is found applied.
      auto again = ApplyEngineDelta(ptrs, *reader);
      ASSERT_TRUE(again.ok()) << again.status().ToString();
      EXPECT_EQ(again->frames_applied, 0u);
      EXPECT_EQ(again->frames_already_applied, reader->manifest().frames.size());
    }
    if (sc.delta_class == DeltaClass::kXorClass) {
      // A failed xor attempt leaves an engine half-applied; the overwrite
      // retry (same baseline) repairs it (DESIGN section 5).
      DeltaOptions retry = opt;
      retry.encode.delta_class = DeltaClass::kOverwrite;
      retry.delta_id = 200 + v;
      Projected overwrite = Project(senders, baseline, current, tensors, retry);
      auto retry_reader = Reader(overwrite);
      ASSERT_TRUE(retry_reader.ok()) << retry_reader.status().ToString();
      Engine& e = engines.back();
      std::vector<Buffers> half = DenseLoad(e.ranks, versions[v - 1]);
      std::vector<PlacedRank> placed;
      for (size_t r = 0; r < e.ranks.size(); ++r) placed.push_back({&e.ranks[r], half[r].spans});
      std::vector<PlacedRank*> ptrs;
      for (auto& p : placed) ptrs.push_back(&p);
      for (size_t f = 0; f < reader->manifest().frames.size(); f += 2) {
        auto frame = reader->Frame(f);
        ASSERT_TRUE(frame.ok());
        ASSERT_TRUE(ApplyOneFrame(ptrs, reader->manifest(), *frame).ok());
      }
      // Chunks the xor attempt reached are found applied; the rest are overwritten.
      auto report = ApplyEngineDelta(ptrs, *retry_reader);
      ASSERT_TRUE(report.ok()) << what << ": " << report.status().ToString();
      EXPECT_GT(report->frames_already_applied, 0u) << what;
      ExpectSameBuffers(e.ranks, half, DenseLoad(e.ranks, versions[v]), what + " overwrite retry");
    }
    // Commit: the trainer adopts its shards as the baseline.
    baseline = std::move(current);
  }
}

using testshapes::DeepseekShape;
using testshapes::LlamaShape;
using testshapes::QwenShape;

// The owner refuses a chunk whose contributions miss a sender or hold one twice.
TEST_F(DeploymentOwnerTest, MergeRefusesIncompleteOrDoubleCoverage) {
  GenOptions gen;
  gen.shape = LlamaShape();
  gen.versions = 1;
  gen.update = UpdateModel::kStress;
  gen.rate = 0.2;
  ASSERT_TRUE(GenerateVersions(Path("gen"), gen).ok());
  auto v0 = Checkpoint::Open(Path("gen/v0")), v1 = Checkpoint::Open(Path("gen/v1"));
  ASSERT_TRUE(v0.ok() && v1.ok());
  const TrainerParallel tp{2, 1, 1, false, 4};
  std::vector<LayoutMap> maps;
  for (const TrainerRank& r : TrainerRanks(tp)) maps.push_back(*MegatronLayout(LlamaShape(), tp, r));
  const std::vector<CompiledLayout> senders = Compile(std::move(maps));
  std::vector<Buffers> base = DenseLoad(senders, *v0), cur = DenseLoad(senders, *v1);
  DeltaOptions opt;
  opt.chunk_elements = 24;
  DeltaManifest m = StartLayoutDelta(v1->tensors(), opt);
  // o_proj is split by columns: every chunk has records from both senders.
  const std::string name = "model.layers.0.self_attn.o_proj.weight";
  uint32_t t = 0;
  while (m.tensors[t].name != name) ++t;
  std::vector<ChunkContribution> chunk0;
  for (uint32_t s = 0; s < 2; ++s) {
    auto c = ProjectSender({&senders[s], base[s].const_spans, cur[s].const_spans}, s, m);
    ASSERT_TRUE(c.ok());
    for (auto& x : *c)
      if (x.tensor == t && x.chunk == 0) chunk0.push_back(x);
  }
  ASSERT_EQ(chunk0.size(), 2u);
  EXPECT_TRUE(EncodeOwnedChunks(m, chunk0, opt.encode).ok());
  auto missing = EncodeOwnedChunks(m, std::span<const ChunkContribution>(chunk0.data(), 1), opt.encode);
  EXPECT_EQ(missing.status().code(), Code::kFailedPrecondition);
  EXPECT_THAT(missing.status().message(), HasSubstr("chunk 0: the contributions cover 12 of its 24 elements"));
  std::vector<ChunkContribution> twice = {chunk0[0], chunk0[1], chunk0[1]};
  auto doubled = EncodeOwnedChunks(m, twice, opt.encode);
  EXPECT_THAT(doubled.status().message(), HasSubstr("is contributed twice (sender 1 among them)"));
  // Ownership: the sender holding the chunk's first element (column 0: tp rank 0).
  const CompiledLayout* ptrs[] = {&senders[0], &senders[1]};
  EXPECT_EQ(*ChunkOwner(ptrs, m, t, 0), 0u);
  const CompiledLayout* only1[] = {&senders[1]};
  EXPECT_EQ(ChunkOwner(only1, m, t, 0).status().code(), Code::kNotFound);

  // A direct contribution (sender 0 holds chunk 0 of the final norm whole)
  // is merged alone; with any other record for the chunk it is refused, and
  // it never leaves its process.
  uint32_t norm = 0;
  while (m.tensors[norm].name != "model.norm.weight") ++norm;
  auto projected = ProjectSender({&senders[0], base[0].const_spans, cur[0].const_spans}, 0, m,
                                 [&](uint32_t tensor, uint32_t chunk) { return tensor == norm && chunk == 0; });
  ASSERT_TRUE(projected.ok());
  std::vector<ChunkContribution> whole;
  for (auto& x : *projected)
    if (x.tensor == norm && x.chunk == 0) whole.push_back(x);
  ASSERT_EQ(whole.size(), 1u);
  ASSERT_TRUE(whole[0].direct());
  EXPECT_TRUE(EncodeOwnedChunks(m, whole, opt.encode).ok());
  ChunkContribution extra = whole[0];
  extra.from = 1;
  extra.direct_base = extra.direct_next = {};
  std::vector<ChunkContribution> with_other = {whole[0], extra};
  EXPECT_THAT(EncodeOwnedChunks(m, with_other, opt.encode).status().message(),
              HasSubstr("sender 0 holds the whole chunk, and 1 other senders contribute to it too"));
  auto written = WriteContributions({m.delta_id, m.delta_class, 0, 1}, m, whole);
  EXPECT_EQ(written.status().code(), Code::kInvalidArgument);
  EXPECT_THAT(written.status().message(), HasSubstr("is direct"));
}

// FP8 weights (E4M3, E5M2) and F32 scales through hand-written maps: rows
// split over two senders, columns over two receivers, the scales replicated.
// Special patterns: +-0, NaNs of both signs and payloads, subnormals, E5M2
// infinities, max magnitudes.
class Fp8MapTest : public testing::TempDirTest, public ::testing::WithParamInterface<DeltaClass> {};

TEST_P(Fp8MapTest, BitExactThroughCopies) {
  const std::vector<TensorInfo> tensors = {*MakeTensorInfo("w5", DType::kF8_E5M2, {6, 16}),
                                           *MakeTensorInfo("w8", DType::kF8_E4M3, {6, 16}),
                                           *MakeTensorInfo("w8.weight_scale_inv", DType::kF32, {2, 2})};
  auto v0 = Checkpoint::Create(Path("v0"), tensors);
  auto v1 = Checkpoint::Create(Path("v1"), tensors);
  ASSERT_TRUE(v0.ok() && v1.ok());
  uint64_t x = 12345;
  auto next_random = [&x] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return x;
  };
  for (size_t t = 0; t < 2; ++t) {
    auto a = v0->MutableData(t), b = v1->MutableData(t);
    for (size_t i = 0; i < a.size(); ++i) {
      a[i] = static_cast<uint8_t>(next_random());
      b[i] = next_random() % 3 == 0 ? static_cast<uint8_t>(next_random()) : a[i];
    }
  }
  const uint8_t e5[][2] = {{0x00, 0x80}, {0x7C, 0xFC}, {0x7D, 0x7E}, {0xFD, 0x7F},
                           {0x01, 0x03}, {0x7B, 0xFB}, {0x7E, 0x7E}};
  const uint8_t e4[][2] = {{0x80, 0x00}, {0x7F, 0xFF}, {0x01, 0x02}, {0x07, 0x87}, {0x7E, 0xFE}, {0x7F, 0x7F}};
  for (size_t k = 0; k < std::size(e5); ++k) v0->MutableData(0)[k] = e5[k][0], v1->MutableData(0)[k] = e5[k][1];
  for (size_t k = 0; k < std::size(e4); ++k)
    v0->MutableData(1)[40 + k] = e4[k][0], v1->MutableData(1)[40 + k] = e4[k][1];
  const uint32_t scales0[] = {0x7FC00001, 0x00000000, 0x00000001, 0x3C000000};
  const uint32_t scales1[] = {0x7FC00002, 0x80000000, 0x00000002, 0x3C000000};
  std::memcpy(v0->MutableData(2).data(), scales0, 16);
  std::memcpy(v1->MutableData(2).data(), scales1, 16);

  auto sender_map = [](uint64_t r) {
    LayoutMap m;
    m.tensors = {{"w5", DType::kF8_E5M2, {6, 16}},
                 {"w8", DType::kF8_E4M3, {6, 16}},
                 {"w8.weight_scale_inv", DType::kF32, {2, 2}}};
    m.buffers = {
        {"fc.w5", DType::kF8_E5M2, {3, 16}}, {"fc.w8", DType::kF8_E4M3, {3, 16}}, {"fc.scale", DType::kF32, {2, 2}}};
    m.copies = {{"w5", {3 * r, 0}, {3, 16}, "fc.w5", {0, 0}, true},
                {"w8", {3 * r, 0}, {3, 16}, "fc.w8", {0, 0}, true},
                {"w8.weight_scale_inv", {0, 0}, {2, 2}, "fc.scale", {0, 0}, r == 0}};
    return m;
  };
  auto receiver_map = [](uint64_t r) {
    LayoutMap m;
    m.tensors = {{"w5", DType::kF8_E5M2, {6, 16}},
                 {"w8", DType::kF8_E4M3, {6, 16}},
                 {"w8.weight_scale_inv", DType::kF32, {2, 2}}};
    // Both weights stacked in one [2, 6, 8] buffer; the scales twice on rank 1 (one replica).
    m.buffers = {{"stack", DType::kF8_E5M2, {1, 6, 8}},
                 {"w8", DType::kF8_E4M3, {6, 8}},
                 {"scale", DType::kF32, {2, 2}},
                 {"scale.copy", DType::kF32, {1, 4}}};
    m.copies = {{"w5", {0, 8 * r}, {6, 8}, "stack", {0, 0, 0}, true},
                {"w8", {0, 8 * r}, {6, 8}, "w8", {0, 0}, true},
                {"w8.weight_scale_inv", {0, 0}, {2, 2}, "scale", {0, 0}, r == 0},
                {"w8.weight_scale_inv", {1, 0}, {1, 2}, "scale.copy", {0, 1}, false}};
    return m;
  };
  const std::vector<CompiledLayout> senders = Compile({sender_map(0), sender_map(1)});
  const std::vector<CompiledLayout> receivers = Compile({receiver_map(0), receiver_map(1)});
  ASSERT_EQ(senders.size(), 2u);
  ASSERT_EQ(receivers.size(), 2u);
  DeltaOptions opt;
  opt.encode.delta_class = GetParam();
  opt.chunk_elements = 16;
  opt.delta_id = 77;
  Projected projected = Project(senders, DenseLoad(senders, *v0), DenseLoad(senders, *v1), tensors, opt);
  DeltaManifest canonical;
  const std::string canonical_frames = CanonicalFrames(*v0, *v1, opt, &canonical);
  EXPECT_TRUE(*projected.bytes == canonical_frames);
  EXPECT_EQ(projected.manifest.ToJson(), canonical.ToJson());
  auto reader = Reader(projected);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  std::vector<Buffers> engine = DenseLoad(receivers, *v0, 0xA5);  // padding-free here; fill shows stray writes
  std::vector<PlacedRank> placed = {{&receivers[0], engine[0].spans}, {&receivers[1], engine[1].spans}};
  std::vector<PlacedRank*> ptrs = {&placed[0], &placed[1]};
  auto report = ApplyEngineDelta(ptrs, *reader);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_GT(report->changed_words, 0u);
  ExpectSameBuffers(receivers, engine, DenseLoad(receivers, *v1, 0xA5), "fp8");
  // The special patterns landed: E5M2 +inf -> -inf at w5[0][1] (rank 0, stack [0, 0, 1]).
  EXPECT_EQ(engine[0].bytes[0][1], 0xFC);
  EXPECT_EQ(engine[0].bytes[0][0], 0x80);  // +0 -> -0
}

INSTANTIATE_TEST_SUITE_P(Modes, Fp8MapTest, ::testing::Values(DeltaClass::kXorClass, DeltaClass::kOverwrite),
                         [](const auto& test_info) {
                           return std::string(test_info.param == DeltaClass::kXorClass ? "xor" : "overwrite");
                         });

std::vector<Scenario> Scenarios() {
  std::vector<Scenario> out;
  for (DeltaClass cls : {DeltaClass::kXorClass, DeltaClass::kOverwrite}) {
    const std::string mode = cls == DeltaClass::kXorClass ? "xor" : "overwrite";
    const UpdateModel update = cls == DeltaClass::kXorClass ? UpdateModel::kTraining : UpdateModel::kStress;
    // Llama: trainer tp 2 x pp 2; engines tp 1, 2 and 4 (kv heads replicated at tp 4).
    out.push_back({"llama_tp2_pp2_" + mode,
                   LlamaShape(),
                   {2, 2, 1, false, 4},
                   {{1, false, 4}, {2, false, 4}, {4, false, 4}},
                   cls,
                   update});
    // Qwen3-MoE: trainer tp 2 x ep 4 (6 experts: 2, 2, 1, 1 per rank); engines tp 1, 2 with EP, 4 with EP
    // (uneven expert map) and 4 without.
    out.push_back({"qwen3moe_tp2_ep4_" + mode,
                   QwenShape(),
                   {2, 1, 4, false, 4},
                   {{1, false, 4}, {2, true, 4}, {4, true, 4}, {4, false, 4}},
                   cls,
                   update});
    // DeepSeek-V3 (MLA, F32 norms and router bias): trainer tp 2 x ep 4 x pp 2 with expert tp.
    out.push_back({"deepseek_tp2_ep4_pp2_" + mode,
                   DeepseekShape(),
                   {2, 2, 4, true, 4},
                   {{1, false, 4}, {2, false, 4}, {4, true, 4}},
                   cls,
                   update});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Families, DeploymentTest, ::testing::ValuesIn(Scenarios()),
                         [](const auto& test_info) { return test_info.param.name; });

}  // namespace
}  // namespace dcr
