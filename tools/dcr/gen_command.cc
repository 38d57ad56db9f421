// dcr gen -o DIR: a synthetic checkpoint and K successive versions.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "cli.h"
#include "dcr/json.h"
#include "dcr/progress.h"
#include "dcr/synth.h"

namespace dcr::cli {
namespace {

struct GenArgs {
  std::string out;
  std::string family = "qwen3-moe";
  std::string size = "64MB";
  std::string shard_size = "0";
  std::string update = "training";
  double rate = 0.03;
  uint32_t versions = 1;
  uint64_t seed = 0;
  uint64_t experts = 0;
  bool json = false;
};

int RunGen(const GenArgs& args) {
  const auto family = ParseFamily(args.family);
  if (!family)
    return Fail("gen", InvalidArgument("unknown --family '" + args.family + "' (llama, qwen3-moe, deepseek-v3)"));
  const auto update = ParseUpdateModel(args.update);
  if (!update) return Fail("gen", InvalidArgument("unknown --update '" + args.update + "' (training, stress)"));
  auto size = ParseBytes(args.size);
  if (!size.ok()) return Fail("gen", size.status().WithContext("--size"));
  auto shard = ParseBytes(args.shard_size);
  if (!shard.ok()) return Fail("gen", shard.status().WithContext("--shard-size"));

  GenOptions opt;
  opt.shape = ShapeForSize(*family, *size, args.experts);
  opt.versions = args.versions;
  opt.update = *update;
  opt.rate = args.rate;
  opt.seed = args.seed;
  opt.max_shard_bytes = *shard;
  const uint64_t bytes = ModelBytes(opt.shape);
  Progress progress("gen", bytes * (args.versions + 1));
  auto report = GenerateVersions(args.out, opt, &progress);
  progress.Finish();
  if (!report.ok()) return Fail("gen", report.status());

  if (args.json) {
    nlohmann::ordered_json doc = {{"out", args.out},
                                  {"family", FamilyName(*family)},
                                  {"layers", opt.shape.num_layers},
                                  {"hidden_size", opt.shape.hidden_size},
                                  {"experts", opt.shape.num_experts},
                                  {"bytes_per_version", report->bytes_per_version},
                                  {"elements_per_version", report->elements_per_version},
                                  {"update", UpdateModelName(opt.update)},
                                  {"learning_rate", report->learning_rate},
                                  {"changed_per_version", report->changed}};
    fmt::print("{}\n", JsonText(doc, 2));
    return kExitOk;
  }
  fmt::print("{}: {} layers, hidden {}, {} experts; {} bytes ({:.3f} GB) and {} elements per version\n",
             FamilyName(*family), opt.shape.num_layers, opt.shape.hidden_size, opt.shape.num_experts,
             report->bytes_per_version, static_cast<double>(report->bytes_per_version) / 1e9,
             report->elements_per_version);
  fmt::print("update model {} at rate {}{}\n", UpdateModelName(opt.update), opt.rate,
             opt.update == UpdateModel::kTraining ? fmt::format(" (learning rate {:.3g})", report->learning_rate) : "");
  for (size_t v = 0; v < report->changed.size(); ++v)
    fmt::print("  v{} -> v{}: {} elements changed ({:.3f}%)\n", v, v + 1, report->changed[v],
               100.0 * static_cast<double>(report->changed[v]) / static_cast<double>(report->elements_per_version));
  fmt::print("wrote {}/v0 .. {}/v{}\n", args.out, args.out, args.versions);
  return kExitOk;
}

}  // namespace

void AddGenCommand(CLI::App& app) {
  auto args = std::make_shared<GenArgs>();
  auto* cmd = app.add_subcommand("gen", "Write a synthetic checkpoint v0 and K successive versions v1..vK");
  cmd->add_option("-o,--out", args->out, "output directory (gets v0 .. vK and gen.json)")->required();
  cmd->add_option("--family", args->family, "llama, qwen3-moe or deepseek-v3")->capture_default_str();
  cmd->add_option("--size", args->size, "approximate bytes per version, e.g. 64MB, 2GB")->capture_default_str();
  cmd->add_option("--versions,-k", args->versions, "number of versions after v0")
      ->capture_default_str()
      ->check(CLI::Range(0u, 100000u));
  cmd->add_option("--update", args->update, "update model: training or stress")->capture_default_str();
  cmd->add_option("--rate", args->rate, "fraction of BF16 weights changed per version")->capture_default_str();
  cmd->add_option("--seed", args->seed, "random seed")->capture_default_str();
  cmd->add_option("--experts", args->experts, "routed experts per MoE layer (0: up to 16)")->capture_default_str();
  cmd->add_option("--shard-size", args->shard_size, "max bytes per safetensors shard (0: one file)")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "print JSON");
  cmd->callback([args] { ExitCode() = RunGen(*args); });
}

}  // namespace dcr::cli
