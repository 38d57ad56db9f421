// dcr_refit_api_bench V0 V1 [--reps N] [--mode xor|overwrite]
//
// The C++ side of bench/python_overhead.py: one in-memory refit over live
// buffers, exactly the calls the Python package's Sender.make_delta and
// Receiver.apply make (python/src/module.cc), without Python. The sender's
// baseline is an owned copy of V0 and its current buffers hold V1; the
// engine's buffers hold V0 (identity layout: one buffer per tensor). Timed,
// best of --reps (3): make (project, encode, assemble the frame object) and
// apply (ApplyEngineDelta: verify, write in place, digest check); the engine
// is restored to V0 between runs (untimed). Prints one JSON object.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dcr/checkpoint.h"
#include "dcr/delta.h"
#include "dcr/dtype.h"
#include "dcr/layout.h"
#include "dcr/layout_apply.h"

namespace {

[[noreturn]] void Die(const std::string& what) {
  fmt::print(stderr, "dcr_refit_api_bench: {}\n", what);
  std::exit(1);
}

template <typename T>
T Take(dcr::Result<T> r) {
  if (!r.ok()) Die(r.status().ToString());
  return std::move(*r);
}

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> pos;
  int reps = 3;
  std::string mode = "xor";
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (k == "--mode" && i + 1 < argc) {
      mode = argv[++i];
    } else if (k.rfind("--", 0) == 0) {
      Die("usage: dcr_refit_api_bench V0 V1 [--reps N] [--mode xor|overwrite]");
    } else {
      pos.push_back(k);
    }
  }
  if (pos.size() != 2 || reps < 1 || (mode != "xor" && mode != "overwrite"))
    Die("usage: dcr_refit_api_bench V0 V1 [--reps N] [--mode xor|overwrite]");
  dcr::Checkpoint v0 = Take(dcr::Checkpoint::Open(pos[0]));
  dcr::Checkpoint v1 = Take(dcr::Checkpoint::Open(pos[1]));

  // The identity layout, as dcr.identity_layout writes it.
  nlohmann::json doc = {{"format", "dcr-layout"}, {"format_version", 1}};
  doc["tensors"] = doc["buffers"] = doc["copies"] = nlohmann::json::array();
  for (const dcr::TensorInfo& t : v0.tensors()) {
    const std::string dtype(dcr::Name(t.dtype));
    const std::vector<uint64_t> zeros(t.shape.size(), 0);
    doc["tensors"].push_back({{"name", t.name}, {"dtype", dtype}, {"shape", t.shape}});
    doc["buffers"].push_back({{"id", t.name}, {"dtype", dtype}, {"shape", t.shape}});
    doc["copies"].push_back(
        {{"tensor", t.name}, {"offset", zeros}, {"extent", t.shape}, {"buffer", t.name}, {"buffer_offset", zeros}});
  }
  dcr::CompiledLayout layout =
      Take(dcr::CompiledLayout::Compile(Take(dcr::LayoutMapFromJson(doc.dump(), "identity layout"))));
  std::vector<dcr::TensorInfo> tensors;
  for (const dcr::LayoutTensor& t : layout.map().tensors)
    tensors.push_back(Take(dcr::MakeTensorInfo(t.name, t.dtype, t.shape)));

  std::vector<std::vector<uint8_t>> baseline, current, engine;
  uint64_t bytes = 0;
  for (const dcr::LayoutBuffer& b : layout.map().buffers) {
    const int64_t i = v0.Find(b.id), j = v1.Find(b.id);
    if (i < 0 || j < 0) Die(fmt::format("tensor {} is not in both checkpoints", b.id));
    const auto x = v0.Data(static_cast<size_t>(i)), y = v1.Data(static_cast<size_t>(j));
    if (x.size() != y.size()) Die(fmt::format("tensor {} differs in size", b.id));
    baseline.emplace_back(x.begin(), x.end());
    engine.emplace_back(x.begin(), x.end());
    current.emplace_back(y.begin(), y.end());
    bytes += x.size();
  }

  dcr::DeltaOptions opt;
  opt.encode.delta_class = mode == "xor" ? dcr::DeltaClass::kXorClass : dcr::DeltaClass::kOverwrite;
  double make_best = 1e300, apply_best = 1e300;
  uint64_t changed = 0, frame_bytes = 0;
  for (int r = 0; r < reps; ++r) {
    const double t0 = Now();
    dcr::SenderRank rank{&layout, {}, {}};
    for (const auto& b : baseline) rank.baseline.emplace_back(b);
    for (const auto& c : current) rank.current.emplace_back(c);
    dcr::DeltaManifest manifest = dcr::StartLayoutDelta(tensors, opt);
    auto contributions = Take(dcr::ProjectSender(rank, 0, manifest));
    std::vector<dcr::OwnedFrames> owners;
    owners.push_back(Take(dcr::EncodeOwnedChunks(manifest, contributions, opt.encode)));
    auto frames = std::make_shared<std::string>(Take(dcr::AssembleLayoutDelta(manifest, owners)));
    const double t1 = Now();
    make_best = std::min(make_best, t1 - t0);

    const double t2 = Now();
    std::vector<std::span<const uint8_t>> objects = {
        {reinterpret_cast<const uint8_t*>(frames->data()), frames->size()}};
    dcr::DeltaReader reader = Take(dcr::DeltaReader::FromObjects(manifest, objects, frames, "in-memory delta"));
    dcr::PlacedRank placed{&layout, {}};
    for (auto& b : engine) placed.buffers.emplace_back(b);
    dcr::PlacedRank* ranks[] = {&placed};
    (void)Take(dcr::ApplyEngineDelta(ranks, reader));
    apply_best = std::min(apply_best, Now() - t2);

    for (size_t b = 0; b < engine.size(); ++b) {
      if (std::memcmp(engine[b].data(), current[b].data(), engine[b].size()) != 0)
        Die(fmt::format("buffer {} is not V1 after the apply", layout.map().buffers[b].id));
      std::memcpy(engine[b].data(), baseline[b].data(), engine[b].size());
    }
    changed = manifest.changed_words;
    frame_bytes = frames->size();
  }
  nlohmann::json out = {{"bytes", bytes},      {"changed_words", changed}, {"frame_bytes", frame_bytes},
                        {"make_s", make_best}, {"apply_s", apply_best},    {"reps", reps},
                        {"mode", mode}};
  fmt::print("{}\n", out.dump());
  return 0;
}
