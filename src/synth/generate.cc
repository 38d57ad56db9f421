// Update models and the version generator behind `dcr gen`.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dcr/checkpoint.h"
#include "dcr/json.h"
#include "dcr/progress.h"
#include "dcr/synth.h"
#include "dcr/thread_pool.h"

namespace dcr {
namespace {

constexpr uint64_t kChunk = 1ull << 20;  // elements generated per task

uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A small counter-based generator: one independent stream per
// (seed, tensor, chunk, version), so output does not depend on scheduling.
class Rng {
 public:
  Rng(uint64_t seed, uint64_t a, uint64_t b, uint64_t c)
      : state_(SplitMix(SplitMix(SplitMix(SplitMix(seed) ^ a) ^ b) ^ c)) {}
  uint64_t Next() { return SplitMix(state_++); }
  // Approximately N(0, 1): the sum of four 16-bit uniforms (range +-3.46).
  float Normal() {
    const uint64_t r = Next();
    const uint64_t s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
    return static_cast<float>((static_cast<double>(s) - 2 * 65535.0) * (1.7320508075688772 / 65536.0));
  }
  // Uniform in [0, 1).
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float Bf16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

float InitValue(InitKind kind, Rng& rng) {
  switch (kind) {
    case InitKind::kWeight: return 0.02f * rng.Normal();
    case InitKind::kNorm: return 1.0f + 0.02f * rng.Normal();
    case InitKind::kBias: return 0.01f * rng.Normal();
  }
  return 0;
}

// Fraction of N(0, 0.02) BF16 weights whose stored bits change after one
// step of `lr` (simulated on a fixed sample).
double TrainingRate(double lr, const std::vector<float>& master, uint64_t seed) {
  Rng rng(seed, ~0ull, 1, 0);
  uint64_t changed = 0;
  for (float m : master) {
    const float next = m + static_cast<float>(lr) * rng.Normal();
    changed += Fp32BitsToBf16Bits(FloatBits(next)) != Fp32BitsToBf16Bits(FloatBits(m));
  }
  return static_cast<double>(changed) / static_cast<double>(master.size());
}

// The learning rate at which `rate` of N(0, 0.02) BF16 weights change per step.
double CalibrateLearningRate(double rate, uint64_t seed) {
  std::vector<float> sample(1 << 16);
  Rng rng(seed, ~0ull, 0, 0);
  for (auto& m : sample) m = InitValue(InitKind::kWeight, rng);
  double lo = std::log(1e-12), hi = std::log(1.0);
  for (int i = 0; i < 48; ++i) {
    const double mid = 0.5 * (lo + hi);
    (TrainingRate(std::exp(mid), sample, seed) < rate ? lo : hi) = mid;
  }
  return std::exp(0.5 * (lo + hi));
}

// Stress model: a different bit pattern near old * (1 + 1e-2 * n).
uint16_t StressBf16(uint16_t old, float n) {
  const uint16_t b = Fp32BitsToBf16Bits(FloatBits(Bf16ToFloat(old) * (1.0f + 0.01f * n)));
  return b != old ? b : static_cast<uint16_t>(old ^ 1);
}
uint32_t StressF32(uint32_t old, float n) {
  const uint32_t b = FloatBits(BitsFloat(old) * (1.0f + 0.01f * n));
  return b != old ? b : old ^ 1;
}

struct Task {
  size_t tensor;
  uint64_t begin, n;
};

// Generates one chunk of one tensor through all versions.
uint64_t GenerateChunk(const GenOptions& opt, double lr, const SynthTensor& t, size_t tensor_index, const Task& task,
                       std::vector<Checkpoint>& versions, std::vector<uint64_t>& changed_local) {
  const bool bf16 = t.info.dtype == DType::kBF16;
  const uint64_t width = bf16 ? 2 : 4;
  std::vector<float> master(task.n);
  std::vector<uint32_t> bits(task.n);  // current stored bits (BF16 in the low half)
  Rng init(opt.seed, tensor_index, task.begin / kChunk, 0);
  for (uint64_t i = 0; i < task.n; ++i) {
    master[i] = InitValue(t.init, init);
    bits[i] = bf16 ? Fp32BitsToBf16Bits(FloatBits(master[i])) : FloatBits(master[i]);
  }
  auto store = [&](uint32_t version) {
    uint8_t* dst = versions[version].MutableData(tensor_index).data() + task.begin * width;
    if (bf16) {
      for (uint64_t i = 0; i < task.n; ++i) {
        const uint16_t b = static_cast<uint16_t>(bits[i]);
        std::memcpy(dst + 2 * i, &b, 2);
      }
    } else {
      std::memcpy(dst, bits.data(), task.n * 4);
    }
  };
  store(0);
  for (uint32_t v = 1; v <= opt.versions; ++v) {
    Rng rng(opt.seed, tensor_index, task.begin / kChunk, v);
    uint64_t changed = 0;
    if (opt.update == UpdateModel::kTraining) {
      for (uint64_t i = 0; i < task.n; ++i) {
        master[i] += static_cast<float>(lr) * rng.Normal();
        const uint32_t b = bf16 ? Fp32BitsToBf16Bits(FloatBits(master[i])) : FloatBits(master[i]);
        changed += b != bits[i];
        bits[i] = b;
      }
    } else {
      const auto threshold = static_cast<uint64_t>(opt.rate * 0x1.0p64);  // rate < 1
      for (uint64_t i = 0; i < task.n; ++i) {
        if (rng.Next() >= threshold) continue;
        const float n = rng.Normal();
        bits[i] = bf16 ? StressBf16(static_cast<uint16_t>(bits[i]), n) : StressF32(bits[i], n);
        ++changed;
      }
    }
    changed_local[v - 1] += changed;
    store(v);
  }
  return task.n * width * (opt.versions + 1);
}

}  // namespace

std::string_view UpdateModelName(UpdateModel m) { return m == UpdateModel::kTraining ? "training" : "stress"; }

std::optional<UpdateModel> ParseUpdateModel(std::string_view name) {
  if (name == "training") return UpdateModel::kTraining;
  if (name == "stress") return UpdateModel::kStress;
  return std::nullopt;
}

Result<GenReport> GenerateVersions(const std::string& out_dir, const GenOptions& opt, Progress* progress) {
  if (!(opt.rate > 0.0 && opt.rate < 1.0))
    return InvalidArgument(fmt::format("rate {} must be in (0, 1), e.g. 0.03 for 3%", opt.rate));
  if (opt.versions > 100000) return InvalidArgument(fmt::format("{} versions is too many", opt.versions));
  const std::vector<SynthTensor> tensors = ModelTensors(opt.shape);
  std::vector<TensorInfo> infos;
  for (const auto& t : tensors) infos.push_back(t.info);

  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create " + out_dir);
  std::vector<Checkpoint> versions;
  CreateOptions create;
  create.max_shard_bytes = opt.max_shard_bytes;
  create.metadata = {{"format", "pt"}, {"generator", "dcr gen"}};
  for (uint32_t v = 0; v <= opt.versions; ++v) {
    const std::string dir = fmt::format("{}/v{}", out_dir, v);
    std::filesystem::remove_all(dir, ec);
    DCR_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Create(dir, infos, create));
    versions.push_back(std::move(ckpt));
  }

  GenReport report;
  report.learning_rate = opt.update == UpdateModel::kTraining ? CalibrateLearningRate(opt.rate, opt.seed) : 0;
  report.changed.assign(opt.versions, 0);
  report.elements_per_version = versions[0].total_elements();
  report.bytes_per_version = versions[0].total_bytes();

  std::vector<Task> tasks;
  for (size_t t = 0; t < tensors.size(); ++t)
    for (uint64_t b = 0; b < tensors[t].info.numel; b += kChunk)
      tasks.push_back({t, b, std::min(kChunk, tensors[t].info.numel - b)});
  std::vector<std::atomic<uint64_t>> changed(opt.versions);
  DefaultPool().ParallelFor(tasks.size(), [&](size_t i) {
    std::vector<uint64_t> local(opt.versions, 0);
    const uint64_t bytes =
        GenerateChunk(opt, report.learning_rate, tensors[tasks[i].tensor], tasks[i].tensor, tasks[i], versions, local);
    for (uint32_t v = 0; v < opt.versions; ++v) changed[v].fetch_add(local[v], std::memory_order_relaxed);
    if (progress) progress->Add(bytes);
  });
  for (uint32_t v = 0; v < opt.versions; ++v) report.changed[v] = changed[v].load();
  for (auto& ckpt : versions) DCR_RETURN_IF_ERROR(ckpt.Sync());

  const ModelShape& s = opt.shape;
  nlohmann::ordered_json doc = {
      {"family", FamilyName(s.family)},
      {"shape",
       {{"hidden_size", s.hidden_size},
        {"num_layers", s.num_layers},
        {"vocab_size", s.vocab_size},
        {"num_heads", s.num_heads},
        {"num_kv_heads", s.num_kv_heads},
        {"head_dim", s.head_dim},
        {"intermediate_size", s.intermediate_size},
        {"num_experts", s.num_experts},
        {"moe_intermediate_size", s.moe_intermediate_size},
        {"num_shared_experts", s.num_shared_experts},
        {"first_dense_layers", s.first_dense_layers},
        {"q_lora_rank", s.q_lora_rank},
        {"kv_lora_rank", s.kv_lora_rank},
        {"qk_nope_head_dim", s.qk_nope_head_dim},
        {"qk_rope_head_dim", s.qk_rope_head_dim},
        {"v_head_dim", s.v_head_dim}}},
      {"update", UpdateModelName(opt.update)},
      {"rate", opt.rate},
      {"seed", opt.seed},
      {"versions", opt.versions},
      {"learning_rate", report.learning_rate},
      {"elements_per_version", report.elements_per_version},
      {"bytes_per_version", report.bytes_per_version},
      {"changed_per_version", report.changed},
  };
  const std::string meta = out_dir + "/gen.json";
  std::ofstream out(meta, std::ios::trunc);
  out << JsonText(doc, 2) << "\n";
  if (!out.flush()) return Unavailable("cannot write " + meta);
  return report;
}

}  // namespace dcr
