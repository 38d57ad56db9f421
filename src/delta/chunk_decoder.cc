// Applying a frame to a chunk (ChunkApplier): its payload decoded into
// changes (the sparse bit stream, the dense layouts), checked against the
// frame's digest, then written.
#include "dcr/chunk_codec.h"

#include <fmt/format.h>
#include <zstd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <type_traits>

#include "bitstream.h"
#include "chunk_codec_internal.h"
#include "kernels.h"

namespace dcr {

using namespace chunk_codec_internal;

namespace {

// The low n < 64 bits of x (one bzhi with BMI2).
inline uint64_t LowBits(uint64_t x, uint32_t n) { return x & ((1ull << n) - 1); }

// ---- reading Rice and Exp-Golomb codes ----------------------------------------

constexpr uint32_t kMaxValueK = 56;  // the largest value parameter a reader accepts

inline uint64_t GetRaw(BitReader& r, uint32_t bits) {
  if (bits > 56) {
    const uint64_t lo = r.Get(32);
    return lo | (r.Get(bits - 32) << 32);
  }
  return r.Get(bits);
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

// ---- the sparse bit stream ----------------------------------------------------

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

}  // namespace

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
