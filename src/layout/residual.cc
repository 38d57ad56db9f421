// Residual tensors: full-chunk overwrites, sender conversions, and the block FP8 quantizer.
#include "dcr/layout_residual.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dcr/dtype.h"

namespace dcr {
namespace {

float LoadFloat(DType dtype, const uint8_t* p) {
  uint32_t bits = 0;
  if (dtype == DType::kBF16) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    bits = uint32_t{h} << 16;
  } else {
    std::memcpy(&bits, p, 4);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

Status CheckSourceDType(DType dtype) {
  if (dtype != DType::kBF16 && dtype != DType::kF32)
    return InvalidArgument(fmt::format("block FP8 quantization reads BF16 or F32, not {}", Name(dtype)));
  return Status::Ok();
}

// Quantizes `n` values of one block (already divided into rows of `cols`
// values each) and returns its scale.
float QuantizeValues(const float* x, uint64_t n, uint8_t* q) {
  float amax = 0;
  for (uint64_t i = 0; i < n; ++i)
    if (std::isfinite(x[i])) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax > 0 ? amax / 448.0f : 1.0f;
  for (uint64_t i = 0; i < n; ++i) q[i] = Fp32ToE4m3(std::isfinite(x[i]) ? x[i] / scale : x[i]);
  return scale;
}

}  // namespace

uint8_t Fp32ToE4m3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t a = bits & 0x7FFFFFFF;
  if (a > 0x7F800000) return sign | 0x7F;  // NaN
  if (a >= 0x43E00000) return sign | 0x7E;  // 448 and above, infinities included: saturate
  if (a < 0x3C800000) {  // below 2^-6: subnormal steps of 2^-9 (8 is the smallest normal, 0x08)
    float f;
    std::memcpy(&f, &a, 4);
    return sign | static_cast<uint8_t>(std::nearbyint(f * 512.0f));
  }
  // Normal: 3 of the 23 mantissa bits kept, rounded to nearest even (a carry
  // moves into the exponent); E4M3's exponent bias is 7, FP32's 127.
  const uint32_t rounded = a + 0x7FFFF + ((a >> 20) & 1);
  return sign | static_cast<uint8_t>(std::min<uint32_t>((rounded >> 20) - (120u << 3), 0x7E));
}

Status QuantizeFp8Blocks(DType dtype, std::span<const uint8_t> src, const Fp8BlockShape& s, std::span<uint8_t> fp8,
                         std::span<uint8_t> scales) {
  DCR_RETURN_IF_ERROR(CheckSourceDType(dtype));
  const uint64_t eb = BitsPerElement(dtype) / 8, n = s.rows * s.cols;
  if (s.block == 0) return InvalidArgument("block FP8: block size 0");
  if (src.size() != n * eb || fp8.size() != n || scales.size() != s.scale_rows() * s.scale_cols() * 4)
    return InvalidArgument(
        fmt::format("block FP8: sizes for [{}, {}] blocks of {}: source {} (want {}), fp8 {} (want {}), "
                    "scales {} (want {})",
                    s.rows, s.cols, s.block, src.size(), n * eb, fp8.size(), n, scales.size(),
                    s.scale_rows() * s.scale_cols() * 4));
  for (uint64_t br = 0; br < s.scale_rows(); ++br)
    for (uint64_t bc = 0; bc < s.scale_cols(); ++bc) QuantizeFp8Block(dtype, src, s, br, bc, fp8, scales);
  return Status::Ok();
}

void QuantizeFp8Block(DType dtype, std::span<const uint8_t> src, const Fp8BlockShape& s, uint64_t br, uint64_t bc,
                      std::span<uint8_t> fp8, std::span<uint8_t> scales) {
  const uint64_t eb = BitsPerElement(dtype) / 8, r0 = br * s.block, c0 = bc * s.block;
  const uint64_t nr = std::min(s.block, s.rows - r0), nc = std::min(s.block, s.cols - c0);
  thread_local std::vector<float> x;
  thread_local std::vector<uint8_t> q;
  x.resize(nr * nc);
  q.resize(nr * nc);
  for (uint64_t r = 0; r < nr; ++r)
    for (uint64_t c = 0; c < nc; ++c) x[r * nc + c] = LoadFloat(dtype, src.data() + ((r0 + r) * s.cols + c0 + c) * eb);
  const float scale = QuantizeValues(x.data(), x.size(), q.data());
  std::memcpy(scales.data() + (br * s.scale_cols() + bc) * 4, &scale, 4);
  for (uint64_t r = 0; r < nr; ++r) std::memcpy(fp8.data() + (r0 + r) * s.cols + c0, q.data() + r * nc, nc);
}

Result<OwnedFrames> EncodeFullChunkOverwrites(const DeltaManifest& manifest,
                                              std::span<const ChunkContribution> contributions,
                                              const EncodeOptions& options) {
  if (manifest.delta_class != DeltaClass::kOverwrite)
    return InvalidArgument("a residual delta is of overwrite class; start it with DeltaClass::kOverwrite");
  // Merge as usual (coverage checks, base digests, the new bits) ...
  DCR_ASSIGN_OR_RETURN(OwnedFrames merged, EncodeOwnedChunks(manifest, contributions, options));
  // ... and re-encode every chunk of each changed tensor with every word in
  // its frame: against a base that differs in every word (each byte
  // inverted), whose digest makes the encoder's target the real one.
  std::vector<bool> tensor_changed(manifest.tensors.size(), false);
  for (const ChunkContribution& c : contributions)
    if (!c.positions.empty()) tensor_changed[c.tensor] = true;
  std::map<ChunkId, std::vector<const ChunkContribution*>> by_chunk;
  for (const ChunkContribution& c : contributions) by_chunk[ChunkId{c.tensor, c.chunk}].push_back(&c);
  EncodeOptions opt = options;
  opt.delta_class = DeltaClass::kOverwrite;
  OwnedFrames out;
  ChunkEncoder encoder;
  EncodedChunk encoded;
  std::vector<uint8_t> next, base;
  for (size_t i = 0; i < merged.chunks.size(); ++i) {
    const ChunkId id = merged.chunks[i];
    out.chunks.push_back(id);
    out.base_digests.push_back(merged.base_digests[i]);
    out.target_digests.push_back(merged.target_digests[i]);
    if (!tensor_changed[id.tensor]) {
      out.frame_of.push_back(-1);
      continue;
    }
    const DeltaTensor& tensor = manifest.tensors[id.tensor];
    uint64_t first_word, words;
    uint32_t elements;
    manifest.ChunkWords(id.tensor, id.chunk, &first_word, &words, &elements);
    const uint64_t eb = BitsPerElement(tensor.dtype) / 8;
    next.assign(uint64_t{elements} * eb, 0);
    for (const ChunkContribution* c : by_chunk[id]) {
      uint64_t at = 0;
      for (auto [lo, len] : c->covered) {
        std::memcpy(next.data() + uint64_t{lo} * eb, c->covered_bits.data() + at * eb, uint64_t{len} * eb);
        at += len;
      }
    }
    base.resize(next.size());
    for (size_t k = 0; k < next.size(); ++k) base[k] = static_cast<uint8_t>(~next[k]);
    const DigestKey key = MakeDigestKey(tensor.name);
    const uint64_t first = uint64_t{id.chunk} * manifest.chunk_elements;
    const Digest fake = DigestBytes(key, first * eb, base);
    ChunkInput in{tensor.dtype, key, first_word, elements, base, next, &fake};
    DCR_ASSIGN_OR_RETURN(bool changed, encoder.Encode(in, opt, &encoded));
    if (!changed || encoded.header.target_digest != merged.target_digests[i] || encoded.header.changed != words)
      return Internal(fmt::format("tensor '{}' chunk {}: the full-chunk overwrite does not reach the chunk's digest",
                                  tensor.name, id.chunk));
    encoded.header.tensor = id.tensor;
    encoded.header.chunk = id.chunk;
    out.frame_of.push_back(static_cast<int64_t>(out.frames.size()));
    out.frames.push_back(EncodeFrame(encoded.header, encoded.payload));
  }
  return out;
}

Status ConvertToCanonical(const SenderConversion& c, DType canonical, std::span<const uint8_t> buffer,
                          std::span<uint8_t> out) {
  const std::string what = fmt::format("converted tensor '{}'", c.tensor);
  if ((c.buffer_dtype != DType::kBF16 && c.buffer_dtype != DType::kF32) ||
      (canonical != DType::kBF16 && canonical != DType::kF32))
    return InvalidArgument(fmt::format("{}: conversions read and write BF16 or F32, not {} -> {}", what,
                                       Name(c.buffer_dtype), Name(canonical)));
  const uint64_t ib = BitsPerElement(c.buffer_dtype) / 8, ob = BitsPerElement(canonical) / 8;
  if (buffer.size() % ib != 0 || out.size() != buffer.size() / ib * ob)
    return InvalidArgument(
        fmt::format("{}: {} buffer bytes do not match {} canonical bytes", what, buffer.size(), out.size()));
  const uint64_t n = buffer.size() / ib;
  for (uint64_t i = 0; i < n; ++i) {
    float f = LoadFloat(c.buffer_dtype, buffer.data() + i * ib);
    if (c.kind == ConversionKind::kZeroCentred) f += 1.0f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if (canonical == DType::kBF16) {
      const uint16_t h = Fp32BitsToBf16Bits(bits);
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &bits, 4);
    }
  }
  return Status::Ok();
}

Result<std::vector<ChunkContribution>> ProjectConverted(const SenderConversion& c, std::span<const uint8_t> baseline,
                                                        std::span<const uint8_t> current, uint32_t index,
                                                        const DeltaManifest& manifest) {
  uint32_t t = 0;
  while (t < manifest.tensors.size() && manifest.tensors[t].name != c.tensor) ++t;
  if (t == manifest.tensors.size())
    return NotFound(
        fmt::format("converted tensor '{}' is not in the delta; put it in the residual delta's manifest", c.tensor));
  const DeltaTensor& tensor = manifest.tensors[t];
  const uint64_t eb = BitsPerElement(tensor.dtype) / 8;
  std::vector<uint8_t> old_bits(tensor.elements * eb), new_bits(tensor.elements * eb);
  DCR_RETURN_IF_ERROR(ConvertToCanonical(c, tensor.dtype, baseline, old_bits));
  DCR_RETURN_IF_ERROR(ConvertToCanonical(c, tensor.dtype, current, new_bits));
  const DigestKey key = MakeDigestKey(tensor.name);
  const bool overwrite = manifest.delta_class == DeltaClass::kOverwrite;
  std::vector<ChunkContribution> out;
  for (uint64_t chunk = 0, n = manifest.ChunkCount(t); chunk < n; ++chunk) {
    const uint64_t first = chunk * manifest.chunk_elements;
    const uint64_t count = std::min(manifest.chunk_elements, tensor.elements - first);
    ChunkContribution cc;
    cc.tensor = t;
    cc.chunk = static_cast<uint32_t>(chunk);
    cc.from = index;
    cc.covered = {{0, static_cast<uint32_t>(count)}};
    const uint8_t* b = old_bits.data() + first * eb;
    const uint8_t* x = new_bits.data() + first * eb;
    cc.base_digest = DigestBytes(key, first * eb, {b, count * eb});
    if (overwrite) cc.covered_bits.assign(x, x + count * eb);
    for (uint64_t e = 0; e < count; ++e)
      if (std::memcmp(b + e * eb, x + e * eb, eb) != 0) {
        cc.positions.push_back(static_cast<uint32_t>(e));
        cc.old_bits.insert(cc.old_bits.end(), b + e * eb, b + (e + 1) * eb);
        cc.new_bits.insert(cc.new_bits.end(), x + e * eb, x + (e + 1) * eb);
      }
    out.push_back(std::move(cc));
  }
  return out;
}

}  // namespace dcr
