#include "dcr/chunk_codec.h"

#include <fmt/format.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

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

// Calls f(U{}) with U the unsigned type of `wb` bytes, so word loops get a
// fixed-size (inlined) load instead of a memcpy call per word.
template <typename F>
inline void WithWordType(uint32_t wb, F&& f) {
  switch (wb) {
    case 1: f(uint8_t{}); break;
    case 2: f(uint16_t{}); break;
    case 4: f(uint32_t{}); break;
    default: f(uint64_t{}); break;
  }
}
template <typename U>
inline U Load(const uint8_t* p) {
  U v;
  std::memcpy(&v, p, sizeof(U));  // little-endian host (see frame.cc)
  return v;
}
template <typename U>
inline void Store(uint8_t* p, U v) {
  std::memcpy(p, &v, sizeof(U));
}
// Word positions[i] of `bytes` = value(i).
template <typename Value>
void Scatter(uint8_t* bytes, uint32_t wb, const uint32_t* positions, uint32_t n, Value value) {
  WithWordType(wb, [&](auto u) {
    using U = decltype(u);
    for (uint32_t i = 0; i < n; ++i) Store<U>(bytes + size_t{positions[i]} * sizeof(U), static_cast<U>(value(i)));
  });
}

// A nonzero `bits`-wide wrapped difference as (negative, magnitude - 1);
// the most negative difference has magnitude 2^(bits-1).
// Branch-free: signs of real updates are random.
inline void SplitSigned(uint64_t d, uint32_t bits, bool* negative, uint64_t* magnitude_minus_1) {
  const uint64_t sign = (d >> (bits - 1)) & 1;
  const uint64_t m = 0 - sign;  // all ones when negative
  *negative = sign != 0;
  // Sign-extend d to 64 bits, negate when negative: 1 .. 2^(bits-1) for d != 0.
  const uint64_t magnitude = (((d | (m & ~Mask(bits))) ^ m) - m) & Mask(bits);
  *magnitude_minus_1 = magnitude - 1;
}
inline uint64_t JoinSigned(bool negative, uint64_t magnitude_minus_1, uint32_t bits) {
  const uint64_t m = 0 - static_cast<uint64_t>(negative);
  return (((magnitude_minus_1 + 1) ^ m) - m) & Mask(bits);
}

inline uint32_t BitLength(uint64_t x) { return x == 0 ? 0 : 64 - static_cast<uint32_t>(__builtin_clzll(x)); }

// ---- Rice and Exp-Golomb codes with an escape --------------------------------

// A quotient of kEscape zeros announces a raw value instead.
constexpr uint32_t kEscape = 32;
constexpr uint32_t kMaxRiceK = 56;

[[gnu::always_inline]] inline void PutRaw(BitWriter& w, uint64_t v, uint32_t bits) {
  if (bits > 56) {
    w.Put(v & 0xFFFFFFFFu, 32);
    w.Put(v >> 32, bits - 32);
  } else {
    w.Put(v, bits);
  }
}
[[gnu::always_inline]] inline uint64_t GetRaw(BitReader& r, uint32_t bits) {
  if (bits > 56) {
    const uint64_t lo = r.Get(32);
    return lo | (r.Get(bits - 32) << 32);
  }
  return r.Get(bits);
}

[[gnu::always_inline]] inline void PutRice(BitWriter& w, uint64_t v, uint32_t k, uint32_t escape_bits) {
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
[[gnu::always_inline]] inline bool GetRice(BitReader& r, uint32_t k, uint32_t escape_bits, uint64_t* v) {
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
[[gnu::always_inline]] inline void PutExpGolomb(BitWriter& w, uint64_t v, uint32_t k, uint32_t escape_bits) {
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
[[gnu::always_inline]] inline uint64_t ExpGolombBits(uint64_t v, uint32_t k, uint32_t escape_bits) {
  const uint64_t u = v + (1ull << k);
  const uint32_t len = u < v ? 65 : BitLength(u);
  const uint32_t zeros = len - 1 - k;
  return zeros < kEscape && len <= 64 ? 2 * zeros + 1 + k : kEscape + 1 + escape_bits;
}
[[gnu::always_inline]] inline bool GetExpGolomb(BitReader& r, uint32_t k, uint32_t escape_bits, uint64_t* v) {
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

// The Exp-Golomb order (0..kMaxExpGolombK) minimising the size of a sample
// (every `stride`-th value), and that size scaled to all n values.
constexpr uint32_t kMaxExpGolombK = 4;
template <typename Get>
std::pair<uint32_t, uint64_t> ChooseExpGolomb(size_t n, size_t stride, Get get, uint32_t escape_bits) {
  uint64_t bits[kMaxExpGolombK + 1] = {};
  size_t m = 0;
  for (size_t i = 0; i < n; i += stride, ++m) {
    const uint64_t v = get(i);
    for (uint32_t k = 0; k <= kMaxExpGolombK; ++k) bits[k] += ExpGolombBits(v, k, escape_bits);
  }
  uint32_t best = 0;
  for (uint32_t k = 1; k <= kMaxExpGolombK; ++k)
    if (bits[k] < bits[best]) best = k;
  return {best, m ? bits[best] * n / m : 0};
}

// The Rice parameter minimising the total size of `values`, and that size.
struct RiceChoice {
  uint32_t k;
  uint64_t bits;
};
// Parameters are chosen on a sample (every `stride`-th value); `bits` is the
// sample's size scaled to all n values: an estimate, used only to choose.
template <typename Get>
RiceChoice ChooseRice(size_t n, size_t stride, Get get, uint32_t escape_bits, uint32_t max_k) {
  long double sum = 0;
  size_t m = 0;
  for (size_t i = 0; i < n; i += stride, ++m) sum += static_cast<long double>(get(i));
  const double mean = m ? static_cast<double>(sum / static_cast<long double>(m)) : 0.0;
  const int guess = mean > 1 ? static_cast<int>(std::floor(std::log2(mean * 0.6931))) : 0;
  RiceChoice best{0, ~0ull};
  for (int k = std::max(0, guess - 1); k <= std::min<int>(static_cast<int>(max_k), guess + 1); ++k) {
    uint64_t bits = 0;
    for (size_t i = 0; i < n; i += stride) bits += RiceBits(get(i), static_cast<uint32_t>(k), escape_bits);
    if (bits < best.bits) best = {static_cast<uint32_t>(k), bits};
  }
  best.bits = m ? best.bits * n / m : 0;
  return best;
}

// ---- sparse payload layout ---------------------------------------------------

enum class ValueCoding : uint8_t {
  kRaw = 0,      // word bits as they are (overwrite: the new word)
  kSignExpGolomb = 1,  // add: the sign bit, then Exp-Golomb of |delta| - 1
  kXorLength = 2,  // xor: Exp-Golomb of bit length - 1, then the bits below the top one
};
constexpr size_t kSparsePrefix = 4;  // value coding, gap k, value k, reserved

// The digest change of words moving from old to new, for increasing word
// positions within one chunk (limb hashes are cached per block).
class DigestDeltaCursor {
 public:
  DigestDeltaCursor(const DigestKey& key, uint64_t first_byte, uint32_t word_bytes)
      : key_(key), first_byte_(first_byte), wb_(word_bytes), t0_(kernels::DigestTable(0)),
        t1_(kernels::DigestTable(1)) {}
  [[gnu::always_inline]] void Add(uint32_t position, uint64_t old_word, uint64_t new_word) {
    const uint64_t byte = first_byte_ + uint64_t{position} * wb_;
    if (wb_ == 8) {
      AddLimb(byte / 4, old_word & 0xFFFFFFFFu, new_word & 0xFFFFFFFFu);
      AddLimb(byte / 4 + 1, old_word >> 32, new_word >> 32);
    } else {
      const uint32_t shift = 8 * (byte % 4);
      AddLimb(byte / 4, old_word << shift, new_word << shift);
    }
  }
  // The digest change of everything added so far.
  Digest Total() const {
    Digest d;
    d.lane[0] = kernels::ModPrime(acc0_);
    d.lane[1] = kernels::ModPrime(acc1_);
    return d;
  }

 private:
  // Adds H(limb) * (new - old) mod p, for limb values below 2^32. Each
  // product is folded below 2^62 and summed in 128 bits (room for 2^66 of
  // them); the one full reduction happens in Total().
  [[gnu::always_inline]] void AddLimb(uint64_t limb, uint64_t old_y, uint64_t new_y) {
    const uint64_t block = limb / kernels::kDigestBlock;
    if (block != block_) {
      block_ = block;
      s0_ = kernels::BlockSeed(key_.seed[0], block);
      s1_ = kernels::BlockSeed(key_.seed[1], block);
    }
    const uint64_t j = limb % kernels::kDigestBlock;
    const uint64_t diff = new_y + kernels::kPrime - old_y;  // (new - old) mod p, below 2^62
    const kernels::Uint128 t0 = static_cast<kernels::Uint128>(kernels::LimbHash(t0_[j], s0_)) * diff;
    const kernels::Uint128 t1 = static_cast<kernels::Uint128>(kernels::LimbHash(t1_[j], s1_)) * diff;
    acc0_ += static_cast<uint64_t>(t0 & kernels::kPrime) + static_cast<uint64_t>(t0 >> 61);
    acc1_ += static_cast<uint64_t>(t1 & kernels::kPrime) + static_cast<uint64_t>(t1 >> 61);
  }

  DigestKey key_;
  uint64_t first_byte_;
  uint32_t wb_;
  const uint64_t *t0_, *t1_;
  uint64_t block_ = ~0ull, s0_ = 0, s1_ = 0;
  kernels::Uint128 acc0_ = 0, acc1_ = 0;
};

// The new word from the old one and a frame's value.
template <WordImage image>
[[gnu::always_inline]] inline uint64_t NewWord(Mode mode, uint64_t old, uint64_t v, uint32_t bits) {
  switch (mode) {
    case Mode::kXor: return old ^ v;
    case Mode::kAdd: return FromImage((ToImage(old, bits, image) + v) & Mask(bits), bits, image);
    case Mode::kOverwrite: return v;
  }
  return v;
}
inline uint64_t NewWordAnyImage(Mode mode, uint64_t old, uint64_t v, uint32_t bits, WordImage image) {
  switch (image) {
    case WordImage::kSignMagnitude: return NewWord<WordImage::kSignMagnitude>(mode, old, v, bits);
    case WordImage::kTwosComplement: return NewWord<WordImage::kTwosComplement>(mode, old, v, bits);
    case WordImage::kPlain: return NewWord<WordImage::kPlain>(mode, old, v, bits);
  }
  return v;
}

// Decodes a sparse payload's changes, computing each new word from the
// target's old one and the digest they give; writes nothing to the target.
// All state lives in locals for the loop (stores through the output arrays
// would otherwise force reloads of everything reachable by reference).
// Instantiated per word type, value coding and image kind, so the loop has
// no per-change dispatch.
template <typename U, ValueCoding coding, WordImage image>
Status DecodeSparse(uint32_t gap_k, uint32_t value_k, const FrameHeader& h, const std::string& where,
                    const uint8_t* target, BitReader* reader, DigestDeltaCursor* cursor_out,
                    uint32_t* positions, uint64_t* values) {
  constexpr uint32_t bits = sizeof(U) * 8;
  constexpr Mode mode = coding == ValueCoding::kRaw         ? Mode::kOverwrite
                        : coding == ValueCoding::kXorLength ? Mode::kXor
                                                            : Mode::kAdd;
  BitReader r = *reader;
  DigestDeltaCursor cursor = *cursor_out;
  const uint32_t changed = h.changed, words = h.words;
  uint64_t pos = 0;
  const uint64_t gap_mask = Mask(gap_k);
  for (uint32_t i = 0; i < changed; ++i) {
    uint64_t g = 0;
    uint64_t v = 0;
    bool fast = false;
    if constexpr (coding == ValueCoding::kSignExpGolomb) {
      // The common case, decoded from one 56-bit window: a short Rice gap, a
      // sign bit and a short Exp-Golomb value. Anything longer (escapes,
      // the end of the data) takes the general path below.
      if (r.Ensure56() >= 56) {
        const uint64_t w = r.Peek();
        const uint32_t q = static_cast<uint32_t>(__builtin_ctzll(w | (1ull << 56)));
        const uint32_t gap_bits = q + 1 + gap_k;
        if (q < kEscape && gap_bits < 56) {
          const uint64_t w2 = w >> gap_bits;  // the sign bit, then the Exp-Golomb code
          const uint32_t zeros = static_cast<uint32_t>(__builtin_ctzll((w2 >> 1) | (1ull << 54)));
          const uint32_t low = zeros + value_k;
          const uint32_t total = gap_bits + 1 + zeros + 1 + low;
          if (zeros < kEscape && total <= 56) {
            g = (static_cast<uint64_t>(q) << gap_k) | ((w >> (q + 1)) & gap_mask);
            const bool negative = w2 & 1;
            const uint64_t u = (1ull << low) | ((w2 >> (zeros + 2)) & Mask(low));
            const uint64_t magnitude_minus_1 = u - (1ull << value_k);
            if (magnitude_minus_1 > (Mask(bits) >> 1))
              return DataLoss(fmt::format("{}: malformed value at change {}", where, i));
            v = JoinSigned(negative, magnitude_minus_1, bits);
            r.Consume(total);
            fast = true;
          }
        }
      }
    }
    if (!fast && !GetRice(r, gap_k, 32, &g))
      return DataLoss(fmt::format("{}: malformed gap code at change {}", where, i));
    pos = (i == 0 ? 0 : pos + 1) + g;
    if (pos >= words)
      return DataLoss(fmt::format("{}: change {} at word {} is past the chunk's {} words", where, i, pos, words));
    if (fast) {
    } else if constexpr (coding == ValueCoding::kRaw) {
      v = GetRaw(r, bits);
    } else if constexpr (coding == ValueCoding::kSignExpGolomb) {
      const bool negative = r.Get(1) != 0;
      if (!GetExpGolomb(r, value_k, bits, &v) || v > (Mask(bits) >> 1))
        return DataLoss(fmt::format("{}: malformed value at change {}", where, i));
      v = JoinSigned(negative, v, bits);
    } else {
      uint64_t len1;
      if (!GetExpGolomb(r, value_k, 8, &len1) || len1 >= bits)
        return DataLoss(fmt::format("{}: malformed xor length at change {}", where, i));
      v = (1ull << len1) | GetRaw(r, static_cast<uint32_t>(len1));
    }
    const uint64_t old = Load<U>(target + pos * sizeof(U));
    const uint64_t nw = NewWord<image>(mode, old, v, bits);
    positions[i] = static_cast<uint32_t>(pos);
    values[i] = nw;
    cursor.Add(static_cast<uint32_t>(pos), old, nw);
  }
  *reader = r;
  *cursor_out = cursor;
  return Status::Ok();
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

  out->base_digest = in.base_digest ? *in.base_digest : DigestBytes(in.key, in.first_word * wb, in.base);
  if (positions_.size() < words) {  // grow only: no per-call zeroing
    positions_.resize(words);
    olds_.resize(words);
    news_.resize(words);
    values_.resize(words);
    negative_.resize(words);
  }
  const uint32_t n =
      k.find_changes(wb, in.base.data(), in.next.data(), words, positions_.data(), olds_.data(), news_.data());
  if (n == 0) return false;

  // Digest of the target from the changes alone.
  Digest target = out->base_digest;
  {
    DigestDeltaCursor cursor(in.key, in.first_word * wb, wb);
    for (uint32_t i = 0; i < n; ++i) cursor.Add(positions_[i], olds_[i], news_[i]);
    target += cursor.Total();
  }

  // Choose the mode and code parameters on a sample of the changes; then
  // encode once with the winner.
  const size_t stride = std::max<size_t>(1, n / 1024);
  auto gap = [&](size_t i) -> uint64_t { return i == 0 ? positions_[0] : positions_[i] - positions_[i - 1] - 1; };
  const RiceChoice gaps = ChooseRice(n, stride, gap, 32, 31);
  const uint64_t dense_bytes = uint64_t{words} * wb;
  const WordImage image = ImageKind(in.dtype);
  auto old_word = [&](size_t i) { return olds_[i]; };
  auto new_word = [&](size_t i) { return news_[i]; };
  auto add_delta = [&](size_t i) {
    return (ToImage(news_[i], bits, image) - ToImage(olds_[i], bits, image)) & Mask(bits);
  };

  struct Candidate {
    Mode mode;
    ValueCoding coding;
    uint32_t value_k;
    uint64_t bytes;  // estimated payload
  };
  Candidate best{Mode::kOverwrite, ValueCoding::kRaw, 0, ~0ull};
  auto consider = [&](Candidate c) {
    if (c.bytes < best.bytes) best = c;
  };
  if (opt.delta_class == DeltaClass::kOverwrite) {
    consider({Mode::kOverwrite, ValueCoding::kRaw, 0, kSparsePrefix + (gaps.bits + uint64_t{n} * bits + 7) / 8});
  } else {
    if (!opt.allow_add && !opt.allow_xor) return InvalidArgument("xor-class delta with both xor and add disabled");
    if (opt.allow_add) {
      const auto [k_v, v_bits] = ChooseExpGolomb(n, stride, [&](size_t i) {
        bool negative;
        uint64_t magnitude_minus_1;
        SplitSigned(add_delta(i), bits, &negative, &magnitude_minus_1);
        return magnitude_minus_1;
      }, bits);
      consider({Mode::kAdd, ValueCoding::kSignExpGolomb, k_v, kSparsePrefix + (gaps.bits + n + v_bits + 7) / 8});
    }
    if (opt.allow_xor) {
      uint64_t low_bits = 0, sampled = 0;
      for (size_t i = 0; i < n; i += stride, ++sampled) low_bits += BitLength(old_word(i) ^ new_word(i)) - 1;
      low_bits = low_bits * n / sampled;
      const auto [k_v, v_bits] = ChooseExpGolomb(
          n, stride, [&](size_t i) { return uint64_t{BitLength(old_word(i) ^ new_word(i))} - 1; }, 8);
      consider({Mode::kXor, ValueCoding::kXorLength, k_v, kSparsePrefix + (gaps.bits + v_bits + low_bits + 7) / 8});
    }
  }
  if (best.mode == Mode::kAdd)
    for (uint32_t i = 0; i < n; ++i) {
      bool negative;
      SplitSigned(add_delta(i), bits, &negative, &values_[i]);
      negative_[i] = negative;
    }

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
      Scatter(scratch_.data(), wb, positions_.data(), n, [&](uint32_t i) { return dense_value(old_word(i), new_word(i)); });
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
  // Worst case per change: an escaped gap (33 + 32 bits) and an escaped
  // value (a sign bit, 33 + 64 bits, or a length code and 63 bits).
  const size_t buffer_bytes = BitWriter::BufferBytes(uint64_t{n} * (65 + 98));
  if (bits_capacity_ < buffer_bytes) {  // grow only, never zeroed
    bits_buffer_ = std::make_unique_for_overwrite<uint8_t[]>(buffer_bytes);
    bits_capacity_ = buffer_bytes;
  }
  BitWriter w(bits_buffer_.get());
  const uint32_t gk = gaps.k, vk = best.value_k;
  const uint64_t gap_mask = Mask(gk);
  const uint32_t* positions = positions_.data();
  const uint64_t* magnitudes = values_.data();
  const uint8_t* negatives = negative_.data();
  for (uint32_t i = 0; i < n; ++i) {
    const uint64_t g = i == 0 ? positions[0] : positions[i] - positions[i - 1] - 1;
    if (best.coding == ValueCoding::kSignExpGolomb) {
      // The common case as one code word: Rice gap, sign, Exp-Golomb value.
      const uint64_t q = g >> gk;
      const uint64_t u = magnitudes[i] + (1ull << vk);
      const uint32_t len = u < magnitudes[i] ? 65 : BitLength(u);
      const uint32_t zeros = len - 1 - vk;
      const uint64_t gap_bits = q + 1 + gk;
      if (q < kEscape && zeros < kEscape && gap_bits + 1 + zeros + len <= 56) {
        uint64_t code = (1ull << q) | ((g & gap_mask) << (q + 1));
        code |= uint64_t{negatives[i]} << gap_bits;
        code |= ((1ull << zeros) | ((u & Mask(len - 1)) << (zeros + 1))) << (gap_bits + 1);
        w.Put(code, static_cast<uint32_t>(gap_bits + 1 + zeros + len));
        continue;
      }
    }
    PutRice(w, g, gk, 32);
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
  const size_t stream_bytes = w.Finish();
  std::vector<uint8_t>& payload = out->payload;
  payload.resize(kSparsePrefix + stream_bytes);
  payload[0] = static_cast<uint8_t>(best.coding);
  payload[1] = static_cast<uint8_t>(gaps.k);
  payload[2] = static_cast<uint8_t>(best.value_k);
  payload[3] = 0;
  std::memcpy(payload.data() + kSparsePrefix, bits_buffer_.get(), stream_bytes);
  h.codec = Codec::kSparse;
  if (payload.size() >= dense_bytes) {  // the estimate was optimistic: cap at the dense size
    payload.resize(dense_bytes);
    if (best.mode == Mode::kOverwrite) {
      std::memcpy(payload.data(), in.next.data(), dense_bytes);
    } else {
      std::memset(payload.data(), 0, dense_bytes);
      Scatter(payload.data(), wb, positions_.data(), n, [&](uint32_t i) { return dense_value(old_word(i), new_word(i)); });
    }
    h.codec = Codec::kRaw;
  }
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
  if (positions_.size() < h.words) {  // grow only: no per-call zeroing
    positions_.resize(h.words);
    values_.resize(h.words);
  }
  // Decoding, the new words and the digest they give run in one pass over
  // the changes; the target is written only after the digest checks out.
  Digest d = current;
  DigestDeltaCursor cursor(key, first_word * wb, wb);
  uint32_t n = 0;
  Status error;
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
    if (!coding_fits)
      return DataLoss(fmt::format("{}: value coding {} does not fit mode {}", where, frame.payload[0], ModeName(h.mode)));
    BitReader r(frame.payload.subspan(kSparsePrefix));
    WithWordType(wb, [&](auto u) {
      using U = decltype(u);
      auto run = [&](auto decode) {
        error = decode(gap_k, value_k, h, where, target.data(), &r, &cursor, positions_.data(), values_.data());
      };
      using C = ValueCoding;
      using I = WordImage;
      switch (coding) {
        case C::kRaw: run(DecodeSparse<U, C::kRaw, I::kPlain>); break;
        case C::kXorLength: run(DecodeSparse<U, C::kXorLength, I::kPlain>); break;
        case C::kSignExpGolomb:
          if (image == I::kSignMagnitude) run(DecodeSparse<U, C::kSignExpGolomb, I::kSignMagnitude>);
          else if (image == I::kTwosComplement) run(DecodeSparse<U, C::kSignExpGolomb, I::kTwosComplement>);
          else run(DecodeSparse<U, C::kSignExpGolomb, I::kPlain>);
          break;
      }
    });
    DCR_RETURN_IF_ERROR(error);
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
    const bool overwrite = h.mode == Mode::kOverwrite;
    WithWordType(wb, [&](auto u) {
      using U = decltype(u);
      for (uint32_t p = 0; p < h.words; ++p) {
        const U v = Load<U>(dense.data() + size_t{p} * sizeof(U));
        const U old = Load<U>(target.data() + size_t{p} * sizeof(U));
        if (overwrite ? v == old : v == 0) continue;
        const uint64_t nw = NewWordAnyImage(h.mode, old, v, bits, image);
        positions_[n] = p;
        values_[n] = nw;
        cursor.Add(p, old, nw);
        ++n;
      }
    });
    if (h.mode != Mode::kOverwrite && n != h.changed)
      return DataLoss(fmt::format("{}: dense payload holds {} changes, the header says {}", where, n, h.changed));
  }

  d += cursor.Total();
  if (d != h.target_digest) {
    if (h.mode == Mode::kOverwrite && current != h.base_digest)
      return FailedPrecondition(fmt::format(
          "{}: the target chunk differs from the base outside this frame's positions; it needs a dense "
          "overwrite or a resync from a snapshot",
          where));
    return DataLoss(fmt::format("{}: decodes to digest {} but the frame promises {}", where, d.ToHex(),
                                h.target_digest.ToHex()));
  }
  Scatter(target.data(), wb, positions_.data(), n, [&](uint32_t i) { return values_[i]; });
  *after = d;
  return ApplyOutcome::kApplied;
}

}  // namespace dcr
