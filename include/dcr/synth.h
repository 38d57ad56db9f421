// Synthetic checkpoints for tests, benchmarks and the demo: tensor lists that
// follow real model families (Hugging Face names and shapes), scaled down to a
// chosen size, and successive versions produced by an update model.
// Everything is deterministic from the seed, whatever the thread count.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dcr/dtype.h"
#include "dcr/safetensors.h"
#include "dcr/status.h"

namespace dcr {

class Progress;

enum class Family { kLlama, kQwen3Moe, kDeepseekV3 };
std::string_view FamilyName(Family family);  // "llama", "qwen3-moe", "deepseek-v3"
std::optional<Family> ParseFamily(std::string_view name);

// Dimensions of a model, with Hugging Face config names.
struct ModelShape {
  Family family = Family::kLlama;
  uint64_t hidden_size = 0, num_layers = 0, vocab_size = 0;
  uint64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  uint64_t intermediate_size = 0;  // dense MLP width
  // MoE (Qwen3-MoE, DeepSeek-V3): routed experts and their width.
  uint64_t num_experts = 0, moe_intermediate_size = 0, num_shared_experts = 0;
  uint64_t first_dense_layers = 0;  // DeepSeek: leading layers with a dense MLP
  // MLA (DeepSeek-V3).
  uint64_t q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
};

// How a tensor's initial values are drawn.
enum class InitKind {
  kWeight,  // N(0, 0.02)
  kNorm,  // 1 + N(0, 0.02)
  kBias,  // N(0, 0.01)
};

struct SynthTensor {
  TensorInfo info;
  InitKind init;
};

// The checkpoint tensors of `shape`, sorted by name. Linear weights, norms
// and embeddings are BF16; DeepSeek-V3-like models store their norms and
// router score-correction biases as F32 (so other dtypes are exercised).
std::vector<SynthTensor> ModelTensors(const ModelShape& shape);
uint64_t ModelBytes(const ModelShape& shape);

// A shape of `family` whose checkpoint is about `target_bytes` (never below a
// two-layer model), with at most `max_experts` routed experts (0 = 16).
ModelShape ShapeForSize(Family family, uint64_t target_bytes, uint64_t max_experts = 0);

enum class UpdateModel {
  // An FP32 master copy takes Adam-like normalised steps of one learning rate
  // (calibrated so that `rate` of N(0, 0.02) BF16 weights change per step)
  // and is rounded to BF16 each version: small weights change more often,
  // F32 tensors change almost everywhere, norms rarely.
  kTraining,
  // Uniformly random positions at `rate`, each multiplied by (1 + 1e-2 * N(0,1))
  // and forced to a different bit pattern (the reference paper's 3%/5% cases).
  kStress,
};
std::string_view UpdateModelName(UpdateModel model);
std::optional<UpdateModel> ParseUpdateModel(std::string_view name);

struct GenOptions {
  ModelShape shape;
  uint32_t versions = 1;  // K: writes v0 .. vK
  UpdateModel update = UpdateModel::kTraining;
  double rate = 0.03;
  uint64_t seed = 0;
  uint64_t max_shard_bytes = 0;  // 0: one model.safetensors per version
};

struct GenReport {
  double learning_rate = 0;  // training model: the calibrated step
  std::vector<uint64_t> changed;  // per version 1..K: elements whose bits changed
  uint64_t elements_per_version = 0;
  uint64_t bytes_per_version = 0;
};

// Writes `out_dir`/v0 .. v<K> (checkpoint directories) and `out_dir`/gen.json
// (options and report). Memory is O(threads x chunk), whatever the size.
Result<GenReport> GenerateVersions(const std::string& out_dir, const GenOptions& options, Progress* progress = nullptr);

}  // namespace dcr
