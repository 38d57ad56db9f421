// Model families: tensor names and shapes as Hugging Face checkpoints have them.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "dcr/synth.h"
#include "dcr/text.h"

namespace dcr {
namespace {

uint64_t RoundTo(double v, uint64_t multiple) {
  return std::max<uint64_t>(multiple,
                            static_cast<uint64_t>(std::llround(v / static_cast<double>(multiple))) * multiple);
}

struct Builder {
  std::vector<SynthTensor> out;
  void Add(std::string name, std::vector<uint64_t> shape, InitKind init, DType dtype = DType::kBF16) {
    auto info = MakeTensorInfo(std::move(name), dtype, std::move(shape));
    out.push_back({std::move(info).value(), init});  // shapes here never overflow
  }
  void Linear(const std::string& name, uint64_t out_features, uint64_t in_features) {
    Add(name + ".weight", {out_features, in_features}, InitKind::kWeight);
  }
  void Norm(const std::string& name, uint64_t n, DType dtype) { Add(name + ".weight", {n}, InitKind::kNorm, dtype); }
  void Mlp(const std::string& prefix, uint64_t hidden, uint64_t width) {
    Linear(prefix + ".gate_proj", width, hidden);
    Linear(prefix + ".up_proj", width, hidden);
    Linear(prefix + ".down_proj", hidden, width);
  }
};

}  // namespace

std::string_view FamilyName(Family f) {
  switch (f) {
    case Family::kLlama: return "llama";
    case Family::kQwen3Moe: return "qwen3-moe";
    case Family::kDeepseekV3: return "deepseek-v3";
  }
  return "?";
}

std::optional<Family> ParseFamily(std::string_view name) {
  for (Family f : {Family::kLlama, Family::kQwen3Moe, Family::kDeepseekV3})
    if (FamilyName(f) == name) return f;
  return std::nullopt;
}

std::vector<SynthTensor> ModelTensors(const ModelShape& s) {
  Builder b;
  const uint64_t h = s.hidden_size;
  const DType norm_dtype = s.family == Family::kDeepseekV3 ? DType::kF32 : DType::kBF16;
  b.Add("model.embed_tokens.weight", {s.vocab_size, h}, InitKind::kWeight);
  b.Add("lm_head.weight", {s.vocab_size, h}, InitKind::kWeight);
  b.Norm("model.norm", h, norm_dtype);
  for (uint64_t l = 0; l < s.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}", l);
    b.Norm(p + ".input_layernorm", h, norm_dtype);
    b.Norm(p + ".post_attention_layernorm", h, norm_dtype);
    if (s.family == Family::kDeepseekV3) {
      const uint64_t qk = s.qk_nope_head_dim + s.qk_rope_head_dim;
      b.Linear(p + ".self_attn.q_a_proj", s.q_lora_rank, h);
      b.Norm(p + ".self_attn.q_a_layernorm", s.q_lora_rank, norm_dtype);
      b.Linear(p + ".self_attn.q_b_proj", s.num_heads * qk, s.q_lora_rank);
      b.Linear(p + ".self_attn.kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, h);
      b.Norm(p + ".self_attn.kv_a_layernorm", s.kv_lora_rank, norm_dtype);
      b.Linear(p + ".self_attn.kv_b_proj", s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank);
      b.Linear(p + ".self_attn.o_proj", h, s.num_heads * s.v_head_dim);
    } else {
      b.Linear(p + ".self_attn.q_proj", s.num_heads * s.head_dim, h);
      b.Linear(p + ".self_attn.k_proj", s.num_kv_heads * s.head_dim, h);
      b.Linear(p + ".self_attn.v_proj", s.num_kv_heads * s.head_dim, h);
      b.Linear(p + ".self_attn.o_proj", h, s.num_heads * s.head_dim);
      if (s.family == Family::kQwen3Moe) {
        b.Norm(p + ".self_attn.q_norm", s.head_dim, norm_dtype);
        b.Norm(p + ".self_attn.k_norm", s.head_dim, norm_dtype);
      }
    }
    const bool moe = s.num_experts > 0 && l >= s.first_dense_layers;
    if (!moe) {
      b.Mlp(p + ".mlp", h, s.intermediate_size);
      continue;
    }
    b.Linear(p + ".mlp.gate", s.num_experts, h);
    if (s.family == Family::kDeepseekV3)
      b.Add(p + ".mlp.gate.e_score_correction_bias", {s.num_experts}, InitKind::kBias, DType::kF32);
    for (uint64_t e = 0; e < s.num_experts; ++e)
      b.Mlp(fmt::format("{}.mlp.experts.{}", p, e), h, s.moe_intermediate_size);
    if (s.num_shared_experts > 0) b.Mlp(p + ".mlp.shared_experts", h, s.moe_intermediate_size * s.num_shared_experts);
  }
  std::sort(b.out.begin(), b.out.end(),
            [](const SynthTensor& x, const SynthTensor& y) { return TensorNameLess(x.info.name, y.info.name); });
  return b.out;
}

uint64_t ModelBytes(const ModelShape& shape) {
  uint64_t total = 0;
  for (const auto& t : ModelTensors(shape)) total += t.info.nbytes;
  return total;
}

namespace {

// The family's proportions at hidden size h (real models' ratios; see
// REFERENCE.md's model table), before layers are chosen.
ModelShape ScaledShape(Family family, uint64_t h, uint64_t max_experts) {
  ModelShape s;
  s.family = family;
  s.hidden_size = h;
  s.head_dim = std::min<uint64_t>(128, h / 4);
  switch (family) {
    case Family::kLlama:  // Llama-3-8B: 4096, 32/8 heads, 14336 MLP, 128256 vocab
      s.num_heads = h / s.head_dim;
      s.num_kv_heads = std::max<uint64_t>(1, s.num_heads / 4);
      s.intermediate_size = RoundTo(3.5 * static_cast<double>(h), 16);
      s.vocab_size = std::min<uint64_t>(128256, 16 * h);
      break;
    case Family::kQwen3Moe:  // Qwen3-30B-A3B: 2048, 32/4 heads of 128, 128 experts of 768
      s.num_heads = std::max<uint64_t>(2, 2 * h / s.head_dim);
      s.num_kv_heads = std::max<uint64_t>(1, s.num_heads / 8);
      s.num_experts = std::min<uint64_t>(128, max_experts);
      s.moe_intermediate_size = RoundTo(0.375 * static_cast<double>(h), 16);
      s.intermediate_size = RoundTo(3.0 * static_cast<double>(h), 16);
      s.vocab_size = std::min<uint64_t>(151936, 16 * h);
      break;
    case Family::kDeepseekV3:  // DeepSeek-V3: 7168, 128 heads, MLA, 256 experts of 2048
      s.num_heads = std::max<uint64_t>(2, h / 56);
      s.num_kv_heads = s.num_heads;
      s.qk_nope_head_dim = std::min<uint64_t>(128, h / 8);
      s.qk_rope_head_dim = s.qk_nope_head_dim / 2;
      s.v_head_dim = s.qk_nope_head_dim;
      s.q_lora_rank = RoundTo(0.214 * static_cast<double>(h), 16);
      s.kv_lora_rank = RoundTo(static_cast<double>(h) / 14, 16);
      s.num_experts = std::min<uint64_t>(256, max_experts);
      s.num_shared_experts = 1;
      s.moe_intermediate_size = RoundTo(0.286 * static_cast<double>(h), 16);
      s.intermediate_size = RoundTo(2.57 * static_cast<double>(h), 16);
      s.vocab_size = std::min<uint64_t>(129280, 16 * h);
      s.first_dense_layers = 1;
      break;
  }
  return s;
}

}  // namespace

ModelShape ShapeForSize(Family family, uint64_t target, uint64_t max_experts) {
  if (max_experts == 0) max_experts = 16;
  static constexpr uint64_t kHidden[] = {7168, 4096, 2048, 1024, 512, 256, 128, 64};
  ModelShape s;
  for (uint64_t h : kHidden) {
    s = ScaledShape(family, h, max_experts);
    s.num_layers = 2;
    if (ModelBytes(s) <= target) break;
  }
  const uint64_t two = ModelBytes(s);
  s.num_layers = 3;
  const uint64_t per_layer = ModelBytes(s) - two;
  const uint64_t fixed = two - 2 * per_layer;
  s.num_layers = target > fixed ? std::max<uint64_t>(2, (target - fixed + per_layer / 2) / per_layer) : 2;
  return s;
}

}  // namespace dcr
