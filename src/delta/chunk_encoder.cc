// Encoding one chunk's change into a frame (ChunkEncoder): the scan, the
// choice of mode and code parameters, the sparse bit stream's writer and
// the dense layouts.
#include "dcr/chunk_codec.h"

#include <fmt/format.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "bitstream.h"
#include "chunk_codec_internal.h"
#include "kernels.h"

namespace dcr {

using namespace chunk_codec_internal;

namespace {

// ---- bit lengths and magnitudes ----------------------------------------------

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

// ---- writing Rice and Exp-Golomb codes ----------------------------------------

// The low `bits` (<= 64) bits of v.
inline void PutRaw(BitWriter& w, uint64_t v, uint32_t bits) {
  if (bits > 56) {
    w.Put(v & 0xFFFFFFFFu, 32);
    w.Put((v >> 32) & Mask(bits - 32), bits - 32);
  } else {
    w.Put(v & Mask(bits), bits);
  }
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

// ---- the sparse bit stream ----------------------------------------------------

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

// ---- the mode, the codec and the payload --------------------------------------

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

}  // namespace dcr
