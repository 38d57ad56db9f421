// dcr_manifest_bench [--chunks 2097152] [--chunk-elements 524288] [--tensors 65536]
//                    [--changed 0.03] [--reps 3]
//
// What a receiver pays for a delta's manifest on a large model (issue 25):
// a synthetic manifest of a model of `chunks` chunks (default 2^21 chunks of
// 2^19 elements: a 1.1T-element model) over `tensors` BF16 tensors, with a
// frame for `changed` of the chunks (spread evenly), each frame the size the
// codec gives at 3% of its elements changed (1.12 bytes per change, a
// 32-byte header). Prints manifest.bin's bytes against the frames' (what the
// receiver downloads besides them per version; the tensor table is the
// run's, downloaded once) and the time to decode and validate it
// (DeltaManifest::Decode, one core) against the same run's baseline: one
// pass that only reads the same bytes (a hash).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

#include "dcr/delta.h"
#include "dcr/hash.h"
#include "dcr/text.h"

namespace {

using namespace dcr;

double Seconds(const std::chrono::steady_clock::time_point& since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

[[noreturn]] void Usage() {
  fmt::print(stderr,
             "usage: dcr_manifest_bench [--chunks N] [--chunk-elements N] [--tensors N] [--changed F] [--reps N]\n");
  std::exit(2);
}

Digest SomeDigest(uint64_t i) {
  Digest d;
  d.lane[0] = (i * 0x9e3779b97f4a7c15ull) % kDigestPrime;
  d.lane[1] = (i * 0xc2b2ae3d27d4eb4full + 1) % kDigestPrime;
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t chunks = 1ull << 21, chunk_elements = 1ull << 19, tensors = 1ull << 16;
  double changed = 0.03;
  int reps = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) Usage();
    const char* v = argv[++i];
    if (a == "--chunks") chunks = std::strtoull(v, nullptr, 10);
    else if (a == "--chunk-elements") chunk_elements = std::strtoull(v, nullptr, 10);
    else if (a == "--tensors") tensors = std::strtoull(v, nullptr, 10);
    else if (a == "--changed") changed = std::atof(v);
    else if (a == "--reps") reps = std::atoi(v);
    else Usage();
  }
  if (tensors == 0 || chunks < tensors || chunk_elements == 0 || chunk_elements % 8 || changed <= 0 || changed > 1)
    Usage();

  // The model: `tensors` BF16 matrices [rows, 4096] of about chunks/tensors chunks each.
  DeltaManifest m;
  m.delta_id = 0x1234567890abcdefull;
  m.chunk_elements = chunk_elements;
  const uint64_t per_tensor = chunks / tensors;
  for (uint64_t t = 0; t < tensors; ++t) {
    DeltaTensor dt;
    dt.name = fmt::format("model.layers.{}.mlp.experts.{}.down_proj.weight", t / 256, t % 256);
    dt.dtype = DType::kBF16;
    dt.elements = per_tensor * chunk_elements;
    dt.shape = {dt.elements / 4096, 4096};
    m.tensors.push_back(std::move(dt));
    m.total_elements += per_tensor * chunk_elements;
  }
  std::sort(m.tensors.begin(), m.tensors.end(),
            [](const DeltaTensor& a, const DeltaTensor& b) { return TensorNameLess(a.name, b.name); });
  m.total_bytes = 2 * m.total_elements;
  m.objects = {"frames/s0-0000.bin"};
  const uint64_t total_chunks = per_tensor * tensors;
  const uint64_t every = std::max<uint64_t>(1, static_cast<uint64_t>(1.0 / changed));
  const uint32_t changes = static_cast<uint32_t>(0.03 * static_cast<double>(chunk_elements));
  const uint64_t payload_bytes = static_cast<uint64_t>(1.12 * changes);
  const uint64_t frame_bytes = 32 + payload_bytes;  // a compact frame header: about 32 bytes
  for (uint64_t c = 0; c < total_chunks; c += every) {
    DeltaFrameEntry f;
    f.tensor = static_cast<uint32_t>(c / per_tensor);
    f.chunk = static_cast<uint32_t>(c % per_tensor);
    f.offset = m.frame_bytes;
    f.bytes = frame_bytes;
    f.mode = Mode::kAdd;
    f.codec = Codec::kSparse;
    f.changed = changes;
    m.frames.push_back(f);
    m.frame_bytes += frame_bytes;
    m.payload_bytes += payload_bytes;
    m.changed_words += changes;
  }
  m.base_digest = SomeDigest(1);
  m.target_digest = SomeDigest(2);

  const std::string text = m.Encode();
  const DeltaManifest table = [&] {
    DeltaManifest t;
    t.chunk_elements = m.chunk_elements;
    t.tensors = m.tensors;
    return t;
  }();
  double parse = 1e30, read = 1e30;
  volatile uint64_t sink = 0;  // keeps the baseline pass
  for (int r = 0; r < std::max(reps, 1); ++r) {
    auto t0 = std::chrono::steady_clock::now();
    sink = sink + Xxh3_64(text.data(), text.size());
    read = std::min(read, Seconds(t0));
    t0 = std::chrono::steady_clock::now();
    auto parsed = DeltaManifest::Decode(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()), table,
                                        "synthetic manifest");
    parse = std::min(parse, Seconds(t0));
    if (!parsed.ok() || parsed->frames.size() != m.frames.size()) {
      fmt::print(stderr, "the manifest does not parse back: {}\n", parsed.status().ToString());
      return 1;
    }
  }
  fmt::print("model: {} chunks of {} elements in {} tensors ({:.2f}T elements); frames for {} chunks ({:.1f}%)\n",
             total_chunks, chunk_elements, tensors, static_cast<double>(m.total_elements) / 1e12, m.frames.size(),
             100.0 * static_cast<double>(m.frames.size()) / static_cast<double>(total_chunks));
  fmt::print(
      "manifest.bin {} bytes = {:.3f} of the frames' {} bytes ({:.1f} bytes per frame); a receiver downloads "
      "{:.3f}x the frames per version (the run's tensor table: {} bytes of JSON, once)\n",
      text.size(), static_cast<double>(text.size()) / static_cast<double>(m.frame_bytes), m.frame_bytes,
      static_cast<double>(text.size()) / static_cast<double>(m.frames.size()),
      static_cast<double>(text.size() + m.frame_bytes) / static_cast<double>(m.frame_bytes), m.TableJson().size());
  fmt::print(
      "decode and validate (1 core, best of {}): {:.3f} s; baseline, reading the same bytes once (xxh3): "
      "{:.4f} s ({:.0f}x){}\n",
      reps, parse, read, parse / read, sink == 42 ? " " : "");
  return 0;
}
