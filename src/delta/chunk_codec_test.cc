// The chunk codec (include/dcr/chunk_codec.h), property-tested: for every
// dtype, chunk size and change rate, with the awkward values of each dtype
// (+0/-0, NaN payloads, infinities, subnormals, integer extremes), every
// frame the encoder produces, in every class, applies to a copy of the base
// and gives the next chunk bit for bit, with the promised digests; duplicate
// frames are no-ops; wrong bases are refused; corrupt payloads never write.
#include "dcr/chunk_codec.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "dcr/synth.h"  // Fp32BitsToBf16Bits (inline)
#include "testing/digest_words.h"

namespace dcr {
namespace {

using Bytes = std::vector<uint8_t>;

std::span<const uint8_t> View(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

using testing::LoadWord;
using testing::StoreWord;
using testing::WordMask;

// ---- dtype layout and special values -----------------------------------------

// The smallest run of words holding whole elements, and its element count.
struct Group {
  uint32_t words, elements;
};
Group GroupOf(DType dtype) {
  const uint32_t bits = BitsPerElement(dtype), wb = WordBytes(dtype);
  if (bits < 8) {
    const uint32_t lcm = std::lcm(bits, 8u);
    return {lcm / 8, lcm / bits};
  }
  return {bits / (8 * wb), 1};
}
uint32_t RoundWords(DType dtype, uint32_t want) {
  const Group g = GroupOf(dtype);
  return std::max<uint32_t>(1, (want + g.words - 1) / g.words) * g.words;
}
uint32_t ElementsOf(DType dtype, uint32_t words) {
  const Group g = GroupOf(dtype);
  return words / g.words * g.elements;
}

// Field masks of one word's value (C64: an F32 lane). Packed F4/F6 bytes
// and integers have no fields (sign_mask = top bit for signed integers).
struct WordFields {
  bool is_float = false;
  uint64_t sign = 0, exponent = 0, mantissa = 0;
};
WordFields FieldsOf(DType dtype) {
  const DTypeInfo& info = Info(dtype);
  WordFields f;
  const uint32_t wbits = 8 * WordBytes(dtype);
  if (info.bits < 8) return f;  // packed bytes: plain bits
  if (info.kind == DTypeKind::kFloat || info.kind == DTypeKind::kComplex) {
    const uint32_t e = info.kind == DTypeKind::kComplex ? 8 : info.exponent_bits;
    const uint32_t m = info.kind == DTypeKind::kComplex ? 23 : info.mantissa_bits;
    const uint32_t s = info.kind == DTypeKind::kComplex ? 1 : info.sign_bits;
    f.is_float = true;
    f.mantissa = (1ull << m) - 1;
    f.exponent = ((1ull << e) - 1) << m;
    f.sign = s ? 1ull << (wbits - 1) : 0;
  } else if (info.kind == DTypeKind::kSigned) {
    f.sign = 1ull << (wbits - 1);
  }
  return f;
}

// The values that break naive codecs: zeros of both signs, infinities, NaNs
// with various payloads, subnormals, largest finite, integer extremes.
std::vector<uint64_t> SpecialWords(DType dtype) {
  const uint32_t wb = WordBytes(dtype);
  const uint64_t mask = WordMask(wb), top = 1ull << (8 * wb - 1);
  std::vector<uint64_t> v = {0, 1, mask, mask - 1, top, top - 1, top + 1, 0x55 & mask, 0xAA & mask};
  const WordFields f = FieldsOf(dtype);
  if (f.is_float) {
    const uint64_t e = f.exponent, m = f.mantissa, s = f.sign;
    v.insert(v.end(), {
                          s,  // -0
                          e, s | e,  // +-inf (or the top exponent)
                          e | 1, e | m, s | e | 1, e | ((m >> 1) + 1),  // NaNs, payloads
                          1, m, s | 1, s | m,  // subnormals
                          (e - (m + 1)) | m,  // largest finite
                      });
  }
  for (auto& x : v) x &= mask;
  return v;
}

// ---- random chunks and changes -----------------------------------------------

Bytes RandomChunk(DType dtype, uint32_t words, std::mt19937_64& rng) {
  const uint32_t wb = WordBytes(dtype);
  const auto specials = SpecialWords(dtype);
  Bytes b(size_t{words} * wb);
  for (uint32_t i = 0; i < words; ++i) {
    uint64_t w = rng();
    switch (rng() % 8) {
      case 0: w = specials[rng() % specials.size()]; break;
      case 1: w = 0; break;
      default: break;
    }
    if (dtype == DType::kBF16 && rng() % 2) {  // realistic weights
      std::normal_distribution<float> nd(0.f, 0.02f);
      const float x = nd(rng);
      uint32_t u;
      std::memcpy(&u, &x, 4);
      w = Fp32BitsToBf16Bits(u);
    }
    StoreWord(b.data() + size_t{i} * wb, wb, w & WordMask(wb));
  }
  return b;
}

// A different value for a word: bit flips, +-1 steps, sign flips (+0 <-> -0),
// special values, NaN payload changes, random words.
uint64_t ChangeWord(DType dtype, uint64_t old, std::mt19937_64& rng) {
  const uint32_t wb = WordBytes(dtype);
  const uint64_t mask = WordMask(wb), top = 1ull << (8 * wb - 1);
  const WordFields f = FieldsOf(dtype);
  uint64_t nw = old;
  switch (rng() % 9) {
    case 0: nw = old ^ (1ull << (rng() % (8 * wb))); break;
    case 1: nw = old + 1; break;
    case 2: nw = old - 1; break;
    case 3: nw = old ^ top; break;  // sign: +0 <-> -0, +inf <-> -inf
    case 4: {
      const auto s = SpecialWords(dtype);
      nw = s[rng() % s.size()];
      break;
    }
    case 5:
      if (f.is_float) {  // a NaN with another payload
        nw = (old & f.sign) | f.exponent | ((rng() & f.mantissa) | 1);
        break;
      }
      [[fallthrough]];
    case 6: nw = rng(); break;
    case 7: nw = old + (rng() % 16) - 8; break;  // small steps
    default: nw = old ^ (rng() & 0xF); break;  // low bits
  }
  nw &= mask;
  if (nw == old) nw = old ^ 1;
  return nw;
}

// next = base with `count` distinct words changed.
Bytes Mutate(DType dtype, const Bytes& base, uint32_t count, std::mt19937_64& rng, std::vector<uint32_t>* positions) {
  const uint32_t wb = WordBytes(dtype);
  const uint32_t words = static_cast<uint32_t>(base.size() / wb);
  std::vector<uint32_t> all(words);
  std::iota(all.begin(), all.end(), 0u);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(std::min(count, words));
  std::sort(all.begin(), all.end());
  Bytes next = base;
  for (uint32_t p : all) {
    const uint64_t old = LoadWord(base.data() + size_t{p} * wb, wb);
    StoreWord(next.data() + size_t{p} * wb, wb, ChangeWord(dtype, old, rng));
  }
  if (positions) *positions = all;
  return next;
}

// ---- encoding and applying -------------------------------------------------------

struct Variant {
  const char* name;
  EncodeOptions options;
};
std::vector<Variant> Variants() {
  std::vector<Variant> v(4);
  v[0].name = "xor-class";
  v[1].name = "xor-class --no-add";
  v[1].options.allow_add = false;
  v[2].name = "xor-class add only";
  v[2].options.allow_xor = false;
  v[3].name = "overwrite";
  v[3].options.delta_class = DeltaClass::kOverwrite;
  return v;
}

FrameView Parse(const std::string& frame) {
  auto v = ParseFrame(View(frame));
  EXPECT_TRUE(v.ok()) << v.status().ToString();
  return v.ok() ? *v : FrameView{};
}

struct Encoded {
  bool changed = false;
  FrameHeader header;
  std::string frame;  // the serialised frame (header + payload)
  Digest base_digest;
};

// Statistics across the sweep, to check the sweep reached every path.
std::set<std::pair<Mode, Codec>>& SeenKinds() {
  static std::set<std::pair<Mode, Codec>> s;
  return s;
}

Encoded EncodeChunk(DType dtype, const DigestKey& key, uint64_t first_word, const Bytes& base, const Bytes& next,
                    const EncodeOptions& options) {
  ChunkEncoder encoder;
  EncodedChunk out;
  const uint32_t words = static_cast<uint32_t>(base.size() / WordBytes(dtype));
  ChunkInput in{dtype, key, first_word, ElementsOf(dtype, words), base, next};
  auto r = encoder.Encode(in, options, &out);
  Encoded e;
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) return e;
  e.changed = *r;
  e.base_digest = out.base_digest;
  if (e.changed) {
    e.frame = EncodeFrame(out.header, out.payload);
    e.header = Parse(e.frame).header;  // with payload_bytes, crc and header_bytes
    SeenKinds().insert({out.header.mode, out.header.codec});
  }
  return e;
}

struct Applied {
  Status status;
  ApplyOutcome outcome = ApplyOutcome::kApplied;
  Digest after;
};

Applied ApplyTo(const std::string& frame, const DigestKey& key, uint64_t first_word, uint32_t wb, Bytes& target) {
  ChunkApplier applier;
  const FrameView view = Parse(frame);
  const Digest current = testing::ChunkDigest(key, wb, first_word, target);
  Applied a;
  a.after.lane[0] = 0xDEAD;
  auto r = applier.Apply(view, key, first_word, target, current, &a.after);
  if (r.ok()) a.outcome = *r;
  else a.status = r.status();
  return a;
}

// A frame with the same header but another payload, whose checksum is valid:
// what a buggy or malicious sender could produce.
std::string WithPayload(const FrameHeader& h, const Bytes& payload) { return EncodeFrame(h, payload); }

Bytes PayloadOf(const std::string& frame) {
  return Bytes(frame.begin() + Parse(frame).header.header_bytes, frame.end());
}

// Applying `frame` to `target` must fail with one of the allowed codes and
// leave it untouched, or (only when `may_decode_correctly`) produce exactly
// `next`. A corrupt frame that writes wrong bits passed the digest check: it
// is counted in *wrong (with the first example in *example) and reported
// once per chunk, since one weakness of the digest shows up many times.
void ExpectRejectedOrCorrect(const std::string& frame, const DigestKey& key, uint64_t first_word, uint32_t wb,
                             const Bytes& start, const Bytes& next, bool may_decode_correctly, const std::string& what,
                             int* wrong, std::string* example) {
  Bytes target = start;
  const Applied a = ApplyTo(frame, key, first_word, wb, target);
  if (a.status.ok()) {
    if (target != next) {
      if ((*wrong)++ == 0) {
        *example = what + ": words";
        for (size_t i = 0; i < target.size(); i += wb)
          if (std::memcmp(&target[i], &next[i], wb) != 0)
            *example += fmt::format(" {} ({:#x} -> {:#x})", i / wb, LoadWord(&next[i], wb), LoadWord(&target[i], wb));
        *example += " differ from the target, yet the digest matched";
      }
      return;
    }
    EXPECT_TRUE(may_decode_correctly) << what << ": a corrupt frame was accepted";
    return;
  }
  EXPECT_TRUE(a.status.code() == Code::kDataLoss || a.status.code() == Code::kFailedPrecondition)
      << what << ": " << a.status.ToString();
  EXPECT_TRUE(target == start) << what << ": a rejected frame wrote to the target";
}

std::string fmt_ctx(DType dtype, uint32_t words, double rate) {
  return std::string(Name(dtype)) + ", " + std::to_string(words) + " words, rate " + std::to_string(rate);
}

struct CaseParams {
  DType dtype;
  uint32_t words;
  double rate;
  uint64_t seed;
  bool corrupt;  // also run the corruption checks
};

void RunCase(const CaseParams& c) {
  std::mt19937_64 rng(c.seed);
  const DType dtype = c.dtype;
  const uint32_t wb = WordBytes(dtype);
  const uint32_t words = c.words;
  const std::string ctx = fmt_ctx(dtype, words, c.rate);
  SCOPED_TRACE(ctx);
  const DigestKey key = MakeDigestKey(std::string("tensor.") + std::string(Name(dtype)));
  const uint64_t first_word = (rng() % 4) * uint64_t{words} + (rng() % 2 ? 4090 : 0);

  const Bytes base = RandomChunk(dtype, words, rng);
  const uint32_t count = c.rate == 0 ? 0 : std::max<uint32_t>(1, static_cast<uint32_t>(std::llround(c.rate * words)));
  std::vector<uint32_t> positions;
  const Bytes next = Mutate(dtype, base, count, rng, &positions);
  const uint32_t changed = static_cast<uint32_t>(positions.size());
  ASSERT_EQ(changed, std::min(count, words));
  const Digest base_digest = testing::ChunkDigest(key, wb, first_word, base);
  const Digest next_digest = testing::ChunkDigest(key, wb, first_word, next);

  // A chunk that is neither base nor target: one word away from the base,
  // at an unchanged position when there is one.
  Bytes other = base;
  {
    uint32_t p = 0;
    if (changed < words) {
      std::vector<bool> is_changed(words, false);
      for (uint32_t q : positions) is_changed[q] = true;
      do p = static_cast<uint32_t>(rng() % words);
      while (is_changed[p]);
    }
    const uint64_t b = LoadWord(base.data() + size_t{p} * wb, wb), n = LoadWord(next.data() + size_t{p} * wb, wb);
    uint64_t o = b ^ 1;
    if (o == n) o = b ^ 2;
    StoreWord(other.data() + size_t{p} * wb, wb, o);
  }
  // Half of the changes done (every other changed position).
  Bytes half = base;
  for (size_t i = 0; i < positions.size(); i += 2)
    std::memcpy(half.data() + size_t{positions[i]} * wb, next.data() + size_t{positions[i]} * wb, wb);

  std::map<std::string, Encoded> frames;
  for (const Variant& v : Variants()) {
    SCOPED_TRACE(v.name);
    const Encoded e = EncodeChunk(dtype, key, first_word, base, next, v.options);
    EXPECT_EQ(e.base_digest, base_digest);
    ASSERT_EQ(e.changed, changed > 0);
    if (!e.changed) continue;
    frames[v.name] = e;
    const FrameHeader& h = e.header;
    EXPECT_EQ(h.changed, changed);
    EXPECT_EQ(h.dtype, dtype);
    EXPECT_EQ(h.target_digest, next_digest);
    if (v.options.delta_class == DeltaClass::kOverwrite) EXPECT_EQ(h.mode, Mode::kOverwrite);
    else if (!v.options.allow_add) EXPECT_EQ(h.mode, Mode::kXor);
    else if (!v.options.allow_xor) EXPECT_EQ(h.mode, Mode::kAdd);
    else EXPECT_NE(h.mode, Mode::kOverwrite);
    // Never larger than the dense chunk (a dense frame is dense bytes + header).
    EXPECT_LE(h.payload_bytes, uint64_t{words} * wb) << ModeName(h.mode) << "/" << CodecName(h.codec);
    EXPECT_LE(e.frame.size(), uint64_t{words} * wb + kMaxFrameHeaderBytes);

    // Apply to a copy of the base: exactly next, with the promised digest.
    Bytes target = base;
    Applied a = ApplyTo(e.frame, key, first_word, wb, target);
    ASSERT_TRUE(a.status.ok()) << a.status.ToString() << " " << ModeName(h.mode) << "/" << CodecName(h.codec);
    EXPECT_EQ(a.outcome, ApplyOutcome::kApplied);
    ASSERT_TRUE(target == next) << ModeName(h.mode) << "/" << CodecName(h.codec) << ": wrong bits";
    EXPECT_EQ(a.after, h.target_digest);
    EXPECT_EQ(a.after, next_digest);

    // The same frame again: a no-op.
    a = ApplyTo(e.frame, key, first_word, wb, target);
    ASSERT_TRUE(a.status.ok()) << a.status.ToString();
    EXPECT_EQ(a.outcome, ApplyOutcome::kAlreadyApplied);
    EXPECT_TRUE(target == next);
    EXPECT_EQ(a.after, next_digest);

    // A target the frame's changes run past (the frame does not say the
    // chunk's size: its receiver does), with that target's own digest:
    // refused, nothing written. And a target not of whole words.
    if (!positions.empty()) {
      Bytes shorter(base.begin(), base.begin() + static_cast<ptrdiff_t>(size_t{positions.back()} * wb));
      const Bytes before = shorter;
      const Digest digest = testing::ChunkDigest(key, wb, first_word, shorter);
      ChunkApplier applier;
      Digest after;
      auto r = applier.Apply(Parse(e.frame), key, first_word, shorter, digest, &after);
      // (Unless its digest is the target's: zero words only, seen as done.)
      if (digest != next_digest) {
        ASSERT_FALSE(r.ok());
        EXPECT_TRUE(r.status().code() == Code::kDataLoss || r.status().code() == Code::kFailedPrecondition)
            << r.status().ToString();
        EXPECT_TRUE(shorter == before);
      }
      if (wb > 1) {
        Bytes ragged(base.begin(), base.end() - 1);
        r = applier.Apply(Parse(e.frame), key, first_word, ragged, base_digest, &after);
        ASSERT_FALSE(r.ok());
        EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
      }
    }

    // A chunk that is neither the base nor the target.
    Bytes t2 = other;
    a = ApplyTo(e.frame, key, first_word, wb, t2);
    if (h.mode != Mode::kOverwrite) {
      ASSERT_FALSE(a.status.ok());
      EXPECT_EQ(a.status.code(), Code::kFailedPrecondition) << a.status.ToString();
      EXPECT_TRUE(t2 == other) << "a refused frame wrote to the target";
    } else if (h.codec == Codec::kSparse && changed < words) {
      // A sparse overwrite only rewrites its positions: it cannot repair a
      // word elsewhere, and says so without writing.
      ASSERT_FALSE(a.status.ok());
      EXPECT_EQ(a.status.code(), Code::kFailedPrecondition) << a.status.ToString();
      EXPECT_TRUE(t2 == other);
    } else {
      // A dense overwrite carries every word: it repairs anything.
      ASSERT_TRUE(a.status.ok()) << a.status.ToString();
      EXPECT_EQ(a.outcome, ApplyOutcome::kApplied);
      EXPECT_TRUE(t2 == next);
      EXPECT_EQ(a.after, next_digest);
    }

    // Half of the changes already made (an interrupted non-atomic write).
    if (changed >= 2) {
      Bytes t3 = half;
      a = ApplyTo(e.frame, key, first_word, wb, t3);
      if (h.mode == Mode::kOverwrite) {
        ASSERT_TRUE(a.status.ok()) << "overwrite must repair a half-applied chunk: " << a.status.ToString();
        EXPECT_EQ(a.outcome, ApplyOutcome::kApplied);
        EXPECT_TRUE(t3 == next);
        EXPECT_EQ(a.after, next_digest);
      } else {
        ASSERT_FALSE(a.status.ok());
        EXPECT_EQ(a.status.code(), Code::kFailedPrecondition) << a.status.ToString();
        EXPECT_TRUE(t3 == half);
      }
    }

    if (!c.corrupt) continue;
    int wrong = 0;
    std::string example;
    auto check = [&](const std::string& frame, bool may_decode_correctly, const std::string& what) {
      ExpectRejectedOrCorrect(frame, key, first_word, wb, base, next, may_decode_correctly, what, &wrong, &example);
    };
    const Bytes payload = PayloadOf(e.frame);
    const bool zstd = h.codec == Codec::kZstd;
    // Truncated payloads with a valid checksum: always rejected.
    for (size_t cut : {size_t{1}, size_t{2}, size_t{5}, payload.size() / 2, payload.size()}) {
      if (cut == 0 || cut > payload.size()) continue;
      const Bytes p(payload.begin(), payload.end() - static_cast<ptrdiff_t>(cut));
      check(WithPayload(h, p), false, "payload truncated by " + std::to_string(cut));
    }
    // One extra byte.
    {
      Bytes p = payload;
      p.push_back(0);
      check(WithPayload(h, p), false, "a zero byte appended");
      p.back() = 0x5A;
      check(WithPayload(h, p), false, "a byte appended");
    }
    // Bit flips: every bit of short payloads, a sample of long ones. A flip
    // must never decode to a wrong chunk; where the encoding has slack it
    // may decode to the right one.
    const size_t nbits = payload.size() * 8;
    std::vector<size_t> flips;
    if (nbits <= 512) {
      flips.resize(nbits);
      std::iota(flips.begin(), flips.end(), size_t{0});
    } else {
      for (size_t i = 0; i < 64; ++i) flips.push_back(i);  // the sparse prefix, a zstd header
      for (int i = 0; i < 128; ++i) flips.push_back(rng() % nbits);
      for (size_t i = nbits - 16; i < nbits; ++i) flips.push_back(i);  // the padding
    }
    for (size_t bit : flips) {
      Bytes p = payload;
      p[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      // Sparse payloads are not canonical either: the value-code parameter
      // (prefix byte 2) is unused by overwrite's raw values, and a larger
      // Exp-Golomb order can read the last value's code plus zero padding
      // as the same value. A raw payload has no slack: every flip is caught.
      const bool slack = zstd || h.codec == Codec::kSparse;
      check(WithPayload(h, p), slack, "payload bit " + std::to_string(bit) + " flipped");
    }
    // Garbage of the same length, and of other lengths.
    for (int i = 0; i < 4; ++i) {
      Bytes p(i == 0 ? payload.size() : rng() % (2 * payload.size() + 8));
      for (auto& b : p) b = static_cast<uint8_t>(rng());
      check(WithPayload(h, p), false, "garbage payload");
    }
    // Headers that lie about the payload (valid checksums throughout).
    {
      FrameHeader lie = h;
      lie.changed = h.changed == words ? h.changed - 1 : h.changed + 1;
      if (!(h.mode == Mode::kOverwrite && h.codec != Codec::kSparse))  // dense overwrite ignores `changed`
        check(WithPayload(lie, payload), false, "changed count");
      lie = h;
      lie.target_digest.lane[1] ^= 4;
      check(WithPayload(lie, payload), false, "target digest");
      lie = h;
      lie.target_digest.lane[0] += 1;
      check(WithPayload(lie, payload), false, "target digest");
      for (Mode m : {Mode::kXor, Mode::kAdd, Mode::kOverwrite}) {
        if (m == h.mode) continue;
        lie = h;
        lie.mode = m;
        // The payload read in another mode: it may happen to give the same
        // bits (an xor of 1 on an even word is an add of 1), never others.
        check(WithPayload(lie, payload), true, std::string("mode ") + std::string(ModeName(m)));
      }
      if (h.mode != Mode::kOverwrite && words > 0) {
        // Applied to a chunk that is not its base (one word off, outside or
        // at the frame's positions): refused before a byte is written.
        for (size_t at : {size_t{0}, size_t{words - 1}}) {
          Bytes t = base;
          t[at * wb] ^= 1;
          if (t == next) continue;  // that flip was the change itself
          const Bytes before = t;
          const Applied r = ApplyTo(e.frame, key, first_word, wb, t);
          ASSERT_FALSE(r.status.ok());
          EXPECT_EQ(r.status.code(), Code::kFailedPrecondition) << r.status.ToString();
          EXPECT_TRUE(t == before);
        }
      }
    }
    EXPECT_EQ(wrong, 0) << wrong << " corrupt " << ModeName(h.mode) << "/" << CodecName(h.codec)
                        << " frames wrote wrong bits; the first: " << example;
  }

  if (changed == 0) return;
  // Overwrite repairs a chunk that got only half of an xor-class frame.
  if (changed >= 2) {
    Bytes t = half;
    const Applied a = ApplyTo(frames["overwrite"].frame, key, first_word, wb, t);
    ASSERT_TRUE(a.status.ok()) << a.status.ToString();
    EXPECT_TRUE(t == next);
  }
  // The xor-class choice between xor and add is made on the sparse codes'
  // sizes: when all three frames are sparse, it is the smaller of the two.
  // (With dense frames the choice is not revisited: zstd of the other mode
  // can come out a few bytes smaller.)
  const Encoded& best = frames["xor-class"];
  const Encoded& x = frames["xor-class --no-add"];
  const Encoded& a = frames["xor-class add only"];
  if (best.header.codec == Codec::kSparse && x.header.codec == Codec::kSparse && a.header.codec == Codec::kSparse) {
    EXPECT_LE(best.frame.size(), x.frame.size());
    EXPECT_LE(best.frame.size(), a.frame.size());
  }
  EXPECT_TRUE(best.frame == x.frame || best.frame == a.frame) << "the xor-class frame is the xor or the add frame";
}

const double kRates[] = {0, 1e-4, 0.01, 0.03, 0.3, 1.0};

class ChunkCodecDtypeTest : public ::testing::TestWithParam<int> {};

TEST_P(ChunkCodecDtypeTest, EveryRateAndSizeRoundTrips) {
  const DType dtype = static_cast<DType>(GetParam());
  uint64_t seed = 1000 * static_cast<uint64_t>(GetParam());
  for (uint32_t want : {1u, 7u, 64u, 4097u, 30000u}) {
    const uint32_t words = RoundWords(dtype, want);
    for (double rate : kRates) {
      const bool corrupt = (want == 7 || want == 4097) && rate >= 0.01;
      RunCase({dtype, words, rate, ++seed, corrupt});
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, ChunkCodecDtypeTest, ::testing::Range(0, kDTypeCount),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return std::string(Name(static_cast<DType>(param_info.param)));
                         });

TEST(ChunkCodecTest, ManySmallRandomChunks) {
  // Lots of seeds on small chunks, where every boundary case of the codes
  // (escapes, gaps at the ends, single changes) is cheap to reach.
  for (int d = 0; d < kDTypeCount; ++d) {
    const DType dtype = static_cast<DType>(d);
    for (uint64_t seed = 0; seed < 30; ++seed) {
      std::mt19937_64 rng(seed * 31 + d);
      const uint32_t words = RoundWords(dtype, 1 + static_cast<uint32_t>(rng() % 40));
      const double rate = kRates[rng() % std::size(kRates)];
      RunCase({dtype, words, rate, seed * 7919 + static_cast<uint64_t>(d), seed % 3 == 0});
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(ChunkCodecTest, SweepReachesEveryModeAndCodec) {
  // Runs after the sweeps above in this binary; make sure on its own too.
  for (int d : {static_cast<int>(DType::kBF16), static_cast<int>(DType::kF32)})
    for (double rate : {0.01, 0.3, 1.0}) RunCase({static_cast<DType>(d), 4096, rate, 77, false});
  // Zstd wins for compressible dense changes.
  {
    const DigestKey key = MakeDigestKey("zstd");
    // A periodic pattern of incompressible-looking words: large for the
    // sparse codes, tiny for zstd.
    std::mt19937_64 rng(3);
    Bytes base(4 * 8192, 0), next(4 * 8192), period(64);
    for (auto& b : period) b = static_cast<uint8_t>(rng() | 0x80);
    for (size_t i = 0; i < next.size(); ++i) next[i] = period[i % period.size()];
    for (const Variant& v : Variants()) {
      const Encoded e = EncodeChunk(DType::kF32, key, 0, base, next, v.options);
      ASSERT_TRUE(e.changed);
      EXPECT_EQ(e.header.codec, Codec::kZstd) << v.name;
      Bytes t = base;
      ASSERT_TRUE(ApplyTo(e.frame, key, 0, 4, t).status.ok());
      EXPECT_TRUE(t == next);
    }
  }
  // Raw wins for incompressible dense changes.
  {
    const DigestKey key = MakeDigestKey("raw");
    std::mt19937_64 rng(4);
    Bytes base(4 * 4096), next(4 * 4096);
    for (auto& b : base) b = static_cast<uint8_t>(rng());
    for (auto& b : next) b = static_cast<uint8_t>(rng());
    for (const Variant& v : Variants()) {
      const Encoded e = EncodeChunk(DType::kU32, key, 0, base, next, v.options);
      ASSERT_TRUE(e.changed);
      EXPECT_EQ(e.header.codec, Codec::kRaw) << v.name;
      EXPECT_EQ(e.header.payload_bytes, base.size()) << v.name;
      Bytes t = base;
      ASSERT_TRUE(ApplyTo(e.frame, key, 0, 4, t).status.ok());
      EXPECT_TRUE(t == next);
    }
  }
  std::set<Mode> modes;
  std::set<Codec> codecs;
  std::string seen;
  for (const auto& [m, c] : SeenKinds()) {
    modes.insert(m);
    codecs.insert(c);
    seen += std::string(ModeName(m)) + "/" + std::string(CodecName(c)) + " ";
  }
  EXPECT_EQ(modes.size(), 3u) << seen;
  EXPECT_EQ(codecs.size(), 3u) << seen;
}

TEST(ChunkCodecTest, NoChangeIsNoFrame) {
  std::mt19937_64 rng(5);
  for (int d = 0; d < kDTypeCount; ++d) {
    const DType dtype = static_cast<DType>(d);
    const uint32_t words = RoundWords(dtype, 100);
    const Bytes base = RandomChunk(dtype, words, rng);
    const DigestKey key = MakeDigestKey("same");
    for (const Variant& v : Variants()) {
      ChunkEncoder enc;
      EncodedChunk out;
      auto r = enc.Encode({dtype, key, 123, ElementsOf(dtype, words), base, base}, v.options, &out);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_FALSE(*r);
      EXPECT_EQ(out.base_digest, testing::ChunkDigest(key, WordBytes(dtype), 123, base));
    }
  }
}

TEST(ChunkCodecTest, EncoderRejectsInconsistentInput) {
  const DigestKey key = MakeDigestKey("bad");
  Bytes a(64, 0), b(64, 1), c(62, 1);
  ChunkEncoder enc;
  EncodedChunk out;
  EncodeOptions opt;
  // Sizes that disagree with the element count or with each other.
  auto r = enc.Encode({DType::kBF16, key, 0, 31, a, b}, opt, &out);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  r = enc.Encode({DType::kBF16, key, 0, 32, a, c}, opt, &out);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  r = enc.Encode({DType::kF6_E2M3, key, 0, 3, Bytes(3, 0), Bytes(3, 1)}, opt, &out);  // 18 bits
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  // Both xor-class modes disabled.
  opt.allow_add = opt.allow_xor = false;
  r = enc.Encode({DType::kBF16, key, 0, 32, a, b}, opt, &out);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
}

TEST(ChunkCodecTest, EncoderAndApplierAreReusable) {
  // One encoder and one applier across chunks of different dtypes and sizes
  // (scratch buffers must not leak state between calls).
  std::mt19937_64 rng(9);
  ChunkEncoder enc;
  ChunkApplier app;
  for (int i = 0; i < 200; ++i) {
    const DType dtype = static_cast<DType>(rng() % kDTypeCount);
    const uint32_t words = RoundWords(dtype, 1 + static_cast<uint32_t>(rng() % 3000));
    const uint32_t wb = WordBytes(dtype);
    const Bytes base = RandomChunk(dtype, words, rng);
    const Bytes next = Mutate(dtype, base, static_cast<uint32_t>(rng() % (words + 1)), rng, nullptr);
    const DigestKey key = MakeDigestKey("reuse" + std::to_string(i));
    EncodeOptions opt = Variants()[rng() % 4].options;
    EncodedChunk out;
    auto r = enc.Encode({dtype, key, 0, ElementsOf(dtype, words), base, next}, opt, &out);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    if (!*r) {
      EXPECT_TRUE(base == next);
      continue;
    }
    const std::string frame = EncodeFrame(out.header, out.payload);
    Bytes t = base;
    Digest after;
    auto a = app.Apply(Parse(frame), key, 0, t, testing::ChunkDigest(key, wb, 0, base), &after);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_TRUE(t == next) << i;
  }
}

TEST(ChunkCodecTest, AddBeatsXorForSmallBf16Steps) {
  std::mt19937_64 rng(11);
  const uint32_t words = 65536;
  Bytes base(size_t{words} * 2);
  std::normal_distribution<float> nd(0.f, 0.02f);
  for (uint32_t i = 0; i < words; ++i) {
    float x = nd(rng);
    if (x == 0) x = 0.01f;
    uint32_t u;
    std::memcpy(&u, &x, 4);
    StoreWord(base.data() + 2 * i, 2, Fp32BitsToBf16Bits(u));
  }
  // 3% of the weights move by one ulp, up or down (as a BF16 optimiser step does).
  Bytes next = base;
  uint32_t changed = 0;
  for (uint32_t i = 0; i < words; ++i) {
    if (rng() % 1000 >= 30) continue;
    const uint64_t w = LoadWord(base.data() + 2 * i, 2);
    StoreWord(next.data() + 2 * i, 2, rng() % 2 ? w + 1 : w - 1);
    ++changed;
  }
  const DigestKey key = MakeDigestKey("model.layers.0.mlp.down_proj.weight");
  const Encoded e = EncodeChunk(DType::kBF16, key, 0, base, next, EncodeOptions{});
  ASSERT_TRUE(e.changed);
  EXPECT_EQ(e.header.mode, Mode::kAdd);
  EXPECT_EQ(e.header.codec, Codec::kSparse);
  EXPECT_EQ(e.header.changed, changed);
  const double per_change = static_cast<double>(e.header.payload_bytes) / changed;
  EXPECT_LT(per_change, 2.0) << e.header.payload_bytes << " bytes for " << changed << " changes";
  EncodeOptions no_add;
  no_add.allow_add = false;
  const Encoded x = EncodeChunk(DType::kBF16, key, 0, base, next, no_add);
  EXPECT_EQ(x.header.mode, Mode::kXor);
  EXPECT_LT(e.header.payload_bytes, x.header.payload_bytes);
  Bytes t = base;
  ASSERT_TRUE(ApplyTo(e.frame, key, 0, 2, t).status.ok());
  EXPECT_TRUE(t == next);
}

TEST(ChunkCodecTest, DenseChunksNeverExceedDenseSize) {
  // 100% changed with incompressible values: at most the dense bytes.
  std::mt19937_64 rng(12);
  for (int d = 0; d < kDTypeCount; ++d) {
    const DType dtype = static_cast<DType>(d);
    const uint32_t wb = WordBytes(dtype);
    for (uint32_t want : {1u, 3u, 1000u, 4097u}) {
      const uint32_t words = RoundWords(dtype, want);
      Bytes base(size_t{words} * wb), next(size_t{words} * wb);
      for (auto& b : base) b = static_cast<uint8_t>(rng());
      for (uint32_t i = 0; i < words; ++i) {
        const uint64_t o = LoadWord(base.data() + size_t{i} * wb, wb);
        uint64_t n = rng() & WordMask(wb);
        if (n == o) n ^= 1;
        StoreWord(next.data() + size_t{i} * wb, wb, n);
      }
      const DigestKey key = MakeDigestKey("dense");
      for (const Variant& v : Variants()) {
        const Encoded e = EncodeChunk(dtype, key, 0, base, next, v.options);
        ASSERT_TRUE(e.changed);
        EXPECT_LE(e.frame.size(), size_t{words} * wb + kMaxFrameHeaderBytes) << Name(dtype) << " " << v.name;
        Bytes t = base;
        ASSERT_TRUE(ApplyTo(e.frame, key, 0, wb, t).status.ok()) << Name(dtype) << " " << v.name;
        EXPECT_TRUE(t == next);
      }
    }
  }
}

}  // namespace
}  // namespace dcr
