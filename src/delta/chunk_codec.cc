#include "dcr/chunk_codec.h"

#include <fmt/format.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "bitstream.h"
#include "kernels.h"

namespace dcr {
namespace {

// ---- words and their order-preserving images (add mode) --------------------

enum class WordImage { kSignMagnitude, kTwosComplement, kPlain };

WordImage ImageKind(DType dtype) {
  const DTypeInfo& info = Info(dtype);
  if (info.bits < 8) return WordImage::kPlain;  // packed F4/F6 bytes hold several elements
  if ((info.kind == DTypeKind::kFloat || info.kind == DTypeKind::kComplex) && info.sign_bits)
    return WordImage::kSignMagnitude;
  if (info.kind == DTypeKind::kSigned) return WordImage::kTwosComplement;
  return WordImage::kPlain;
}

inline uint64_t Mask(uint32_t bits) { return bits >= 64 ? ~0ull : (1ull << bits) - 1; }

inline uint64_t ToImage(uint64_t x, uint32_t bits, WordImage kind) {
  switch (kind) {
    case WordImage::kSignMagnitude: return OrderedImage(x, bits);
    case WordImage::kTwosComplement: return x ^ (1ull << (bits - 1));
    case WordImage::kPlain: return x;
  }
  return x;
}
inline uint64_t FromImage(uint64_t y, uint32_t bits, WordImage kind) {
  switch (kind) {
    case WordImage::kSignMagnitude: return FromOrderedImage(y, bits);
    case WordImage::kTwosComplement: return y ^ (1ull << (bits - 1));
    case WordImage::kPlain: return y;
  }
  return y;
}

inline uint64_t LoadWord(const uint8_t* p, uint32_t wb) {
  uint64_t v = 0;
  std::memcpy(&v, p, wb);  // little-endian host (see frame.cc)
  return v;
}
inline void StoreWord(uint8_t* p, uint32_t wb, uint64_t v) { std::memcpy(p, &v, wb); }

// A nonzero `bits`-wide wrapped difference as (negative, magnitude - 1);
// the most negative difference has magnitude 2^(bits-1).
inline void SplitSigned(uint64_t d, uint32_t bits, bool* negative, uint64_t* magnitude_minus_1) {
  *negative = (d >> (bits - 1)) & 1;
  *magnitude_minus_1 = (*negative ? ((~d + 1) & Mask(bits)) : d) - 1;
}
inline uint64_t JoinSigned(bool negative, uint64_t magnitude_minus_1, uint32_t bits) {
  const uint64_t magnitude = magnitude_minus_1 + 1;
  return (negative ? (~magnitude + 1) : magnitude) & Mask(bits);
}

inline uint32_t BitLength(uint64_t x) { return x == 0 ? 0 : 64 - static_cast<uint32_t>(__builtin_clzll(x)); }

// ---- Rice codes with an escape ---------------------------------------------

// A quotient of kEscape zeros announces a raw value instead.
constexpr uint32_t kEscape = 32;
constexpr uint32_t kMaxRiceK = 56;

inline void PutRaw(BitWriter& w, uint64_t v, uint32_t bits) {
  if (bits > 57) {
    w.Put(v & 0xFFFFFFFFu, 32);
    w.Put(v >> 32, bits - 32);
  } else {
    w.Put(v, bits);
  }
}
inline uint64_t GetRaw(BitReader& r, uint32_t bits) {
  if (bits > 57) {
    const uint64_t lo = r.Get(32);
    return lo | (r.Get(bits - 32) << 32);
  }
  return r.Get(bits);
}

inline void PutRice(BitWriter& w, uint64_t v, uint32_t k, uint32_t escape_bits) {
  const uint64_t q = v >> k;
  if (q < kEscape) {
    w.Put(1ull << q, static_cast<uint32_t>(q) + 1);  // q zeros, then a one
    PutRaw(w, v, k);
  } else {
    w.Put(1ull << kEscape, kEscape + 1);
    PutRaw(w, v, escape_bits);
  }
}
inline uint64_t RiceBits(uint64_t v, uint32_t k, uint32_t escape_bits) {
  const uint64_t q = v >> k;
  return q < kEscape ? q + 1 + k : kEscape + 1 + escape_bits;
}
// False on a malformed code.
inline bool GetRice(BitReader& r, uint32_t k, uint32_t escape_bits, uint64_t* v) {
  const uint64_t peek = r.Peek();
  if (peek == 0) return false;
  const uint32_t q = static_cast<uint32_t>(__builtin_ctzll(peek));
  if (q > kEscape) return false;
  r.Skip(q + 1);
  if (q == kEscape) {
    *v = GetRaw(r, escape_bits);
  } else {
    *v = (static_cast<uint64_t>(q) << k) | GetRaw(r, k);
  }
  return true;
}

// Exp-Golomb of order k: u = v + 2^k has L bits; L-1-k zeros, a one, then the
// low L-1 bits of u. Short for small values, logarithmic for the tail. A run
// of kEscape zeros announces `escape_bits` raw bits instead.
inline void PutExpGolomb(BitWriter& w, uint64_t v, uint32_t k, uint32_t escape_bits) {
  const uint64_t u = v + (1ull << k);
  const uint32_t len = u < v ? 65 : BitLength(u);  // u < v: overflowed 64 bits
  const uint32_t zeros = len - 1 - k;
  if (zeros < kEscape && len <= 64) {
    w.Put(1ull << zeros, zeros + 1);
    PutRaw(w, u, len - 1);
  } else {
    w.Put(1ull << kEscape, kEscape + 1);
    PutRaw(w, v, escape_bits);
  }
}
inline uint64_t ExpGolombBits(uint64_t v, uint32_t k, uint32_t escape_bits) {
  const uint64_t u = v + (1ull << k);
  const uint32_t len = u < v ? 65 : BitLength(u);
  const uint32_t zeros = len - 1 - k;
  return zeros < kEscape && len <= 64 ? 2 * zeros + 1 + k : kEscape + 1 + escape_bits;
}
inline bool GetExpGolomb(BitReader& r, uint32_t k, uint32_t escape_bits, uint64_t* v) {
  const uint64_t peek = r.Peek();
  if (peek == 0) return false;
  const uint32_t zeros = static_cast<uint32_t>(__builtin_ctzll(peek));
  if (zeros > kEscape) return false;
  r.Skip(zeros + 1);
  if (zeros == kEscape) {
    *v = GetRaw(r, escape_bits);
    return true;
  }
  const uint32_t low = zeros + k;  // bits below u's top bit
  if (low >= 64) return false;
  const uint64_t u = (1ull << low) | GetRaw(r, low);
  *v = u - (1ull << k);
  return true;
}

// The Exp-Golomb order (0..max_k) minimising the total size, and that size.
template <typename Get>
std::pair<uint32_t, uint64_t> ChooseExpGolomb(size_t n, Get get, uint32_t escape_bits, uint32_t max_k) {
  std::pair<uint32_t, uint64_t> best{0, ~0ull};
  for (uint32_t k = 0; k <= max_k; ++k) {
    uint64_t bits = 0;
    for (size_t i = 0; i < n; ++i) bits += ExpGolombBits(get(i), k, escape_bits);
    if (bits < best.second) best = {k, bits};
  }
  return best;
}

// The Rice parameter minimising the total size of `values`, and that size.
struct RiceChoice {
  uint32_t k;
  uint64_t bits;
};
template <typename Get>
RiceChoice ChooseRice(size_t n, Get get, uint32_t escape_bits, uint32_t max_k) {
  long double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += static_cast<long double>(get(i));
  const double mean = n ? static_cast<double>(sum / static_cast<long double>(n)) : 0.0;
  const int guess = mean > 1 ? static_cast<int>(std::floor(std::log2(mean * 0.6931))) : 0;
  RiceChoice best{0, ~0ull};
  for (int k = std::max(0, guess - 1); k <= std::min<int>(static_cast<int>(max_k), guess + 1); ++k) {
    uint64_t bits = 0;
    for (size_t i = 0; i < n; ++i) bits += RiceBits(get(i), static_cast<uint32_t>(k), escape_bits);
    if (bits < best.bits) best = {static_cast<uint32_t>(k), bits};
  }
  return best;
}

// ---- sparse payload layout ---------------------------------------------------

enum class ValueCoding : uint8_t {
  kRaw = 0,      // word bits as they are (overwrite: the new word)
  kSignExpGolomb = 1,  // add: the sign bit, then Exp-Golomb of |delta| - 1
  kXorLength = 2,  // xor: Exp-Golomb of bit length - 1, then the bits below the top one
};
constexpr size_t kSparsePrefix = 4;  // value coding, gap k, value k, reserved

// Iterates the digest position hashes for increasing word indices.
class PositionHashCursor {
 public:
  explicit PositionHashCursor(const DigestKey& key)
      : key_(key), t0_(kernels::DigestTable(0)), t1_(kernels::DigestTable(1)) {}
  void At(uint64_t index, uint64_t* h0, uint64_t* h1) {
    const uint64_t block = index / kernels::kDigestBlock;
    if (block != block_) {
      block_ = block;
      s0_ = kernels::BlockSeed(key_.seed[0], block);
      s1_ = kernels::BlockSeed(key_.seed[1], block);
    }
    const uint64_t j = index % kernels::kDigestBlock;
    *h0 = (t0_[j] ^ s0_) | 1;
    *h1 = (t1_[j] ^ s1_) | 1;
  }

 private:
  DigestKey key_;
  const uint64_t *t0_, *t1_;
  uint64_t block_ = ~0ull, s0_ = 0, s1_ = 0;
};

Digest ChunkDigest(const DigestKey& key, uint32_t wb, uint64_t first_word, std::span<const uint8_t> bytes) {
  return DigestWords(key, wb, first_word, bytes);
}

}  // namespace

// ============================================================================

Result<bool> ChunkEncoder::Encode(const ChunkInput& in, const EncodeOptions& opt, EncodedChunk* out) {
  const uint32_t wb = WordBytes(in.dtype);
  const uint32_t bits = wb * 8;
  const auto chunk_bytes = ByteSize(in.dtype, in.elements);
  if (!chunk_bytes || in.base.size() != *chunk_bytes || in.next.size() != *chunk_bytes)
    return InvalidArgument(fmt::format("chunk of {} {} elements needs {} bytes, got base {} and next {}", in.elements,
                                       Name(in.dtype), chunk_bytes.value_or(0), in.base.size(), in.next.size()));
  const uint32_t words = static_cast<uint32_t>(*chunk_bytes / wb);
  const auto& k = kernels::Kernels();

  out->base_digest = ChunkDigest(in.key, wb, in.first_word, in.base);
  positions_.resize(words);
  const uint32_t n = k.find_changes(wb, in.base.data(), in.next.data(), words, positions_.data());
  positions_.resize(n);
  if (n == 0) return false;

  // Digest of the target from the changes alone.
  Digest target = out->base_digest;
  {
    PositionHashCursor cursor(in.key);
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t p = positions_[i];
      const uint64_t d = LoadWord(in.next.data() + size_t{p} * wb, wb) - LoadWord(in.base.data() + size_t{p} * wb, wb);
      uint64_t h0, h1;
      cursor.At(in.first_word + p, &h0, &h1);
      target.lane[0] += h0 * d;
      target.lane[1] += h1 * d;
    }
  }

  auto gap = [&](size_t i) -> uint64_t { return i == 0 ? positions_[0] : positions_[i] - positions_[i - 1] - 1; };
  const RiceChoice gaps = ChooseRice(n, gap, 32, 31);
  const uint64_t dense_bytes = uint64_t{words} * wb;
  const WordImage image = ImageKind(in.dtype);
  auto old_word = [&](size_t i) { return LoadWord(in.base.data() + size_t{positions_[i]} * wb, wb); };
  auto new_word = [&](size_t i) { return LoadWord(in.next.data() + size_t{positions_[i]} * wb, wb); };

  // Candidates within the class: (mode, value coding, value k, payload bytes).
  struct Candidate {
    Mode mode;
    ValueCoding coding;
    uint32_t value_k;
    uint64_t bytes;
  };
  std::vector<Candidate> sparse;
  if (opt.delta_class == DeltaClass::kOverwrite) {
    sparse.push_back({Mode::kOverwrite, ValueCoding::kRaw, 0, kSparsePrefix + (gaps.bits + uint64_t{n} * bits + 7) / 8});
  } else {
    if (opt.allow_add) {
      values_.resize(n);
      negative_.resize(n);
      for (uint32_t i = 0; i < n; ++i) {
        bool neg;
        SplitSigned((ToImage(new_word(i), bits, image) - ToImage(old_word(i), bits, image)) & Mask(bits), bits, &neg,
                    &values_[i]);
        negative_[i] = neg;
      }
      const auto [k_v, v_bits] = ChooseExpGolomb(n, [&](size_t i) { return values_[i]; }, bits, 4);
      sparse.push_back({Mode::kAdd, ValueCoding::kSignExpGolomb, k_v, kSparsePrefix + (gaps.bits + n + v_bits + 7) / 8});
    }
    if (opt.allow_xor) {
      uint64_t low_bits = 0;
      const auto [k_v, v_bits] = ChooseExpGolomb(
          n, [&](size_t i) { return uint64_t{BitLength(old_word(i) ^ new_word(i))} - 1; }, 8, 4);
      for (uint32_t i = 0; i < n; ++i) low_bits += BitLength(old_word(i) ^ new_word(i)) - 1;
      sparse.push_back({Mode::kXor, ValueCoding::kXorLength, k_v, kSparsePrefix + (gaps.bits + v_bits + low_bits + 7) / 8});
    }
    if (sparse.empty()) return InvalidArgument("xor-class delta with both xor and add disabled");
  }
  const Candidate best = *std::min_element(sparse.begin(), sparse.end(),
                                           [](const Candidate& a, const Candidate& b) { return a.bytes < b.bytes; });

  FrameHeader& h = out->header;
  h = FrameHeader{};
  h.elements = in.elements;
  h.words = words;
  h.changed = n;
  h.dtype = in.dtype;
  h.word_bytes = static_cast<uint8_t>(wb);
  h.base_digest = out->base_digest;
  h.target_digest = target;
  h.mode = best.mode;

  // Dense layout in the chosen mode: needed for raw, and for zstd when the
  // sparse form is not clearly smaller.
  auto dense_value = [&](uint64_t o, uint64_t nw) -> uint64_t {
    switch (best.mode) {
      case Mode::kXor: return o ^ nw;
      case Mode::kAdd: return (ToImage(nw, bits, image) - ToImage(o, bits, image)) & Mask(bits);
      case Mode::kOverwrite: return nw;
    }
    return nw;
  };
  if (best.bytes >= dense_bytes || static_cast<double>(best.bytes) > opt.zstd_when_sparse_above * static_cast<double>(dense_bytes)) {
    scratch_.resize(dense_bytes);
    if (best.mode == Mode::kOverwrite) {
      std::memcpy(scratch_.data(), in.next.data(), dense_bytes);
    } else {
      std::memset(scratch_.data(), 0, dense_bytes);
      for (uint32_t i = 0; i < n; ++i)
        StoreWord(scratch_.data() + size_t{positions_[i]} * wb, wb, dense_value(old_word(i), new_word(i)));
    }
    std::vector<uint8_t>& payload = out->payload;
    payload.resize(ZSTD_compressBound(dense_bytes));
    const size_t z = ZSTD_compress(payload.data(), payload.size(), scratch_.data(), dense_bytes, opt.zstd_level);
    const bool zstd_ok = !ZSTD_isError(z) && z < dense_bytes && z < best.bytes;
    if (zstd_ok) {
      payload.resize(z);
      h.codec = Codec::kZstd;
      return true;
    }
    if (best.bytes >= dense_bytes) {
      payload.assign(scratch_.begin(), scratch_.end());
      h.codec = Codec::kRaw;
      return true;
    }
  }

  // The sparse bitstream.
  std::vector<uint8_t>& payload = out->payload;
  payload.clear();
  payload.reserve(best.bytes + 8);
  payload.push_back(static_cast<uint8_t>(best.coding));
  payload.push_back(static_cast<uint8_t>(gaps.k));
  payload.push_back(static_cast<uint8_t>(best.value_k));
  payload.push_back(0);
  BitWriter w(&payload);
  for (uint32_t i = 0; i < n; ++i) {
    PutRice(w, gap(i), gaps.k, 32);
    switch (best.coding) {
      case ValueCoding::kRaw: PutRaw(w, new_word(i), bits); break;
      case ValueCoding::kSignExpGolomb:
        w.Put(negative_[i], 1);
        PutExpGolomb(w, values_[i], best.value_k, bits);
        break;
      case ValueCoding::kXorLength: {
        const uint64_t x = old_word(i) ^ new_word(i);
        const uint32_t len = BitLength(x);
        PutExpGolomb(w, len - 1, best.value_k, 8);
        PutRaw(w, x & Mask(len - 1), len - 1);
        break;
      }
    }
  }
  w.Finish();
  h.codec = Codec::kSparse;
  return true;
}

// ============================================================================

Result<ApplyOutcome> ChunkApplier::Apply(const FrameView& frame, const DigestKey& key, uint64_t first_word,
                                         std::span<uint8_t> target, const Digest& current, Digest* after) {
  const FrameHeader& h = frame.header;
  const std::string where = fmt::format("frame (tensor {}, chunk {})", h.tensor, h.chunk);
  const uint32_t wb = h.word_bytes;
  const uint32_t bits = wb * 8;
  if (target.size() != uint64_t{h.words} * wb)
    return InvalidArgument(fmt::format("{}: covers {} words of {} bytes but the target chunk has {} bytes", where,
                                       h.words, wb, target.size()));
  if (current == h.target_digest) {
    *after = current;
    return ApplyOutcome::kAlreadyApplied;
  }
  if (h.mode != Mode::kOverwrite && current != h.base_digest)
    return FailedPrecondition(fmt::format(
        "{}: the target chunk is neither this frame's base nor its target (digest {} , base {}); "
        "it needs an overwrite frame or a resync from a snapshot",
        where, current.ToHex(), h.base_digest.ToHex()));

  const WordImage image = ImageKind(h.dtype);
  uint32_t n = 0;
  positions_.resize(h.words);
  values_.resize(h.words);
  if (h.codec == Codec::kSparse) {
    if (frame.payload.size() < kSparsePrefix) return DataLoss(where + ": sparse payload shorter than its prefix");
    const auto coding = static_cast<ValueCoding>(frame.payload[0]);
    const uint32_t gap_k = frame.payload[1], value_k = frame.payload[2];
    if (frame.payload[0] > 2 || frame.payload[3] != 0 || gap_k > 31 || value_k > kMaxRiceK)
      return DataLoss(fmt::format("{}: bad sparse prefix {:02x} {:02x} {:02x} {:02x}", where, frame.payload[0],
                                  frame.payload[1], frame.payload[2], frame.payload[3]));
    const bool coding_fits = (h.mode == Mode::kOverwrite && coding == ValueCoding::kRaw) ||
                             (h.mode == Mode::kAdd && coding == ValueCoding::kSignExpGolomb) ||
                             (h.mode == Mode::kXor && coding == ValueCoding::kXorLength);
    if (!coding_fits) return DataLoss(fmt::format("{}: value coding {} does not fit mode {}", where, frame.payload[0], ModeName(h.mode)));
    BitReader r(frame.payload.subspan(kSparsePrefix));
    uint64_t pos = 0;
    for (uint32_t i = 0; i < h.changed; ++i) {
      uint64_t g;
      if (!GetRice(r, gap_k, 32, &g)) return DataLoss(fmt::format("{}: malformed gap code at change {}", where, i));
      pos = (i == 0 ? 0 : pos + 1) + g;
      if (pos >= h.words) return DataLoss(fmt::format("{}: change {} at word {} is past the chunk's {} words", where, i, pos, h.words));
      uint64_t v = 0;
      switch (coding) {
        case ValueCoding::kRaw: v = GetRaw(r, bits); break;
        case ValueCoding::kSignExpGolomb: {
          const bool negative = r.Get(1) != 0;
          if (!GetExpGolomb(r, value_k, bits, &v) || v > (Mask(bits) >> 1))
            return DataLoss(fmt::format("{}: malformed value at change {}", where, i));
          v = JoinSigned(negative, v, bits);
          break;
        }
        case ValueCoding::kXorLength: {
          uint64_t len1;
          if (!GetExpGolomb(r, value_k, 8, &len1) || len1 >= bits)
            return DataLoss(fmt::format("{}: malformed xor length at change {}", where, i));
          v = (1ull << len1) | GetRaw(r, static_cast<uint32_t>(len1));
          break;
        }
      }
      positions_[i] = static_cast<uint32_t>(pos);
      values_[i] = v;
    }
    if (r.overrun()) return DataLoss(where + ": sparse payload ends early");
    if (!r.AtPaddedEnd()) return DataLoss(where + ": sparse payload has bytes after its last change");
    n = h.changed;
  } else {
    const uint64_t dense_bytes = uint64_t{h.words} * wb;
    std::span<const uint8_t> dense;
    if (h.codec == Codec::kRaw) {
      if (frame.payload.size() != dense_bytes)
        return DataLoss(fmt::format("{}: raw payload of {} bytes, the chunk needs {}", where, frame.payload.size(), dense_bytes));
      dense = frame.payload;
    } else {
      const unsigned long long size = ZSTD_getFrameContentSize(frame.payload.data(), frame.payload.size());
      if (size != dense_bytes)
        return DataLoss(fmt::format("{}: zstd payload declares {} bytes, the chunk needs {}", where,
                                    size == ZSTD_CONTENTSIZE_UNKNOWN ? 0ull : size, dense_bytes));
      dense_.resize(dense_bytes);
      const size_t got = ZSTD_decompress(dense_.data(), dense_.size(), frame.payload.data(), frame.payload.size());
      if (ZSTD_isError(got) || got != dense_bytes)
        return DataLoss(fmt::format("{}: zstd payload does not decode: {}", where,
                                    ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short output"));
      dense = dense_;
    }
    for (uint32_t p = 0; p < h.words; ++p) {
      const uint64_t v = LoadWord(dense.data() + size_t{p} * wb, wb);
      const bool change = h.mode == Mode::kOverwrite ? v != LoadWord(target.data() + size_t{p} * wb, wb) : v != 0;
      if (!change) continue;
      positions_[n] = p;
      values_[n] = v;
      ++n;
    }
    if (h.mode != Mode::kOverwrite && n != h.changed)
      return DataLoss(fmt::format("{}: dense payload holds {} changes, the header says {}", where, n, h.changed));
  }

  // New words and the digest they give, before touching the target.
  Digest d = current;
  PositionHashCursor cursor(key);
  for (uint32_t i = 0; i < n; ++i) {
    const uint64_t old = LoadWord(target.data() + size_t{positions_[i]} * wb, wb);
    uint64_t nw = values_[i];
    if (h.mode == Mode::kXor) nw = old ^ values_[i];
    else if (h.mode == Mode::kAdd) nw = FromImage((ToImage(old, bits, image) + values_[i]) & Mask(bits), bits, image);
    values_[i] = nw;
    uint64_t h0, h1;
    cursor.At(first_word + positions_[i], &h0, &h1);
    d.lane[0] += h0 * (nw - old);
    d.lane[1] += h1 * (nw - old);
  }
  if (d != h.target_digest) {
    if (h.mode == Mode::kOverwrite && current != h.base_digest)
      return FailedPrecondition(fmt::format(
          "{}: the target chunk differs from the base outside this frame's positions; it needs a dense "
          "overwrite or a resync from a snapshot",
          where));
    return DataLoss(fmt::format("{}: decodes to digest {} but the frame promises {}", where, d.ToHex(),
                                h.target_digest.ToHex()));
  }
  for (uint32_t i = 0; i < n; ++i) StoreWord(target.data() + size_t{positions_[i]} * wb, wb, values_[i]);
  *after = d;
  return ApplyOutcome::kApplied;
}

}  // namespace dcr
