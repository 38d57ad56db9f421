// dcr layout generate|validate|show|load: layout maps as JSON (docs/layouts.md).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <sstream>

#include "cli.h"
#include "dcr/checkpoint.h"
#include "dcr/layout.h"
#include "dcr/layout_apply.h"
#include "dcr/layout_families.h"
#include "dcr/progress.h"
#include "dcr/synth.h"

namespace dcr::cli {
namespace {

struct GenerateArgs {
  std::string side = "vllm", family = "qwen3-moe", size = "64MB", out;
  uint64_t experts = 0;
  uint32_t tp = 1, pp = 1, ep = 1, rank = 0, pp_rank = 0, ep_rank = 0;
  bool expert_tp = false, expert_parallel = false;
  uint64_t vocab_multiple = 0;
};

Result<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(fmt::format("cannot open {}", path));
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) return DataLoss(fmt::format("cannot read {}", path));
  return s.str();
}

}  // namespace

Result<LayoutMap> ReadLayoutFile(const std::string& path) {
  DCR_ASSIGN_OR_RETURN(std::string text, ReadText(path));
  return LayoutMapFromJson(text, path);
}

namespace {

int RunGenerate(const GenerateArgs& a) {
  const auto family = ParseFamily(a.family);
  if (!family)
    return Fail("layout generate",
                InvalidArgument("unknown --family '" + a.family + "' (llama, qwen3-moe, deepseek-v3)"));
  auto size = ParseBytes(a.size);
  if (!size.ok()) return Fail("layout generate", size.status().WithContext("--size"));
  // The shape `dcr gen --family F --size S --experts N` writes.
  const ModelShape shape = ShapeForSize(*family, *size, a.experts);
  Result<LayoutMap> map = InvalidArgument("unknown --side '" + a.side + "' (megatron, vllm)");
  if (a.side == "megatron") {
    TrainerParallel p{a.tp, a.pp, a.ep, a.expert_tp, a.vocab_multiple ? a.vocab_multiple : 128};
    map = MegatronLayout(shape, p, {a.pp_rank, a.ep_rank, a.rank});
  } else if (a.side == "vllm") {
    ServingParallel p{a.tp, a.expert_parallel, a.vocab_multiple ? a.vocab_multiple : 64};
    map = VllmLayout(shape, p, a.rank);
  }
  if (!map.ok()) return Fail("layout generate", map.status());
  const std::string json = LayoutMapToJson(*map);
  if (a.out.empty()) {
    fmt::print("{}", json);
    return kExitOk;
  }
  std::ofstream out(a.out, std::ios::binary | std::ios::trunc);
  out << json;
  out.close();
  if (!out) return Fail("layout generate", Unavailable(fmt::format("cannot write {}", a.out)));
  return kExitOk;
}

int RunValidate(const std::string& file, const std::string& checkpoint) {
  auto map = ReadLayoutFile(file);
  if (!map.ok()) return Fail("layout validate", map.status());
  if (!checkpoint.empty()) {
    auto ckpt = Checkpoint::Open(checkpoint);
    if (!ckpt.ok()) return Fail("layout validate", ckpt.status());
    // One file is one rank: its tensors must be the checkpoint's (coverage
    // needs every rank of the engine; see ValidateEngine).
    for (const LayoutTensor& t : map->tensors) {
      const int64_t i = ckpt->Find(t.name);
      if (i < 0)
        return Fail("layout validate", InvalidArgument(fmt::format("tensor '{}' is not in {}; generate the map for "
                                                                   "this model",
                                                                   t.name, checkpoint)));
      const TensorInfo& info = ckpt->tensors()[static_cast<size_t>(i)];
      if (info.dtype != t.dtype || info.shape != t.shape)
        return Fail("layout validate",
                    InvalidArgument(fmt::format("tensor '{}' is {} [{}] in the map but {} [{}] in {}", t.name,
                                                Name(t.dtype), fmt::join(t.shape, ", "), Name(info.dtype),
                                                fmt::join(info.shape, ", "), checkpoint)));
    }
  }
  fmt::print("{}: valid ({} tensors, {} buffers, {} copies)\n", file, map->tensors.size(), map->buffers.size(),
             map->copies.size());
  return kExitOk;
}

int RunShow(const std::string& file) {
  auto map = ReadLayoutFile(file);
  if (!map.ok()) return Fail("layout show", map.status());
  auto compiled = CompiledLayout::Compile(*map);
  if (!compiled.ok()) return Fail("layout show", compiled.status());
  uint64_t buffer_bytes = 0, copied = 0, primary = 0;
  for (size_t b = 0; b < map->buffers.size(); ++b) buffer_bytes += compiled->BufferBytes(b);
  fmt::print("{:<64} {:>6} {:>8} {:>12}\n", "buffer", "dtype", "copies", "bytes");
  for (size_t b = 0; b < map->buffers.size(); ++b) {
    size_t n = 0;
    for (size_t c = 0; c < map->copies.size(); ++c) n += compiled->BufferOf(c) == b;
    fmt::print("{:<64} {:>6} {:>8} {:>12}\n", map->buffers[b].id, Name(map->buffers[b].dtype), n,
               compiled->BufferBytes(b));
  }
  for (const BoxCopy& c : map->copies) {
    uint64_t v = 1;
    for (uint64_t e : c.extent) v *= e;
    v *= compiled->ElementBytes(static_cast<size_t>(compiled->FindTensor(c.tensor)));
    copied += v;
    if (c.primary) primary += v;
  }
  fmt::print(
      "{} tensors, {} buffers ({} bytes), {} copies: {} bytes copied, {} of them primary, {} bytes unmapped "
      "(padding)\n",
      map->tensors.size(), map->buffers.size(), buffer_bytes, map->copies.size(), copied, primary,
      buffer_bytes - copied);
  return kExitOk;
}

// A dense load of a checkpoint through one rank's map into buffer files.
int RunLoad(const std::string& checkpoint, const std::string& file, const std::string& out) {
  auto map = ReadLayoutFile(file);
  if (!map.ok()) return Fail("layout load", map.status());
  auto layout = CompiledLayout::Compile(std::move(*map));
  if (!layout.ok()) return Fail("layout load", layout.status().WithContext(file));
  auto ckpt = Checkpoint::Open(checkpoint);
  if (!ckpt.ok()) return Fail("layout load", ckpt.status());
  auto files = RankBufferFiles::Create(*layout, out);
  if (!files.ok()) return Fail("layout load", files.status());
  PlacedRank placed = files->placed();
  if (Status s = LoadDense(CheckpointBytes(*ckpt), placed); !s.ok())
    return Fail("layout load", s.WithContext(checkpoint));
  if (Status s = files->Sync(); !s.ok()) return Fail("layout load", s);
  fmt::print("{}: {} buffers loaded from {}\n", out, layout->map().buffers.size(), checkpoint);
  return kExitOk;
}

}  // namespace

void AddLayoutCommand(CLI::App& app) {
  auto* cmd = app.add_subcommand("layout", "Layout maps: generate, validate and show (docs/layouts.md)");
  cmd->require_subcommand(1);

  auto g = std::make_shared<GenerateArgs>();
  auto* gen = cmd->add_subcommand("generate", "Print (or write) the map of one rank, for the shape dcr gen makes");
  gen->add_option("--side", g->side, "megatron (trainer) or vllm (receiver)")->capture_default_str();
  gen->add_option("--family", g->family, "llama, qwen3-moe or deepseek-v3")->capture_default_str();
  gen->add_option("--size", g->size, "model size as given to dcr gen")->capture_default_str();
  gen->add_option("--experts", g->experts, "routed experts as given to dcr gen (0: up to 16)")->capture_default_str();
  gen->add_option("--tp", g->tp, "tensor-parallel size")->capture_default_str();
  gen->add_option("--pp", g->pp, "pipeline stages (megatron)")->capture_default_str();
  gen->add_option("--ep", g->ep, "expert-parallel size (megatron)")->capture_default_str();
  gen->add_option("--rank", g->rank, "tensor-parallel rank")->capture_default_str();
  gen->add_option("--pp-rank", g->pp_rank, "pipeline stage (megatron)")->capture_default_str();
  gen->add_option("--ep-rank", g->ep_rank, "expert-parallel rank (megatron)")->capture_default_str();
  gen->add_flag("--expert-tp", g->expert_tp, "split experts over tp (megatron)");
  gen->add_flag("--expert-parallel", g->expert_parallel, "spread experts over the tp ranks (vllm)");
  gen->add_option("--vocab-multiple", g->vocab_multiple,
                  "vocabulary padding multiple (default 128 x tp megatron, 64 vllm)");
  gen->add_option("-o,--out", g->out, "write here instead of stdout");
  gen->callback([g] { ExitCode() = RunGenerate(*g); });

  auto vfile = std::make_shared<std::string>(), vckpt = std::make_shared<std::string>();
  auto* val = cmd->add_subcommand("validate", "Check a map (and, with --checkpoint, its tensors against a checkpoint)");
  val->add_option("map", *vfile, "layout map JSON")->required();
  val->add_option("--checkpoint", *vckpt, "a checkpoint whose tensors the map must match");
  val->callback([vfile, vckpt] { ExitCode() = RunValidate(*vfile, *vckpt); });

  auto sfile = std::make_shared<std::string>();
  auto* show = cmd->add_subcommand("show", "Summarise a map: buffers, copies, bytes");
  show->add_option("map", *sfile, "layout map JSON")->required();
  show->callback([sfile] { ExitCode() = RunShow(*sfile); });

  auto lckpt = std::make_shared<std::string>(), lmap = std::make_shared<std::string>(),
       lout = std::make_shared<std::string>();
  auto* load = cmd->add_subcommand("load",
                                   "Dense load of a checkpoint through one rank's map into buffer files "
                                   "(one file per buffer, named by its id)");
  load->add_option("checkpoint", *lckpt, "checkpoint file or directory")->required();
  load->add_option("map", *lmap, "the rank's layout map JSON")->required();
  load->add_option("-o,--out", *lout, "directory of the buffer files (created; files replaced)")->required();
  load->callback([lckpt, lmap, lout] { ExitCode() = RunLoad(*lckpt, *lmap, *lout); });
}

}  // namespace dcr::cli
