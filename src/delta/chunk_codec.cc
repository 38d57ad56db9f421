#include "dcr/chunk_codec.h"

#include <fmt/format.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#include "bitstream.h"
#include "kernels.h"

// How the work is laid out (docs/benchmarks.md has the figures). Encode: a
// vector kernel scans the chunk and lists the changes (position, base and
// next word); the mode and code parameters are chosen on a sample of them;
// a loop instantiated per word type, value coding and image writes each
// change's gap and value codes with one Put (for 16-bit add frames a vector
// kernel computes the codes, and a second one writes them and sums their
// digest terms in the same loop: the vector digest work fills the cycles of
// the bit writer's serial chain); otherwise a vector kernel then sums the
// digest terms. Apply:
// a loop decodes the changes into the same list (add frames through a table
// of whole changes, four per window) and prefetches their target lines;
// every 512 changes a vector kernel reads those old words and computes the
// new ones (other frames: a second pass, with its own prefetch); the digest
// kernel sums their terms, and only when the digest matches are the new
// words written. The decoder and the digest are passes of their own:
// fused, they ran out of registers.

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

template <typename U>
inline constexpr uint32_t kWordBits = sizeof(U) * 8;

constexpr uint64_t Mask(uint32_t bits) { return bits >= 64 ? ~0ull : (1ull << bits) - 1; }
// The low n < 64 bits of x (one bzhi with BMI2).
inline uint64_t LowBits(uint64_t x, uint32_t n) { return x & ((1ull << n) - 1); }
// The bit length of x > 0.
inline uint32_t BitLength(uint64_t x) { return 64 - static_cast<uint32_t>(__builtin_clzll(x)); }
// |v| - 1 for a nonzero U read as two's complement (|v| is 2^(bits-1) at
// most), and whether it is negative; branch-free, as signs are random.
template <typename U>
inline uint64_t MagnitudeMinus1(U v, uint64_t* negative) {
  const uint64_t sign = v >> (kWordBits<U> - 1);
  const U m = static_cast<U>(0 - sign);  // all ones when negative
  *negative = sign;
  return static_cast<U>((v ^ m) - m) - uint64_t{1};
}

// I(x) of docs/format.md (mode add), branch-free. Sign-magnitude: negative
// words flip every bit, others set the sign bit; two's complement: flip the
// sign bit.
template <WordImage image, typename U>
inline U ToImage(U x) {
  constexpr U kSign = static_cast<U>(U{1} << (kWordBits<U> - 1));
  if constexpr (image == WordImage::kSignMagnitude)
    return static_cast<U>(x ^ (static_cast<U>(0 - (x >> (kWordBits<U> - 1))) | kSign));
  else if constexpr (image == WordImage::kTwosComplement) return static_cast<U>(x ^ kSign);
  else return x;
}
template <WordImage image, typename U>
inline U FromImage(U y) {
  constexpr U kSign = static_cast<U>(U{1} << (kWordBits<U> - 1));
  if constexpr (image == WordImage::kSignMagnitude)
    return static_cast<U>(y ^ (static_cast<U>((y >> (kWordBits<U> - 1)) - 1) | kSign));
  else if constexpr (image == WordImage::kTwosComplement) return static_cast<U>(y ^ kSign);
  else return y;
}

// A frame's value for a word going from `o` to `n`, and the new word from
// the old one and the value.
template <Mode mode, WordImage image, typename U>
inline U ValueOf(U o, U n) {
  if constexpr (mode == Mode::kXor) return static_cast<U>(o ^ n);
  else if constexpr (mode == Mode::kAdd) return static_cast<U>(ToImage<image>(n) - ToImage<image>(o));
  else return n;
}
template <Mode mode, WordImage image, typename U>
inline U NewWord(U old, U v) {
  if constexpr (mode == Mode::kXor) return static_cast<U>(old ^ v);
  else if constexpr (mode == Mode::kAdd) return FromImage<image>(static_cast<U>(ToImage<image>(old) + v));
  else return v;
}

// Calls f(U{}) with U the unsigned type of `wb` bytes.
template <typename F>
inline void WithWordType(uint32_t wb, F&& f) {
  switch (wb) {
    case 1: f(uint8_t{}); break;
    case 2: f(uint16_t{}); break;
    case 4: f(uint32_t{}); break;
    default: f(uint64_t{}); break;
  }
}
constexpr kernels::Image KernelImage(WordImage image) {
  return image == WordImage::kSignMagnitude    ? kernels::Image::kFloat
         : image == WordImage::kTwosComplement ? kernels::Image::kSigned
                                               : kernels::Image::kUnsigned;
}
// Calls f(std::integral_constant<WordImage, image>{}) for a run-time image.
template <typename F>
inline void WithImage(WordImage image, F&& f) {
  switch (image) {
    case WordImage::kSignMagnitude: f(std::integral_constant<WordImage, WordImage::kSignMagnitude>{}); break;
    case WordImage::kTwosComplement: f(std::integral_constant<WordImage, WordImage::kTwosComplement>{}); break;
    case WordImage::kPlain: f(std::integral_constant<WordImage, WordImage::kPlain>{}); break;
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

// ---- the hot loops, built twice on x86-64 ------------------------------------

// Run<&Loop>(args...) calls the always-inline function Loop, compiled, on
// x86-64 CPUs that have them, with BMI1 and BMI2: shifts by any register
// (no funnelling counts through CL), bit-field extracts and tzcnt. The
// loops below are the codec's per-change work; a call costs one branch per
// chunk.
template <auto Loop, typename... Args>
[[gnu::noinline]] auto RunPlain(Args&&... args) {
  return Loop(std::forward<Args>(args)...);
}
#if defined(__x86_64__)
template <auto Loop, typename... Args>
[[gnu::noinline, gnu::target("bmi,bmi2")]] auto RunBmi2(Args&&... args) {
  return Loop(std::forward<Args>(args)...);
}
inline bool HasBmi2() {
  static const bool has = !kernels::BaselineIsa() && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
  return has;
}
#endif
template <auto Loop, typename... Args>
auto Run(Args&&... args) {
#if defined(__x86_64__)
  if (HasBmi2()) return RunBmi2<Loop>(std::forward<Args>(args)...);
#endif
  return RunPlain<Loop>(std::forward<Args>(args)...);
}

// ---- the digest change of changed words --------------------------------------

using kernels::Change;

// The digest change of n changes of one tensor's words of type U (the word
// at first_word + position going from old to new; positions increasing).
template <typename U>
Digest DigestChanges(const DigestKey& key, uint64_t first_word, const Change<U>* changes, uint32_t n) {
  Digest d;
  kernels::Kernels().digest_changes(sizeof(U), key.seed, first_word, changes, n, d.lane);
  return d;
}

// ---- Rice and Exp-Golomb codes with an escape (the general path) -------------

// A quotient of kEscape zeros announces a raw value instead.
constexpr uint32_t kEscape = 32;
constexpr uint32_t kMaxValueK = 56;  // the largest value parameter a reader accepts

// The low `bits` (<= 64) bits of v.
inline void PutRaw(BitWriter& w, uint64_t v, uint32_t bits) {
  if (bits > 56) {
    w.Put(v & 0xFFFFFFFFu, 32);
    w.Put((v >> 32) & Mask(bits - 32), bits - 32);
  } else {
    w.Put(v & Mask(bits), bits);
  }
}
inline uint64_t GetRaw(BitReader& r, uint32_t bits) {
  if (bits > 56) {
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
  const uint64_t peek = r.Peek();  // 56 bits or more: a whole unary prefix
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

// ---- choosing code parameters -------------------------------------------------

// The Exp-Golomb order (0..kMaxExpGolombK) minimising the size of a sample
// (every `stride`-th value), and that size scaled to all n values.
constexpr uint32_t kMaxExpGolombK = 4;
template <typename Get>
std::pair<uint32_t, uint64_t> ChooseExpGolomb(size_t n, size_t stride, Get get, uint32_t escape_bits) {
  uint64_t bits[kMaxExpGolombK + 1] = {};
  size_t m = 0;
  for (size_t i = 0; i < n; i += stride, ++m) {
    const uint64_t v = get(i);
    if (v < (1ull << 31)) [[likely]] {
      // No escape (u has at most 32 bits): ExpGolombBits is 2 L - k - 1.
      for (uint32_t k = 0; k <= kMaxExpGolombK; ++k) bits[k] += 2 * BitLength(v + (1ull << k)) - k - 1;
    } else {
      for (uint32_t k = 0; k <= kMaxExpGolombK; ++k) bits[k] += ExpGolombBits(v, k, escape_bits);
    }
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
  // double, not long double: x87 state shared with MMX registers that GCC 12
  // may use for 128-bit copies nearby; the mean only guides the choice.
  double sum = 0;
  size_t m = 0;
  for (size_t i = 0; i < n; i += stride, ++m) sum += static_cast<double>(get(i));
  const double mean = m ? sum / static_cast<double>(m) : 0.0;
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

// ---- the sparse payload -----------------------------------------------------------

enum class ValueCoding : uint8_t {
  kRaw = 0,  // word bits as they are (overwrite: the new word)
  kSignExpGolomb = 1,  // add: the sign bit, then Exp-Golomb of |delta| - 1
  kXorLength = 2,  // xor: Exp-Golomb of bit length - 1, then the bits below the top one
};
constexpr size_t kSparsePrefix = 4;  // value coding, gap k, value k, reserved

template <ValueCoding coding>
constexpr Mode kModeOf = coding == ValueCoding::kRaw         ? Mode::kOverwrite
                         : coding == ValueCoding::kXorLength ? Mode::kXor
                                                             : Mode::kAdd;

// Calls f(std::integral_constant<ValueCoding, c>{}) for a run-time coding.
template <typename F>
inline void WithCoding(ValueCoding coding, F&& f) {
  switch (coding) {
    case ValueCoding::kRaw: f(std::integral_constant<ValueCoding, ValueCoding::kRaw>{}); break;
    case ValueCoding::kSignExpGolomb: f(std::integral_constant<ValueCoding, ValueCoding::kSignExpGolomb>{}); break;
    case ValueCoding::kXorLength: f(std::integral_constant<ValueCoding, ValueCoding::kXorLength>{}); break;
  }
}

// The general code of one change (any gap and value, escapes included) as
// bits at `out` (32 bytes); returns how many. Out of line: it is rare, and
// inlined it crowded the common path out of registers.
template <typename U, ValueCoding coding>
[[gnu::noinline]] uint32_t GeneralCode(uint64_t g, U v, uint32_t gap_k, uint32_t value_k, uint8_t* out) {
  constexpr uint32_t kBits = kWordBits<U>;
  BitWriter w(out);  // at most 65 + 98 bits
  PutRice(w, g, gap_k, 32);
  if constexpr (coding == ValueCoding::kRaw) {
    PutRaw(w, v, kBits);
  } else if constexpr (coding == ValueCoding::kSignExpGolomb) {
    uint64_t negative;
    const uint64_t magnitude_minus_1 = MagnitudeMinus1(v, &negative);
    w.Put(negative, 1);
    PutExpGolomb(w, magnitude_minus_1, value_k, kBits);
  } else {
    const uint32_t low = BitLength(v) - 1;  // v != 0
    PutExpGolomb(w, low, value_k, 8);
    PutRaw(w, v, low);
  }
  return w.Bits();
}

// Writes the n changes as the sparse bit stream. The common case, a gap and
// a value whose codes fit in 56 bits together, is assembled in a register
// and written with one Put; the rest (escapes, long codes, 64-bit raw
// words) take GeneralCode. Add-mode 16-bit words (BF16, F16), the bulk of
// RL weights, get their codes from a vector kernel, two changes per Put.
// The digest terms of a 16-bit chunk's changes when the sparse loop sums
// them as it writes (AddPutDigest16): changes [0, done) are in `sum`.
struct FusedDigest {
  kernels::Digest16Sum sum;
  uint32_t done = 0;
};

// One change's gap (from *next) and value codes: the common case in one
// Put, the rest through GeneralCode.
template <typename U, ValueCoding coding, WordImage image>
[[gnu::always_inline]] inline void EncodeOne(const Change<U>& change, uint32_t gap_k, uint32_t value_k,
                                             uint64_t gap_mask, uint64_t* next, BitWriter& w) {
  constexpr Mode mode = kModeOf<coding>;
  const uint32_t p = change.position;
  const U v = ValueOf<mode, image>(change.old_word, change.new_word);
  const uint64_t g = p - *next;
  *next = uint64_t{p} + 1;
  // The value's code length, and inputs to its code.
  uint64_t negative = 0, u = 0;
  uint32_t value_bits, zeros = 0, len = 0, low = 0;
  if constexpr (coding == ValueCoding::kRaw) {
    value_bits = kWordBits<U>;
  } else if constexpr (coding == ValueCoding::kSignExpGolomb) {
    u = MagnitudeMinus1(v, &negative) + (1ull << value_k);  // value_k <= kMaxExpGolombK: no overflow
    len = BitLength(u);
    zeros = len - 1 - value_k;
    value_bits = 1 + zeros + len;
  } else {
    low = BitLength(v) - 1;  // v != 0
    u = low + (1ull << value_k);
    len = BitLength(u);
    zeros = len - 1 - value_k;
    value_bits = zeros + len + low;
  }
  const uint64_t q = g >> gap_k;
  const uint64_t gap_bits = q + 1 + gap_k;
  if (q < kEscape && gap_bits + value_bits <= 56) [[likely]] {
    uint64_t code;
    if constexpr (coding == ValueCoding::kRaw) {
      code = v;
    } else {
      // zeros, a one, the bits of u below its top one.
      code = (1ull << zeros) | ((u ^ (1ull << (len - 1))) << (zeros + 1));
      if constexpr (coding == ValueCoding::kSignExpGolomb) code = negative | (code << 1);
      else code |= (v ^ (1ull << low)) << (zeros + len);
    }
    w.Put((1ull << q) | ((g & gap_mask) << (q + 1)) | (code << gap_bits), static_cast<uint32_t>(gap_bits) + value_bits);
  } else {
    uint8_t general[32];
    const uint32_t bits = GeneralCode<U, coding>(g, v, gap_k, value_k, general);
    for (uint32_t k = 0; k < bits; k += 32) {
      const uint32_t m = std::min(32u, bits - k);
      w.Put(Load<uint64_t>(general + k / 8) & Mask(m), m);
    }
  }
}

// Add-mode 16-bit changes in batches, their codes from the vector kernel
// (and, with `fused`, written and digested by the fused kernel); returns
// how many changes it wrote (the rest, fewer than 8, go one by one).
template <WordImage image>
[[gnu::always_inline]] inline uint32_t EncodeAdd16Batches(uint32_t gap_k, uint32_t value_k,
                                                          const Change<uint16_t>* changes, uint32_t n,
                                                          uint64_t gap_mask, uint64_t* next, BitWriter& w,
                                                          FusedDigest* fused) {
  constexpr ValueCoding kCoding = ValueCoding::kSignExpGolomb;
  const auto add_codes16 = kernels::Kernels().add_codes16;
  if (add_codes16 == nullptr) return 0;
  constexpr uint32_t kBatch = 512;  // changes; their codes stay in L1
  uint64_t codes[kBatch / 2];
  uint32_t i = 0;
  while (n - i >= 8) {
    const uint32_t batch = std::min(kBatch, (n - i) / 8 * 8);
    add_codes16(changes + i, batch, static_cast<uint32_t>(*next), gap_k, value_k, KernelImage(image), codes);
    auto put_code = [&](uint32_t k) {
      if (codes[k] != 0) [[likely]] {
        w.Put(codes[k] & Mask(56), static_cast<uint32_t>(codes[k] >> 56));
      } else {
        *next = i + 2 * k == 0 ? 0 : changes[i + 2 * k - 1].position + uint64_t{1};
        EncodeOne<uint16_t, kCoding, image>(changes[i + 2 * k], gap_k, value_k, gap_mask, next, w);
        EncodeOne<uint16_t, kCoding, image>(changes[i + 2 * k + 1], gap_k, value_k, gap_mask, next, w);
      }
    };
    if (fused != nullptr) {
      // Groups of four changes (two codes): the kernel writes and digests
      // them up to one with a general-path code, done here.
      const uint32_t groups = batch / 4;
      for (uint32_t g = 0; g < groups; ++g) {
        g += kernels::Kernels().add_put_digest16(codes + 2 * g, changes + i + 4 * g, groups - g, &w, &fused->sum);
        if (g == groups) break;
        put_code(2 * g);
        put_code(2 * g + 1);
        kernels::Digest16AddScalar(&fused->sum, changes + i + 4 * g, 4);
      }
      fused->done = i + batch;
    } else {
      for (uint32_t k = 0; k < batch / 2; ++k) put_code(k);
    }
    i += batch;
    *next = changes[i - 1].position + uint64_t{1};
  }
  return i;
}

template <typename U, ValueCoding coding, WordImage image>
[[gnu::always_inline]] inline void EncodeSparseLoop(uint32_t gap_k, uint32_t value_k, const Change<U>* changes,
                                                    uint32_t n, BitWriter* writer, FusedDigest* fused) {
  (void)fused;  // used by the 16-bit add path only
  BitWriter w = *writer;  // in locals for the loop
  const uint64_t gap_mask = Mask(gap_k);
  uint64_t next = 0;  // the first word the next change may be at
  uint32_t i = 0;
  if constexpr (std::is_same_v<U, uint16_t> && coding == ValueCoding::kSignExpGolomb)
    i = EncodeAdd16Batches<image>(gap_k, value_k, changes, n, gap_mask, &next, w, fused);
  for (; i < n; ++i) EncodeOne<U, coding, image>(changes[i], gap_k, value_k, gap_mask, &next, w);
  *writer = w;
}

// A change decoded by the general path: its gap and value, and the reader
// after it; or `error`, saying what is malformed.
struct GeneralChange {
  uint64_t g, v;
  BitReader r;
  const char* error;
};
// Decodes one change's codes (any, escapes included) from a copy of the
// reader. Out of line, like GeneralCode.
template <typename U, ValueCoding coding>
[[gnu::noinline]] GeneralChange GeneralDecode(BitReader r, uint32_t gap_k, uint32_t value_k) {
  constexpr uint32_t kBits = kWordBits<U>;
  GeneralChange c{0, 0, r, nullptr};
  if (!GetRice(r, gap_k, 32, &c.g)) {
    c.error = "malformed gap code";
    return c;
  }
  if constexpr (coding == ValueCoding::kRaw) {
    c.v = GetRaw(r, kBits);
  } else if constexpr (coding == ValueCoding::kSignExpGolomb) {
    const bool negative = r.Get(1) != 0;
    uint64_t magnitude_minus_1;
    if (!GetExpGolomb(r, value_k, kBits, &magnitude_minus_1) || magnitude_minus_1 > (Mask(kBits) >> 1)) {
      c.error = "malformed value";
      return c;
    }
    const U magnitude = static_cast<U>(magnitude_minus_1 + 1);
    c.v = negative ? static_cast<U>(0 - magnitude) : magnitude;
  } else {
    uint64_t length_minus_1;
    if (!GetExpGolomb(r, value_k, 8, &length_minus_1) || length_minus_1 >= kBits) {
      c.error = "malformed xor length";
      return c;
    }
    c.v = (1ull << length_minus_1) | GetRaw(r, static_cast<uint32_t>(length_minus_1));
  }
  c.r = r;
  return c;
}

// The decode table of add-mode (sign + Exp-Golomb) changes: entry x, for
// the next kDecodeTableBits bits x of the stream, describes the change
// whose gap and value codes lie within them: its bits in all (4 bits; 0:
// the change is longer, or malformed, and takes the per-change path), its
// gap (12 bits) and its value as a signed number (16 bits). Most changes
// of RL weight updates fit (8-10 bits at 1-5% changed), so they decode
// with one load and a few shifts, and four of them from one window.
constexpr uint32_t kDecodeTableBits = 12;
constexpr uint32_t kDecodeTableSize = 1u << kDecodeTableBits;

void BuildAddDecodeTable(uint32_t word_bits, uint32_t gap_k, uint32_t value_k, uint32_t* table) {
  // Every code that fits, entered at each index whose low bits it is:
  // about one store per entry.
  constexpr uint32_t kB = kDecodeTableBits;
  const uint64_t max_magnitude_minus_1 = Mask(word_bits) >> 1;
  std::memset(table, 0, kDecodeTableSize * sizeof(uint32_t));
  for (uint32_t q = 0; q + 1 + gap_k + 2 <= kB; ++q) {
    const uint32_t gap_bits = q + 1 + gap_k;
    for (uint32_t gap_low = 0; gap_low < (1u << gap_k); ++gap_low) {
      const uint32_t g = (q << gap_k) | gap_low;
      const uint32_t gap_code = (1u << q) | (gap_low << (q + 1));  // q zeros, a one, the low bits
      for (uint32_t zeros = 0;; ++zeros) {
        const uint32_t low = zeros + value_k;  // bits of u below its top one
        const uint32_t bits = gap_bits + 2 + zeros + low;
        if (bits > kB) break;
        for (uint32_t u_low = 0; u_low < (1u << low); ++u_low) {
          const uint64_t magnitude_minus_1 = ((1ull << low) | u_low) - (1ull << value_k);
          if (magnitude_minus_1 > max_magnitude_minus_1) continue;  // malformed: the per-change path says so
          const int32_t magnitude = static_cast<int32_t>(magnitude_minus_1 + 1);
          for (uint32_t negative = 0; negative < 2; ++negative) {
            // The sign bit, zeros zeros, a one, the low bits of u.
            const uint32_t code =
                gap_code | (negative << gap_bits) | (1u << (gap_bits + 1 + zeros)) | (u_low << (gap_bits + 2 + zeros));
            const int32_t v = negative ? -magnitude : magnitude;
            const uint32_t e = bits | (g << 4) | (static_cast<uint32_t>(v) << 16);
            for (uint32_t x = code; x < kDecodeTableSize; x += 1u << bits) table[x] = e;
          }
        }
      }
    }
  }
}

// Decodes a sparse payload's changes into `changes`, with the target's old
// words and the new words they give; writes nothing to the target. Without a
// target (null) each change keeps the frame's value in new_word. Add-mode
// changes that fit the decode table (`table`, or null) are decoded from it,
// up to four per window; otherwise the common case, a gap and a value
// within one 56-bit window, is parsed from one Peek() with no branch but
// the range checks; the rest take GeneralDecode. The decoding loop is bound
// by its chain of dependent steps (window, code length, window), so that
// chain is kept short, and it leaves the target alone: the old words are
// read in a second pass, which knows the positions ahead and prefetches
// them (sparse changes in a large chunk miss the caches).
// A sparse decode's state: the reader, the first word the next change may
// be at, and what is malformed, if anything (a message, or a change past
// the chunk at error_word).
struct SparseDecode {
  BitReader r;
  uint64_t next = 0;
  const char* error = nullptr;
  bool past = false;
  uint64_t error_word = 0;

  Status Fail(const std::string& where, uint32_t i, uint64_t words) const {
    if (past)
      return DataLoss(
          fmt::format("{}: change {} at word {} is past the chunk's {} words", where, i, error_word, words));
    return DataLoss(fmt::format("{}: {} at change {}", where, error, i));
  }
};

// The value code after a gap code of gap_bits in window `w` (whose gap
// quotient q < kEscape), in the common case: its bits in *value_bits and
// the value in *v. False when the change takes the general path, or (with
// *error set) when the value is malformed.
template <typename U, ValueCoding coding>
[[gnu::always_inline]] inline bool FastValue(uint64_t w, uint32_t q, uint32_t gap_k, uint32_t value_k, U* v,
                                             uint32_t* value_bits, const char** error) {
  constexpr uint32_t kBits = kWordBits<U>;
  constexpr uint64_t kMaxMagnitudeMinus1 = Mask(kBits) >> 1;
  const uint32_t gap_bits = q + 1 + gap_k;  // <= 63
  const uint64_t rest = w >> gap_bits;  // the value's code
  if constexpr (coding == ValueCoding::kRaw) {
    if constexpr (kBits > 32) return false;
    *value_bits = kBits;
    *v = static_cast<U>(rest);
    return gap_bits + kBits <= 56;
  } else if constexpr (coding == ValueCoding::kSignExpGolomb) {
    // The zeros of the value's code count from after the sign bit; the
    // window's bit 63 stops the count (a code that long is not fast).
    // Only q + gap_k <= 52 is fast (the shift mask matters only otherwise).
    const uint32_t zeros = static_cast<uint32_t>(__builtin_ctzll((w | (1ull << 63)) >> ((gap_bits + 1) & 63)));
    const uint32_t low = zeros + value_k;  // bits below u's top one
    *value_bits = 2 + zeros + low;
    if (!(q + gap_k <= 52 && gap_bits + *value_bits <= 56)) [[unlikely]]
      return false;
    const uint64_t u = (1ull << low) | LowBits(rest >> (zeros + 2), low);
    const uint64_t magnitude_minus_1 = u - (1ull << value_k);
    if (magnitude_minus_1 > kMaxMagnitudeMinus1) {
      *error = "malformed value";
      return false;
    }
    const U magnitude = static_cast<U>(magnitude_minus_1 + 1);
    *v = (rest & 1) ? static_cast<U>(0 - magnitude) : magnitude;
    return true;
  } else {
    const uint32_t zeros = static_cast<uint32_t>(__builtin_ctzll(rest | (1ull << kEscape)));
    const uint32_t low = zeros + value_k;
    const uint32_t length_bits = zeros + 1 + low;
    if (!(zeros < kEscape && gap_bits + length_bits <= 56)) [[unlikely]]
      return false;
    const uint64_t length_minus_1 = ((1ull << low) | LowBits(rest >> (zeros + 1), low)) - (1ull << value_k);
    if (length_minus_1 >= kBits) {
      *error = "malformed xor length";
      return false;
    }
    *value_bits = length_bits + static_cast<uint32_t>(length_minus_1);
    *v = static_cast<U>((1ull << length_minus_1) | LowBits(rest >> length_bits, static_cast<uint32_t>(length_minus_1)));
    return gap_bits + *value_bits <= 56;
  }
}

// One change by the common path (FastValue) or GeneralDecode into
// changes[i]; false on an error (in d).
template <typename U, ValueCoding coding>
[[gnu::always_inline]] inline bool DecodeOne(SparseDecode& d, uint32_t gap_k, uint32_t value_k, uint64_t words,
                                             const uint8_t* target, Change<U>* changes, uint32_t i) {
  uint64_t g = 0;
  U v = 0;
  bool fast = false;
  const uint64_t w = d.r.Peek();
  const uint32_t q = static_cast<uint32_t>(__builtin_ctzll(w | (1ull << kEscape)));
  if (q < kEscape) [[likely]] {
    uint32_t value_bits = 0;
    fast = FastValue<U, coding>(w, q, gap_k, value_k, &v, &value_bits, &d.error);
    if (d.error != nullptr) return false;
    if (fast) {
      g = (uint64_t{q} << gap_k) | LowBits(w >> (q + 1), gap_k);
      d.r.Skip(q + 1 + gap_k + value_bits);
    }
  }
  if (!fast) {
    const GeneralChange c = GeneralDecode<U, coding>(d.r, gap_k, value_k);
    if (c.error) {
      d.error = c.error;
      return false;
    }
    g = c.g;
    v = static_cast<U>(c.v);
    d.r = c.r;
  }
  const uint64_t pos = d.next + g;
  if (pos >= words) {
    d.past = true;
    d.error_word = pos;
    return false;
  }
  d.next = pos + 1;
  // The line will be read and written once the digest checks out: start
  // fetching it now, while this loop computes (10-20% faster apply on a
  // target in DRAM).
  if (target != nullptr) __builtin_prefetch(target + pos * sizeof(U), 1);
  changes[i] = {static_cast<uint32_t>(pos), 0, v};  // the value, for now
  return true;
}

// Add-mode changes from the decode table while four fit a window, each
// window's misfit by DecodeOne; with a 16-bit target, every kApplyBatch
// changes get their old and new words (add_apply16) while the lines the
// decoder prefetched are in L1. *i: the changes decoded, *applied: those
// resolved.
template <typename U, WordImage image>
[[gnu::always_inline]] inline Status DecodeTableLoop(SparseDecode& d, uint32_t gap_k, uint32_t value_k,
                                                     uint32_t changed, uint64_t words, const std::string& where,
                                                     const uint8_t* target, Change<U>* changes, const uint32_t* table,
                                                     kernels::AddApply16Fn add_apply16, uint32_t* i_out,
                                                     uint32_t* applied) {
  constexpr uint64_t kTableMask = kDecodeTableSize - 1;
  constexpr uint32_t kApplyBatch = 512;
  uint32_t i = 0;
  for (uint32_t batch_end = 0; i + 4 <= changed;) {
    if constexpr (std::is_same_v<U, uint16_t>) {
      if (i >= batch_end) {
        if (add_apply16 != nullptr && i > *applied) {
          add_apply16(changes + *applied, i - *applied, target, static_cast<uint32_t>(words), KernelImage(image));
          *applied = i;
        }
        batch_end = i + kApplyBatch;
      }
    }
    if (d.r.exhausted()) [[unlikely]]
      return DataLoss(where + ": sparse payload ends early");
    uint64_t w = d.r.Peek();  // 56 bits or more: four table entries' worth
    uint32_t used = 0;
    uint64_t pos = 0;
    // One change from the table; false when it does not fit there.
    auto step = [&]() __attribute__((always_inline)) {
      const uint32_t e = table[w & kTableMask];
      if ((e & 15) == 0) return false;
      w >>= e & 15;
      used += e & 15;
      pos = d.next + ((e >> 4) & 0xFFF);
      d.next = pos + 1;
      if (target != nullptr) __builtin_prefetch(target + pos * sizeof(U), 1);
      if constexpr (std::is_same_v<U, uint16_t>) {
        // One store: the position, and the value in the new word's place
        // (the top 16 bits of the entry); the old word's place gets the
        // entry's low bits, which the next pass overwrites. (pos < 2^32:
        // a position past the chunk is refused below, a few steps on.)
        static_assert(sizeof(Change<U>) == 8 && offsetof(Change<U>, new_word) == 6);
        const uint64_t record = pos | (static_cast<uint64_t>(e) << 32);
        std::memcpy(changes + i, &record, 8);
      } else {
        changes[i] = {static_cast<uint32_t>(pos), 0, static_cast<U>(static_cast<int32_t>(e) >> 16)};
      }
      ++i;
      return true;
    };
    const bool all = step() && step() && step() && step();
    d.r.Skip(used);
    // Positions increase: the last one checks them all (a gap from the
    // table is below 2^12, so none has wrapped).
    if (pos >= words) [[unlikely]] {
      d.past = true;
      d.error_word = pos;
      return d.Fail(where, i - 1, words);
    }
    if (!all) {
      if (!DecodeOne<U, ValueCoding::kSignExpGolomb>(d, gap_k, value_k, words, target, changes, i)) [[unlikely]]
        return d.Fail(where, i, words);
      ++i;
    }
  }
  *i_out = i;
  return Status::Ok();
}

// The old words of changes [0, n) from the target, and the new words their
// values give (a pass of its own, which knows the positions ahead and
// prefetches them).
template <typename U, Mode mode, WordImage image>
[[gnu::always_inline]] inline void ResolveFromTarget(Change<U>* changes, uint32_t n, const uint8_t* target) {
  constexpr uint32_t kAhead = 16;  // changes ahead, for lines the decoder's prefetch missed
  for (uint32_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(target + size_t{changes[i + kAhead].position} * sizeof(U));
    const U old = Load<U>(target + size_t{changes[i].position} * sizeof(U));
    changes[i].old_word = old;
    changes[i].new_word = NewWord<mode, image>(old, changes[i].new_word);
  }
}

// Decodes a sparse payload's changes into `changes`, with the target's old
// words and the new words they give; writes nothing to the target. Without a
// target (null) each change keeps the frame's value in new_word. Add-mode
// changes that fit the decode table (`table`, or null) are decoded from it,
// up to four per window; otherwise the common case, a gap and a value
// within one 56-bit window, is parsed from one Peek() with no branch but
// the range checks; the rest take GeneralDecode. The decoding loop is bound
// by its chain of dependent steps (window, code length, window), so that
// chain is kept short, and it leaves the target alone: the old words are
// read in a second pass, which knows the positions ahead and prefetches
// them (sparse changes in a large chunk miss the caches).
template <typename U, ValueCoding coding, WordImage image>
[[gnu::always_inline]] inline Status DecodeSparseLoop(uint32_t gap_k, uint32_t value_k, const FrameHeader& h,
                                                      uint64_t words, const std::string& where, const uint8_t* target,
                                                      BitReader* reader, Change<U>* changes, const uint32_t* table) {
  SparseDecode d{*reader};
  const uint32_t changed = h.changed;
  uint32_t i = 0;
  [[maybe_unused]] uint32_t applied = 0;  // changes whose old and new words are filled in
  [[maybe_unused]] const kernels::AddApply16Fn add_apply16 =
      std::is_same_v<U, uint16_t> && coding == ValueCoding::kSignExpGolomb && target != nullptr
          ? kernels::Kernels().add_apply16
          : nullptr;
  if constexpr (coding == ValueCoding::kSignExpGolomb) {
    if (table != nullptr)
      DCR_RETURN_IF_ERROR((DecodeTableLoop<U, image>(d, gap_k, value_k, changed, words, where, target, changes, table,
                                                     add_apply16, &i, &applied)));
  }
  for (; i < changed; ++i) {
    if (d.r.exhausted()) return DataLoss(where + ": sparse payload ends early");
    if (!DecodeOne<U, coding>(d, gap_k, value_k, words, target, changes, i)) [[unlikely]]
      return d.Fail(where, i, words);
  }
  *reader = d.r;
  if constexpr (std::is_same_v<U, uint16_t> && coding == ValueCoding::kSignExpGolomb) {
    if (add_apply16 != nullptr) {
      add_apply16(changes + applied, changed - applied, target, static_cast<uint32_t>(words), KernelImage(image));
      return Status::Ok();
    }
  }
  if (target == nullptr) return Status::Ok();  // values only: the caller gathers and resolves
  ResolveFromTarget<U, kModeOf<coding>, image>(changes, changed, target);
  return Status::Ok();
}

// Grows a scratch array to at least n elements (never shrinks, never zeroes).
template <typename T>
T* Reserve(std::unique_ptr<T[]>& p, size_t& capacity, size_t n) {
  if (capacity < n) {
    p = std::make_unique_for_overwrite<T[]>(n);
    capacity = n;
  }
  return p.get();
}

// Bytes of a Change<U> for words of `wb` bytes.
inline size_t ChangeBytes(uint32_t wb) {
  size_t bytes = 0;
  WithWordType(wb, [&](auto word) { bytes = sizeof(Change<decltype(word)>); });
  return bytes;
}

inline Mode ModeOf(ValueCoding coding) {
  switch (coding) {
    case ValueCoding::kRaw: return Mode::kOverwrite;
    case ValueCoding::kXorLength: return Mode::kXor;
    case ValueCoding::kSignExpGolomb: return Mode::kAdd;
  }
  return Mode::kOverwrite;
}

// A value coding with its parameter and estimated payload bytes.
struct Candidate {
  ValueCoding coding;
  uint32_t value_k;
  uint64_t bytes;
};

// The smallest coding of the class for n changes whose gaps code as `gaps`,
// chosen on a sample of the changes.
template <typename U>
Candidate ChooseCoding(const ChunkInput& in, const EncodeOptions& opt, const Change<U>* c, uint32_t n,
                       const RiceChoice& gaps, size_t stride) {
  constexpr uint32_t kBits = kWordBits<U>;
  Candidate best{ValueCoding::kRaw, 0, ~0ull};
  auto consider = [&](Candidate candidate) {
    if (candidate.bytes < best.bytes) best = candidate;
  };
  if (opt.delta_class == DeltaClass::kOverwrite) {
    consider({ValueCoding::kRaw, 0, kSparsePrefix + (gaps.bits + uint64_t{n} * kBits + 7) / 8});
    return best;
  }
  if (opt.allow_add) {
    std::pair<uint32_t, uint64_t> choice;
    WithImage(ImageKind(in.dtype), [&](auto image_constant) {
      choice = ChooseExpGolomb(
          n, stride,
          [&](size_t i) {
            uint64_t negative;
            return MagnitudeMinus1(ValueOf<Mode::kAdd, decltype(image_constant)::value>(c[i].old_word, c[i].new_word),
                                   &negative);
          },
          kBits);
    });
    consider({ValueCoding::kSignExpGolomb, choice.first, kSparsePrefix + (gaps.bits + n + choice.second + 7) / 8});
  }
  if (opt.allow_xor) {
    auto length_minus_1 = [&](size_t i) -> uint64_t {
      return BitLength(static_cast<U>(c[i].old_word ^ c[i].new_word)) - 1;
    };
    uint64_t low_bits = 0, sampled = 0;
    for (size_t i = 0; i < n; i += stride, ++sampled) low_bits += length_minus_1(i);
    low_bits = low_bits * n / sampled;
    const auto [k_v, v_bits] = ChooseExpGolomb(n, stride, length_minus_1, 8);
    consider({ValueCoding::kXorLength, k_v, kSparsePrefix + (gaps.bits + v_bits + low_bits + 7) / 8});
  }
  return best;
}

// The dense layout of the chunk's change in `mode` (dense_bytes at `dense`).
template <typename U>
void WriteDense(const ChunkInput& in, Mode mode, const Change<U>* c, uint32_t n, uint64_t dense_bytes, uint8_t* dense) {
  if (mode == Mode::kOverwrite) {
    std::memcpy(dense, in.next.data(), dense_bytes);
    return;
  }
  std::memset(dense, 0, dense_bytes);
  WithImage(ImageKind(in.dtype), [&](auto image_constant) {
    constexpr WordImage kImage = decltype(image_constant)::value;
    for (uint32_t i = 0; i < n; ++i)
      Store<U>(dense + size_t{c[i].position} * sizeof(U),
               mode == Mode::kXor ? ValueOf<Mode::kXor, kImage>(c[i].old_word, c[i].new_word)
                                  : ValueOf<Mode::kAdd, kImage>(c[i].old_word, c[i].new_word));
  });
}

// Encode after the scan, for words of type U: chooses the mode and codec,
// writes the payload and fills the header.
template <typename U>
void EncodeChanges(const ChunkInput& in, const EncodeOptions& opt, uint32_t words, const Change<U>* c, uint32_t n,
                   uint8_t* bits, std::vector<uint8_t>& scratch, EncodedChunk* out, FusedDigest* fused) {
  // Choose the mode and code parameters on a sample of the changes; then
  // encode once with the winner.
  const size_t stride = std::max<size_t>(1, n / 1024);
  auto gap = [&](size_t i) -> uint64_t { return i == 0 ? c[0].position : c[i].position - c[i - 1].position - 1; };
  const RiceChoice gaps = ChooseRice(n, stride, gap, 32, 31);
  const uint64_t dense_bytes = uint64_t{words} * sizeof(U);
  const Candidate best = ChooseCoding<U>(in, opt, c, n, gaps, stride);
  const Mode mode = ModeOf(best.coding);
  FrameHeader& h = out->header;
  h = FrameHeader{};
  h.changed = n;
  h.dtype = in.dtype;
  h.mode = mode;
  // The dense layout, zstd-compressed, when the sparse form is not clearly
  // smaller (raw when zstd does not help either).
  std::vector<uint8_t>& payload = out->payload;
  if (best.bytes >= dense_bytes ||
      static_cast<double>(best.bytes) > opt.zstd_when_sparse_above * static_cast<double>(dense_bytes)) {
    scratch.resize(dense_bytes);
    WriteDense<U>(in, mode, c, n, dense_bytes, scratch.data());
    payload.resize(ZSTD_compressBound(dense_bytes));
    const size_t z = ZSTD_compress(payload.data(), payload.size(), scratch.data(), dense_bytes, opt.zstd_level);
    const bool zstd_ok = !ZSTD_isError(z) && z < dense_bytes && z < best.bytes;
    if (zstd_ok || best.bytes >= dense_bytes) {
      if (zstd_ok) {
        payload.resize(z);
        h.codec = Codec::kZstd;
      } else {
        payload.assign(scratch.begin(), scratch.end());
        h.codec = Codec::kRaw;
      }
      return;
    }
  }
  // The sparse bit stream.
  BitWriter w(bits);
  WithCoding(best.coding, [&](auto coding_constant) {
    constexpr ValueCoding kCoding = decltype(coding_constant)::value;
    auto run = [&](auto image_constant) {
      Run<&EncodeSparseLoop<U, kCoding, decltype(image_constant)::value>>(gaps.k, best.value_k, c, n, &w, fused);
    };
    if constexpr (kCoding == ValueCoding::kSignExpGolomb) WithImage(ImageKind(in.dtype), run);
    else run(std::integral_constant<WordImage, WordImage::kPlain>{});
  });
  const size_t stream_bytes = w.Finish();
  if (kSparsePrefix + stream_bytes >= dense_bytes) {  // the estimate was optimistic: cap at the dense size
    payload.resize(dense_bytes);
    WriteDense<U>(in, mode, c, n, dense_bytes, payload.data());
    h.codec = Codec::kRaw;
    return;
  }
  payload.resize(kSparsePrefix + stream_bytes);
  payload[0] = static_cast<uint8_t>(best.coding);
  payload[1] = static_cast<uint8_t>(gaps.k);
  payload[2] = static_cast<uint8_t>(best.value_k);
  payload[3] = 0;
  std::memcpy(payload.data() + kSparsePrefix, bits, stream_bytes);
  h.codec = Codec::kSparse;
}

}  // namespace

// ============================================================================

Result<bool> ChunkEncoder::Encode(const ChunkInput& in, const EncodeOptions& opt, EncodedChunk* out) {
  const uint32_t wb = WordBytes(in.dtype);
  const auto chunk_bytes = ByteSize(in.dtype, in.elements);
  if (!chunk_bytes || in.base.size() != *chunk_bytes || in.next.size() != *chunk_bytes)
    return InvalidArgument(fmt::format("chunk of {} {} elements needs {} bytes, got base {} and next {}", in.elements,
                                       Name(in.dtype), chunk_bytes.value_or(0), in.base.size(), in.next.size()));
  if (opt.delta_class == DeltaClass::kXorClass && !opt.allow_add && !opt.allow_xor)
    return InvalidArgument("xor-class delta with both xor and add disabled");
  const uint32_t words = static_cast<uint32_t>(*chunk_bytes / wb);

  out->base_digest = in.base_digest ? *in.base_digest : DigestBytes(in.key, in.first_word * wb, in.base);
  Reserve(positions_, positions_capacity_, size_t{words} + 8);
  uint8_t* changes = Reserve(changes_, changes_capacity_, size_t{words} * ChangeBytes(wb));
  const uint32_t n =
      kernels::Kernels().find_changes(wb, in.base.data(), in.next.data(), words, positions_.get(), changes);
  if (n == 0) return false;
  // Worst case per change: an escaped gap (33 + 32 bits) and an escaped
  // value (a sign bit, 33 + 64 bits, or a length code and 63 bits).
  Reserve(bits_buffer_, bits_capacity_, BitWriter::BufferBytes(uint64_t{n} * (65 + 98)));
  WithWordType(wb, [&](auto word) {
    using U = decltype(word);
    const auto* c = reinterpret_cast<const Change<U>*>(changes);
    // 16-bit changes: the sparse add loop may sum the digest terms as it
    // writes (FusedDigest); the rest are summed here.
    FusedDigest fused;
    FusedDigest* fuse = nullptr;
    if (opt.skip_target_digest) {
      EncodeChanges<U>(in, opt, words, c, n, bits_buffer_.get(), scratch_, out, nullptr);
      out->header.target_digest = out->base_digest;
      return;
    }
    if constexpr (std::is_same_v<U, uint16_t>) {
      if (kernels::Kernels().add_put_digest16 != nullptr) {
        kernels::Digest16Start(&fused.sum, in.key.seed, in.first_word);
        fuse = &fused;
      }
    }
    EncodeChanges<U>(in, opt, words, c, n, bits_buffer_.get(), scratch_, out, fuse);
    Digest moved = DigestChanges<U>(in.key, in.first_word, c + fused.done, n - fused.done);
    if (fused.done > 0) {
      Digest summed;
      kernels::Digest16Finish(&fused.sum, summed.lane);
      moved += summed;
    }
    out->header.target_digest = out->base_digest + moved;
  });
  return true;
}

// ============================================================================

Status ChunkApplier::Decode(const FrameView& frame, const uint8_t* target, uint32_t words, const std::string& where,
                            uint8_t* records, uint32_t* count) {
  const FrameHeader& h = frame.header;
  if (!frame.PayloadHeld())
    return FailedPrecondition(
        fmt::format("{}: its payload was dropped once the frame was applied, so it cannot be "
                    "applied again",
                    where));
  if (h.changed > words) return DataLoss(fmt::format("{}: {} changed words in a chunk of {}", where, h.changed, words));
  // The changes, decoded with the old and new words and checked against the
  // frame's digest before the target is written.
  uint8_t* changes = records != nullptr ? records : Reserve(changes_, changes_capacity_, DecodedBytes(h, words));
  if (h.codec != Codec::kSparse) return DecodeDense(frame, target, words, where, changes, count);
  DCR_RETURN_IF_ERROR(DecodeSparse(frame, target, words, where, changes));
  *count = h.changed;
  return Status::Ok();
}

Status ChunkApplier::DecodeSparse(const FrameView& frame, const uint8_t* target, uint32_t words,
                                  const std::string& where, uint8_t* changes) {
  const FrameHeader& h = frame.header;
  const uint32_t wb = WordBytes(h.dtype);
  if (frame.payload.size() < kSparsePrefix) return DataLoss(where + ": sparse payload shorter than its prefix");
  const auto coding = static_cast<ValueCoding>(frame.payload[0]);
  const uint32_t gap_k = frame.payload[1], value_k = frame.payload[2];
  if (frame.payload[0] > 2 || frame.payload[3] != 0 || gap_k > 31 || value_k > kMaxValueK)
    return DataLoss(fmt::format("{}: bad sparse prefix {:02x} {:02x} {:02x} {:02x}", where, frame.payload[0],
                                frame.payload[1], frame.payload[2], frame.payload[3]));
  if (ModeOf(coding) != h.mode)
    return DataLoss(fmt::format("{}: value coding {} does not fit mode {}", where, frame.payload[0], ModeName(h.mode)));
  // The bit stream, copied with the zero padding BitReader reads into.
  const size_t stream_bytes = frame.payload.size() - kSparsePrefix;
  payload_.resize(stream_bytes + BitReader::kPadding);
  std::memcpy(payload_.data(), frame.payload.data() + kSparsePrefix, stream_bytes);
  std::memset(payload_.data() + stream_bytes, 0, BitReader::kPadding);
  BitReader r(payload_.data(), stream_bytes);
  // The decode table for these parameters (add frames; kept while they
  // repeat, which they do across the chunks of a tensor).
  const uint32_t* table = nullptr;
  if (coding == ValueCoding::kSignExpGolomb && gap_k + 3 <= kDecodeTableBits) {
    const uint32_t table_key = (wb << 16) | (gap_k << 8) | value_k;
    if (!decode_table_) decode_table_ = std::make_unique_for_overwrite<uint32_t[]>(kDecodeTableSize);
    if (decode_table_key_ != table_key) {
      BuildAddDecodeTable(8 * wb, gap_k, value_k, decode_table_.get());
      decode_table_key_ = table_key;
    }
    table = decode_table_.get();
  }
  Status error;
  const WordImage image = ImageKind(h.dtype);
  WithWordType(wb, [&](auto word) {
    using U = decltype(word);
    WithCoding(coding, [&](auto coding_constant) {
      constexpr ValueCoding kCoding = decltype(coding_constant)::value;
      auto run = [&](auto image_constant) {
        error = Run<&DecodeSparseLoop<U, kCoding, decltype(image_constant)::value>>(
            gap_k, value_k, h, words, where, target, &r, reinterpret_cast<Change<U>*>(changes), table);
      };
      if constexpr (kCoding == ValueCoding::kSignExpGolomb) WithImage(image, run);
      else run(std::integral_constant<WordImage, WordImage::kPlain>{});
    });
  });
  DCR_RETURN_IF_ERROR(error);
  if (r.overrun()) return DataLoss(where + ": sparse payload ends early");
  if (!r.AtPaddedEnd()) return DataLoss(where + ": sparse payload has bytes after its last change");
  return Status::Ok();
}

Status ChunkApplier::DecodeDense(const FrameView& frame, const uint8_t* target, uint32_t words,
                                 const std::string& where, uint8_t* changes, uint32_t* count) {
  const FrameHeader& h = frame.header;
  const uint32_t wb = WordBytes(h.dtype);
  const uint64_t dense_bytes = uint64_t{words} * wb;
  std::span<const uint8_t> dense;
  if (h.codec == Codec::kRaw) {
    if (frame.payload.size() != dense_bytes)
      return DataLoss(
          fmt::format("{}: raw payload of {} bytes, the chunk needs {}", where, frame.payload.size(), dense_bytes));
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
  uint32_t n = 0;
  WithWordType(wb, [&](auto word) {
    using U = decltype(word);
    auto* c = reinterpret_cast<Change<U>*>(changes);
    WithImage(ImageKind(h.dtype), [&](auto image_constant) {
      constexpr WordImage kImage = decltype(image_constant)::value;
      for (uint32_t p = 0; p < words; ++p) {
        const U v = Load<U>(dense.data() + size_t{p} * sizeof(U));
        if (target == nullptr) {  // values only: every word the value changes
          if (v != 0 || h.mode == Mode::kOverwrite) c[n++] = {p, 0, v};
          continue;
        }
        const U old = Load<U>(target + size_t{p} * sizeof(U));
        U nw;
        switch (h.mode) {
          case Mode::kXor: nw = NewWord<Mode::kXor, kImage>(old, v); break;
          case Mode::kAdd: nw = NewWord<Mode::kAdd, kImage>(old, v); break;
          default: nw = v; break;
        }
        if (nw == old) continue;
        c[n++] = {p, old, nw};
      }
    });
  });
  // A nonzero xor or add value changes its word (add: a bijection).
  if (h.mode != Mode::kOverwrite && n != h.changed)
    return DataLoss(fmt::format("{}: dense payload holds {} changes, the header says {}", where, n, h.changed));
  *count = n;
  return Status::Ok();
}

void ChunkApplier::WriteChanges(uint32_t wb, uint32_t n, std::span<uint8_t> target) const {
  const uint8_t* changes = changes_.get();
  WithWordType(wb, [&](auto word) {
    using U = decltype(word);
    const auto* c = reinterpret_cast<const Change<U>*>(changes);
    if constexpr (std::is_same_v<U, uint16_t>) {
      // Each record in one load: the position, and the new word on top.
      for (uint32_t i = 0; i < n; ++i) {
        const uint64_t record = Load<uint64_t>(reinterpret_cast<const uint8_t*>(c + i));
        Store<uint16_t>(target.data() + (record & 0xFFFFFFFFu) * 2, static_cast<uint16_t>(record >> 48));
      }
    } else {
      for (uint32_t i = 0; i < n; ++i) Store<U>(target.data() + size_t{c[i].position} * sizeof(U), c[i].new_word);
    }
  });
}

namespace {

// kInvalidArgument unless `target` is a whole number of the frame's words
// (at most 2^32 of them).
Status CheckTargetSize(const FrameHeader& h, std::span<const uint8_t> target, const std::string& where) {
  const uint64_t wb = WordBytes(h.dtype);
  if (target.size() % wb != 0 || target.size() / wb > 0xFFFFFFFFu)
    return InvalidArgument(
        fmt::format("{}: a {} frame cannot cover a chunk of {} bytes", where, Name(h.dtype), target.size()));
  return Status::Ok();
}

}  // namespace

uint64_t ChunkApplier::DecodedBytes(const FrameHeader& h, uint32_t words) {
  const uint32_t most = h.codec == Codec::kSparse ? std::min(h.changed, words) : words;  // changes the frame may hold
  return uint64_t{most} * ChangeBytes(WordBytes(h.dtype));
}

Result<ChunkChanges> ChunkApplier::DecodeValues(const FrameView& frame, uint32_t words, uint8_t* storage) {
  const FrameHeader& h = frame.header;
  const std::string where = fmt::format("frame (tensor {}, chunk {})", h.tensor, h.chunk);
  uint32_t n = 0;
  DCR_RETURN_IF_ERROR(Decode(frame, nullptr, words, where, storage, &n));
  return ChunkChanges{WordBytes(h.dtype), n, storage != nullptr ? storage : changes_.get()};
}

void ChunkApplier::Resolve(const FrameHeader& h, const ChunkChanges& changes) {
  if (h.mode == Mode::kOverwrite) return;  // the value is the new word
  const WordImage image = ImageKind(h.dtype);
  changes.Visit([&](auto* c) {
    using U = decltype(c->old_word);
    WithImage(image, [&](auto image_constant) {
      constexpr WordImage kImage = decltype(image_constant)::value;
      if (h.mode == Mode::kXor)
        for (uint32_t i = 0; i < changes.count; ++i)
          c[i].new_word = NewWord<Mode::kXor, kImage, U>(c[i].old_word, c[i].new_word);
      else
        for (uint32_t i = 0; i < changes.count; ++i)
          c[i].new_word = NewWord<Mode::kAdd, kImage, U>(c[i].old_word, c[i].new_word);
    });
  });
}

Digest ChangesDigest(const DigestKey& key, uint64_t first_word, const ChunkChanges& changes) {
  Digest d;
  kernels::Kernels().digest_changes(changes.word_bytes, key.seed, first_word, changes.records, changes.count, d.lane);
  return d;
}

Result<ApplyOutcome> ChunkApplier::Apply(const FrameView& frame, const DigestKey& key, uint64_t first_word,
                                         std::span<uint8_t> target, const Digest& current, Digest* after, bool write) {
  const FrameHeader& h = frame.header;
  const std::string where = fmt::format("frame (tensor {}, chunk {})", h.tensor, h.chunk);
  const uint32_t wb = WordBytes(h.dtype);
  DCR_RETURN_IF_ERROR(CheckTargetSize(h, target, where));
  if (current == h.target_digest) {
    *after = current;
    return ApplyOutcome::kAlreadyApplied;
  }

  uint32_t n = 0;
  DCR_RETURN_IF_ERROR(Decode(frame, target.data(), static_cast<uint32_t>(target.size() / wb), where, nullptr, &n));
  const uint8_t* changes = changes_.get();
  Digest d = current;
  WithWordType(wb, [&](auto word) {
    using U = decltype(word);
    d += DigestChanges<U>(key, first_word, reinterpret_cast<const Change<U>*>(changes), n);
  });
  // The digest after the change is computed from the chunk's own words: a
  // chunk not at the frame's base does not reach the target (the frame's
  // checksum held, so the frame is what its publisher wrote).
  if (d != h.target_digest)
    return FailedPrecondition(fmt::format(
        "{}: the target chunk is not this frame's base (applying it would give digest {}, not the frame's target "
        "{}); it needs {} or a resync from a snapshot",
        where, d.ToHex(), h.target_digest.ToHex(),
        h.mode == Mode::kOverwrite ? "a dense overwrite" : "an overwrite frame"));
  if (write) WriteChanges(wb, n, target);
  *after = d;
  return ApplyOutcome::kApplied;
}

}  // namespace dcr
