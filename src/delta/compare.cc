#include "dcr/compare.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "dcr/progress.h"
#include "dcr/thread_pool.h"
#include "kernels.h"

namespace dcr {
namespace {

struct Fields {
  uint64_t sign, exponent, mantissa;
};

Fields FieldMasks(const DTypeInfo& info, uint32_t bits) {
  if (info.kind != DTypeKind::kFloat && info.kind != DTypeKind::kComplex) return {0, 0, 0};
  const uint64_t mant = (1ull << info.mantissa_bits) - 1;
  const uint64_t exp = ((1ull << info.exponent_bits) - 1) << info.mantissa_bits;
  const uint64_t sign = info.sign_bits ? 1ull << (bits - 1) : 0;
  return {sign, exp, mant};
}

// Element i of a densely packed sub-byte tensor (bits < 8).
inline uint64_t PackedElement(const uint8_t* p, uint64_t i, uint32_t bits) {
  const uint64_t bit = i * bits;
  const uint64_t byte = bit / 8;
  uint32_t word = p[byte];
  if ((bit % 8) + bits > 8) word |= static_cast<uint32_t>(p[byte + 1]) << 8;
  return (word >> (bit % 8)) & ((1u << bits) - 1);
}

void ComparePacked(const DTypeInfo& info, const uint8_t* a, const uint8_t* b, uint64_t n, BitDiffStats* out) {
  const Fields f = FieldMasks(info, info.bits);
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t va = PackedElement(a, i, info.bits), vb = PackedElement(b, i, info.bits);
    const uint64_t x = va ^ vb;
    if (x == 0) continue;
    if (out->first_changed == std::numeric_limits<uint64_t>::max()) out->first_changed = i;
    ++out->changed;
    out->sign_changed += (x & f.sign) != 0;
    out->exponent_changed += (x & f.exponent) != 0;
    out->mantissa_changed += (x & f.mantissa) != 0;
    const uint64_t ia = OrderedImage(va, info.bits), ib = OrderedImage(vb, info.bits);
    out->max_ulp = std::max(out->max_ulp, ia > ib ? ia - ib : ib - ia);
  }
}

// C64: an element is two F32 lanes; it changed if either lane did.
void CompareComplex(const uint8_t* a, const uint8_t* b, uint64_t n, BitDiffStats* out) {
  const Fields f = FieldMasks(Info(DType::kF32), 32);
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t la[2], lb[2];
    std::memcpy(la, a + 8 * i, 8);
    std::memcpy(lb, b + 8 * i, 8);
    const uint32_t x0 = la[0] ^ lb[0], x1 = la[1] ^ lb[1];
    if ((x0 | x1) == 0) continue;
    if (out->first_changed == std::numeric_limits<uint64_t>::max()) out->first_changed = i;
    ++out->changed;
    out->sign_changed += ((x0 | x1) & f.sign) != 0;
    out->exponent_changed += (((x0 & f.exponent) | (x1 & f.exponent))) != 0;
    out->mantissa_changed += (((x0 & f.mantissa) | (x1 & f.mantissa))) != 0;
    for (int l = 0; l < 2; ++l) {
      const uint64_t ia = OrderedImage(la[l], 32), ib = OrderedImage(lb[l], 32);
      out->max_ulp = std::max(out->max_ulp, ia > ib ? ia - ib : ib - ia);
    }
  }
}

}  // namespace

void BitDiffStats::Append(const BitDiffStats& o) {
  if (first_changed == std::numeric_limits<uint64_t>::max() && o.first_changed != std::numeric_limits<uint64_t>::max())
    first_changed = elements + o.first_changed;
  elements += o.elements;
  changed += o.changed;
  sign_changed += o.sign_changed;
  exponent_changed += o.exponent_changed;
  mantissa_changed += o.mantissa_changed;
  max_ulp = std::max(max_ulp, o.max_ulp);
}

BitDiffStats CompareBits(DType dtype, uint64_t numel, std::span<const uint8_t> a, std::span<const uint8_t> b) {
  BitDiffStats out;
  out.elements = numel;
  const DTypeInfo& info = Info(dtype);
  if (info.kind == DTypeKind::kComplex) {
    CompareComplex(a.data(), b.data(), numel, &out);
    return out;
  }
  if (info.bits < 8) {
    ComparePacked(info, a.data(), b.data(), numel, &out);
    return out;
  }
  const Fields f = FieldMasks(info, info.bits);
  using kernels::Image;
  const Image image = info.kind == DTypeKind::kFloat    ? (info.sign_bits ? Image::kFloat : Image::kUnsigned)
                      : info.kind == DTypeKind::kSigned ? Image::kSigned
                                                        : Image::kUnsigned;
  kernels::Kernels().compare(info.bits, image, a.data(), b.data(), numel, f.sign, f.exponent, f.mantissa, &out);
  return out;
}

CheckpointDiff DiffCheckpoints(const Checkpoint& a, const Checkpoint& b, Progress* progress, ThreadPool* pool) {
  CheckpointDiff diff;
  struct Piece {
    size_t tensor;  // index into diff.tensors
    size_t ia, ib;  // tensor indices in a and b
    uint64_t begin, n;  // element range
  };
  std::vector<Piece> pieces;
  std::vector<size_t> first_piece;
  // Pieces of at most 2^20 elements (sub-byte types: a multiple of 8 so
  // pieces start on byte boundaries).
  constexpr uint64_t kPiece = 1ull << 20;
  for (size_t ia = 0; ia < a.size(); ++ia) {
    const TensorInfo& ta = a.tensors()[ia];
    const int64_t ib = b.Find(ta.name);
    if (ib < 0) {
      diff.only_in_a.push_back(ta.name);
      continue;
    }
    const TensorInfo& tb = b.tensors()[static_cast<size_t>(ib)];
    if (ta.dtype != tb.dtype || ta.shape != tb.shape) {
      diff.mismatched.push_back(fmt::format("{}: {}[{}] vs {}[{}]", ta.name, Name(ta.dtype), fmt::join(ta.shape, ","),
                                            Name(tb.dtype), fmt::join(tb.shape, ",")));
      continue;
    }
    diff.tensors.push_back({ta.name, ta.dtype, {}});
    first_piece.push_back(pieces.size());
    for (uint64_t begin = 0; begin < ta.numel || begin == 0; begin += kPiece) {
      pieces.push_back(
          {diff.tensors.size() - 1, ia, static_cast<size_t>(ib), begin, std::min(kPiece, ta.numel - begin)});
      if (ta.numel == 0) break;
    }
  }
  for (const auto& tb : b.tensors())
    if (a.Find(tb.name) < 0) diff.only_in_b.push_back(tb.name);

  std::vector<BitDiffStats> results(pieces.size());
  (pool ? *pool : DefaultPool()).ParallelFor(pieces.size(), [&](size_t i) {
    const Piece& p = pieces[i];
    const DType dtype = a.tensors()[p.ia].dtype;
    const uint32_t bits = BitsPerElement(dtype);
    const uint64_t off = p.begin * bits / 8, len = p.n * bits / 8;
    results[i] = CompareBits(dtype, p.n, a.Data(p.ia).subspan(off, len), b.Data(p.ib).subspan(off, len));
    if (progress) progress->Add(len);
  });
  for (size_t t = 0; t < diff.tensors.size(); ++t) {
    const size_t end = t + 1 < first_piece.size() ? first_piece[t + 1] : pieces.size();
    for (size_t i = first_piece[t]; i < end; ++i) diff.tensors[t].stats.Append(results[i]);
    BitDiffStats s = diff.tensors[t].stats;
    s.first_changed = std::numeric_limits<uint64_t>::max();
    diff.total.Append(s);
  }
  diff.total.first_changed = std::numeric_limits<uint64_t>::max();
  return diff;
}

}  // namespace dcr
