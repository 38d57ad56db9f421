// Residual tensors: a tensor an engine does not hold as a copy (it converts
// it on load) travels as full-chunk overwrites of a residual delta, and the
// engine applies the main delta without it; sender-side conversions.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "dcr/checkpoint.h"
#include "dcr/layout_apply.h"
#include "dcr/layout_families.h"
#include "dcr/layout_residual.h"
#include "layout/test_shapes.h"
#include "testing/temp_dir.h"

namespace dcr {
namespace {

using ::testing::HasSubstr;

float Bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

TEST(Fp32ToE4m3Test, RoundsToNearestEvenAndSaturates) {
  struct Case {
    float x;
    uint8_t want;
  };
  const Case cases[] = {
      {0.0f, 0x00},
      {-0.0f, 0x80},
      {1.0f, 0x38},
      {-1.0f, 0xB8},
      {448.0f, 0x7E},
      {-448.0f, 0xFE},
      {500.0f, 0x7E},
      {1e30f, 0x7E},
      {240.0f, 0x77},
      {1.0625f, 0x38},  // halfway 1 / 1.125: to even (1)
      {1.1875f, 0x3A},  // halfway 1.125 / 1.25: to even (1.25)
      {0.015625f, 0x08},  // 2^-6, the smallest normal
      {0.001953125f, 0x01},  // 2^-9, the smallest subnormal
      {0.0009765625f, 0x00},  // half of it: to even (0)
      {0.0029296875f, 0x02},  // 1.5 x 2^-9: to even (2)
      {0.013671875f, 0x07},  // 7 x 2^-9, the largest subnormal
      {0.0152587890625f, 0x08},  // rounds up from the subnormal range into the smallest normal
      {std::numeric_limits<float>::infinity(), 0x7E},
      {-std::numeric_limits<float>::infinity(), 0xFE},
      {Bits(0x7FC00001), 0x7F},  // NaN (any payload) -> NaN
      {Bits(0xFFC00000), 0xFF},  // negative NaN keeps its sign
      {Bits(0x00000001), 0x00},  // an FP32 subnormal underflows to +0
      {Bits(0x80000001), 0x80},  // ... and to -0
  };
  for (const Case& c : cases) EXPECT_EQ(Fp32ToE4m3(c.x), c.want) << c.x;
}

// An independent reference by values: the nearest of the 127 non-negative
// finite E4M3 values (ties to the even code), saturating at 448.
uint8_t E4m3ByValue(float x) {
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (int code = 0; code <= 0x7E; ++code) {
      const int e = code >> 3, m = code & 7;
      v.push_back(e == 0 ? m * std::ldexp(1.0, -9) : (1 + m / 8.0) * std::ldexp(1.0, e - 7));
    }
    return v;
  }();
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7F;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448) return sign | 0x7E;
  const auto hi = std::upper_bound(values.begin(), values.end(), a);
  const int up = static_cast<int>(hi - values.begin()), down = up - 1;
  const double dd = a - values[down], du = values[up] - a;
  const int code = dd < du ? down : du < dd ? up : (down % 2 == 0 ? down : up);
  return sign | static_cast<uint8_t>(code);
}

TEST(Fp32ToE4m3Test, AgreesWithTheNearestValueOverTheFloatRange) {
  // Every sign, exponent and top 12 mantissa bits (for normals, the rounding
  // bit 19 and the tie's bits below it among them), with the low 11 bits at
  // the edges (a tie, just above and below one) and random.
  std::mt19937 rng(9);
  const uint32_t lows[] = {0, 1, 0x3FF, 0x400, 0x7FF};
  uint64_t checked = 0;
  for (uint32_t top = 0; top < (1u << 21); ++top) {
    for (const uint32_t low : {lows[0], lows[1], lows[2], lows[3], lows[4], static_cast<uint32_t>(rng() & 0x7FF)}) {
      const uint32_t bits = (top << 11) | low;
      ASSERT_EQ(Fp32ToE4m3(Bits(bits)), E4m3ByValue(Bits(bits))) << std::hex << bits;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 6u << 21);
}

TEST(QuantizeFp8BlocksTest, ScalesByBlockAmax) {
  // [2, 3] F32 in blocks of 2: block (0,0) = {1, 2; -4, 0} (amax 4), block (0,1) = {NaN; inf} (no finite: scale 1).
  const float src[] = {1.0f, 2.0f, Bits(0x7FC00000), -4.0f, 0.0f, std::numeric_limits<float>::infinity()};
  std::vector<uint8_t> fp8(6), scales(8);
  ASSERT_TRUE(
      QuantizeFp8Blocks(DType::kF32, {reinterpret_cast<const uint8_t*>(src), sizeof(src)}, {2, 3, 2}, fp8, scales)
          .ok());
  // 1, 2, -4, 0 over 4/448: 112, 224, -448, 0.
  EXPECT_EQ(fp8, (std::vector<uint8_t>{0x6E, 0x76, 0x7F, 0xFE, 0x00, 0x7E}));
  float s[2];
  std::memcpy(s, scales.data(), 8);
  EXPECT_EQ(s[0], 4.0f / 448.0f);
  EXPECT_EQ(s[1], 1.0f);
  EXPECT_THAT(QuantizeFp8Blocks(DType::kF16, {}, {2, 3, 2}, fp8, scales).message(), HasSubstr("BF16 or F32"));
  EXPECT_THAT(QuantizeFp8Blocks(DType::kF32, {}, {2, 3, 2}, fp8, scales).message(), HasSubstr("sizes for [2, 3]"));
}

TEST(ConvertToCanonicalTest, ExportRoundsToNearestEven) {
  const uint32_t in[] = {0x3F808000, 0x3F818000, 0xBF800000, 0xC0000000, 0x7FC00001, 0x80000000, 0x00000001};
  const uint16_t cast[] = {0x3F80, 0x3F82, 0xBF80, 0xC000, 0x7FC0, 0x8000, 0x0000};
  const uint16_t centred[] = {0x4000, 0x4001, 0x0000, 0xBF80, 0x7FC0, 0x3F80, 0x3F80};
  const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(in), sizeof(in));
  std::vector<uint8_t> out(std::size(in) * 2);
  ASSERT_TRUE(ConvertToCanonical({"t", ConversionKind::kCast, DType::kF32}, DType::kBF16, bytes, out).ok());
  EXPECT_EQ(std::memcmp(out.data(), cast, out.size()), 0);
  ASSERT_TRUE(ConvertToCanonical({"t", ConversionKind::kZeroCentred, DType::kF32}, DType::kBF16, bytes, out).ok());
  for (size_t i = 0; i < std::size(in); ++i) {
    uint16_t h;
    std::memcpy(&h, out.data() + 2 * i, 2);
    EXPECT_EQ(h, centred[i]) << i;
  }
  EXPECT_THAT(ConvertToCanonical({"t", ConversionKind::kCast, DType::kF16}, DType::kBF16, bytes, out).message(),
              HasSubstr("converted tensor 't': conversions read and write BF16 or F32"));
}

struct Buffers {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::span<uint8_t>> spans;
  std::vector<std::span<const uint8_t>> const_spans;
  explicit Buffers(const CompiledLayout& l) {
    for (size_t b = 0; b < l.map().buffers.size(); ++b) bytes.emplace_back(l.BufferBytes(b), 0);
    for (auto& v : bytes) spans.emplace_back(v), const_spans.emplace_back(v);
  }
};

class ResidualTest : public testing::TempDirTest {};

// The trainer (tp 2 x pp 2) projects as usual; one engine (vLLM tp 1)
// converts the embedding on load instead of holding a copy: the residual
// delta carries every chunk of it whole, and the engine applies the main
// delta with the embedding declared residual.
TEST_F(ResidualTest, AResidualTensorTravelsWholeAndTheEngineSkipsItsFrames) {
  const ModelShape shape = testshapes::LlamaShape();
  const std::string kTensor = "model.embed_tokens.weight";
  GenOptions gen;
  gen.shape = shape;
  gen.versions = 1;
  gen.update = UpdateModel::kStress;
  gen.rate = 0.1;
  gen.seed = 3;
  ASSERT_TRUE(GenerateVersions(Path("gen"), gen).ok());
  auto v0 = Checkpoint::Open(Path("gen/v0"), OpenMode::kReadWrite);
  auto v1 = Checkpoint::Open(Path("gen/v1"), OpenMode::kReadWrite);
  ASSERT_TRUE(v0.ok() && v1.ok());
  {
    // Special values in the new version: -0, NaNs, infinities, BF16 subnormals.
    auto d = v1->MutableData(static_cast<size_t>(v1->Find(kTensor)));
    const uint16_t specials[] = {0x8000, 0x7FC1, 0xFF80, 0x7F80, 0x0001, 0x8003, 0xFFC5, 0x0000};
    std::memcpy(d.data() + 2 * 20, specials, sizeof(specials));
  }
  const TensorInfo& info = v1->tensors()[static_cast<size_t>(v1->Find(kTensor))];

  // Trainer shards.
  const TrainerParallel tp{2, 2, 1, false, 4};
  std::vector<CompiledLayout> senders;
  for (const TrainerRank& r : TrainerRanks(tp)) {
    auto m = MegatronLayout(shape, tp, r);
    ASSERT_TRUE(m.ok());
    senders.push_back(std::move(*CompiledLayout::Compile(std::move(*m))));
  }
  std::vector<Buffers> base, cur;
  for (const CompiledLayout& l : senders) {
    base.emplace_back(l);
    cur.emplace_back(l);
    PlacedRank b{&l, base.back().spans}, c{&l, cur.back().spans};
    ASSERT_TRUE(LoadDense(CheckpointBytes(*v0), b).ok());
    ASSERT_TRUE(LoadDense(CheckpointBytes(*v1), c).ok());
  }

  // The residual delta: overwrite class, the embedding only, one owner.
  DeltaOptions opt;
  opt.encode.delta_class = DeltaClass::kOverwrite;
  opt.chunk_elements = 24;  // chunks straddle the 4-row blocks (32 elements per block row)
  opt.delta_id = 9;
  DeltaManifest manifest = StartLayoutDelta(std::vector<TensorInfo>{info}, opt);
  std::vector<ChunkContribution> all;
  for (uint32_t s = 0; s < senders.size(); ++s) {
    auto c = ProjectSender({&senders[s], base[s].const_spans, cur[s].const_spans}, s, manifest);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    for (auto& x : *c) all.push_back(std::move(x));
  }
  auto owned = EncodeFullChunkOverwrites(manifest, all, opt.encode);
  ASSERT_TRUE(owned.ok()) << owned.status().ToString();
  EXPECT_EQ(owned->frames.size(), manifest.ChunkCount(0));  // the tensor changed: every chunk goes
  auto bytes = AssembleLayoutDelta(manifest, std::span<const OwnedFrames>(&*owned, 1));
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  auto holder = std::make_shared<std::string>(std::move(*bytes));
  std::vector<std::span<const uint8_t>> objects = {{reinterpret_cast<const uint8_t*>(holder->data()), holder->size()}};
  auto reader = DeltaReader::FromObjects(manifest, objects, holder, "residual delta");
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->manifest().target_digest, DigestBytes(MakeDigestKey(kTensor), 0, v1->Data(v1->Find(kTensor))));

  // The main delta (xor class) goes to the engine's copies; its embedding frames are skipped there.
  {
    DeltaOptions main_opt;
    main_opt.chunk_elements = 24;
    main_opt.delta_id = 10;
    std::vector<TensorInfo> tensors = v1->tensors();
    DeltaManifest m = StartLayoutDelta(tensors, main_opt);
    std::vector<const CompiledLayout*> maps;
    for (const auto& l : senders) maps.push_back(&l);
    std::map<uint32_t, std::vector<ChunkContribution>> to_owner;
    for (uint32_t s = 0; s < senders.size(); ++s) {
      auto c = ProjectSender({&senders[s], base[s].const_spans, cur[s].const_spans}, s, m);
      ASSERT_TRUE(c.ok());
      for (auto& x : *c) to_owner[*ChunkOwner(maps, m, x.tensor, x.chunk)].push_back(std::move(x));
    }
    std::vector<OwnedFrames> frames;
    for (auto& [o, recs] : to_owner) frames.push_back(std::move(*EncodeOwnedChunks(m, recs, main_opt.encode)));
    auto main_bytes = AssembleLayoutDelta(m, frames);
    ASSERT_TRUE(main_bytes.ok());
    auto main_holder = std::make_shared<std::string>(std::move(*main_bytes));
    std::vector<std::span<const uint8_t>> objs = {
        {reinterpret_cast<const uint8_t*>(main_holder->data()), main_holder->size()}};
    auto main_reader = DeltaReader::FromObjects(m, objs, main_holder, "main delta");
    ASSERT_TRUE(main_reader.ok());
    // The engine: vLLM tp 1 without a copy of the embedding.
    auto rm = VllmLayout(shape, {1, false, 4}, 0);
    ASSERT_TRUE(rm.ok());
    std::erase_if(rm->copies, [&](const BoxCopy& c) { return c.tensor == kTensor; });
    std::erase_if(rm->tensors, [&](const LayoutTensor& t) { return t.name == kTensor; });
    auto engine = CompiledLayout::Compile(std::move(*rm));
    ASSERT_TRUE(engine.ok());
    const CompiledLayout* one[] = {&*engine};
    std::vector<std::string> unmapped;
    ASSERT_TRUE(ValidateEngine(one, tensors, &unmapped).ok());
    EXPECT_EQ(unmapped, std::vector<std::string>{kTensor});
    Buffers got(*engine), want(*engine);
    PlacedRank g{&*engine, got.spans}, w{&*engine, want.spans};
    ASSERT_TRUE(LoadDense(CheckpointBytes(*v0), g).ok());
    ASSERT_TRUE(LoadDense(CheckpointBytes(*v1), w).ok());
    PlacedRank* ranks[] = {&g};
    // Without declaring the residual, the engine refuses its frames.
    {
      Buffers tmp(*engine);
      PlacedRank t{&*engine, tmp.spans};
      ASSERT_TRUE(LoadDense(CheckpointBytes(*v0), t).ok());
      PlacedRank* tr[] = {&t};
      auto r = ApplyEngineDelta(tr, *main_reader);
      EXPECT_THAT(r.status().message(), HasSubstr("no rank given holds it"));
    }
    const std::string residuals[] = {kTensor};
    auto report = ApplyEngineDelta(ranks, *main_reader, residuals);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_TRUE(got.bytes == want.bytes);
  }
}

// Sender-side conversions: the trainer holds the final norm zero-centred
// (F32, weight - 1) and lm_head as an FP32 master; both go through the
// checkpoint's export function (ConvertToCanonical) into a residual delta of
// full-chunk overwrites, everything else by projection in an xor delta. An
// engine holding all of it as copies ends equal to a dense load.
TEST_F(ResidualTest, SenderConversionsTravelAsOverwrites) {
  const ModelShape shape = testshapes::LlamaShape();
  GenOptions gen;
  gen.shape = shape;
  gen.versions = 1;
  gen.rate = 0.1;
  gen.seed = 5;
  ASSERT_TRUE(GenerateVersions(Path("gen"), gen).ok());
  auto v0 = Checkpoint::Open(Path("gen/v0"), OpenMode::kReadWrite);
  auto v1 = Checkpoint::Open(Path("gen/v1"), OpenMode::kReadWrite);
  ASSERT_TRUE(v0.ok() && v1.ok());
  const std::vector<SenderConversion> conversions = {{"model.norm.weight", ConversionKind::kZeroCentred, DType::kF32},
                                                     {"lm_head.weight", ConversionKind::kCast, DType::kF32}};
  // The trainer's own representation: v0 exactly; v1 with small FP32 moves
  // (many round away in BF16). The canonical v1 is by definition its export.
  std::vector<std::vector<uint8_t>> s0, s1;
  for (const SenderConversion& c : conversions) {
    auto w0 = v0->Data(static_cast<size_t>(v0->Find(c.tensor)));
    auto w1 = v1->MutableData(static_cast<size_t>(v1->Find(c.tensor)));
    const size_t n = w0.size() / 2;
    std::vector<float> a(n), b(n);
    for (size_t i = 0; i < n; ++i) {
      uint16_t h0, h1;
      std::memcpy(&h0, w0.data() + 2 * i, 2);
      std::memcpy(&h1, w1.data() + 2 * i, 2);
      a[i] = Bits(uint32_t{h0} << 16);
      b[i] = Bits(uint32_t{h1} << 16) * (1.0f + 1e-3f * static_cast<float>(static_cast<int>(i % 7) - 3));
      if (c.kind == ConversionKind::kZeroCentred) a[i] -= 1.0f, b[i] -= 1.0f;
    }
    s0.emplace_back(reinterpret_cast<uint8_t*>(a.data()), reinterpret_cast<uint8_t*>(a.data() + n));
    s1.emplace_back(reinterpret_cast<uint8_t*>(b.data()), reinterpret_cast<uint8_t*>(b.data() + n));
    // v0's export is v0 (exact); v1 := export of the trainer's v1.
    std::vector<uint8_t> back(w0.size());
    ASSERT_TRUE(ConvertToCanonical(c, DType::kBF16, s0.back(), back).ok());
    ASSERT_TRUE(std::equal(back.begin(), back.end(), w0.begin())) << c.tensor;
    ASSERT_TRUE(ConvertToCanonical(c, DType::kBF16, s1.back(), w1).ok());
  }
  auto is_converted = [&](const std::string& name) {
    return std::any_of(conversions.begin(), conversions.end(),
                       [&](const SenderConversion& c) { return c.tensor == name; });
  };
  // Trainer tp 2: the converted tensors have no copies.
  const TrainerParallel tp{2, 1, 1, false, 4};
  std::vector<CompiledLayout> senders;
  for (const TrainerRank& r : TrainerRanks(tp)) {
    auto m = MegatronLayout(shape, tp, r);
    ASSERT_TRUE(m.ok());
    std::erase_if(m->copies, [&](const BoxCopy& c) { return is_converted(c.tensor); });
    std::erase_if(m->tensors, [&](const LayoutTensor& t) { return is_converted(t.name); });
    senders.push_back(std::move(*CompiledLayout::Compile(std::move(*m))));
  }
  std::vector<Buffers> base, cur;
  for (const CompiledLayout& l : senders) {
    base.emplace_back(l);
    cur.emplace_back(l);
    PlacedRank b{&l, base.back().spans}, c{&l, cur.back().spans};
    ASSERT_TRUE(LoadDense(CheckpointBytes(*v0), b).ok());
    ASSERT_TRUE(LoadDense(CheckpointBytes(*v1), c).ok());
  }
  std::vector<TensorInfo> main_tensors, residual_tensors;
  for (const TensorInfo& t : v1->tensors()) (is_converted(t.name) ? residual_tensors : main_tensors).push_back(t);

  auto finish = [](DeltaManifest& m, std::vector<OwnedFrames>& owned, const char* where) -> Result<DeltaReader> {
    DCR_ASSIGN_OR_RETURN(std::string bytes, AssembleLayoutDelta(m, owned));
    auto holder = std::make_shared<std::string>(std::move(bytes));
    std::vector<std::span<const uint8_t>> objs = {{reinterpret_cast<const uint8_t*>(holder->data()), holder->size()}};
    return DeltaReader::FromObjects(m, objs, holder, where);
  };
  // The main delta, by projection.
  DeltaOptions main_opt;
  main_opt.chunk_elements = 24;
  main_opt.delta_id = 20;
  DeltaManifest main_m = StartLayoutDelta(main_tensors, main_opt);
  std::vector<const CompiledLayout*> maps;
  for (const auto& l : senders) maps.push_back(&l);
  std::map<uint32_t, std::vector<ChunkContribution>> to_owner;
  for (uint32_t s = 0; s < senders.size(); ++s) {
    auto c = ProjectSender({&senders[s], base[s].const_spans, cur[s].const_spans}, s, main_m);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    for (auto& x : *c) to_owner[*ChunkOwner(maps, main_m, x.tensor, x.chunk)].push_back(std::move(x));
  }
  std::vector<OwnedFrames> main_owned;
  for (auto& [o, recs] : to_owner) {
    auto f = EncodeOwnedChunks(main_m, recs, main_opt.encode);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    main_owned.push_back(std::move(*f));
  }
  auto main_reader = finish(main_m, main_owned, "main delta");
  ASSERT_TRUE(main_reader.ok()) << main_reader.status().ToString();
  // The residual delta, by conversion (rank 0 holds both tensors whole).
  DeltaOptions res_opt;
  res_opt.encode.delta_class = DeltaClass::kOverwrite;
  res_opt.chunk_elements = 24;
  res_opt.delta_id = 21;
  DeltaManifest res_m = StartLayoutDelta(residual_tensors, res_opt);
  std::vector<ChunkContribution> res_records;
  for (size_t i = 0; i < conversions.size(); ++i) {
    auto c = ProjectConverted(conversions[i], s0[i], s1[i], 0, res_m);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    for (auto& x : *c) res_records.push_back(std::move(x));
  }
  auto res_owned = EncodeFullChunkOverwrites(res_m, res_records, res_opt.encode);
  ASSERT_TRUE(res_owned.ok()) << res_owned.status().ToString();
  std::vector<OwnedFrames> res_list;
  res_list.push_back(std::move(*res_owned));
  auto res_reader = finish(res_m, res_list, "residual delta");
  ASSERT_TRUE(res_reader.ok()) << res_reader.status().ToString();
  EXPECT_GT(res_reader->manifest().frames.size(), 0u);
  for (const DeltaFrameEntry& f : res_reader->manifest().frames) EXPECT_EQ(f.mode, Mode::kOverwrite);
  // The two deltas together are the version: their digests add up to v1's.
  Digest version;
  for (size_t t = 0; t < v1->size(); ++t) version += DigestBytes(MakeDigestKey(v1->tensors()[t].name), 0, v1->Data(t));
  EXPECT_EQ(main_reader->manifest().target_digest + res_reader->manifest().target_digest, version);

  // An engine (vLLM tp 2) holding everything as copies applies both.
  std::vector<CompiledLayout> engine;
  for (uint32_t r = 0; r < 2; ++r)
    engine.push_back(std::move(*CompiledLayout::Compile(*VllmLayout(shape, {2, false, 4}, r))));
  std::vector<Buffers> got, want;
  std::vector<PlacedRank> placed;
  for (const CompiledLayout& l : engine) {
    got.emplace_back(l);
    want.emplace_back(l);
  }
  for (size_t r = 0; r < engine.size(); ++r) {
    placed.push_back({&engine[r], got[r].spans});
    PlacedRank w{&engine[r], want[r].spans};
    ASSERT_TRUE(LoadDense(CheckpointBytes(*v0), placed.back()).ok());
    ASSERT_TRUE(LoadDense(CheckpointBytes(*v1), w).ok());
  }
  std::vector<PlacedRank*> ptrs = {&placed[0], &placed[1]};
  auto a = ApplyEngineDelta(ptrs, *main_reader);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = ApplyEngineDelta(ptrs, *res_reader);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->frames_applied, res_reader->manifest().frames.size());
  for (size_t r = 0; r < engine.size(); ++r) EXPECT_TRUE(got[r].bytes == want[r].bytes) << "rank " << r;
  Digest sum;
  for (auto* p : ptrs) sum += *RankDigest(*p);
  EXPECT_EQ(sum, version);
  // A residual overwrite applied again is harmless.
  auto again = ApplyEngineDelta(ptrs, *res_reader);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->frames_already_applied, res_reader->manifest().frames.size());
}

}  // namespace
}  // namespace dcr
