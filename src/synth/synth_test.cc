#include "dcr/synth.h"
#include "testing/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "dcr/checkpoint.h"
#include "dcr/compare.h"
#include "dcr/text.h"

namespace dcr {
namespace {

namespace fs = std::filesystem;

// ----- names -------------------------------------------------------------

TEST(SynthNamesTest, FamilyAndUpdateModelNamesRoundTrip) {
  for (Family f : {Family::kLlama, Family::kQwen3Moe, Family::kDeepseekV3}) {
    const auto parsed = ParseFamily(FamilyName(f));
    ASSERT_TRUE(parsed.has_value()) << FamilyName(f);
    EXPECT_EQ(*parsed, f);
  }
  EXPECT_EQ(FamilyName(Family::kLlama), "llama");
  EXPECT_EQ(FamilyName(Family::kQwen3Moe), "qwen3-moe");
  EXPECT_EQ(FamilyName(Family::kDeepseekV3), "deepseek-v3");
  EXPECT_FALSE(ParseFamily("gpt2").has_value());
  EXPECT_FALSE(ParseFamily("").has_value());
  EXPECT_FALSE(ParseFamily("Llama").has_value());

  EXPECT_EQ(ParseUpdateModel(UpdateModelName(UpdateModel::kTraining)), UpdateModel::kTraining);
  EXPECT_EQ(ParseUpdateModel(UpdateModelName(UpdateModel::kStress)), UpdateModel::kStress);
  EXPECT_EQ(UpdateModelName(UpdateModel::kTraining), "training");
  EXPECT_EQ(UpdateModelName(UpdateModel::kStress), "stress");
  EXPECT_FALSE(ParseUpdateModel("random").has_value());
}

// ----- ModelTensors --------------------------------------------------------

using TensorMap = std::map<std::string, SynthTensor>;

TensorMap ByName(const std::vector<SynthTensor>& tensors) {
  TensorMap m;
  for (const auto& t : tensors) EXPECT_TRUE(m.emplace(t.info.name, t).second) << "duplicate " << t.info.name;
  return m;
}

void ExpectTensor(const TensorMap& m, const std::string& name, std::vector<uint64_t> shape, DType dtype,
                  InitKind init) {
  auto it = m.find(name);
  ASSERT_NE(it, m.end()) << "missing " << name;
  EXPECT_EQ(it->second.info.shape, shape) << name;
  EXPECT_EQ(it->second.info.dtype, dtype) << name;
  EXPECT_EQ(it->second.init, init) << name;
}

void ExpectSortedAndConsistent(const std::vector<SynthTensor>& tensors) {
  for (size_t i = 1; i < tensors.size(); ++i)
    EXPECT_TRUE(TensorNameLess(tensors[i - 1].info.name, tensors[i].info.name))
        << tensors[i - 1].info.name << " before " << tensors[i].info.name;
  for (const auto& t : tensors) {
    uint64_t numel = 1;
    for (uint64_t d : t.info.shape) {
      EXPECT_GT(d, 0u) << t.info.name;
      numel *= d;
    }
    EXPECT_EQ(t.info.numel, numel) << t.info.name;
    EXPECT_EQ(t.info.nbytes, numel * BitsPerElement(t.info.dtype) / 8) << t.info.name;
  }
}

uint64_t SumBytes(const std::vector<SynthTensor>& tensors) {
  uint64_t total = 0;
  for (const auto& t : tensors) total += t.info.nbytes;
  return total;
}

ModelShape LlamaShape() {
  ModelShape s;
  s.family = Family::kLlama;
  s.hidden_size = 64;
  s.num_layers = 3;
  s.vocab_size = 500;
  s.num_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 16;
  s.intermediate_size = 160;
  return s;
}

TEST(ModelTensorsTest, Llama) {
  const ModelShape s = LlamaShape();
  const auto tensors = ModelTensors(s);
  ExpectSortedAndConsistent(tensors);
  const TensorMap m = ByName(tensors);
  EXPECT_EQ(tensors.size(), 3u + 9u * s.num_layers);
  const auto W = InitKind::kWeight, N = InitKind::kNorm;
  const auto B = DType::kBF16;
  ExpectTensor(m, "model.embed_tokens.weight", {500, 64}, B, W);
  ExpectTensor(m, "lm_head.weight", {500, 64}, B, W);
  ExpectTensor(m, "model.norm.weight", {64}, B, N);
  for (int l = 0; l < 3; ++l) {
    const std::string p = "model.layers." + std::to_string(l);
    ExpectTensor(m, p + ".input_layernorm.weight", {64}, B, N);
    ExpectTensor(m, p + ".post_attention_layernorm.weight", {64}, B, N);
    ExpectTensor(m, p + ".self_attn.q_proj.weight", {64, 64}, B, W);
    ExpectTensor(m, p + ".self_attn.k_proj.weight", {32, 64}, B, W);
    ExpectTensor(m, p + ".self_attn.v_proj.weight", {32, 64}, B, W);
    ExpectTensor(m, p + ".self_attn.o_proj.weight", {64, 64}, B, W);
    ExpectTensor(m, p + ".mlp.gate_proj.weight", {160, 64}, B, W);
    ExpectTensor(m, p + ".mlp.up_proj.weight", {160, 64}, B, W);
    ExpectTensor(m, p + ".mlp.down_proj.weight", {64, 160}, B, W);
  }
  EXPECT_EQ(m.count("model.layers.3.mlp.gate_proj.weight"), 0u);
  EXPECT_EQ(m.count("model.layers.0.self_attn.q_norm.weight"), 0u);
  EXPECT_EQ(ModelBytes(s), SumBytes(tensors));
}

TEST(ModelTensorsTest, Qwen3Moe) {
  ModelShape s = LlamaShape();
  s.family = Family::kQwen3Moe;
  s.num_layers = 2;
  s.num_experts = 4;
  s.moe_intermediate_size = 32;
  const auto tensors = ModelTensors(s);
  ExpectSortedAndConsistent(tensors);
  const TensorMap m = ByName(tensors);
  const auto W = InitKind::kWeight, N = InitKind::kNorm;
  const auto B = DType::kBF16;
  for (const auto& t : tensors) EXPECT_EQ(t.info.dtype, B) << t.info.name;
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l);
    ExpectTensor(m, p + ".self_attn.q_norm.weight", {16}, B, N);
    ExpectTensor(m, p + ".self_attn.k_norm.weight", {16}, B, N);
    ExpectTensor(m, p + ".self_attn.q_proj.weight", {64, 64}, B, W);
    ExpectTensor(m, p + ".mlp.gate.weight", {4, 64}, B, W);
    for (int e = 0; e < 4; ++e) {
      const std::string x = p + ".mlp.experts." + std::to_string(e);
      ExpectTensor(m, x + ".gate_proj.weight", {32, 64}, B, W);
      ExpectTensor(m, x + ".up_proj.weight", {32, 64}, B, W);
      ExpectTensor(m, x + ".down_proj.weight", {64, 32}, B, W);
    }
    EXPECT_EQ(m.count(p + ".mlp.experts.4.gate_proj.weight"), 0u);
    EXPECT_EQ(m.count(p + ".mlp.gate_proj.weight"), 0u) << "no dense MLP in MoE layers";
    EXPECT_EQ(m.count(p + ".mlp.shared_experts.gate_proj.weight"), 0u);
    EXPECT_EQ(m.count(p + ".mlp.gate.e_score_correction_bias"), 0u);
  }
  EXPECT_TRUE(m.count("model.layers.0.mlp.experts.0.gate_proj.weight"));
  EXPECT_EQ(ModelBytes(s), SumBytes(tensors));
}

TEST(ModelTensorsTest, DeepseekV3) {
  ModelShape s;
  s.family = Family::kDeepseekV3;
  s.hidden_size = 64;
  s.num_layers = 3;
  s.vocab_size = 300;
  s.num_heads = 2;
  s.num_kv_heads = 2;
  s.q_lora_rank = 16;
  s.kv_lora_rank = 8;
  s.qk_nope_head_dim = 8;
  s.qk_rope_head_dim = 4;
  s.v_head_dim = 8;
  s.num_experts = 3;
  s.moe_intermediate_size = 16;
  s.num_shared_experts = 1;
  s.intermediate_size = 96;
  s.first_dense_layers = 1;
  const auto tensors = ModelTensors(s);
  ExpectSortedAndConsistent(tensors);
  const TensorMap m = ByName(tensors);
  const auto W = InitKind::kWeight, N = InitKind::kNorm;
  const auto B = DType::kBF16, F = DType::kF32;
  ExpectTensor(m, "model.norm.weight", {64}, F, N);
  ExpectTensor(m, "model.embed_tokens.weight", {300, 64}, B, W);
  for (int l = 0; l < 3; ++l) {
    const std::string p = "model.layers." + std::to_string(l);
    ExpectTensor(m, p + ".input_layernorm.weight", {64}, F, N);
    ExpectTensor(m, p + ".post_attention_layernorm.weight", {64}, F, N);
    ExpectTensor(m, p + ".self_attn.q_a_proj.weight", {16, 64}, B, W);
    ExpectTensor(m, p + ".self_attn.q_a_layernorm.weight", {16}, F, N);
    ExpectTensor(m, p + ".self_attn.q_b_proj.weight", {2 * 12, 16}, B, W);
    ExpectTensor(m, p + ".self_attn.kv_a_proj_with_mqa.weight", {8 + 4, 64}, B, W);
    ExpectTensor(m, p + ".self_attn.kv_a_layernorm.weight", {8}, F, N);
    ExpectTensor(m, p + ".self_attn.kv_b_proj.weight", {2 * (8 + 8), 8}, B, W);
    ExpectTensor(m, p + ".self_attn.o_proj.weight", {64, 2 * 8}, B, W);
    EXPECT_EQ(m.count(p + ".self_attn.q_proj.weight"), 0u);
    if (l == 0) {
      // The leading dense layer.
      ExpectTensor(m, p + ".mlp.gate_proj.weight", {96, 64}, B, W);
      ExpectTensor(m, p + ".mlp.down_proj.weight", {64, 96}, B, W);
      EXPECT_EQ(m.count(p + ".mlp.gate.weight"), 0u);
      EXPECT_EQ(m.count(p + ".mlp.experts.0.gate_proj.weight"), 0u);
      EXPECT_EQ(m.count(p + ".mlp.shared_experts.gate_proj.weight"), 0u);
      continue;
    }
    EXPECT_EQ(m.count(p + ".mlp.gate_proj.weight"), 0u);
    ExpectTensor(m, p + ".mlp.gate.weight", {3, 64}, B, W);
    ExpectTensor(m, p + ".mlp.gate.e_score_correction_bias", {3}, F, InitKind::kBias);
    for (int e = 0; e < 3; ++e)
      ExpectTensor(m, p + ".mlp.experts." + std::to_string(e) + ".up_proj.weight", {16, 64}, B, W);
    ExpectTensor(m, p + ".mlp.shared_experts.gate_proj.weight", {16, 64}, B, W);
    ExpectTensor(m, p + ".mlp.shared_experts.up_proj.weight", {16, 64}, B, W);
    ExpectTensor(m, p + ".mlp.shared_experts.down_proj.weight", {64, 16}, B, W);
  }
  // Every F32 tensor is a norm or a router bias.
  for (const auto& t : tensors) {
    if (t.info.dtype != F) continue;
    EXPECT_TRUE(t.info.name.find("norm") != std::string::npos ||
                t.info.name.find("e_score_correction_bias") != std::string::npos)
        << t.info.name;
  }
  EXPECT_EQ(ModelBytes(s), SumBytes(tensors));
}

TEST(ModelTensorsTest, RealisticShapesForEveryFamily) {
  // The shapes ShapeForSize picks produce the documented structure.
  for (Family f : {Family::kLlama, Family::kQwen3Moe, Family::kDeepseekV3}) {
    const ModelShape s = ShapeForSize(f, 32ull << 20);
    const auto tensors = ModelTensors(s);
    ExpectSortedAndConsistent(tensors);
    const TensorMap m = ByName(tensors);
    EXPECT_TRUE(m.count("model.embed_tokens.weight")) << FamilyName(f);
    EXPECT_TRUE(m.count("lm_head.weight")) << FamilyName(f);
    const std::string last = "model.layers." + std::to_string(s.num_layers - 1) + ".input_layernorm.weight";
    EXPECT_TRUE(m.count(last)) << last;
    EXPECT_FALSE(m.count("model.layers." + std::to_string(s.num_layers) + ".input_layernorm.weight"));
    if (f == Family::kQwen3Moe) {
      EXPECT_TRUE(m.count("model.layers.0.mlp.experts.0.gate_proj.weight"));
      EXPECT_TRUE(m.count("model.layers.0.self_attn.q_norm.weight"));
    }
    if (f == Family::kDeepseekV3) {
      EXPECT_TRUE(m.count("model.layers.0.mlp.gate_proj.weight"));
      EXPECT_TRUE(m.count("model.layers.1.mlp.experts.0.gate_proj.weight"));
      EXPECT_TRUE(m.count("model.layers.1.mlp.shared_experts.down_proj.weight"));
      EXPECT_TRUE(m.count("model.layers.1.self_attn.kv_a_proj_with_mqa.weight"));
      EXPECT_TRUE(m.count("model.layers.1.self_attn.q_a_proj.weight"));
      auto bias = m.find("model.layers.1.mlp.gate.e_score_correction_bias");
      ASSERT_NE(bias, m.end());
      EXPECT_EQ(bias->second.info.dtype, DType::kF32);
      EXPECT_EQ(bias->second.info.shape, std::vector<uint64_t>{s.num_experts});
    }
  }
}

// ----- ShapeForSize ---------------------------------------------------------

TEST(ShapeForSizeTest, WithinTwiceTheTarget) {
  for (Family f : {Family::kLlama, Family::kQwen3Moe, Family::kDeepseekV3}) {
    for (uint64_t target : {16ull << 20, 100ull << 20, 1ull << 30, 8ull << 30, 200ull << 30}) {
      const ModelShape s = ShapeForSize(f, target);
      const uint64_t bytes = ModelBytes(s);
      SCOPED_TRACE(std::string(FamilyName(f)) + " target=" + std::to_string(target) + " got=" + std::to_string(bytes) +
                   " h=" + std::to_string(s.hidden_size) + " layers=" + std::to_string(s.num_layers));
      EXPECT_EQ(s.family, f);
      EXPECT_GE(s.num_layers, 2u);
      EXPECT_LE(bytes, 2 * target);
      EXPECT_GE(bytes, target / 2);
      if (f != Family::kLlama) {
        EXPECT_GT(s.num_experts, 0u);
        EXPECT_LE(s.num_experts, 16u);  // the default cap
      } else {
        EXPECT_EQ(s.num_experts, 0u);
      }
    }
  }
}

TEST(ShapeForSizeTest, LargerTargetsNeverShrink) {
  for (Family f : {Family::kLlama, Family::kQwen3Moe, Family::kDeepseekV3}) {
    uint64_t prev = 0;
    for (uint64_t target = 8ull << 20; target <= (64ull << 30); target *= 2) {
      const uint64_t bytes = ModelBytes(ShapeForSize(f, target));
      EXPECT_GE(bytes, prev) << FamilyName(f) << " " << target;
      prev = bytes;
    }
  }
}

TEST(ShapeForSizeTest, TinyTargetsGiveTheSmallestTwoLayerModel) {
  for (Family f : {Family::kLlama, Family::kQwen3Moe, Family::kDeepseekV3}) {
    const ModelShape s = ShapeForSize(f, 1);
    EXPECT_EQ(s.num_layers, 2u) << FamilyName(f);
    EXPECT_EQ(s.hidden_size, 64u) << FamilyName(f);
  }
}

TEST(ShapeForSizeTest, MaxExperts) {
  EXPECT_EQ(ShapeForSize(Family::kQwen3Moe, 64ull << 20, 4).num_experts, 4u);
  EXPECT_EQ(ShapeForSize(Family::kDeepseekV3, 64ull << 20, 2).num_experts, 2u);
  EXPECT_EQ(ShapeForSize(Family::kQwen3Moe, 64ull << 20, 1000).num_experts, 128u);  // the family's own count
  EXPECT_EQ(ShapeForSize(Family::kDeepseekV3, 64ull << 20, 1000).num_experts, 256u);
  EXPECT_EQ(ShapeForSize(Family::kLlama, 64ull << 20, 4).num_experts, 0u);
}

// ----- Fp32BitsToBf16Bits -----------------------------------------------------

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }

TEST(Bf16RoundingTest, KnownCases) {
  EXPECT_EQ(Fp32BitsToBf16Bits(Bits(1.0f)), 0x3F80);
  EXPECT_EQ(Fp32BitsToBf16Bits(Bits(-2.0f)), 0xC000);
  EXPECT_EQ(Fp32BitsToBf16Bits(0x00000000u), 0x0000);
  EXPECT_EQ(Fp32BitsToBf16Bits(0x80000000u), 0x8000);  // -0 keeps its sign
  // Below, at and above the halfway point; ties go to the even neighbour.
  EXPECT_EQ(Fp32BitsToBf16Bits(0x3F807FFFu), 0x3F80);
  EXPECT_EQ(Fp32BitsToBf16Bits(0x3F808000u), 0x3F80);  // tie, 0x3F80 is even
  EXPECT_EQ(Fp32BitsToBf16Bits(0x3F808001u), 0x3F81);
  EXPECT_EQ(Fp32BitsToBf16Bits(0x3F818000u), 0x3F82);  // tie, 0x3F82 is even
  EXPECT_EQ(Fp32BitsToBf16Bits(0xBF818000u), 0xBF82);  // negative tie
  EXPECT_EQ(Fp32BitsToBf16Bits(0xBF808000u), 0xBF80);
  // Rounding carries into the exponent.
  EXPECT_EQ(Fp32BitsToBf16Bits(0x3FFFFFFFu), 0x4000);
  // Subnormals.
  EXPECT_EQ(Fp32BitsToBf16Bits(0x00008000u), 0x0000);
  EXPECT_EQ(Fp32BitsToBf16Bits(0x00018000u), 0x0002);
  EXPECT_EQ(Fp32BitsToBf16Bits(0x00000001u), 0x0000);
  // Infinities stay infinite; the largest floats round up to infinity.
  EXPECT_EQ(Fp32BitsToBf16Bits(0x7F800000u), 0x7F80);
  EXPECT_EQ(Fp32BitsToBf16Bits(0xFF800000u), 0xFF80);
  EXPECT_EQ(Fp32BitsToBf16Bits(0x7F7FFFFFu), 0x7F80);
  EXPECT_EQ(Fp32BitsToBf16Bits(0xFF7FFFFFu), 0xFF80);
  EXPECT_EQ(Fp32BitsToBf16Bits(0x7F7F7FFFu), 0x7F7F);  // just below halfway: largest finite BF16
}

bool IsBf16NaN(uint16_t b) { return (b & 0x7F80) == 0x7F80 && (b & 0x007F) != 0; }

TEST(Bf16RoundingTest, NaNsStayNaN) {
  // Payloads only in the low 16 bits would truncate to infinity.
  for (uint32_t nan :
       {0x7F800001u, 0x7F80FFFFu, 0x7FC00000u, 0xFF800001u, 0xFFC00000u, 0x7FFFFFFFu, 0xFFFFFFFFu, 0x7F810000u}) {
    const uint16_t b = Fp32BitsToBf16Bits(nan);
    EXPECT_TRUE(IsBf16NaN(b)) << std::hex << nan << " -> " << b;
    EXPECT_EQ(b & 0x8000, (nan >> 16) & 0x8000) << "sign kept for " << std::hex << nan;
    EXPECT_NE(b & 0x0040, 0) << "quiet NaN for " << std::hex << nan;
  }
}

TEST(Bf16RoundingTest, MatchesNearestEvenReference) {
  // Reference: the two BF16 neighbours of f (truncation and the next one out),
  // picked by distance in double precision, ties to the even mantissa.
  std::mt19937 rng(17);
  auto value = [](uint32_t b16) -> double {
    if ((b16 & 0x7FFF) == 0x7F80) return std::copysign(std::ldexp(1.0, 128), (b16 & 0x8000) ? -1.0 : 1.0);
    return static_cast<double>(std::bit_cast<float>(b16 << 16));
  };
  int checked = 0;
  for (int i = 0; i < 300000; ++i) {
    uint32_t f = static_cast<uint32_t>(rng());
    if (i % 3 == 0) f = (f & 0xFFFF0000u) | 0x8000u;  // many exact ties
    const float x = std::bit_cast<float>(f);
    if (std::isnan(x) || std::isinf(x)) continue;
    const uint32_t lo = f >> 16, hi = lo + 1;
    const double dlo = std::fabs(static_cast<double>(x) - value(lo));
    const double dhi = std::fabs(value(hi) - static_cast<double>(x));
    const uint32_t want = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
    ASSERT_EQ(Fp32BitsToBf16Bits(f), want) << std::hex << f;
    ++checked;
  }
  EXPECT_GT(checked, 250000);
}

// ----- GenerateVersions -------------------------------------------------------

class GenerateTest : public testing::TempDirTest {
 protected:
  static std::string ReadAll(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  // Every file under `root`, relative path -> contents.
  static std::map<std::string, std::string> Snapshot(const std::string& root) {
    std::map<std::string, std::string> out;
    for (const auto& e : fs::recursive_directory_iterator(root))
      if (e.is_regular_file()) out[fs::relative(e.path(), root).string()] = ReadAll(e.path().string());
    return out;
  }
  static Checkpoint OpenVersion(const std::string& out, uint32_t v) {
    auto c = Checkpoint::Open(out + "/v" + std::to_string(v));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return std::move(c).value();
  }
  // Changed elements between two versions, recounted tensor by tensor.
  static uint64_t Recount(const Checkpoint& a, const Checkpoint& b,
                          std::map<std::string, uint64_t>* per_tensor = nullptr) {
    EXPECT_EQ(a.size(), b.size());
    uint64_t changed = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const TensorInfo& t = a.tensors()[i];
      EXPECT_EQ(t, b.tensors()[i]);
      const uint64_t c = CompareBits(t.dtype, t.numel, a.Data(i), b.Data(i)).changed;
      if (per_tensor) (*per_tensor)[t.name] = c;
      changed += c;
    }
    return changed;
  }
};

GenOptions SmallOptions(Family family, uint64_t bytes, UpdateModel update, double rate, uint32_t versions,
                        uint64_t seed) {
  GenOptions o;
  o.shape = ShapeForSize(family, bytes);
  o.update = update;
  o.rate = rate;
  o.versions = versions;
  o.seed = seed;
  return o;
}

TEST_F(GenerateTest, WritesVersionsAndGenJson) {
  const GenOptions opt = SmallOptions(Family::kLlama, 1 << 20, UpdateModel::kTraining, 0.03, 2, 5);
  auto report = GenerateVersions(Path("out"), opt);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  const auto tensors = ModelTensors(opt.shape);
  uint64_t elements = 0;
  for (const auto& t : tensors) elements += t.info.numel;
  EXPECT_EQ(report->elements_per_version, elements);
  EXPECT_EQ(report->bytes_per_version, ModelBytes(opt.shape));
  ASSERT_EQ(report->changed.size(), 2u);
  EXPECT_GT(report->learning_rate, 0.0);

  for (uint32_t v = 0; v <= 2; ++v) {
    Checkpoint c = OpenVersion(Path("out"), v);
    ASSERT_EQ(c.size(), tensors.size());
    for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(c.tensors()[i], tensors[i].info);
    EXPECT_THAT(c.metadata(), ::testing::Contains(std::pair<std::string, std::string>("format", "pt")));
  }
  EXPECT_FALSE(fs::exists(Path("out/v3")));

  const auto doc = nlohmann::json::parse(ReadAll(Path("out/gen.json")));
  EXPECT_EQ(doc["family"], "llama");
  EXPECT_EQ(doc["update"], "training");
  EXPECT_EQ(doc["versions"], 2);
  EXPECT_EQ(doc["seed"], 5);
  EXPECT_DOUBLE_EQ(doc["rate"].get<double>(), 0.03);
  EXPECT_DOUBLE_EQ(doc["learning_rate"].get<double>(), report->learning_rate);
  EXPECT_EQ(doc["elements_per_version"], report->elements_per_version);
  EXPECT_EQ(doc["bytes_per_version"], report->bytes_per_version);
  EXPECT_EQ(doc["changed_per_version"].get<std::vector<uint64_t>>(), report->changed);
  EXPECT_EQ(doc["shape"]["hidden_size"], opt.shape.hidden_size);
  EXPECT_EQ(doc["shape"]["num_layers"], opt.shape.num_layers);
  EXPECT_EQ(doc["shape"]["vocab_size"], opt.shape.vocab_size);
}

TEST_F(GenerateTest, InitialValuesFollowTheirInitKind) {
  const GenOptions opt = SmallOptions(Family::kDeepseekV3, 1 << 20, UpdateModel::kTraining, 0.01, 0, 3);
  ASSERT_TRUE(GenerateVersions(Path("out"), opt).ok());
  Checkpoint c = OpenVersion(Path("out"), 0);
  const TensorMap m = ByName(ModelTensors(opt.shape));
  double sum = 0, sum2 = 0;
  uint64_t n = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    const TensorInfo& t = c.tensors()[i];
    const InitKind init = m.at(t.name).init;
    const auto d = c.Data(i);
    for (uint64_t k = 0; k < t.numel; ++k) {
      float x;
      if (t.dtype == DType::kBF16) {
        uint16_t b;
        std::memcpy(&b, d.data() + 2 * k, 2);
        x = std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
      } else {
        ASSERT_EQ(t.dtype, DType::kF32);
        std::memcpy(&x, d.data() + 4 * k, 4);
      }
      ASSERT_TRUE(std::isfinite(x)) << t.name;
      if (init == InitKind::kNorm) {
        ASSERT_GT(x, 0.85f) << t.name;
        ASSERT_LT(x, 1.15f) << t.name;
      } else if (init == InitKind::kBias) {
        ASSERT_LT(std::fabs(x), 0.06f) << t.name;
      } else {
        ASSERT_LT(std::fabs(x), 0.1f) << t.name;
        sum += x;
        sum2 += static_cast<double>(x) * x;
        ++n;
      }
    }
  }
  ASSERT_GT(n, 100000u);
  const double mean = sum / static_cast<double>(n);
  const double sd = std::sqrt(sum2 / static_cast<double>(n) - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.001);
  EXPECT_NEAR(sd, 0.02, 0.002);
}

TEST_F(GenerateTest, DeterministicFromSeed) {
  const GenOptions opt = SmallOptions(Family::kQwen3Moe, 1 << 20, UpdateModel::kTraining, 0.02, 2, 42);
  auto r1 = GenerateVersions(Path("a"), opt);
  auto r2 = GenerateVersions(Path("b"), opt);
  ASSERT_TRUE(r1.ok() && r2.ok());
  EXPECT_EQ(r1->changed, r2->changed);
  EXPECT_EQ(r1->learning_rate, r2->learning_rate);
  const auto a = Snapshot(Path("a")), b = Snapshot(Path("b"));
  ASSERT_EQ(a.size(), b.size());
  EXPECT_TRUE(a.count("gen.json"));
  EXPECT_TRUE(a.count("v2/model.safetensors"));
  for (const auto& [name, bytes] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(bytes == b.at(name)) << name << " differs between runs with the same seed";
  }

  // Regenerating into the same directory gives the same bytes again.
  ASSERT_TRUE(GenerateVersions(Path("a"), opt).ok());
  EXPECT_TRUE(Snapshot(Path("a")) == a);

  GenOptions other = opt;
  other.seed = 43;
  ASSERT_TRUE(GenerateVersions(Path("c"), other).ok());
  const auto c = Snapshot(Path("c"));
  for (uint32_t v = 0; v <= 2; ++v) {
    const std::string f = fmt::format("v{}/model.safetensors", v);
    ASSERT_EQ(c.at(f).size(), a.at(f).size());
    EXPECT_FALSE(c.at(f) == a.at(f)) << f << " same for different seeds";
  }
}

TEST_F(GenerateTest, TrainingRateMatchesRequestForBf16Models) {
  for (Family family : {Family::kLlama, Family::kQwen3Moe}) {
    for (double rate : {0.01, 0.05}) {
      SCOPED_TRACE(std::string(FamilyName(family)) + " rate=" + std::to_string(rate));
      const std::string out = Path(std::string(FamilyName(family)) + std::to_string(rate));
      const GenOptions opt = SmallOptions(family, 2 << 20, UpdateModel::kTraining, rate, 2, 9);
      auto report = GenerateVersions(out, opt);
      ASSERT_TRUE(report.ok()) << report.status().ToString();
      for (uint32_t v = 0; v < 2; ++v) {
        const double got = static_cast<double>(report->changed[v]) / static_cast<double>(report->elements_per_version);
        EXPECT_NEAR(got, rate, 0.2 * rate) << "version " << v + 1;
      }
      // The report's counts are the real ones.
      Checkpoint c0 = OpenVersion(out, 0), c1 = OpenVersion(out, 1), c2 = OpenVersion(out, 2);
      std::map<std::string, uint64_t> per_tensor;
      EXPECT_EQ(Recount(c0, c1, &per_tensor), report->changed[0]);
      EXPECT_EQ(Recount(c1, c2), report->changed[1]);
      // Norms (values near 1, coarse BF16 steps) change much less often than weights.
      const size_t norm = static_cast<size_t>(c0.Find("model.norm.weight"));
      const size_t embed = static_cast<size_t>(c0.Find("model.embed_tokens.weight"));
      const double norm_rate =
          static_cast<double>(per_tensor["model.norm.weight"]) / static_cast<double>(c0.tensors()[norm].numel);
      const double embed_rate =
          static_cast<double>(per_tensor["model.embed_tokens.weight"]) / static_cast<double>(c0.tensors()[embed].numel);
      EXPECT_LT(norm_rate, embed_rate / 4);
      EXPECT_NEAR(embed_rate, rate, 0.2 * rate);
    }
  }
}

TEST_F(GenerateTest, TrainingChangesF32TensorsAlmostEverywhere) {
  const GenOptions opt = SmallOptions(Family::kDeepseekV3, 1 << 20, UpdateModel::kTraining, 0.01, 1, 4);
  auto report = GenerateVersions(Path("ds"), opt);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  Checkpoint c0 = OpenVersion(Path("ds"), 0), c1 = OpenVersion(Path("ds"), 1);
  const CheckpointDiff diff = DiffCheckpoints(c0, c1);
  EXPECT_TRUE(diff.only_in_a.empty() && diff.only_in_b.empty() && diff.mismatched.empty());
  EXPECT_EQ(diff.total.changed, report->changed[0]);
  uint64_t f32_elements = 0, f32_changed = 0, bf16_elements = 0, bf16_changed = 0;
  for (const auto& td : diff.tensors) {
    (td.dtype == DType::kF32 ? f32_elements : bf16_elements) += td.stats.elements;
    (td.dtype == DType::kF32 ? f32_changed : bf16_changed) += td.stats.changed;
  }
  ASSERT_GT(f32_elements, 0u);
  const double f32_rate = static_cast<double>(f32_changed) / static_cast<double>(f32_elements);
  const double bf16_rate = static_cast<double>(bf16_changed) / static_cast<double>(bf16_elements);
  EXPECT_GT(f32_rate, 0.8);
  EXPECT_GT(f32_rate, 20 * bf16_rate);
}

TEST_F(GenerateTest, StressModelChangesExactlyTheRate) {
  for (Family family : {Family::kLlama, Family::kDeepseekV3}) {
    for (double rate : {0.03, 0.05}) {
      SCOPED_TRACE(std::string(FamilyName(family)) + " rate=" + std::to_string(rate));
      const std::string out = Path(std::string("stress_") + std::string(FamilyName(family)) + std::to_string(rate));
      const GenOptions opt = SmallOptions(family, 2 << 20, UpdateModel::kStress, rate, 2, 11);
      auto report = GenerateVersions(out, opt);
      ASSERT_TRUE(report.ok()) << report.status().ToString();
      EXPECT_EQ(report->learning_rate, 0.0);
      const double n = static_cast<double>(report->elements_per_version);
      const double sigma = std::sqrt(n * rate * (1 - rate));
      for (uint32_t v = 0; v < 2; ++v)
        EXPECT_NEAR(static_cast<double>(report->changed[v]), n * rate, 6 * sigma) << "version " << v + 1;
      Checkpoint c0 = OpenVersion(out, 0), c1 = OpenVersion(out, 1), c2 = OpenVersion(out, 2);
      const CheckpointDiff d1 = DiffCheckpoints(c0, c1);
      EXPECT_EQ(d1.total.changed, report->changed[0]);
      EXPECT_EQ(Recount(c0, c1), report->changed[0]);
      EXPECT_EQ(Recount(c1, c2), report->changed[1]);
      // Every dtype, F32 included, sees changes at about the rate.
      std::map<DType, std::pair<uint64_t, uint64_t>> by_dtype;  // changed, elements
      for (const auto& td : d1.tensors) {
        by_dtype[td.dtype].first += td.stats.changed;
        by_dtype[td.dtype].second += td.stats.elements;
      }
      for (const auto& [dtype, ce] : by_dtype) {
        const double m = static_cast<double>(ce.second);
        EXPECT_NEAR(static_cast<double>(ce.first), m * rate, 6 * std::sqrt(m * rate * (1 - rate)) + 3) << Name(dtype);
      }
      // Multiplicative noise of 1%: small steps, never a sign flip of a normal value.
      EXPECT_EQ(d1.total.sign_changed, 0u);
    }
  }
}

TEST_F(GenerateTest, ShardedOutput) {
  GenOptions opt = SmallOptions(Family::kLlama, 1 << 20, UpdateModel::kStress, 0.05, 1, 1);
  opt.max_shard_bytes = 256 << 10;
  auto report = GenerateVersions(Path("sh"), opt);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  for (uint32_t v = 0; v <= 1; ++v) {
    const std::string dir = Path("sh/v" + std::to_string(v));
    EXPECT_TRUE(fs::exists(fs::path(dir) / kIndexFileName)) << dir;
    Checkpoint c = OpenVersion(Path("sh"), v);
    EXPECT_GT(c.files().size(), 2u);
    EXPECT_EQ(c.total_bytes(), report->bytes_per_version);
  }
  EXPECT_EQ(Recount(OpenVersion(Path("sh"), 0), OpenVersion(Path("sh"), 1)), report->changed[0]);
}

TEST_F(GenerateTest, RejectsBadOptions) {
  GenOptions opt = SmallOptions(Family::kLlama, 1 << 20, UpdateModel::kTraining, 0.03, 1, 0);
  for (double rate : {0.0, 1.0, -0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    opt.rate = rate;
    auto r = GenerateVersions(Path("bad"), opt);
    ASSERT_FALSE(r.ok()) << rate;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << rate;
  }
  opt.rate = 0.03;
  opt.versions = 100001;
  auto r = GenerateVersions(Path("bad"), opt);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_FALSE(fs::exists(Path("bad/v0")));
}

}  // namespace
}  // namespace dcr
