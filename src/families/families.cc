// Megatron-style trainer maps and vLLM-style serving maps for the families
// of synth.h. Every box is spelled out here; docs/layouts.md has the tables.
#include <fmt/format.h>

#include <map>
#include <set>

#include "dcr/layout_families.h"

namespace dcr {
namespace {

uint64_t RoundUp(uint64_t v, uint64_t m) { return (v + m - 1) / m * m; }

Status NeedDivisible(uint64_t value, uint64_t by, std::string_view what, std::string_view split) {
  if (by == 0 || value % by != 0)
    return InvalidArgument(
        fmt::format("{} = {} is not divisible by {} = {}; choose a {} that divides it", what, value, split, by, split));
  return Status::Ok();
}

class Builder {
 public:
  explicit Builder(const ModelShape& shape) {
    for (const SynthTensor& t : ModelTensors(shape)) canon_.emplace(t.info.name, t.info);
  }
  const TensorInfo& Tensor(const std::string& name) const { return canon_.at(name); }

  void Buffer(const std::string& id, DType dtype, std::vector<uint64_t> shape) {
    map_.buffers.push_back({id, dtype, std::move(shape)});
  }
  // A buffer shaped like (and of the dtype of) canonical tensor `like`.
  void BufferLike(const std::string& id, const std::string& like, std::vector<uint64_t> shape) {
    Buffer(id, Tensor(like).dtype, std::move(shape));
  }
  void Copy(const std::string& tensor, std::vector<uint64_t> offset, std::vector<uint64_t> extent,
            const std::string& buffer, std::vector<uint64_t> buffer_offset, bool primary) {
    if (declared_.insert(tensor).second) {
      const TensorInfo& t = Tensor(tensor);
      map_.tensors.push_back({t.name, t.dtype, t.shape});
    }
    map_.copies.push_back({tensor, std::move(offset), std::move(extent), buffer, std::move(buffer_offset), primary});
  }
  // The whole tensor into a buffer of its own shape.
  void Whole(const std::string& tensor, const std::string& buffer, bool primary) {
    const TensorInfo& t = Tensor(tensor);
    BufferLike(buffer, tensor, t.shape);
    Copy(tensor, std::vector<uint64_t>(t.shape.size(), 0), t.shape, buffer, std::vector<uint64_t>(t.shape.size(), 0),
         primary);
  }
  // Rows [row, row + rows) of a 2-D tensor to rows at buffer_row of a 2-D buffer.
  void Rows(const std::string& tensor, uint64_t row, uint64_t rows, const std::string& buffer, uint64_t buffer_row,
            bool primary) {
    Copy(tensor, {row, 0}, {rows, Tensor(tensor).shape[1]}, buffer, {buffer_row, 0}, primary);
  }
  // Columns [col, col + cols) of a 2-D tensor, to column 0 of a 2-D buffer.
  void Cols(const std::string& tensor, uint64_t col, uint64_t cols, const std::string& buffer, bool primary) {
    Copy(tensor, {0, col}, {Tensor(tensor).shape[0], cols}, buffer, {0, 0}, primary);
  }
  LayoutMap Take() { return std::move(map_); }

 private:
  std::map<std::string, TensorInfo> canon_;
  std::set<std::string> declared_;
  LayoutMap map_;
};

bool IsMoeLayer(const ModelShape& s, uint64_t layer) { return s.num_experts > 0 && layer >= s.first_dense_layers; }

// A column-parallel gate/up pair fused as [gate shard; up shard] and its
// row-parallel down projection, narrowed by `parts` at `part`.
void FusedMlp(Builder& b, const std::string& canon, const std::string& fc1, const std::string& fc2, uint64_t width,
              uint64_t hidden, uint64_t parts, uint64_t part, bool primary) {
  const uint64_t w = width / parts;
  b.BufferLike(fc1, canon + ".gate_proj.weight", {2 * w, hidden});
  b.Rows(canon + ".gate_proj.weight", part * w, w, fc1, 0, primary);
  b.Rows(canon + ".up_proj.weight", part * w, w, fc1, w, primary);
  b.BufferLike(fc2, canon + ".down_proj.weight", {hidden, w});
  b.Cols(canon + ".down_proj.weight", part * w, w, fc2, primary);
}

Status CheckCommon(const ModelShape& s, uint32_t tp) {
  if (tp == 0) return InvalidArgument("tensor-parallel size 0; use 1 or more");
  DCR_RETURN_IF_ERROR(NeedDivisible(s.num_heads, tp, "num_heads", "tensor-parallel size"));
  if (s.intermediate_size > 0)
    DCR_RETURN_IF_ERROR(NeedDivisible(s.intermediate_size, tp, "intermediate_size", "tensor-parallel size"));
  if (s.num_shared_experts > 0)
    DCR_RETURN_IF_ERROR(NeedDivisible(s.moe_intermediate_size * s.num_shared_experts, tp, "shared expert width",
                                      "tensor-parallel size"));
  return Status::Ok();
}

}  // namespace

ExpertRange ExpertsOfRank(uint64_t experts, uint32_t ranks, uint32_t rank) {
  if (ranks == 0) return {};
  const uint64_t base = experts / ranks, extra = experts % ranks;
  return {rank * base + std::min<uint64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

std::vector<TrainerRank> TrainerRanks(const TrainerParallel& p) {
  std::vector<TrainerRank> out;
  for (uint32_t s = 0; s < p.pp; ++s)
    for (uint32_t e = 0; e < p.ep; ++e)
      for (uint32_t t = 0; t < p.tp; ++t) out.push_back({s, e, t});
  return out;
}

void StageLayers(uint64_t layers, uint32_t pp, uint32_t stage, uint64_t* first, uint64_t* count) {
  const ExpertRange r = ExpertsOfRank(layers, pp, stage);  // the same contiguous split
  *first = r.first;
  *count = r.count;
}

// A trainer layer's attention (Megatron names), TP-split by rank r of tp.
void MegatronAttention(Builder& b, const ModelShape& s, const std::string& c, const std::string& m, uint64_t tp,
                       uint64_t r, bool dense_primary, bool replica_primary) {
  const uint64_t h = s.hidden_size;
  if (s.family == Family::kDeepseekV3) {
    const uint64_t qk = s.qk_nope_head_dim + s.qk_rope_head_dim, heads = s.num_heads / tp;
    const std::string a = c + ".self_attn", ma = m + ".self_attention";
    b.Whole(a + ".q_a_proj.weight", ma + ".linear_q_down_proj.weight", replica_primary);
    b.Whole(a + ".q_a_layernorm.weight", ma + ".linear_q_up_proj.layer_norm_weight", replica_primary);
    b.BufferLike(ma + ".linear_q_up_proj.weight", a + ".q_b_proj.weight", {heads * qk, s.q_lora_rank});
    b.Rows(a + ".q_b_proj.weight", r * heads * qk, heads * qk, ma + ".linear_q_up_proj.weight", 0, dense_primary);
    b.Whole(a + ".kv_a_proj_with_mqa.weight", ma + ".linear_kv_down_proj.weight", replica_primary);
    b.Whole(a + ".kv_a_layernorm.weight", ma + ".linear_kv_up_proj.layer_norm_weight", replica_primary);
    const uint64_t kvr = heads * (s.qk_nope_head_dim + s.v_head_dim);
    b.BufferLike(ma + ".linear_kv_up_proj.weight", a + ".kv_b_proj.weight", {kvr, s.kv_lora_rank});
    b.Rows(a + ".kv_b_proj.weight", r * kvr, kvr, ma + ".linear_kv_up_proj.weight", 0, dense_primary);
    const uint64_t cols = heads * s.v_head_dim;
    b.BufferLike(ma + ".linear_proj.weight", a + ".o_proj.weight", {h, cols});
    b.Cols(a + ".o_proj.weight", r * cols, cols, ma + ".linear_proj.weight", dense_primary);
  } else {
    const uint64_t hd = s.head_dim, groups = s.num_kv_heads / tp, qpg = s.num_heads / s.num_kv_heads;
    const std::string a = c + ".self_attn", qkv = m + ".self_attention.linear_qkv.weight";
    b.BufferLike(qkv, a + ".q_proj.weight", {groups * (qpg + 2) * hd, h});
    for (uint64_t j = 0; j < groups; ++j) {
      const uint64_t g = r * groups + j, row = j * (qpg + 2) * hd;
      b.Rows(a + ".q_proj.weight", g * qpg * hd, qpg * hd, qkv, row, dense_primary);
      b.Rows(a + ".k_proj.weight", g * hd, hd, qkv, row + qpg * hd, dense_primary);
      b.Rows(a + ".v_proj.weight", g * hd, hd, qkv, row + (qpg + 1) * hd, dense_primary);
    }
    const uint64_t cols = s.num_heads * hd / tp;
    b.BufferLike(m + ".self_attention.linear_proj.weight", a + ".o_proj.weight", {h, cols});
    b.Cols(a + ".o_proj.weight", r * cols, cols, m + ".self_attention.linear_proj.weight", dense_primary);
    if (s.family == Family::kQwen3Moe) {
      b.Whole(a + ".q_norm.weight", m + ".self_attention.q_layernorm.weight", replica_primary);
      b.Whole(a + ".k_norm.weight", m + ".self_attention.k_layernorm.weight", replica_primary);
    }
  }
}

// A trainer MoE layer's router and its expert-parallel rank's experts.
void MegatronMoe(Builder& b, const ModelShape& s, const TrainerParallel& p, const TrainerRank& rank,
                 const std::string& c, const std::string& m, bool dense_primary, bool replica_primary) {
  const uint64_t h = s.hidden_size, tp = p.tp, r = rank.tp;
  b.Whole(c + ".mlp.gate.weight", m + ".mlp.router.weight", replica_primary);
  if (s.family == Family::kDeepseekV3)
    b.Whole(c + ".mlp.gate.e_score_correction_bias", m + ".mlp.router.expert_bias", replica_primary);
  const ExpertRange er = ExpertsOfRank(s.num_experts, p.ep, rank.ep);
  for (uint64_t i = 0; i < er.count; ++i) {
    const std::string ce = fmt::format("{}.mlp.experts.{}", c, er.first + i);
    const std::string fc1 = fmt::format("{}.mlp.experts.linear_fc1.weight{}", m, i);
    const std::string fc2 = fmt::format("{}.mlp.experts.linear_fc2.weight{}", m, i);
    if (p.expert_tp) FusedMlp(b, ce, fc1, fc2, s.moe_intermediate_size, h, tp, r, true);
    else FusedMlp(b, ce, fc1, fc2, s.moe_intermediate_size, h, 1, 0, r == 0);
  }
  if (s.num_shared_experts > 0)
    FusedMlp(b, c + ".mlp.shared_experts", m + ".mlp.shared_experts.linear_fc1.weight",
             m + ".mlp.shared_experts.linear_fc2.weight", s.moe_intermediate_size * s.num_shared_experts, h, tp, r,
             dense_primary);
}

// A serving layer's attention (vLLM names: fused qkv, MLA's fused q_a/kv_a),
// TP-split by rank r of tp; KV heads replicated when tp exceeds them.
Status VllmAttention(Builder& b, const ModelShape& s, const std::string& a, uint64_t tp, uint64_t r, bool rep) {
  const uint64_t h = s.hidden_size;
  if (s.family == Family::kDeepseekV3) {
    const uint64_t qk = s.qk_nope_head_dim + s.qk_rope_head_dim, heads = s.num_heads / tp;
    const std::string fused = a + ".fused_qkv_a_proj.weight";
    const uint64_t qa = s.q_lora_rank, kva = s.kv_lora_rank + s.qk_rope_head_dim;
    b.BufferLike(fused, a + ".q_a_proj.weight", {qa + kva, h});
    b.Rows(a + ".q_a_proj.weight", 0, qa, fused, 0, rep);
    b.Rows(a + ".kv_a_proj_with_mqa.weight", 0, kva, fused, qa, rep);
    b.Whole(a + ".q_a_layernorm.weight", a + ".q_a_layernorm.weight", rep);
    b.Whole(a + ".kv_a_layernorm.weight", a + ".kv_a_layernorm.weight", rep);
    b.BufferLike(a + ".q_b_proj.weight", a + ".q_b_proj.weight", {heads * qk, s.q_lora_rank});
    b.Rows(a + ".q_b_proj.weight", r * heads * qk, heads * qk, a + ".q_b_proj.weight", 0, true);
    const uint64_t kvr = heads * (s.qk_nope_head_dim + s.v_head_dim);
    b.BufferLike(a + ".kv_b_proj.weight", a + ".kv_b_proj.weight", {kvr, s.kv_lora_rank});
    b.Rows(a + ".kv_b_proj.weight", r * kvr, kvr, a + ".kv_b_proj.weight", 0, true);
    const uint64_t cols = heads * s.v_head_dim;
    b.BufferLike(a + ".o_proj.weight", a + ".o_proj.weight", {h, cols});
    b.Cols(a + ".o_proj.weight", r * cols, cols, a + ".o_proj.weight", true);
  } else {
    const uint64_t hd = s.head_dim, qh = s.num_heads / tp, nkv = s.num_kv_heads;
    uint64_t kvh, kv_first;
    bool kv_primary = true;
    if (tp >= nkv) {
      DCR_RETURN_IF_ERROR(NeedDivisible(tp, nkv, "tensor-parallel size", "num_kv_heads"));
      const uint64_t replicas = tp / nkv;
      kvh = 1;
      kv_first = r / replicas;
      kv_primary = r % replicas == 0;
    } else {
      DCR_RETURN_IF_ERROR(NeedDivisible(nkv, tp, "num_kv_heads", "tensor-parallel size"));
      kvh = nkv / tp;
      kv_first = r * kvh;
    }
    const std::string qkv = a + ".qkv_proj.weight";
    b.BufferLike(qkv, a + ".q_proj.weight", {(qh + 2 * kvh) * hd, h});
    b.Rows(a + ".q_proj.weight", r * qh * hd, qh * hd, qkv, 0, true);
    b.Rows(a + ".k_proj.weight", kv_first * hd, kvh * hd, qkv, qh * hd, kv_primary);
    b.Rows(a + ".v_proj.weight", kv_first * hd, kvh * hd, qkv, (qh + kvh) * hd, kv_primary);
    const uint64_t cols = qh * hd;
    b.BufferLike(a + ".o_proj.weight", a + ".o_proj.weight", {h, cols});
    b.Cols(a + ".o_proj.weight", r * cols, cols, a + ".o_proj.weight", true);
    if (s.family == Family::kQwen3Moe) {
      b.Whole(a + ".q_norm.weight", a + ".q_norm.weight", rep);
      b.Whole(a + ".k_norm.weight", a + ".k_norm.weight", rep);
    }
  }
  return Status::Ok();
}

// A serving MoE layer's router and experts (stacked w13 and w2: split by TP,
// or whole experts by expert parallelism).
void VllmMoe(Builder& b, const ModelShape& s, const ServingParallel& p, uint32_t rank, const std::string& c) {
  const uint64_t h = s.hidden_size, tp = p.tp, r = rank;
  const bool rep = r == 0;
  b.Whole(c + ".mlp.gate.weight", c + ".mlp.gate.weight", rep);
  if (s.family == Family::kDeepseekV3)
    b.Whole(c + ".mlp.gate.e_score_correction_bias", c + ".mlp.gate.e_score_correction_bias", rep);
  const ExpertRange er = p.expert_parallel ? ExpertsOfRank(s.num_experts, p.tp, rank) : ExpertRange{0, s.num_experts};
  const uint64_t parts = p.expert_parallel ? 1 : tp, part = p.expert_parallel ? 0 : r;
  const uint64_t w = s.moe_intermediate_size / parts;
  const std::string w13 = c + ".mlp.experts.w13_weight", w2 = c + ".mlp.experts.w2_weight";
  const std::string e0 = c + ".mlp.experts.0";
  b.BufferLike(w13, e0 + ".gate_proj.weight", {er.count, 2 * w, h});
  b.BufferLike(w2, e0 + ".down_proj.weight", {er.count, h, w});
  for (uint64_t i = 0; i < er.count; ++i) {
    const std::string ce = fmt::format("{}.mlp.experts.{}", c, er.first + i);
    b.Copy(ce + ".gate_proj.weight", {part * w, 0}, {w, h}, w13, {i, 0, 0}, true);
    b.Copy(ce + ".up_proj.weight", {part * w, 0}, {w, h}, w13, {i, w, 0}, true);
    b.Copy(ce + ".down_proj.weight", {0, part * w}, {h, w}, w2, {i, 0, 0}, true);
  }
  if (s.num_shared_experts > 0)
    FusedMlp(b, c + ".mlp.shared_experts", c + ".mlp.shared_experts.gate_up_proj.weight",
             c + ".mlp.shared_experts.down_proj.weight", s.moe_intermediate_size * s.num_shared_experts, h, tp, r,
             true);
}

Result<LayoutMap> MegatronLayout(const ModelShape& s, const TrainerParallel& p, const TrainerRank& rank) {
  if (p.pp == 0 || p.ep == 0) return InvalidArgument("pipeline and expert-parallel sizes must be 1 or more");
  if (rank.pp >= p.pp || rank.ep >= p.ep || rank.tp >= p.tp)
    return InvalidArgument(fmt::format("trainer rank (pp {}, ep {}, tp {}) is outside the grid pp {} x ep {} x tp {}",
                                       rank.pp, rank.ep, rank.tp, p.pp, p.ep, p.tp));
  DCR_RETURN_IF_ERROR(CheckCommon(s, p.tp));
  if (s.family != Family::kDeepseekV3)
    DCR_RETURN_IF_ERROR(NeedDivisible(s.num_kv_heads, p.tp, "num_kv_heads (query groups)", "tensor-parallel size"));
  if (s.num_experts > 0 && p.expert_tp)
    DCR_RETURN_IF_ERROR(NeedDivisible(s.moe_intermediate_size, p.tp, "moe_intermediate_size", "tensor-parallel size"));
  if (s.num_layers < p.pp)
    return InvalidArgument(fmt::format("{} layers cannot fill {} pipeline stages", s.num_layers, p.pp));

  Builder b(s);
  const uint64_t h = s.hidden_size, tp = p.tp, r = rank.tp;
  const bool dense_primary = rank.ep == 0;  // TP-split tensors, replicated over ep
  const bool replica_primary = rank.ep == 0 && r == 0;  // replicated over the stage
  const bool first_stage = rank.pp == 0, last_stage = rank.pp + 1 == p.pp;
  const uint64_t vpad = RoundUp(s.vocab_size, p.vocab_multiple * tp), vrows = vpad / tp;
  auto vocab = [&](const std::string& tensor, const std::string& buffer) {
    b.BufferLike(buffer, tensor, {vrows, h});
    const uint64_t lo = r * vrows, hi = std::min(s.vocab_size, lo + vrows);
    if (lo < hi) b.Rows(tensor, lo, hi - lo, buffer, 0, dense_primary);  // rows past the vocabulary: padding
  };
  if (first_stage) vocab("model.embed_tokens.weight", "embedding.word_embeddings.weight");
  if (last_stage) {
    b.Whole("model.norm.weight", "decoder.final_layernorm.weight", replica_primary);
    vocab("lm_head.weight", "output_layer.weight");
  }
  uint64_t first_layer, layers;
  StageLayers(s.num_layers, p.pp, rank.pp, &first_layer, &layers);
  for (uint64_t local = 0; local < layers; ++local) {
    const uint64_t l = first_layer + local;
    const std::string c = fmt::format("model.layers.{}", l);
    const std::string m = fmt::format("decoder.layers.{}", local);
    b.Whole(c + ".input_layernorm.weight", m + ".input_layernorm.weight", replica_primary);
    MegatronAttention(b, s, c, m, tp, r, dense_primary, replica_primary);
    b.Whole(c + ".post_attention_layernorm.weight", m + ".pre_mlp_layernorm.weight", replica_primary);
    if (!IsMoeLayer(s, l)) {
      FusedMlp(b, c + ".mlp", m + ".mlp.linear_fc1.weight", m + ".mlp.linear_fc2.weight", s.intermediate_size, h, tp, r,
               dense_primary);
      continue;
    }
    MegatronMoe(b, s, p, rank, c, m, dense_primary, replica_primary);
  }
  LayoutMap map = b.Take();
  DCR_RETURN_IF_ERROR(ValidateLayoutMap(map));
  return map;
}

Result<LayoutMap> VllmLayout(const ModelShape& s, const ServingParallel& p, uint32_t rank) {
  if (rank >= p.tp)
    return InvalidArgument(fmt::format("serving rank {} is outside tensor-parallel size {}", rank, p.tp));
  DCR_RETURN_IF_ERROR(CheckCommon(s, p.tp));
  if (s.num_experts > 0 && !p.expert_parallel)
    DCR_RETURN_IF_ERROR(NeedDivisible(s.moe_intermediate_size, p.tp, "moe_intermediate_size", "tensor-parallel size"));
  Builder b(s);
  const uint64_t h = s.hidden_size, tp = p.tp, r = rank;
  const bool rep = r == 0;  // primary for tensors every rank holds whole
  const uint64_t vpad = RoundUp(s.vocab_size, p.vocab_multiple);
  DCR_RETURN_IF_ERROR(NeedDivisible(vpad, tp, "padded vocabulary", "tensor-parallel size"));
  const uint64_t vrows = vpad / tp;
  auto vocab = [&](const std::string& tensor) {
    b.BufferLike(tensor, tensor, {vrows, h});
    const uint64_t lo = r * vrows, hi = std::min(s.vocab_size, lo + vrows);
    if (lo < hi) b.Rows(tensor, lo, hi - lo, tensor, 0, true);
  };
  vocab("model.embed_tokens.weight");
  vocab("lm_head.weight");
  b.Whole("model.norm.weight", "model.norm.weight", rep);
  for (uint64_t l = 0; l < s.num_layers; ++l) {
    const std::string c = fmt::format("model.layers.{}", l), a = c + ".self_attn";
    b.Whole(c + ".input_layernorm.weight", c + ".input_layernorm.weight", rep);
    b.Whole(c + ".post_attention_layernorm.weight", c + ".post_attention_layernorm.weight", rep);
    DCR_RETURN_IF_ERROR(VllmAttention(b, s, a, tp, r, rep));
    if (!IsMoeLayer(s, l)) {
      FusedMlp(b, c + ".mlp", c + ".mlp.gate_up_proj.weight", c + ".mlp.down_proj.weight", s.intermediate_size, h, tp,
               r, true);
      continue;
    }
    VllmMoe(b, s, p, rank, c);
  }
  LayoutMap map = b.Take();
  DCR_RETURN_IF_ERROR(ValidateLayoutMap(map));
  return map;
}

}  // namespace dcr
