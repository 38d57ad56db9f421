// dcr_codec_bench [--dir DIR] [--size 1GB] [--quick] [--reps N] [--sets training-3,stress-5] [--dcr-only]
//                 [--real DIR]
//
// The chunk codec (ChunkEncoder / ChunkApplier) against the reference
// paper's codec and two simpler baselines, on generated qwen3-moe-like
// checkpoint pairs: the training update model at 1%, 3%, 5% and the stress
// model at 3%, 5%. --real DIR adds real training updates: DIR holds the
// checkpoints step-000, step-001, ... that scripts/train_updates.py saves
// (a tiny Qwen3-MoE trained on text with AdamW), and the pairs of steps
// 0->1, the middle step and the last step become data sets "real K" (key
// real-K, the pair step K-1 -> step K). Every chunk of every tensor (2^20 elements, as
// DeltaManifest::ChunkWords cuts them) is encoded, applied to an in-memory
// copy of the base, and the copy is checked against the next version byte
// for byte. Baselines, measured in the same run on the same chunks:
//   (a) the paper's codec: changed positions as gaps (the first position,
//       then differences) at the smallest of uint16/32/64 that fits every gap
//       of the chunk, values as raw XOR bits at word width; each array
//       compressed with zstd level 1;
//   (b) zstd level 1 of the chunk's dense XOR mask;
//   (c) the dense new bits of every chunk (size only).
// Also shown, size only: (a') = (a) with each array stored as byte planes
// (not the paper's layout; zstd-1 compresses it much better).
// Throughputs are GB/s of dense (base) bytes per core: with 1 thread, and
// with every core divided by the number of threads. Timings are the best of
// --reps runs (3; --quick: 1, and a 128 MB checkpoint).
//
// --dcr-only: dcr encode (tracked digests) and decode+apply alone, 1 thread,
// checked, no baselines. With --reps 1, for instruction counts, e.g.
//   valgrind --tool=callgrind --toggle-collect='dcr::ChunkEncoder::Encode*' (or
//   'dcr::ChunkApplier::Apply*') dcr_codec_bench --dcr-only --reps 1 --sets training-3
// divided by the changed words printed.
#include <fmt/format.h>
#include <zstd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "../src/delta/kernels.h"  // internal: the encoder's digest kernel, timed alone
#include "dcr/checkpoint.h"
#include "dcr/chunk_codec.h"
#include "dcr/cpu.h"
#include "dcr/delta.h"
#include "dcr/digest.h"
#include "dcr/frame.h"
#include "dcr/hash.h"
#include "dcr/progress.h"
#include "dcr/synth.h"
#include "dcr/thread_pool.h"

namespace {

using namespace dcr;

constexpr uint64_t kChunkElements = kDefaultChunkElements;  // 2^20

[[noreturn]] void Die(const std::string& what) {
  fmt::print(stderr, "dcr_codec_bench: {}\n", what);
  std::fflush(stdout);
  std::exit(2);  // a clear message and a failing exit status, not a crash
}

// ---- data sets ----------------------------------------------------------------

struct DataSet {
  std::string name;  // "training 3%"
  std::string key;  // "training-3" (for --sets)
  UpdateModel update;
  double rate;
  std::string dir;
  std::string base_dir, next_dir;  // the pair's checkpoints
  bool real = false;  // from --real: figures counted from the checkpoints, not gen.json
  // From gen.json (synthetic) or counted (real).
  uint64_t bytes = 0, elements = 0, changed = 0;
  uint64_t tensors = 0, chunks = 0;
};

std::vector<DataSet> AllDataSets(const std::string& dir, uint64_t size) {
  std::vector<DataSet> sets;
  auto add = [&](UpdateModel u, double rate) {
    DataSet d;
    d.update = u;
    d.rate = rate;
    d.name = fmt::format("{} {:g}%", UpdateModelName(u), rate * 100);
    d.key = fmt::format("{}-{:g}", UpdateModelName(u), rate * 100);
    d.dir = fmt::format("{}/qwen3-moe-{}-{}-{}", dir, size, UpdateModelName(u), rate);
    d.base_dir = d.dir + "/v0";
    d.next_dir = d.dir + "/v1";
    sets.push_back(d);
  };
  add(UpdateModel::kTraining, 0.01);
  add(UpdateModel::kTraining, 0.03);
  add(UpdateModel::kTraining, 0.05);
  add(UpdateModel::kStress, 0.03);
  add(UpdateModel::kStress, 0.05);
  return sets;
}

// The pairs of real training steps under `dir` (step-000, step-001, ...):
// the first, the middle and the last step.
std::vector<DataSet> RealDataSets(const std::string& dir) {
  uint64_t last = 0;
  while (std::filesystem::is_directory(fmt::format("{}/step-{:03d}", dir, last + 1))) ++last;
  if (!std::filesystem::is_directory(dir + "/step-000") || last == 0)
    Die(fmt::format("--real {}: no step-000 and step-001 checkpoints (write them with scripts/train_updates.py)", dir));
  std::vector<uint64_t> steps = {1, (last + 1) / 2, last};
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  std::vector<DataSet> sets;
  for (uint64_t k : steps) {
    DataSet d;
    d.real = true;
    d.name = fmt::format("real {}", k);
    d.key = fmt::format("real-{}", k);
    d.dir = dir;
    d.base_dir = fmt::format("{}/step-{:03d}", dir, k - 1);
    d.next_dir = fmt::format("{}/step-{:03d}", dir, k);
    sets.push_back(d);
  }
  return sets;
}

// Bytes, elements and changed elements of a real pair, counted element by element.
void CountReal(DataSet& d) {
  auto a = Checkpoint::Open(d.base_dir);
  if (!a.ok()) Die(a.status().ToString());
  auto b = Checkpoint::Open(d.next_dir);
  if (!b.ok()) Die(b.status().ToString());
  for (size_t t = 0; t < a->size(); ++t) {
    const TensorInfo& info = a->tensors()[t];
    const int64_t j = b->Find(info.name);
    if (j < 0 || b->tensors()[static_cast<size_t>(j)].nbytes != info.nbytes)
      Die(fmt::format("{} / {}: tensor {} differs in shape or dtype", d.base_dir, d.next_dir, info.name));
    const uint64_t eb = BitsPerElement(info.dtype) / 8;
    if (eb == 0) Die(fmt::format("{}: tensor {}: sub-byte dtype in a real data set", d.base_dir, info.name));
    const auto x = a->Data(t), y = b->Data(static_cast<size_t>(j));
    for (uint64_t i = 0; i < info.nbytes; i += eb) d.changed += std::memcmp(x.data() + i, y.data() + i, eb) != 0;
    d.bytes += info.nbytes;
    d.elements += info.numel;
  }
}

void EnsureGenerated(DataSet& d, uint64_t size) {
  if (d.real) return CountReal(d);
  GenOptions opt;
  opt.shape = ShapeForSize(Family::kQwen3Moe, size);
  opt.versions = 1;
  opt.update = d.update;
  opt.rate = d.rate;
  opt.seed = 1;
  const std::string meta = d.dir + "/gen.json";
  if (!std::filesystem::exists(meta)) {
    std::fflush(stdout);
    fmt::print(stderr, "generating {} in {} ...\n", d.name, d.dir);
    Progress progress(fmt::format("gen {}", d.name), ModelBytes(opt.shape) * 2);
    auto report = GenerateVersions(d.dir, opt, &progress);
    progress.Finish();
    if (!report.ok()) Die(fmt::format("generating {}: {}", d.dir, report.status().ToString()));
  }
  std::ifstream in(meta);
  std::stringstream text;
  text << in.rdbuf();
  const auto doc = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.contains("changed_per_version") || !doc.contains("elements_per_version"))
    Die(fmt::format("{} is unreadable; delete {} to regenerate", meta, d.dir));
  d.bytes = doc["bytes_per_version"].get<uint64_t>();
  d.elements = doc["elements_per_version"].get<uint64_t>();
  d.changed = doc["changed_per_version"][0].get<uint64_t>();
}

// ---- chunks ---------------------------------------------------------------------

struct ChunkRef {
  uint32_t base_tensor, next_tensor;  // indices in the two checkpoints
  uint32_t key;  // index into keys
  DType dtype;
  uint32_t wb;
  uint64_t first_word, words;
  uint32_t elements;
  uint64_t offset, bytes;  // within the tensor's data
  uint64_t work_offset;  // within the apply copy
};

struct Pair {
  Checkpoint base, next;
  std::vector<DigestKey> keys;  // per base tensor
  std::vector<uint64_t> work_offset;  // per base tensor
  std::vector<size_t> next_index;  // per base tensor: its index in next
  std::vector<ChunkRef> chunks;
  uint64_t bytes = 0;

  std::span<const uint8_t> Base(const ChunkRef& c) const { return base.Data(c.base_tensor).subspan(c.offset, c.bytes); }
  std::span<const uint8_t> Next(const ChunkRef& c) const { return next.Data(c.next_tensor).subspan(c.offset, c.bytes); }
};

std::unique_ptr<Pair> OpenPair(const DataSet& d) {
  auto a = Checkpoint::Open(d.base_dir);
  if (!a.ok()) Die(a.status().ToString());
  auto b = Checkpoint::Open(d.next_dir);
  if (!b.ok()) Die(b.status().ToString());
  auto p = std::make_unique<Pair>(Pair{std::move(*a), std::move(*b), {}, {}, {}, {}, 0});
  uint64_t work = 0;
  for (size_t t = 0; t < p->base.size(); ++t) {
    const TensorInfo& info = p->base.tensors()[t];
    const int64_t j = p->next.Find(info.name);
    if (j < 0 || p->next.tensors()[static_cast<size_t>(j)].nbytes != info.nbytes)
      Die(fmt::format("{}: tensor {} differs between {} and {}", d.dir, info.name, d.base_dir, d.next_dir));
    p->keys.push_back(MakeDigestKey(info.name));
    p->next_index.push_back(static_cast<size_t>(j));
    p->work_offset.push_back(work);
    const uint64_t bits = BitsPerElement(info.dtype), wb = WordBytes(info.dtype);
    for (uint64_t first = 0; first < info.numel; first += kChunkElements) {
      // As DeltaManifest::ChunkWords.
      const uint64_t count = std::min(kChunkElements, info.numel - first);
      ChunkRef c;
      c.base_tensor = static_cast<uint32_t>(t);
      c.next_tensor = static_cast<uint32_t>(j);
      c.key = static_cast<uint32_t>(t);
      c.dtype = info.dtype;
      c.wb = static_cast<uint32_t>(wb);
      c.first_word = first * bits / (8 * wb);
      c.words = count * bits / (8 * wb);
      c.elements = static_cast<uint32_t>(count);
      c.offset = c.first_word * wb;
      c.bytes = c.words * wb;
      c.work_offset = work + c.offset;
      p->chunks.push_back(c);
    }
    work += info.nbytes;
  }
  p->bytes = work;
  return p;
}

// ---- per-thread state -------------------------------------------------------------

struct ZstdFree {
  void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
  void operator()(ZSTD_DCtx* c) const { ZSTD_freeDCtx(c); }
};

struct Workspace {
  ChunkEncoder encoder;
  EncodedChunk encoded;
  ChunkApplier applier;
  std::unique_ptr<ZSTD_CCtx, ZstdFree> cctx{ZSTD_createCCtx()};
  std::unique_ptr<ZSTD_DCtx, ZstdFree> dctx{ZSTD_createDCtx()};
  std::vector<uint32_t> positions;
  std::vector<uint8_t> gaps, values, dense, compressed;
};

// One per thread (the pools' workers and the main thread), kept across runs.
Workspace& Ws() {
  thread_local Workspace ws;
  return ws;
}

inline uint64_t LoadWord(const uint8_t* p, uint32_t wb) {
  uint64_t v = 0;
  std::memcpy(&v, p, wb);  // little-endian host
  return v;
}
inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// ---- dcr ------------------------------------------------------------------------------

struct DcrOut {
  bool frame = false;
  FrameHeader header;
  std::vector<uint8_t> payload;
  Digest base_digest;
};

// `base_digest`: the chunk's tracked digest, as a sender that keeps its
// baseline's chunk digests passes it (steady state); null computes it.
// `target_digest` false: without the chunk's target digest (frames that do
// not apply; what digests cost the encoder is the difference).
void DcrEncode(const Pair& p, const ChunkRef& c, DcrOut* out, const Digest* base_digest, bool target_digest = true) {
  Workspace& ws = Ws();
  ChunkInput in{c.dtype, p.keys[c.key], c.first_word, c.elements, p.Base(c), p.Next(c)};
  in.base_digest = base_digest;
  EncodeOptions options;
  options.skip_target_digest = !target_digest;
  auto r = ws.encoder.Encode(in, options, &ws.encoded);
  if (!r.ok()) Die(fmt::format("Encode: {}", r.status().ToString()));
  out->frame = *r;
  out->base_digest = ws.encoded.base_digest;
  if (*r) {
    out->header = ws.encoded.header;
    out->header.payload_bytes = static_cast<uint32_t>(ws.encoded.payload.size());
    out->payload.assign(ws.encoded.payload.begin(), ws.encoded.payload.end());
  }
}

void DcrApply(const Pair& p, const ChunkRef& c, const DcrOut& f, uint8_t* work) {
  if (!f.frame) return;
  Digest after;
  auto r = Ws().applier.Apply(FrameView{f.header, f.payload}, p.keys[c.key], c.first_word,
                              std::span<uint8_t>(work + c.work_offset, c.bytes), f.base_digest, &after);
  if (!r.ok())
    Die(fmt::format("Apply (tensor {}, words from {}): {}", c.base_tensor, c.first_word, r.status().ToString()));
  if (*r != ApplyOutcome::kApplied || after != f.header.target_digest)
    Die(fmt::format("Apply (tensor {}, words from {}): not applied, or wrong digest", c.base_tensor, c.first_word));
}

// ---- (a) the paper's codec ------------------------------------------------------------

struct PaperOut {
  uint32_t changed = 0;
  uint8_t width = 0;  // bytes per gap: 2, 4 or 8
  std::vector<uint8_t> zpos, zval;
};

// Changed word positions; 32 bytes compared at a time, then 8.
uint32_t ScanChanges(const uint8_t* a, const uint8_t* b, uint64_t words, uint32_t wb, std::vector<uint32_t>& pos) {
  pos.resize(words);
  uint32_t n = 0;
  const uint64_t bytes = words * wb;
  uint64_t i = 0;
  auto block8 = [&](uint64_t at) {
    if (Load64(a + at) == Load64(b + at)) return;
    for (uint64_t w = at / wb; w < (at + 8) / wb; ++w) {
      pos[n] = static_cast<uint32_t>(w);
      n += LoadWord(a + w * wb, wb) != LoadWord(b + w * wb, wb);
    }
  };
  for (; i + 32 <= bytes; i += 32) {
    const uint64_t x = (Load64(a + i) ^ Load64(b + i)) | (Load64(a + i + 8) ^ Load64(b + i + 8)) |
                       (Load64(a + i + 16) ^ Load64(b + i + 16)) | (Load64(a + i + 24) ^ Load64(b + i + 24));
    if (x == 0) continue;
    for (uint64_t k = 0; k < 32; k += 8) block8(i + k);
  }
  for (; i + 8 <= bytes; i += 8) block8(i);
  for (uint64_t w = i / wb; w < words; ++w)
    if (LoadWord(a + w * wb, wb) != LoadWord(b + w * wb, wb)) pos[n++] = static_cast<uint32_t>(w);
  return n;
}

// ---- floors: what no codec can beat on this machine -----------------------------------
// Encode must read base and next in full (read both, count differing 8-byte
// words); apply must read and write each 64-byte line of the target that a
// change lands in (each touched line read and written once, no decoding).

// Whether a and b differ in their first n bytes, reading both in full at the
// widest loads the machine has (the encoder's kernels use AVX2 where it can).
bool DifferScalar(const uint8_t* a, const uint8_t* b, uint64_t n) {
  uint64_t acc[4] = {0, 0, 0, 0}, i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) acc[k] |= Load64(a + i + 8 * k) ^ Load64(b + i + 8 * k);
  uint64_t r = acc[0] | acc[1] | acc[2] | acc[3];
  for (; i < n; ++i) r |= a[i] ^ b[i];
  return r != 0;
}
#if defined(__x86_64__)
__attribute__((target("avx2"))) bool DifferAvx2(const uint8_t* a, const uint8_t* b, uint64_t n) {
  __m256i x = _mm256_setzero_si256(), y = _mm256_setzero_si256();
  uint64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const auto* pa = reinterpret_cast<const __m256i*>(a + i);
    const auto* pb = reinterpret_cast<const __m256i*>(b + i);
    x = _mm256_or_si256(x, _mm256_xor_si256(_mm256_loadu_si256(pa), _mm256_loadu_si256(pb)));
    y = _mm256_or_si256(y, _mm256_xor_si256(_mm256_loadu_si256(pa + 1), _mm256_loadu_si256(pb + 1)));
  }
  x = _mm256_or_si256(x, y);
  return !_mm256_testz_si256(x, x) || DifferScalar(a + i, b + i, n - i);
}
#endif
bool Differ(const uint8_t* a, const uint8_t* b, uint64_t n) {
#if defined(__x86_64__)
  if (dcr::Cpu().avx2) return DifferAvx2(a, b, n);
#endif
  return DifferScalar(a, b, n);
}

// The offsets in chunk `c` of the 64-byte lines of the work buffer (aligned
// as it is) that its changed words touch, ascending.
std::vector<uint32_t> TouchedLines(const Pair& p, const ChunkRef& c, const uint8_t* work) {
  std::vector<uint32_t> pos;
  const uint32_t n = ScanChanges(p.Base(c).data(), p.Next(c).data(), c.words, c.wb, pos);
  const uintptr_t start = reinterpret_cast<uintptr_t>(work + c.work_offset);
  std::vector<uint32_t> lines;
  for (uint32_t i = 0; i < n; ++i) {
    const uintptr_t line = ((start + uint64_t{pos[i]} * c.wb) & ~uintptr_t{63}) - (start & ~uintptr_t{63});
    if (lines.empty() || lines.back() != line) lines.push_back(static_cast<uint32_t>(line));
  }
  return lines;
}

// Reads and writes each touched line of chunk `c` once.
void TouchLines(const ChunkRef& c, const std::vector<uint32_t>& lines, uint8_t* work) {
  uint8_t* first = reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(work + c.work_offset) & ~uintptr_t{63});
  uint8_t* const begin = work + c.work_offset;
  for (uint32_t off : lines) {
    uint8_t* l = std::max(first + off, begin);  // the chunk's first line may start before it
    *l = static_cast<uint8_t>(*l + 1);
  }
}

// What a class-split decoder (issue 24's byte target; not built) must do
// before it can place a change: read every word of the target chunk and
// class it by its exponent (3 thresholds, 4 classes, as bench/codec_entropy.py
// models), here as per-16-element bit masks whose popcounts are summed (what
// a decoder's select needs), nothing stored. BF16 chunks only (else 0).
uint64_t ClassPassScalar(const uint8_t* data, uint64_t words) {
  uint64_t n = 0;
  for (uint64_t i = 0; i < words; ++i) {
    uint16_t w;
    std::memcpy(&w, data + 2 * i, 2);
    const int e = (w >> 7) & 0xFF;
    n += (e > 118) + (e > 121) + (e > 124);
  }
  return n;
}
#if defined(__x86_64__)
__attribute__((target("avx2,popcnt"))) uint64_t ClassPassAvx2(const uint8_t* data, uint64_t words) {
  const __m256i mask = _mm256_set1_epi16(0xFF), t0 = _mm256_set1_epi16(118), t1 = _mm256_set1_epi16(121),
                t2 = _mm256_set1_epi16(124);
  uint64_t n = 0, i = 0;
  for (; i + 16 <= words; i += 16) {
    const __m256i e = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + 2 * i)), 7), mask);
    n += _mm_popcnt_u32(static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpgt_epi16(e, t0)))) +
         _mm_popcnt_u32(static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpgt_epi16(e, t1)))) +
         _mm_popcnt_u32(static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpgt_epi16(e, t2))));
  }
  return n / 2 + ClassPassScalar(data + 2 * i, words - i);
}
#endif
uint64_t ClassPass(const ChunkRef& c, const uint8_t* work) {
  if (c.wb != 2) return 0;
#if defined(__x86_64__)
  if (dcr::Cpu().avx2) return ClassPassAvx2(work + c.work_offset, c.words);
#endif
  return ClassPassScalar(work + c.work_offset, c.words);
}

void Compress(ZSTD_CCtx* cctx, const std::vector<uint8_t>& src, size_t len, std::vector<uint8_t>* dst) {
  dst->resize(ZSTD_compressBound(len));
  const size_t z = ZSTD_compressCCtx(cctx, dst->data(), dst->size(), src.data(), len, 1);
  if (ZSTD_isError(z)) Die(fmt::format("ZSTD_compress: {}", ZSTD_getErrorName(z)));
  dst->resize(z);
}

void PaperEncode(const Pair& p, const ChunkRef& c, PaperOut* out) {
  Workspace& ws = Ws();
  const uint8_t* a = p.Base(c).data();
  const uint8_t* b = p.Next(c).data();
  const uint32_t wb = c.wb;
  const uint32_t n = ScanChanges(a, b, c.words, wb, ws.positions);
  out->changed = n;
  if (n == 0) {
    out->width = 0;
    out->zpos.clear();
    out->zval.clear();
    return;
  }
  uint64_t max_gap = ws.positions[0];
  for (uint32_t i = 1; i < n; ++i) max_gap = std::max<uint64_t>(max_gap, ws.positions[i] - ws.positions[i - 1]);
  const uint32_t width = max_gap <= 0xFFFF ? 2 : max_gap <= 0xFFFFFFFFull ? 4 : 8;
  out->width = static_cast<uint8_t>(width);
  ws.gaps.resize(size_t{n} * width);
  ws.values.resize(size_t{n} * wb);
  uint32_t prev = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t q = ws.positions[i];
    const uint64_t gap = q - prev;
    prev = q;
    std::memcpy(ws.gaps.data() + size_t{i} * width, &gap, width);
    const uint64_t x = LoadWord(a + size_t{q} * wb, wb) ^ LoadWord(b + size_t{q} * wb, wb);
    std::memcpy(ws.values.data() + size_t{i} * wb, &x, wb);
  }
  Compress(ws.cctx.get(), ws.gaps, ws.gaps.size(), &out->zpos);
  Compress(ws.cctx.get(), ws.values, ws.values.size(), &out->zval);
}

// For comparison only (not the paper's layout, untimed): the same two arrays
// stored as byte planes (all low bytes, then the next byte, ...), which zstd
// compresses much better than interleaved little-endian words.
uint64_t PaperPlanesBytes(const Pair& p, const ChunkRef& c, const PaperOut& f) {
  if (f.changed == 0) return 0;
  Workspace& ws = Ws();
  const uint8_t* a = p.Base(c).data();
  const uint8_t* b = p.Next(c).data();
  const uint32_t wb = c.wb, width = f.width, n = f.changed;
  if (ScanChanges(a, b, c.words, wb, ws.positions) != n) Die("baseline (a'): changes differ");
  ws.gaps.assign(size_t{n} * width, 0);
  ws.values.assign(size_t{n} * wb, 0);
  uint32_t prev = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t q = ws.positions[i];
    const uint64_t gap = q - prev;
    prev = q;
    const uint64_t x = LoadWord(a + size_t{q} * wb, wb) ^ LoadWord(b + size_t{q} * wb, wb);
    for (uint32_t k = 0; k < width; ++k) ws.gaps[size_t{k} * n + i] = static_cast<uint8_t>(gap >> (8 * k));
    for (uint32_t k = 0; k < wb; ++k) ws.values[size_t{k} * n + i] = static_cast<uint8_t>(x >> (8 * k));
  }
  std::vector<uint8_t> z;
  Compress(ws.cctx.get(), ws.gaps, ws.gaps.size(), &z);
  uint64_t bytes = z.size();
  Compress(ws.cctx.get(), ws.values, ws.values.size(), &z);
  return bytes + z.size();
}

void Decompress(ZSTD_DCtx* dctx, const std::vector<uint8_t>& src, size_t expect, std::vector<uint8_t>* dst) {
  const unsigned long long size = ZSTD_getFrameContentSize(src.data(), src.size());
  if (size != expect) Die("baseline (a): zstd frame of the wrong size");
  dst->resize(expect);
  const size_t got = ZSTD_decompressDCtx(dctx, dst->data(), dst->size(), src.data(), src.size());
  if (ZSTD_isError(got) || got != expect) Die("baseline (a): zstd frame does not decode");
}

void PaperApply(const ChunkRef& c, const PaperOut& f, uint8_t* work) {
  if (f.changed == 0) return;
  Workspace& ws = Ws();
  const uint32_t wb = c.wb, width = f.width;
  Decompress(ws.dctx.get(), f.zpos, size_t{f.changed} * width, &ws.gaps);
  Decompress(ws.dctx.get(), f.zval, size_t{f.changed} * wb, &ws.values);
  uint8_t* t = work + c.work_offset;
  uint64_t q = 0;
  for (uint32_t i = 0; i < f.changed; ++i) {
    uint64_t gap = 0, x = 0;
    std::memcpy(&gap, ws.gaps.data() + size_t{i} * width, width);
    std::memcpy(&x, ws.values.data() + size_t{i} * wb, wb);
    q += gap;
    if (q >= c.words) Die("baseline (a): position past the chunk");
    const uint64_t v = LoadWord(t + q * wb, wb) ^ x;
    std::memcpy(t + q * wb, &v, wb);
  }
}

// ---- (b) zstd of the dense XOR mask -------------------------------------------------

uint64_t DenseXorZstd(const Pair& p, const ChunkRef& c) {
  Workspace& ws = Ws();
  const uint8_t* a = p.Base(c).data();
  const uint8_t* b = p.Next(c).data();
  ws.dense.resize(c.bytes);
  uint8_t* d = ws.dense.data();
  uint64_t i = 0;
  for (; i + 8 <= c.bytes; i += 8) {
    const uint64_t x = Load64(a + i) ^ Load64(b + i);
    std::memcpy(d + i, &x, 8);
  }
  for (; i < c.bytes; ++i) d[i] = a[i] ^ b[i];
  Compress(ws.cctx.get(), ws.dense, c.bytes, &ws.compressed);
  return ws.compressed.size();
}

// ---- the digest terms of the changes alone ----------------------------------------

size_t ChangeRecordBytes(uint32_t wb) {
  switch (wb) {
    case 1: return sizeof(kernels::Change<uint8_t>);
    case 2: return sizeof(kernels::Change<uint16_t>);
    case 4: return sizeof(kernels::Change<uint32_t>);
    default: return sizeof(kernels::Change<uint64_t>);
  }
}

// What tracked digests cost the encoder: the target digest is the tracked
// base digest plus the terms of the changed words (DigestChanges, the
// encoder's own kernel, over the chunk's (position, old, new) records, which
// it has just gathered: they are in cache). Here each chunk's records are
// found first, untimed, then the kernel over them is timed; the result is the
// sum over chunks (1 thread) and the digests' total movement, which must
// equal the frames'. Apply runs the same kernel over the same records.
struct TermsTiming {
  double seconds = 0;
  Digest moved;
};

TermsTiming TimeDigestTerms(const Pair& p) {
  TermsTiming out;
  std::vector<uint32_t> positions;
  std::vector<uint64_t> records;  // 8-byte aligned Change<U> array
  for (const ChunkRef& c : p.chunks) {
    positions.resize(c.words + 8);
    records.resize((c.words * ChangeRecordBytes(c.wb) + 7) / 8);
    const uint32_t n = kernels::Kernels().find_changes(
        c.wb, p.Base(c).data(), p.Next(c).data(), static_cast<uint32_t>(c.words), positions.data(), records.data());
    if (n == 0) continue;
    Digest d;
    const double t0 = MonotonicSeconds();
    kernels::Kernels().digest_changes(c.wb, p.keys[c.key].seed, c.first_word, records.data(), n, d.lane);
    out.seconds += MonotonicSeconds() - t0;
    out.moved += d;
  }
  return out;
}

// ---- the digest alone ---------------------------------------------------------------

// The base chunk's digest, as Encode computes it.
Digest ChunkDigest(const DigestKey& key, uint32_t wb, uint64_t first_word, std::span<const uint8_t> bytes) {
  return DigestBytes(key, first_word * wb, bytes);
}

// ---- timing ---------------------------------------------------------------------------

double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The wall time of a run, and the CPU time the process got meanwhile.
struct Timing {
  double wall = 0, cpu = 0;
};

// Best of `reps` runs of run(); setup() before each, untimed; check() after each, untimed.
Timing BestOf(int reps, const std::function<void()>& setup, const std::function<void()>& run,
              const std::function<void()>& check) {
  Timing best{1e30, 0};
  for (int r = 0; r < reps; ++r) {
    if (setup) setup();
    const double c0 = ProcessCpuSeconds();
    const double t0 = MonotonicSeconds();
    run();
    const double wall = MonotonicSeconds() - t0;
    const double cpu = ProcessCpuSeconds() - c0;
    if (wall < best.wall) best = {wall, cpu};
    if (check) check();
  }
  return best;
}

// A run whose threads got less than this share of the wall time on a CPU
// was slowed by other work on the machine: its figure is marked.
constexpr double kBusyShare = 0.85;
bool g_busy_seen = false;

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return in ? fmt::format("{} {} {}", a, b, c) : "unknown";
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown";
}

struct Row {
  std::string name;
  double bytes = 0;  // payload
  Timing enc[2], dec[2];  // wall 0: not measured
};

std::string Gbps(double bytes, const Timing& t, size_t threads) {
  if (t.wall <= 0) return "-";
  const bool busy = t.cpu < kBusyShare * static_cast<double>(threads) * t.wall;
  g_busy_seen |= busy;
  return fmt::format("{:.2f}{}", bytes / t.wall / 1e9 / static_cast<double>(threads), busy ? "*" : "");
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp/dcr-bench-codec";
  uint64_t size = 1'000'000'000;
  bool size_given = false, quick = false, dcr_only = false;
  int reps = 3;
  bool reps_given = false;
  std::string only, real_dir;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        fmt::print(stderr, "{} needs a value\n", k);
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--dir") dir = value();
    else if (k == "--real") real_dir = value();
    else if (k == "--size") {
      auto parsed = ParseBytes(value());
      if (!parsed.ok() || *parsed == 0) {
        fmt::print(stderr, "--size: {}\n", parsed.ok() ? "must be positive" : parsed.status().ToString());
        return 2;
      }
      size = *parsed;
      size_given = true;
    } else if (k == "--quick") quick = true;
    else if (k == "--dcr-only") dcr_only = true;
    else if (k == "--reps") {
      reps = std::atoi(value().c_str());
      reps_given = true;
      if (reps < 1) {
        fmt::print(stderr, "--reps must be at least 1\n");
        return 2;
      }
    } else if (k == "--sets") {
      only = ",";
      only += value();
      only += ",";
    } else if (k == "--help" || k == "-h") {
      fmt::print(
          "usage: dcr_codec_bench [--dir DIR] [--size 1GB] [--quick] [--reps N] [--sets training-3,stress-5] "
          "[--dcr-only] [--real DIR]\n");
      return 0;
    } else {
      fmt::print(stderr, "unknown option {}\n", k);
      return 2;
    }
  }
  if (quick) {
    if (!size_given) size = 128'000'000;
    if (!reps_given) reps = 1;
  }

  std::vector<DataSet> sets, candidates = AllDataSets(dir, size);
  if (!real_dir.empty())
    for (auto& d : RealDataSets(real_dir)) candidates.push_back(d);
  std::string keys;
  for (auto& d : candidates) {
    keys += (keys.empty() ? "" : ", ") + d.key;
    if (only.empty() || only.find(fmt::format(",{},", d.key)) != std::string::npos) sets.push_back(d);
  }
  if (sets.empty()) {
    fmt::print(stderr, "--sets matches none of {}\n", keys);
    return 2;
  }
  for (auto& d : sets) EnsureGenerated(d, size);

  const size_t threads_all = DefaultThreadCount();
  ThreadPool pool1(0), pool_all(threads_all - 1);
  ThreadPool* pools[2] = {&pool1, &pool_all};
  const int configs = threads_all > 1 ? 2 : 1;

  fmt::print("dcr chunk codec vs baselines: qwen3-moe-like checkpoint pairs, chunks of 2^20 elements\n");
  if (!real_dir.empty())
    fmt::print("real K: training steps K-1 -> K under {} (scripts/train_updates.py: tiny Qwen3-MoE, text, AdamW)\n",
               real_dir);
  fmt::print("machine: {} cores ({}), {} threads for 'all cores'; zstd {}\n", std::thread::hardware_concurrency(),
             CpuModel(), threads_all, ZSTD_versionString());
  fmt::print("load average (1, 5, 15 min) at start: {} (other work on the machine skews timings)\n", LoadAverage());
  fmt::print("timings: best of {} run{}; GB/s of dense base bytes per core (all cores: divided by {} threads)\n", reps,
             reps == 1 ? "" : "s", threads_all);
  if (size < 1'000'000'000 && std::any_of(sets.begin(), sets.end(), [](const DataSet& d) { return !d.real; }))
    fmt::print("NOTE: --size {} is below 1 GB: a smoke run of the synthetic sets, not a recordable result\n",
               FormatBytes(static_cast<double>(size)));
  fmt::print("\n{:<14} {:>10} {:>14} {:>13} {:>9} {:>8} {:>8}  {}\n", "data set", "bytes", "elements", "changed", "%",
             "tensors", "chunks", "dir");
  for (auto& d : sets) {
    auto p = OpenPair(d);
    d.tensors = p->base.size();
    d.chunks = p->chunks.size();
    fmt::print("{:<14} {:>10} {:>14} {:>13} {:>8.3f}% {:>8} {:>8}  {}\n", d.name,
               FormatBytes(static_cast<double>(d.bytes)), d.elements, d.changed,
               100.0 * static_cast<double>(d.changed) / static_cast<double>(d.elements), d.tensors, d.chunks,
               d.real ? d.next_dir : d.dir);
  }

  std::vector<std::string> summaries;
  for (auto& d : sets) {
    std::fflush(stdout);
    fmt::print(stderr, "measuring {} ...\n", d.name);
    auto p = OpenPair(d);
    const size_t nchunks = p->chunks.size();
    const double dense = static_cast<double>(p->bytes);
    std::unique_ptr<uint8_t[]> work(new uint8_t[p->bytes]);

    auto copy_base = [&] {
      pool_all.ParallelFor(p->base.size(), [&](size_t t) {
        const auto src = p->base.Data(t);
        std::memcpy(work.get() + p->work_offset[t], src.data(), src.size());
      });
    };
    auto verify = [&](const char* who) {
      pool_all.ParallelFor(p->base.size(), [&](size_t t) {
        const auto want = p->next.Data(p->next_index[t]);
        if (std::memcmp(work.get() + p->work_offset[t], want.data(), want.size()) != 0)
          Die(fmt::format("{}: {} applied to v0 does not give v1 in tensor {}", d.name, who,
                          p->base.tensors()[t].name));
      });
    };

    // Warm-up (faults the mappings in) and the memory reference: read both, count differing words.
    std::vector<uint64_t> diff_words(nchunks);
    auto read_both = [&] {
      pools[0]->ParallelFor(nchunks, [&](size_t i) {
        const auto a = p->Base(p->chunks[i]);
        const auto b = p->Next(p->chunks[i]);
        uint64_t n = 0;
        for (size_t w = 0; w + 8 <= a.size(); w += 8) n += Load64(a.data() + w) != Load64(b.data() + w);
        diff_words[i] = n;
      });
    };
    read_both();
    copy_base();
    if (dcr_only) {
      std::vector<DcrOut> frames(nchunks);
      std::vector<Digest> digests(nchunks);
      for (size_t i = 0; i < nchunks; ++i) {
        const auto& c = p->chunks[i];
        digests[i] = ChunkDigest(p->keys[c.key], c.wb, c.first_word, p->Base(c));
      }
      // With and without target digests, alternating (the difference is small).
      std::vector<DcrOut> undigested(nchunks);
      Timing enc{1e30, 0}, enc_nd{1e30, 0};
      for (int r = 0; r < reps; ++r) {
        const Timing a = BestOf(
            1, nullptr,
            [&] {
              for (size_t i = 0; i < nchunks; ++i) DcrEncode(*p, p->chunks[i], &frames[i], &digests[i]);
            },
            nullptr);
        const Timing b = BestOf(
            1, nullptr,
            [&] {
              for (size_t i = 0; i < nchunks; ++i) DcrEncode(*p, p->chunks[i], &undigested[i], &digests[i], false);
            },
            nullptr);
        if (a.wall < enc.wall) enc = a;
        if (b.wall < enc_nd.wall) enc_nd = b;
      }
      const Timing dec = BestOf(
          reps, copy_base,
          [&] {
            for (size_t i = 0; i < nchunks; ++i) DcrApply(*p, p->chunks[i], frames[i], work.get());
          },
          [&] { verify("dcr"); });
      uint64_t changed = 0, payload = 0, hash = 0;  // hash: of every frame, equal across builds that encode alike
      for (const auto& f : frames) {
        if (!f.frame) continue;
        changed += f.header.changed;
        payload += f.payload.size();
        const std::string bytes = EncodeFrame(f.header, f.payload);
        hash = Xxh3_64(bytes.data(), bytes.size(), hash);
      }
      auto by_cpu = [&](const Timing& t) { return fmt::format("{:.2f}", dense / t.cpu / 1e9); };
      fmt::print(
          "{}: dcr only: {} changed words, {:.4f} payload bytes per changed, frames hash {:016x}; "
          "encode {} GB/s ({} by CPU time; digests add {:.1f}%), decode+apply {} GB/s ({} by CPU time) "
          "(1 thread)\n",
          d.name, changed, static_cast<double>(payload) / static_cast<double>(changed), hash, Gbps(dense, enc, 1),
          by_cpu(enc), 100.0 * (enc.wall - enc_nd.wall) / enc_nd.wall, Gbps(dense, dec, 1), by_cpu(dec));
      continue;
    }
    const Timing t_read = BestOf(reps, nullptr, read_both, nullptr);
    // The floors, on one thread and on all.
    std::vector<std::vector<uint32_t>> touched(nchunks);
    pool_all.ParallelFor(nchunks, [&](size_t i) { touched[i] = TouchedLines(*p, p->chunks[i], work.get()); });
    Timing enc_floor[2], apply_floor[2];
    std::vector<uint8_t> differ(nchunks);
    for (int k = 0; k < configs; ++k) {
      enc_floor[k] = BestOf(
          reps, nullptr,
          [&] {
            pools[k]->ParallelFor(nchunks, [&](size_t i) {
              const auto& c = p->chunks[i];
              differ[i] = Differ(p->Base(c).data(), p->Next(c).data(), c.bytes);
            });
          },
          nullptr);
      apply_floor[k] = BestOf(
          reps, copy_base,
          [&] { pools[k]->ParallelFor(nchunks, [&](size_t i) { TouchLines(p->chunks[i], touched[i], work.get()); }); },
          nullptr);
    }
    touched.clear();
    touched.shrink_to_fit();
    const Timing t_memcpy = BestOf(
        reps, nullptr,
        [&] {
          for (size_t t = 0; t < p->base.size(); ++t) {
            const auto src = p->next.Data(p->next_index[t]);
            std::memcpy(work.get() + p->work_offset[t], src.data(), src.size());
          }
        },
        nullptr);

    // dcr: digest (a full pass, as at join or audit), encode with tracked
    // digests (steady state), encode computing them, apply.
    std::vector<DcrOut> dcr(nchunks);
    std::vector<Digest> tracked(nchunks);
    const Timing t_digest = BestOf(
        reps, nullptr,
        [&] {
          for (size_t i = 0; i < nchunks; ++i) {
            const auto& c = p->chunks[i];
            tracked[i] = ChunkDigest(p->keys[c.key], c.wb, c.first_word, p->Base(c));
          }
        },
        nullptr);
    Row r_dcr{"dcr"};
    for (int k = 0; k < configs; ++k)
      r_dcr.enc[k] = BestOf(
          reps, nullptr,
          [&] { pools[k]->ParallelFor(nchunks, [&](size_t i) { DcrEncode(*p, p->chunks[i], &dcr[i], &tracked[i]); }); },
          nullptr);
    // What digests add to encode: the same encode without target digests
    // (frames that do not apply), alternating with it, 1 thread.
    Timing t_enc_with{1e30, 0}, t_enc_without{1e30, 0};
    {
      std::vector<DcrOut> scratch(nchunks);
      for (int r = 0; r < reps; ++r) {
        const Timing a = BestOf(
            1, nullptr,
            [&] {
              for (size_t i = 0; i < nchunks; ++i) DcrEncode(*p, p->chunks[i], &scratch[i], &tracked[i]);
            },
            nullptr);
        const Timing b = BestOf(
            1, nullptr,
            [&] {
              for (size_t i = 0; i < nchunks; ++i) DcrEncode(*p, p->chunks[i], &scratch[i], &tracked[i], false);
            },
            nullptr);
        if (a.wall < t_enc_with.wall) t_enc_with = a;
        if (b.wall < t_enc_without.wall) t_enc_without = b;
      }
    }
    const double digests_add = 100.0 * (t_enc_with.wall - t_enc_without.wall) / t_enc_without.wall;
    const Timing t_enc_full = BestOf(
        reps, nullptr,
        [&] { pools[0]->ParallelFor(nchunks, [&](size_t i) { DcrEncode(*p, p->chunks[i], &dcr[i], nullptr); }); },
        nullptr);
    TermsTiming t_terms{1e30, {}};
    for (int r = 0; r < reps; ++r) {
      const TermsTiming t = TimeDigestTerms(*p);
      if (t.seconds < t_terms.seconds) t_terms = t;
    }
    uint64_t changed = 0, frames = 0, payload = 0, headers = 0;
    uint64_t by_kind[4][4] = {};  // [mode][codec]
    for (const auto& f : dcr) {
      if (!f.frame) continue;
      ++frames;
      headers += EncodeFrame(f.header, f.payload).size() - f.payload.size();
      changed += f.header.changed;
      payload += f.payload.size();
      ++by_kind[static_cast<int>(f.header.mode)][static_cast<int>(f.header.codec)];
    }
    r_dcr.bytes = static_cast<double>(payload);
    for (int k = 0; k < configs; ++k)
      r_dcr.dec[k] = BestOf(
          reps, copy_base,
          [&] { pools[k]->ParallelFor(nchunks, [&](size_t i) { DcrApply(*p, p->chunks[i], dcr[i], work.get()); }); },
          [&] { verify("dcr"); });
    std::vector<uint64_t> classed(nchunks);
    const Timing t_class = BestOf(
        reps, copy_base,
        [&] { pools[0]->ParallelFor(nchunks, [&](size_t i) { classed[i] = ClassPass(p->chunks[i], work.get()); }); },
        nullptr);

    // (a) the paper's codec.
    std::vector<PaperOut> paper(nchunks);
    Row r_a{"(a) paper: gaps+xor, zstd-1"};
    for (int k = 0; k < configs; ++k)
      r_a.enc[k] = BestOf(
          reps, nullptr,
          [&] { pools[k]->ParallelFor(nchunks, [&](size_t i) { PaperEncode(*p, p->chunks[i], &paper[i]); }); },
          nullptr);
    uint64_t a_bytes = 0, a_wide = 0;
    for (size_t i = 0; i < nchunks; ++i) {
      const uint32_t want = dcr[i].frame ? dcr[i].header.changed : 0;
      if (paper[i].changed != want)
        Die(fmt::format("{}: chunk {}: baseline (a) finds {} changed words, dcr {}", d.name, i, paper[i].changed,
                        want));
      a_bytes += paper[i].zpos.size() + paper[i].zval.size();
      a_wide += paper[i].width > 2;
    }
    r_a.bytes = static_cast<double>(a_bytes);
    for (int k = 0; k < configs; ++k)
      r_a.dec[k] = BestOf(
          reps, copy_base,
          [&] { pools[k]->ParallelFor(nchunks, [&](size_t i) { PaperApply(p->chunks[i], paper[i], work.get()); }); },
          [&] { verify("baseline (a)"); });
    std::vector<uint64_t> planes(nchunks);
    pool_all.ParallelFor(nchunks, [&](size_t i) { planes[i] = PaperPlanesBytes(*p, p->chunks[i], paper[i]); });
    Row r_a2{"(a') = (a) as byte planes"};
    for (uint64_t x : planes) r_a2.bytes += static_cast<double>(x);
    paper.clear();
    paper.shrink_to_fit();

    // (b) zstd-1 of the dense XOR mask (chunks without a change send nothing).
    std::vector<uint64_t> b_sizes(nchunks);
    Row r_b{"(b) zstd-1 of dense xor"};
    for (int k = 0; k < configs; ++k)
      r_b.enc[k] = BestOf(
          reps, nullptr,
          [&] { pools[k]->ParallelFor(nchunks, [&](size_t i) { b_sizes[i] = DenseXorZstd(*p, p->chunks[i]); }); },
          nullptr);
    for (size_t i = 0; i < nchunks; ++i)
      if (dcr[i].frame) r_b.bytes += static_cast<double>(b_sizes[i]);

    // (c) dense new bits: every chunk's bytes.
    Row r_c{"(c) dense new bits"};
    r_c.bytes = dense;

    // The table.
    const double ch = static_cast<double>(changed);
    fmt::print("\n== {} ({}, {} of {} elements changed = {:.3f}%; dcr frames {} of {} chunks) ==\n", d.name,
               FormatBytes(dense), changed, d.elements, 100.0 * ch / static_cast<double>(d.elements), frames, nchunks);
    if (changed != d.changed)
      fmt::print("  NOTE: changed words {} differ from the generator's changed elements {}\n", changed, d.changed);
    fmt::print("{:<30} {:>10} {:>10} {:>8} | {:>9} {:>9} | {:>10} {:>10}\n", "", "B/changed", "% dense", "vs (a)",
               "enc 1t", fmt::format("enc {}t", threads_all), "apply 1t", fmt::format("apply {}t", threads_all));
    fmt::print("{:<30} {:>10} {:>10} {:>8} | {:>19} | {:>21}\n", "", "", "", "", "GB/s/core", "GB/s/core");
    auto print_row = [&](const Row& row, bool timings) {
      fmt::print("{:<30} {:>10.3f} {:>9.3f}% {:>7.3f}x | {:>9} {:>9} | {:>10} {:>10}\n", row.name, row.bytes / ch,
                 100.0 * row.bytes / dense, row.bytes / r_a.bytes, timings ? Gbps(dense, row.enc[0], 1) : "-",
                 timings && configs > 1 ? Gbps(dense, row.enc[1], threads_all) : "-",
                 timings ? Gbps(dense, row.dec[0], 1) : "-",
                 timings && configs > 1 ? Gbps(dense, row.dec[1], threads_all) : "-");
    };
    print_row(r_dcr, true);
    Row r_dcr_h{fmt::format("dcr incl. frame headers ({:.1f} B each)",
                            frames ? static_cast<double>(headers) / static_cast<double>(frames) : 0.0)};
    r_dcr_h.bytes = static_cast<double>(payload + headers);
    print_row(r_dcr_h, false);
    print_row(r_a, true);
    print_row(r_a2, false);
    print_row(r_b, true);
    print_row(r_c, false);
    std::string mix;
    for (int m = 1; m <= 3; ++m)
      for (int c = 1; c <= 3; ++c)
        if (by_kind[m][c])
          mix += fmt::format("{}{} {}/{}", mix.empty() ? "" : ", ", by_kind[m][c], ModeName(static_cast<Mode>(m)),
                             CodecName(static_cast<Codec>(c)));
    fmt::print("dcr frames: {}; dcr payload {} (+headers {}), (a) {} ({} chunks with gaps wider than 16 bits)\n", mix,
               FormatBytes(static_cast<double>(payload)), FormatBytes(static_cast<double>(payload + headers)),
               FormatBytes(r_a.bytes), a_wide);
    fmt::print(
        "dcr encode above uses tracked chunk digests (a sender's steady state); computing them in the\n"
        "encoder instead (no tracked digests): {} GB/s/core (1 thread). Digest full pass alone: {} GB/s\n"
        "= {:.1f}% of steady-state encode time (needed at join and audits, not per step)\n",
        Gbps(dense, t_enc_full, 1), Gbps(dense, t_digest, 1), 100.0 * t_digest.wall / r_dcr.enc[0].wall);
    {
      // The kernel's sum must be what the frames say the chunks' digests moved by.
      Digest moved;
      for (const auto& f : dcr)
        if (f.frame) moved += f.header.target_digest - f.base_digest;
      if (moved != t_terms.moved)
        Die(fmt::format("{}: the digest terms of the changes do not sum to the frames' digests", d.name));
    }
    fmt::print(
        "digest terms of the changes alone: {:.1f}% of encode time, {:.1f}% of decode+apply time (1 thread; "
        "{:.2f} ns per change); digests add {:.1f}% to encode time (encode with and without target digests, "
        "alternating, 1 thread: the encoder sums the terms of 16-bit add frames while it writes them)\n",
        100.0 * t_terms.seconds / r_dcr.enc[0].wall, 100.0 * t_terms.seconds / r_dcr.dec[0].wall,
        1e9 * t_terms.seconds / static_cast<double>(changed), digests_add);
    fmt::print(
        "memory reference (1 thread): read base+next, count differing 8-byte words {} GB/s; memcpy next {} GB/s\n",
        Gbps(dense, t_read, 1), Gbps(dense, t_memcpy, 1));
    fmt::print(
        "class pass (what a decoder of changes split by the old exponent must add; not built): every target word "
        "read and classed, {} GB/s (1 thread) = {:.0f}% of decode+apply's time\n",
        Gbps(dense, t_class, 1), 100.0 * t_class.wall / r_dcr.dec[0].wall);
    // Against the floors (same bytes: rate ratio = time ratio); targets: at least 0.9.
    std::string vs_floor;
    for (int k = 0; k < configs; ++k) {
      const size_t th = k == 0 ? 1 : threads_all;
      vs_floor += fmt::format(
          "{}{}t: encode {:.2f} of its floor ({} GB/s/core: base and next read in full), decode+apply {:.2f} of its "
          "floor ({} "
          "GB/s/core, "
          "touched lines read and written)",
          k ? "; " : "", th, enc_floor[k].wall / r_dcr.enc[k].wall, Gbps(dense, enc_floor[k], th),
          apply_floor[k].wall / r_dcr.dec[k].wall, Gbps(dense, apply_floor[k], th));
    }
    fmt::print("dcr against the floors (target: at least 0.90): {}\n", vs_floor);
    summaries.push_back(fmt::format(
        "{}: dcr {:.2f} B/changed ({:.2f}x of (a)); encode {} GB/s/core ({} computing digests); "
        "decode+apply {} GB/s/core; vs floors: encode {:.2f}{}, decode+apply {:.2f}{}; "
        "digests add {:.1f}% to encode (terms alone {:.0f}%); full digest pass {:.0f}% of encode",
        d.name, r_dcr.bytes / ch, r_dcr.bytes / r_a.bytes, Gbps(dense, r_dcr.enc[0], 1), Gbps(dense, t_enc_full, 1),
        Gbps(dense, r_dcr.dec[0], 1), enc_floor[0].wall / r_dcr.enc[0].wall,
        configs > 1 ? fmt::format(" ({}t {:.2f})", threads_all, enc_floor[1].wall / r_dcr.enc[1].wall) : "",
        apply_floor[0].wall / r_dcr.dec[0].wall,
        configs > 1 ? fmt::format(" ({}t {:.2f})", threads_all, apply_floor[1].wall / r_dcr.dec[1].wall) : "",
        digests_add, 100.0 * t_terms.seconds / r_dcr.enc[0].wall, 100.0 * t_digest.wall / r_dcr.enc[0].wall));
  }
  fmt::print("\nload average at end: {}\n", LoadAverage());
  fmt::print("\nsummary (throughputs with 1 thread):\n");
  for (const auto& s : summaries) fmt::print("{}\n", s);
  if (g_busy_seen)
    fmt::print(
        "\n* the best run got under {:.0f}% of its threads' time on a CPU (other work on the machine): the figure\n"
        "  understates; rerun on a quiet machine or with more --reps\n",
        100 * kBusyShare);
  return 0;
}
