// dcr_diff_bench [--dir DIR] [--size 2GB] [--family qwen3-moe] [--rate 0.03]
//
// Throughput of `dcr diff` (DiffCheckpoints) on a pair of generated
// checkpoints, with 1 thread and with every core, next to the baseline of
// a minimal pass over the same mapped bytes (read both, count differing
// 64-bit words), which is what memory speed allows. Figures are GB/s of one
// checkpoint's bytes (each pass reads twice that).
#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "dcr/checkpoint.h"
#include "dcr/compare.h"
#include "dcr/progress.h"
#include "dcr/synth.h"
#include "dcr/thread_pool.h"

namespace {

using namespace dcr;

uint64_t BaselinePass(const Checkpoint& a, const Checkpoint& b, ThreadPool& pool) {
  std::vector<uint64_t> counts(a.size());
  pool.ParallelFor(a.size(), [&](size_t i) {
    const auto x = a.Data(i);
    const auto y = b.Data(static_cast<size_t>(b.Find(a.tensors()[i].name)));
    uint64_t n = 0;
    const size_t words = x.size() / 8;
    for (size_t w = 0; w < words; ++w) {
      uint64_t u, v;
      std::memcpy(&u, x.data() + 8 * w, 8);
      std::memcpy(&v, y.data() + 8 * w, 8);
      n += u != v;
    }
    counts[i] = n;
  });
  uint64_t total = 0;
  for (uint64_t c : counts) total += c;
  return total;
}

template <typename F>
double BestOf(int runs, F&& f) {
  double best = 1e30;
  for (int r = 0; r < runs; ++r) {
    const double t0 = MonotonicSeconds();
    f();
    best = std::min(best, MonotonicSeconds() - t0);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp/dcr-bench-diff", family = "qwen3-moe";
  uint64_t size = 2'000'000'000;
  double rate = 0.03;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--dir") dir = v;
    else if (k == "--size") {
      auto parsed = ParseBytes(v);
      if (!parsed.ok()) {
        fmt::print(stderr, "--size: {}\n", parsed.status().ToString());
        return 2;
      }
      size = *parsed;
    } else if (k == "--family") family = v;
    else if (k == "--rate") rate = std::stod(v);
    else {
      fmt::print(stderr, "unknown option {}\n", k);
      return 2;
    }
  }
  const auto fam = ParseFamily(family);
  if (!fam) return 2;

  GenOptions opt;
  opt.shape = ShapeForSize(*fam, size);
  opt.versions = 1;
  opt.rate = rate;
  opt.seed = 1;
  const std::string pair = fmt::format("{}/{}-{}-{}", dir, family, size, rate);
  if (!std::filesystem::exists(pair + "/gen.json")) {
    fmt::print("generating {} ...\n", pair);
    Progress progress("gen", ModelBytes(opt.shape) * 2);
    auto report = GenerateVersions(pair, opt, &progress);
    if (!report.ok()) {
      fmt::print(stderr, "{}\n", report.status().ToString());
      return 2;
    }
  }
  auto a = Checkpoint::Open(pair + "/v0");
  auto b = Checkpoint::Open(pair + "/v1");
  if (!a.ok() || !b.ok()) {
    fmt::print(stderr, "cannot open the pair in {}\n", pair);
    return 2;
  }
  const double gb = static_cast<double>(a->total_bytes()) / 1e9;
  const size_t cores = std::thread::hardware_concurrency();
  fmt::print("dcr diff throughput: {} checkpoint pair, {:.2f} GB each, {} tensors; {} cores\n", family, gb, a->size(),
             cores);
  fmt::print("(files in the page cache; best of 3 runs after a warm-up)\n\n");
  fmt::print("{:<34} {:>8} {:>10} {:>14} {:>12}\n", "pass", "threads", "seconds", "GB/s/core", "vs baseline");

  for (size_t threads : {size_t{1}, cores}) {
    ThreadPool pool(threads - 1);
    uint64_t changed = 0, words = 0;
    BaselinePass(*a, *b, pool);  // warm-up: fault the mappings in
    const double base = BestOf(3, [&] { words = BaselinePass(*a, *b, pool); });
    const double ours = BestOf(3, [&] { changed = DiffCheckpoints(*a, *b, nullptr, &pool).total.changed; });
    const double per_core = static_cast<double>(threads);
    fmt::print("{:<34} {:>8} {:>10.3f} {:>14.2f} {:>12}\n", "baseline: read both, count words", threads, base,
               gb / base / per_core, "1.00x");
    fmt::print("{:<34} {:>8} {:>10.3f} {:>14.2f} {:>11.2f}x\n", "dcr diff (DiffCheckpoints)", threads, ours,
               gb / ours / per_core, base / ours);
    if (threads == cores)
      fmt::print("\nchanged elements {} of {} ({:.3f}%); differing 64-bit words {}\n", changed, a->total_elements(),
                 100.0 * static_cast<double>(changed) / static_cast<double>(a->total_elements()), words);
  }
  return 0;
}
