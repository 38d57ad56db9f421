// dcr_layout_bench [--dir DIR] [--size 256MB] [--rate 0.03]
//
// For a qwen3-moe-like and a deepseek-v3-like checkpoint (dcr gen, training
// update), played by a Megatron-style trainer (tp 2 x ep 4; deepseek also
// pp 2 with expert tp):
//  - the share of the checkpoint's bytes that senders project by box copies
//    and the share converted (residual tensors), by kind of tensor, and how
//    many contribution records (and changed elements) go to another owner;
//  - the time to build the delta from shards (every sender diffs its own
//    shards, owners merge and encode) against the baseline of assembling the
//    new canonical tensors from the shards first and encoding them against a
//    canonical baseline (EncodeFrames), both on one thread.
#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <string>

#include "dcr/checkpoint.h"
#include "dcr/delta.h"
#include "dcr/layout_apply.h"
#include "dcr/layout_families.h"
#include "dcr/progress.h"
#include "dcr/synth.h"
#include "dcr/thread_pool.h"

namespace {

using namespace dcr;
namespace fs = std::filesystem;

struct Shards {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::span<uint8_t>> spans;
  std::vector<std::span<const uint8_t>> const_spans;
};

Shards Load(const CompiledLayout& l, const Checkpoint& ckpt) {
  Shards s;
  for (size_t b = 0; b < l.map().buffers.size(); ++b) s.bytes.emplace_back(l.BufferBytes(b), 0);
  for (auto& v : s.bytes) s.spans.emplace_back(v), s.const_spans.emplace_back(v);
  PlacedRank p{&l, s.spans};
  Status st = LoadDense(CheckpointBytes(ckpt), p);
  if (!st.ok()) fmt::print(stderr, "load: {}\n", st.ToString()), std::exit(2);
  return s;
}

std::string Kind(const std::string& name) {
  if (name.find(".mlp.experts.") != std::string::npos) return "routed experts";
  if (name.find("embed_tokens") != std::string::npos || name.find("lm_head") != std::string::npos)
    return "embed + head";
  if (name.find("norm") != std::string::npos || name.find("mlp.gate.") != std::string::npos) return "norms + routers";
  if (name.find("self_attn") != std::string::npos) return "attention";
  return "dense + shared MLP";
}

void Run(Family family, const std::string& dir, uint64_t size, double rate) {
  const ModelShape shape = ShapeForSize(family, size);
  const std::string root = fmt::format("{}/{}-{}", dir, FamilyName(family), size);
  if (!fs::exists(root + "/v1")) {
    GenOptions g;
    g.shape = shape;
    g.versions = 1;
    g.rate = rate;
    auto r = GenerateVersions(root, g);
    if (!r.ok()) fmt::print(stderr, "gen: {}\n", r.status().ToString()), std::exit(2);
  }
  auto v0 = Checkpoint::Open(root + "/v0");
  auto v1 = Checkpoint::Open(root + "/v1");
  if (!v0.ok() || !v1.ok()) fmt::print(stderr, "open failed\n"), std::exit(2);
  TrainerParallel tp{2, 1, 4, false, 128};
  if (family == Family::kDeepseekV3) tp = {2, 2, 4, true, 128};
  std::vector<CompiledLayout> senders;
  for (const TrainerRank& r : TrainerRanks(tp)) {
    auto m = MegatronLayout(shape, tp, r);
    if (!m.ok()) fmt::print(stderr, "map: {}\n", m.status().ToString()), std::exit(2);
    senders.push_back(std::move(*CompiledLayout::Compile(std::move(*m))));
  }
  std::vector<const CompiledLayout*> maps;
  for (const auto& l : senders) maps.push_back(&l);
  std::vector<std::string> unmapped;
  Status valid = ValidateEngine(maps, v0->tensors(), &unmapped);
  if (!valid.ok()) fmt::print(stderr, "{}\n", valid.ToString()), std::exit(2);
  std::vector<Shards> base, cur;
  for (const auto& l : senders) base.push_back(Load(l, *v0)), cur.push_back(Load(l, *v1));

  // Bytes by kind: projected (mapped by copies) or converted (residual).
  std::map<std::string, uint64_t> kind_bytes;
  uint64_t total = 0, converted = 0;
  for (const TensorInfo& t : v0->tensors()) {
    kind_bytes[Kind(t.name)] += t.nbytes;
    total += t.nbytes;
    if (std::find(unmapped.begin(), unmapped.end(), t.name) != unmapped.end()) converted += t.nbytes;
  }
  fmt::print(
      "\n{}: {} layers, hidden {}, {} experts, {:.1f} MB, {} tensors; trainer tp {} x ep {} x pp {}{} ({} ranks)\n",
      FamilyName(family), shape.num_layers, shape.hidden_size, shape.num_experts, total / 1e6, v0->tensors().size(),
      tp.tp, tp.ep, tp.pp, tp.expert_tp ? " (expert tp)" : "", senders.size());
  fmt::print("  projected by box copies: {:.2f}% of bytes; converted (residual): {:.2f}%\n",
             100.0 * static_cast<double>(total - converted) / static_cast<double>(total),
             100.0 * static_cast<double>(converted) / static_cast<double>(total));
  for (const auto& [k, b] : kind_bytes)
    fmt::print("    {:<20} {:6.2f}%\n", k, 100.0 * static_cast<double>(b) / static_cast<double>(total));

  DeltaOptions opt;
  opt.delta_id = 1;
  const int kRuns = 3;
  // From shards.
  double best_shards = 1e30;
  uint64_t records = 0, handed = 0, handed_changes = 0, changes = 0;
  std::string shard_frames;
  DeltaManifest shard_manifest;
  for (int run = 0; run < kRuns; ++run) {
    const double t0 = MonotonicSeconds();
    DeltaManifest m = StartLayoutDelta(v1->tensors(), opt);
    std::map<uint32_t, std::vector<ChunkContribution>> to_owner;
    records = handed = handed_changes = changes = 0;
    for (uint32_t s = 0; s < senders.size(); ++s) {
      auto c = ProjectSender({&senders[s], base[s].const_spans, cur[s].const_spans}, s, m);
      if (!c.ok()) fmt::print(stderr, "{}\n", c.status().ToString()), std::exit(2);
      for (auto& x : *c) {
        const uint32_t owner = *ChunkOwner(maps, m, x.tensor, x.chunk);
        ++records;
        changes += x.positions.size();
        if (owner != s) ++handed, handed_changes += x.positions.size();
        to_owner[owner].push_back(std::move(x));
      }
    }
    std::vector<OwnedFrames> owned;
    for (auto& [o, recs] : to_owner) owned.push_back(std::move(*EncodeOwnedChunks(m, recs, opt.encode)));
    auto bytes = AssembleLayoutDelta(m, owned);
    best_shards = std::min(best_shards, MonotonicSeconds() - t0);
    shard_frames = std::move(*bytes);
    shard_manifest = std::move(m);
  }
  // Baseline: assemble canonical v1 from the primaries of every sender, then encode.
  ThreadPool one(0);
  double best_canonical = 1e30, best_assemble = 1e30;
  std::string canonical_frames;
  for (int run = 0; run < kRuns; ++run) {
    const std::string out =
        fmt::format("{}/assembled-{}", fs::exists("/dev/shm") ? "/dev/shm" : dir, FamilyName(family));
    fs::remove_all(out);
    const double t0 = MonotonicSeconds();
    auto assembled = Checkpoint::Create(out, v1->tensors());
    if (!assembled.ok()) fmt::print(stderr, "{}\n", assembled.status().ToString()), std::exit(2);
    std::vector<CopyRun> runs;
    for (size_t s = 0; s < senders.size(); ++s) {
      const CompiledLayout& l = senders[s];
      for (size_t t = 0; t < l.map().tensors.size(); ++t) {
        const size_t ci = static_cast<size_t>(assembled->Find(l.map().tensors[t].name));
        uint8_t* dst = assembled->MutableData(ci).data();
        const uint64_t eb = l.ElementBytes(t), numel = assembled->tensors()[ci].numel;
        for (uint32_t c : l.CopiesOf(t)) {
          if (!l.map().copies[c].primary) continue;
          runs.clear();
          l.RunsInRange(c, 0, numel, &runs);
          const uint8_t* src = cur[s].bytes[l.BufferOf(c)].data();
          for (const CopyRun& r : runs) std::memcpy(dst + r.canonical * eb, src + r.buffer * eb, r.length * eb);
        }
      }
    }
    const double t1 = MonotonicSeconds();
    auto m = StartDelta(*v0, *assembled, opt);
    std::string frames;
    auto enc = EncodeFrames(
        *v0, *assembled, *m, AllChunks(*m), opt.encode,
        [&](std::string_view f) {
          frames += f;
          return Status::Ok();
        },
        nullptr, nullptr, &one);
    if (!enc.ok()) fmt::print(stderr, "{}\n", enc.status().ToString()), std::exit(2);
    const double t2 = MonotonicSeconds();
    best_assemble = std::min(best_assemble, t1 - t0);
    best_canonical = std::min(best_canonical, t2 - t0);
    canonical_frames = std::move(frames);
    fs::remove_all(out);
  }
  fmt::print(
      "  contribution records {}, {} of them ({:.1f}%) handed to another owner, carrying {} of {} changed "
      "elements ({:.1f}%)\n",
      records, handed, 100.0 * static_cast<double>(handed) / static_cast<double>(records), handed_changes, changes,
      changes ? 100.0 * static_cast<double>(handed_changes) / static_cast<double>(changes) : 0.0);
  fmt::print("  delta from shards: {:.3f} s ({:.2f} GB/s of checkpoint); frames identical to canonical: {}\n",
             best_shards, total / best_shards / 1e9, shard_frames == canonical_frames ? "yes" : "NO");
  fmt::print("  baseline, assemble canonical then encode: {:.3f} s (assemble {:.3f} s) -> shards/baseline {:.2f}x\n",
             best_canonical, best_assemble, best_canonical / best_shards);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp/dcr-layout-bench", size_text = "256MB";
  double rate = 0.03;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--dir") dir = argv[i + 1];
    else if (a == "--size") size_text = argv[i + 1];
    else if (a == "--rate") rate = std::stod(argv[i + 1]);
    else {
      fmt::print(stderr, "usage: dcr_layout_bench [--dir DIR] [--size 256MB] [--rate 0.03]\n");
      return 2;
    }
  }
  auto size = ParseBytes(size_text);
  if (!size.ok()) return fmt::print(stderr, "--size: {}\n", size.status().ToString()), 2;
  fs::create_directories(dir);
  Run(Family::kQwen3Moe, dir, *size, rate);
  Run(Family::kDeepseekV3, dir, *size, rate);
  return 0;
}
