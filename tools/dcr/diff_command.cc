// dcr diff A B [--json] [--summary]: which stored bits differ between two
// checkpoints. Exit 0 when bit-identical, 1 when they differ, 2 on error.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "cli.h"
#include "dcr/checkpoint.h"
#include "dcr/compare.h"
#include "dcr/json.h"
#include "dcr/progress.h"

namespace dcr::cli {
namespace {

struct DiffArgs {
  std::string a, b;
  bool json = false;
  bool summary = false;
};

double Percent(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0.0 : 100.0 * static_cast<double>(part) / static_cast<double>(whole);
}

bool HasFields(DType dtype) {
  const auto kind = Info(dtype).kind;
  return kind == DTypeKind::kFloat || kind == DTypeKind::kComplex;
}

nlohmann::ordered_json StatsJson(const BitDiffStats& s, bool fields) {
  nlohmann::ordered_json j = {
      {"elements", s.elements}, {"changed_elements", s.changed}, {"changed_percent", Percent(s.changed, s.elements)}};
  if (fields) {
    j["sign_changed"] = s.sign_changed;
    j["exponent_changed"] = s.exponent_changed;
    j["mantissa_changed"] = s.mantissa_changed;
  }
  j["max_ulp"] = s.max_ulp;
  return j;
}

int RunDiff(const DiffArgs& args) {
  auto a = Checkpoint::Open(args.a);
  if (!a.ok()) return Fail("diff", a.status());
  auto b = Checkpoint::Open(args.b);
  if (!b.ok()) return Fail("diff", b.status());
  Progress progress("diff", a->total_bytes());
  const CheckpointDiff diff = DiffCheckpoints(*a, *b, &progress);
  progress.Finish();
  const BitDiffStats& total = diff.total;

  if (args.json) {
    nlohmann::ordered_json doc = {{"a", args.a}, {"b", args.b}};
    doc["identical"] = diff.identical();
    doc["total_elements"] = total.elements;
    doc["changed_elements"] = total.changed;
    doc["changed_percent"] = Percent(total.changed, total.elements);
    doc["sign_changed"] = total.sign_changed;
    doc["exponent_changed"] = total.exponent_changed;
    doc["mantissa_changed"] = total.mantissa_changed;
    doc["max_ulp"] = total.max_ulp;
    doc["only_in_a"] = diff.only_in_a;
    doc["only_in_b"] = diff.only_in_b;
    doc["mismatched"] = diff.mismatched;
    if (!args.summary) {
      auto& tensors = doc["tensors"] = nlohmann::ordered_json::array();
      for (const auto& t : diff.tensors) {
        nlohmann::ordered_json e = {{"name", t.name}, {"dtype", Name(t.dtype)}};
        e.update(StatsJson(t.stats, HasFields(t.dtype)));
        tensors.push_back(std::move(e));
      }
    }
    fmt::print("{}\n", JsonText(doc, 2));
  } else {
    if (!args.summary) {
      size_t width = 6;
      for (const auto& t : diff.tensors) width = std::max(width, t.name.size());
      fmt::print("{:<{}}  {:<7}  {:>12}  {:>12}  {:>8}  {:>10}  {:>10}  {:>10}  {:>8}\n", "tensor", width, "dtype",
                 "changed", "elements", "%", "sign", "exponent", "mantissa", "max ulp");
      for (const auto& t : diff.tensors) {
        const auto& s = t.stats;
        const bool f = HasFields(t.dtype);
        auto field = [&](uint64_t v) { return f ? fmt::to_string(v) : std::string("-"); };
        fmt::print("{:<{}}  {:<7}  {:>12}  {:>12}  {:>8.4f}  {:>10}  {:>10}  {:>10}  {:>8}\n", t.name, width,
                   Name(t.dtype), s.changed, s.elements, Percent(s.changed, s.elements), field(s.sign_changed),
                   field(s.exponent_changed), field(s.mantissa_changed), s.max_ulp);
      }
      fmt::print("\n");
    }
    for (const auto& n : diff.only_in_a) fmt::print("only in {}: {}\n", args.a, n);
    for (const auto& n : diff.only_in_b) fmt::print("only in {}: {}\n", args.b, n);
    for (const auto& m : diff.mismatched) fmt::print("dtype or shape differs: {}\n", m);
    fmt::print(
        "{} of {} elements changed ({:.4f}%) in {} tensors; fields changed: sign {}, exponent {}, "
        "mantissa {}; max distance {} ulp\n",
        total.changed, total.elements, Percent(total.changed, total.elements), diff.tensors.size(), total.sign_changed,
        total.exponent_changed, total.mantissa_changed, total.max_ulp);
    fmt::print("{}\n", diff.identical() ? "identical" : "differ");
  }
  return diff.identical() ? kExitOk : kExitDiffers;
}

}  // namespace

void AddDiffCommand(CLI::App& app) {
  auto args = std::make_shared<DiffArgs>();
  auto* cmd = app.add_subcommand("diff", "Compare the stored bits of two checkpoints (exit 0 same, 1 differ, 2 error)");
  cmd->add_option("a", args->a, "the old checkpoint")->required();
  cmd->add_option("b", args->b, "the new checkpoint")->required();
  cmd->add_flag("--json", args->json, "print JSON");
  cmd->add_flag("--summary", args->summary, "totals only, no per-tensor lines");
  cmd->callback([args] { ExitCode() = RunDiff(*args); });
}

}  // namespace dcr::cli
