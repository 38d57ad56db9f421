// FP8 engine ranks (Fp8EngineMemory): ordinary frames applied to a BF16
// master through the apply loop, and exactly the touched blocks requantized.
// After every version each rank's E4M3 bytes and scales equal, bit for bit,
// the block-FP8 quantization (QuantizeFp8Blocks) of its share of the new BF16
// tensors, and its master equals a dense load; covered: a row-split tensor
// over two ranks, a fused buffer with an edge block, an expert stack, a
// plain (unquantized) buffer, a block that becomes all zeros, a block whose
// amax changes, special bit patterns, xor/add frames and overwrites, and an
// overwrite retry of a half-applied version.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <set>

#include "dcr/chunk_codec.h"
#include "dcr/delta.h"
#include "dcr/fp8_engine.h"
#include "testing/fake_memory.h"
#include "testing/tensor_delta.h"

namespace dcr {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kChunk = 1000;  // elements: chunks straddle rows and blocks
constexpr uint64_t kB = 128;

using testing::Tensors;

const std::vector<TensorInfo>& Infos() {
  static const std::vector<TensorInfo> infos = {
      {"e0", DType::kBF16, {128, 256}, 128 * 256, 128 * 256 * 2},
      {"e1", DType::kBF16, {128, 256}, 128 * 256, 128 * 256 * 2},
      {"k", DType::kBF16, {100, 200}, 100 * 200, 100 * 200 * 2},
      {"n", DType::kBF16, {256}, 256, 512},
      {"q", DType::kBF16, {256, 200}, 256 * 200, 256 * 200 * 2},
      {"w", DType::kBF16, {384, 256}, 384 * 256, 384 * 256 * 2},
  };
  return infos;
}

// Rank 0: rows 0..255 of "w", and "q" and "k" fused into "qk" (k's last block
// row is an edge block of 100 rows). Rank 1: rows 256..383 of "w", the experts
// stacked, and a replica of the norm, which is rank 0's.
LayoutMap RankMap(uint32_t r) {
  LayoutMap m;
  for (const TensorInfo& t : Infos()) m.tensors.push_back({t.name, t.dtype, t.shape});
  if (r == 0) {
    m.buffers = {
        {"w_shard", DType::kBF16, {256, 256}}, {"qk", DType::kBF16, {356, 200}}, {"norm", DType::kBF16, {256}}};
    m.copies = {{"w", {0, 0}, {256, 256}, "w_shard", {0, 0}, true},
                {"q", {0, 0}, {256, 200}, "qk", {0, 0}, true},
                {"k", {0, 0}, {100, 200}, "qk", {256, 0}, true},
                {"n", {0}, {256}, "norm", {0}, true}};
  } else {
    m.buffers = {
        {"w_shard", DType::kBF16, {128, 256}}, {"experts", DType::kBF16, {2, 128, 256}}, {"norm", DType::kBF16, {256}}};
    m.copies = {{"w", {256, 0}, {128, 256}, "w_shard", {0, 0}, true},
                {"e0", {0, 0}, {128, 256}, "experts", {0, 0, 0}, true},
                {"e1", {0, 0}, {128, 256}, "experts", {1, 0, 0}, true},
                {"n", {0}, {256}, "norm", {0}, false}};
  }
  // Keep only the tensors this rank maps.
  std::erase_if(m.tensors, [&](const LayoutTensor& t) {
    return std::none_of(m.copies.begin(), m.copies.end(), [&](const BoxCopy& c) { return c.tensor == t.name; });
  });
  return m;
}

uint16_t Bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

Tensors Initial(std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 0.02f);
  Tensors out;
  for (const TensorInfo& t : Infos()) {
    std::vector<uint8_t>& v = out[t.name];
    v.resize(t.nbytes);
    for (uint64_t i = 0; i < t.numel; ++i) {
      const uint16_t h = Bf16(normal(rng));
      std::memcpy(v.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

// ~2% of the elements changed (some to special patterns), block (1, 0) of
// "w" all zeros, and one element of block (0, 1) of "q" grown past the amax.
Tensors Step(const Tensors& base, std::mt19937_64& rng) {
  const uint16_t specials[] = {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0x0001, 0x8001, 0x007F, 0x4400};
  Tensors next = base;
  for (auto& [name, v] : next) {
    const uint64_t n = v.size() / 2;
    for (uint64_t i = 0; i < n / 50; ++i) {
      const uint64_t at = rng() % n;
      uint16_t h;
      std::memcpy(&h, v.data() + 2 * at, 2);
      h = rng() % 8 == 0 ? specials[rng() % 10] : static_cast<uint16_t>(h ^ (1u << (rng() % 7)));
      std::memcpy(v.data() + 2 * at, &h, 2);
    }
  }
  for (uint64_t r = kB; r < 2 * kB; ++r) std::memset(next["w"].data() + (r * 256) * 2, 0, kB * 2);
  const uint16_t big = Bf16(4096.0f);  // above every finite special
  std::memcpy(next["q"].data() + (5 * 200 + 130) * 2, &big, 2);
  return next;
}

using Delta = testing::TensorDelta;

Delta Encode(const Tensors& base, const Tensors& next, DeltaClass cls) {
  DeltaOptions o;
  o.encode.delta_class = cls;
  o.chunk_elements = kChunk;
  o.delta_id = 0x5678;
  return testing::EncodeTensorDelta(Infos(), base, next, o);
}

std::vector<FrameView> Views(const Delta& d) {
  std::vector<FrameView> out;
  for (const std::string& f : d.frames) out.push_back(testing::ParseTestFrame(f));
  return out;
}

// One FP8 engine rank: its BF16 map, the engine's FP8 bytes and scales per
// FP8 buffer, its plain norm (in host memory, or behind `inner`), and the
// memory the loop writes through.
struct Fp8Rank {
  CompiledLayout layout;
  std::map<size_t, std::vector<uint8_t>> fp8, scales;
  std::vector<uint8_t> norm;
  std::unique_ptr<testing::FakeMemory> inner;
  std::unique_ptr<Fp8EngineMemory> memory;
  ChunkDigestTable tracked;

  // The memory refers to `layout`.
  explicit Fp8Rank(uint32_t r, bool behind_inner = false) : layout(*CompiledLayout::Compile(RankMap(r))) {
    std::map<size_t, Fp8Placement> placements;
    std::vector<std::span<uint8_t>> plain(layout.map().buffers.size());
    for (size_t b = 0; b < layout.map().buffers.size(); ++b) {
      const LayoutBuffer& lb = layout.map().buffers[b];
      if (lb.id == "norm") {
        norm.assign(layout.BufferBytes(b), 0xA5);
        plain[b] = norm;
        continue;
      }
      const uint64_t stack = lb.shape.size() == 3 ? lb.shape[0] : 1, rows = lb.shape[lb.shape.size() - 2];
      const Fp8BlockShape s{rows, lb.shape.back(), kB};
      fp8[b].assign(layout.BufferBytes(b) / 2, 0xA5);
      scales[b].assign(stack * s.scale_rows() * s.scale_cols() * 4, 0xA5);
      placements[b] = {fp8[b], scales[b]};
    }
    if (behind_inner) {
      std::vector<std::vector<uint8_t>> bytes(plain.size());
      for (size_t b = 0; b < plain.size(); ++b) bytes[b].assign(plain[b].begin(), plain[b].end());
      inner = std::make_unique<testing::FakeMemory>(std::move(bytes));
    }
    auto m = Fp8EngineMemory::Create(layout, std::move(placements), inner ? std::vector<std::span<uint8_t>>() : plain,
                                     inner.get());
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    memory = std::move(*m);
  }
  Fp8Rank(const Fp8Rank&) = delete;
  PlacedRank placed() { return {&layout, {}, memory.get()}; }
};

// What a fresh load of the block-FP8 checkpoint made from `tensors` puts in
// rank `r`: each buffer's BF16 bytes (a dense load), and its E4M3 bytes and
// scales (QuantizeFp8Blocks of each stack entry).
struct Expected {
  std::vector<std::vector<uint8_t>> dense;
  std::map<size_t, std::vector<uint8_t>> fp8, scales;
};
Expected Reference(const CompiledLayout& layout, const Tensors& tensors) {
  Expected e;
  PlacedRank host{&layout, {}, nullptr};
  for (size_t b = 0; b < layout.map().buffers.size(); ++b) e.dense.emplace_back(layout.BufferBytes(b), 0xA5);
  for (auto& v : e.dense) host.buffers.emplace_back(v);
  EXPECT_TRUE(LoadDense(testing::TensorSource(tensors), host).ok());
  for (size_t b = 0; b < layout.map().buffers.size(); ++b) {
    const LayoutBuffer& lb = layout.map().buffers[b];
    if (lb.id == "norm") continue;
    const uint64_t stack = lb.shape.size() == 3 ? lb.shape[0] : 1, rows = lb.shape[lb.shape.size() - 2];
    const Fp8BlockShape s{rows, lb.shape.back(), kB};
    const uint64_t n = s.rows * s.cols, blocks = s.scale_rows() * s.scale_cols();
    e.fp8[b].resize(stack * n);
    e.scales[b].resize(stack * blocks * 4);
    for (uint64_t k = 0; k < stack; ++k)
      EXPECT_TRUE(QuantizeFp8Blocks(DType::kBF16, std::span<const uint8_t>(e.dense[b]).subspan(k * n * 2, n * 2), s,
                                    std::span<uint8_t>(e.fp8[b]).subspan(k * n, n),
                                    std::span<uint8_t>(e.scales[b]).subspan(k * blocks * 4, blocks * 4))
                      .ok());
  }
  return e;
}

void ExpectRankIs(Fp8Rank& rank, const Tensors& tensors, const std::string& when) {
  const Expected e = Reference(rank.layout, tensors);
  for (size_t b = 0; b < rank.layout.map().buffers.size(); ++b) {
    const std::string& id = rank.layout.map().buffers[b].id;
    std::vector<uint8_t> bytes(rank.layout.BufferBytes(b));
    ASSERT_TRUE(rank.memory->Read(b, 0, bytes).ok());
    if (id == "norm") {
      // The replica on rank 1 is written too (every copy is), where it lives.
      EXPECT_EQ(rank.inner ? rank.inner->bytes()[b] : rank.norm, e.dense[b]) << when;
      continue;
    }
    EXPECT_EQ(bytes, e.dense[b]) << when << ": master of " << id;
    EXPECT_EQ(rank.fp8.at(b), e.fp8.at(b)) << when << ": E4M3 bytes of " << id;
    EXPECT_EQ(rank.scales.at(b), e.scales.at(b)) << when << ": scales of " << id;
  }
}

// The blocks of rank `layout`'s FP8 buffers holding an element that differs
// between `a` and `b`: what a version must requantize, and all it may.
uint64_t TouchedBlocks(const CompiledLayout& layout, const Tensors& a, const Tensors& b) {
  const Expected ea = Reference(layout, a), eb = Reference(layout, b);
  std::set<std::pair<size_t, uint64_t>> blocks;
  for (size_t buf = 0; buf < layout.map().buffers.size(); ++buf) {
    const LayoutBuffer& lb = layout.map().buffers[buf];
    if (lb.id == "norm") continue;
    const uint64_t cols = lb.shape.back(), rows = lb.shape[lb.shape.size() - 2];
    const uint64_t scols = (cols + kB - 1) / kB, srows = (rows + kB - 1) / kB;
    for (uint64_t e = 0; e < ea.dense[buf].size() / 2; ++e)
      if (std::memcmp(ea.dense[buf].data() + 2 * e, eb.dense[buf].data() + 2 * e, 2) != 0) {
        const uint64_t k = e / (rows * cols), in = e % (rows * cols);
        blocks.insert({buf, (k * srows + in / cols / kB) * scols + in % cols / kB});
      }
  }
  return blocks.size();
}

// Applies `frames` to every rank, checking that the ranks' partial digests
// of each chunk add up to its frame's target.
void Apply(std::deque<Fp8Rank>& ranks, const Delta& d, std::span<const FrameView> frames) {
  std::vector<std::vector<FrameApplied>> results;
  for (Fp8Rank& rank : ranks) {
    std::vector<Digest> current;
    for (const FrameView& f : frames) current.push_back(rank.tracked[f.header.tensor][f.header.chunk]);
    PlacedRank placed = rank.placed();
    results.push_back(ApplyRankFrames(placed, d.manifest, frames, current));
    for (size_t i = 0; i < frames.size(); ++i) {
      ASSERT_TRUE(results.back()[i].status.ok()) << results.back()[i].status.ToString();
      rank.tracked[frames[i].header.tensor][frames[i].header.chunk] = results.back()[i].after;
    }
  }
  for (size_t i = 0; i < frames.size(); ++i) {
    Digest sum;
    for (const auto& r : results) sum += r[i].after;
    EXPECT_EQ(sum, frames[i].header.target_digest) << "frame " << i;
  }
}

std::deque<Fp8Rank> Join(const Tensors& v0, bool behind_inner = false) {
  std::deque<Fp8Rank> ranks;
  for (uint32_t r = 0; r < 2; ++r) ranks.emplace_back(r, behind_inner);
  DeltaOptions o;
  o.chunk_elements = kChunk;
  const DeltaManifest shape = StartLayoutDelta(Infos(), o);
  for (Fp8Rank& rank : ranks) {
    PlacedRank placed = rank.placed();
    EXPECT_TRUE(LoadDense(testing::TensorSource(v0), placed).ok());
    // A join quantizes every block, at the load's flush.
    EXPECT_EQ(rank.memory->blocks_pending(), 0u);
    EXPECT_GT(rank.memory->blocks_requantized(), 0u);
    rank.tracked = *RankChunkDigests(placed, shape);
  }
  return ranks;
}

TEST(Fp8Engine, VersionsRequantizeExactlyTheTouchedBlocksBitForBit) {
  for (const auto& [cls, behind_inner] :
       {std::pair{DeltaClass::kXorClass, false}, {DeltaClass::kOverwrite, false}, {DeltaClass::kXorClass, true}}) {
    SCOPED_TRACE(::testing::Message() << "class " << static_cast<int>(cls)
                                      << (behind_inner ? ", behind a memory" : ""));
    std::mt19937_64 rng(7 + static_cast<int>(cls));
    Tensors v = Initial(rng);
    std::deque<Fp8Rank> ranks = Join(v, behind_inner);
    for (Fp8Rank& rank : ranks) ExpectRankIs(rank, v, "joined");
    for (int version = 1; version <= 3; ++version) {
      const Tensors next = Step(v, rng);
      const Delta d = Encode(v, next, cls);
      const std::vector<FrameView> frames = Views(d);
      std::vector<uint64_t> before;
      for (Fp8Rank& rank : ranks) before.push_back(rank.memory->blocks_requantized());
      ASSERT_NO_FATAL_FAILURE(Apply(ranks, d, frames));
      for (size_t r = 0; r < ranks.size(); ++r) {
        Fp8Rank& rank = ranks[r];
        // The apply's end flushed: exactly the touched blocks were requantized.
        EXPECT_EQ(rank.memory->blocks_pending(), 0u);
        EXPECT_EQ(rank.memory->blocks_requantized() - before[r], TouchedBlocks(rank.layout, v, next))
            << "version " << version;
        ExpectRankIs(rank, next, "version " + std::to_string(version));
        if (behind_inner) {
          EXPECT_EQ(rank.inner->flushes, version + 1);  // the join's and each apply's
        }
      }
      v = next;
    }
  }
}

TEST(Fp8Engine, AnOverwriteRetryOfAHalfAppliedVersionRestoresExactBits) {
  std::mt19937_64 rng(99);
  const Tensors v0 = Initial(rng), v1 = Step(v0, rng);
  std::deque<Fp8Rank> ranks = Join(v0);
  const Delta xor_delta = Encode(v0, v1, DeltaClass::kXorClass);
  const std::vector<FrameView> frames = Views(xor_delta);
  // Half the frames land, and the engine is requantized from that master.
  ASSERT_NO_FATAL_FAILURE(Apply(ranks, xor_delta, std::span<const FrameView>(frames).first(frames.size() / 2)));
  // The retry is an overwrite delta of the same version, every frame.
  const Delta retry = Encode(v0, v1, DeltaClass::kOverwrite);
  ASSERT_NO_FATAL_FAILURE(Apply(ranks, retry, Views(retry)));
  for (Fp8Rank& rank : ranks) ExpectRankIs(rank, v1, "after the retry");
}

TEST(Fp8Engine, AZeroBlockHasScaleOneAndAGrownAmaxMovesTheScale) {
  std::mt19937_64 rng(3);
  const Tensors v0 = Initial(rng), v1 = Step(v0, rng);
  std::deque<Fp8Rank> ranks = Join(v0);
  const Delta d = Encode(v0, v1, DeltaClass::kXorClass);
  ASSERT_NO_FATAL_FAILURE(Apply(ranks, d, Views(d)));
  auto scale = [](const std::vector<uint8_t>& s, uint64_t block) {
    float f;
    std::memcpy(&f, s.data() + block * 4, 4);
    return f;
  };
  // Rank 0's "w_shard" is buffer 0 ([256, 256]: 2 x 2 blocks); block (1, 0) is all zeros.
  EXPECT_EQ(scale(ranks[0].scales.at(0), 2), 1.0f);
  for (uint64_t r = kB; r < 2 * kB; ++r)
    for (uint64_t c = 0; c < kB; ++c) ASSERT_EQ(ranks[0].fp8.at(0)[r * 256 + c], 0) << r << "," << c;
  // "qk" is buffer 1 ([356, 200]: 3 x 2 blocks); q's element (5, 130) is 4096 now: block (0, 1)'s amax.
  EXPECT_EQ(scale(ranks[0].scales.at(1), 1), 4096.0f / 448.0f);
  EXPECT_EQ(ranks[0].fp8.at(1)[5 * 200 + 130], 0x7E);  // 448 in E4M3
}

TEST(Fp8Engine, SharesThatAreNotWholeBlocksAreRefused) {
  LayoutMap m;
  m.tensors = {{"w", DType::kBF16, {384, 256}}};
  m.buffers = {{"w_shard", DType::kBF16, {192, 256}}};
  m.copies = {{"w", {192, 0}, {192, 256}, "w_shard", {0, 0}, true}};  // starts mid-block
  auto layout = CompiledLayout::Compile(m);
  ASSERT_TRUE(layout.ok());
  std::vector<uint8_t> fp8(192 * 256), scales(2 * 2 * 4);
  auto memory = Fp8EngineMemory::Create(*layout, {{0, {fp8, scales}}}, {{}}, nullptr);
  ASSERT_FALSE(memory.ok());
  EXPECT_EQ(memory.status().code(), Code::kInvalidArgument);
  EXPECT_THAT(memory.status().message(), HasSubstr("not aligned to 128-element blocks"));
  // Wrong sizes of the engine's bytes are refused too.
  m.copies[0].offset = {128, 0};
  layout = CompiledLayout::Compile(m);
  ASSERT_TRUE(layout.ok());
  std::vector<uint8_t> small(10);
  memory = Fp8EngineMemory::Create(*layout, {{0, {fp8, small}}}, {{}}, nullptr);
  ASSERT_FALSE(memory.ok());
  EXPECT_THAT(memory.status().message(), HasSubstr("scales 10"));
}

}  // namespace
}  // namespace dcr
