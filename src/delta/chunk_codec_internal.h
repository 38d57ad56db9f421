// The pieces of the chunk codec that its encoder (chunk_encoder.cc) and
// decoder (chunk_decoder.cc) both use, inline so that both inline them:
// word images, the hot-loop runner, the sparse payload's value codings.
// Internal to src/delta.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#include "dcr/chunk_codec.h"
#include "dcr/cpu.h"
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

namespace dcr::chunk_codec_internal {

using kernels::Change;

// ---- words and their order-preserving images (add mode) --------------------

enum class WordImage { kSignMagnitude, kTwosComplement, kPlain };

inline WordImage ImageKind(DType dtype) {
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
  static const bool has = !kernels::BaselineIsa() && Cpu().bmi1 && Cpu().bmi2;
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

// The digest change of n changes of one tensor's words of type U (the word
// at first_word + position going from old to new; positions increasing).
template <typename U>
Digest DigestChanges(const DigestKey& key, uint64_t first_word, const Change<U>* changes, uint32_t n) {
  Digest d;
  kernels::Kernels().digest_changes(sizeof(U), key.seed, first_word, changes, n, d.lane);
  return d;
}

// ---- Rice and Exp-Golomb codes with an escape (the general path) -------------
// (written in chunk_encoder.cc, read in chunk_decoder.cc)

// A quotient of kEscape zeros announces a raw value instead.
constexpr uint32_t kEscape = 32;

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

}  // namespace dcr::chunk_codec_internal
