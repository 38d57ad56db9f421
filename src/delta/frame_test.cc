// Frames (include/dcr/frame.h): encode/parse round trips for every mode,
// codec and dtype, and every kind of corruption rejected with its code.
#include "dcr/frame.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dcr/hash.h"

namespace dcr {
namespace {

constexpr size_t kHeaderCrcOffset = 92;

std::span<const uint8_t> Bytes(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

// Elements of `dtype` filling `words` words exactly (words chosen to fit).
FrameHeader HeaderFor(DType dtype, uint32_t words, std::mt19937_64& rng) {
  FrameHeader h;
  h.tensor = static_cast<uint32_t>(rng() % 1000);
  h.chunk = static_cast<uint32_t>(rng() % 1000);
  h.first_element = rng() >> 8;
  h.dtype = dtype;
  h.word_bytes = static_cast<uint8_t>(WordBytes(dtype));
  h.words = words;
  h.elements = static_cast<uint32_t>(uint64_t{words} * h.word_bytes * 8 / BitsPerElement(dtype));
  h.changed = static_cast<uint32_t>(rng() % (words + 1));
  h.base_digest.lane[0] = rng();
  h.base_digest.lane[1] = rng();
  h.target_digest.lane[0] = rng();
  h.target_digest.lane[1] = rng();
  h.delta_id = rng();
  return h;
}

// A word count every dtype fills with whole elements (F6: 4 elements per 3
// bytes; C64: 2 words per element).
constexpr uint32_t kWords = 24;

std::vector<uint8_t> RandomPayload(size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> p(n);
  for (auto& b : p) b = static_cast<uint8_t>(rng());
  return p;
}

// Recomputes the header checksum after a deliberate edit, so that the parser
// gets past it to the field checks.
void Reseal(std::string& frame) {
  auto* p = reinterpret_cast<uint8_t*>(frame.data());
  const uint32_t crc = Crc32c(p, kHeaderCrcOffset);
  std::memcpy(p + kHeaderCrcOffset, &crc, 4);
}

template <typename T>
void Poke(std::string& frame, size_t offset, T v) {
  std::memcpy(frame.data() + offset, &v, sizeof v);
}

std::string ValidFrame(std::mt19937_64& rng, std::vector<uint8_t>* payload_out = nullptr) {
  FrameHeader h = HeaderFor(DType::kBF16, kWords, rng);
  h.mode = Mode::kAdd;
  h.codec = Codec::kSparse;
  const auto payload = RandomPayload(37, rng);
  if (payload_out) *payload_out = payload;
  return EncodeFrame(h, payload);
}

TEST(FrameTest, RoundTripEveryModeCodecAndDtype) {
  std::mt19937_64 rng(1);
  int count = 0;
  for (Mode mode : {Mode::kXor, Mode::kAdd, Mode::kOverwrite}) {
    for (Codec codec : {Codec::kSparse, Codec::kZstd, Codec::kRaw}) {
      for (int d = 0; d < kDTypeCount; ++d) {
        const DType dtype = static_cast<DType>(d);
        for (size_t payload_size : {0u, 1u, 95u, 1000u}) {
          FrameHeader h = HeaderFor(dtype, kWords, rng);
          h.mode = mode;
          h.codec = codec;
          h.payload_bytes = 12345;  // EncodeFrame fills these two
          h.payload_crc = 6789;
          const auto payload = RandomPayload(payload_size, rng);
          std::string frame = EncodeFrame(h, payload);
          ASSERT_EQ(frame.size(), kFrameHeaderBytes + payload_size);
          uint32_t magic;
          std::memcpy(&magic, frame.data(), 4);
          EXPECT_EQ(magic, kFrameMagic);
          EXPECT_EQ(std::string_view(frame.data(), 4), "DCRF");
          // Trailing bytes (the next frame) are not part of this one.
          frame += "trailing bytes of the next frame";
          size_t consumed = 0;
          auto view = ParseFrame(Bytes(frame), &consumed);
          ASSERT_TRUE(view.ok()) << view.status().ToString() << " " << Name(dtype) << " " << ModeName(mode) << " "
                                 << CodecName(codec);
          EXPECT_EQ(consumed, kFrameHeaderBytes + payload_size);
          FrameHeader expected = h;
          expected.payload_bytes = static_cast<uint32_t>(payload_size);
          expected.payload_crc = Crc32c(payload.data(), payload.size());
          EXPECT_EQ(view->header, expected);
          EXPECT_EQ(std::vector<uint8_t>(view->payload.begin(), view->payload.end()), payload);
          EXPECT_EQ(view->payload.data(), reinterpret_cast<const uint8_t*>(frame.data()) + kFrameHeaderBytes)
              << "the payload is a view into the frame";
          ++count;
        }
      }
    }
  }
  EXPECT_EQ(count, 3 * 3 * kDTypeCount * 4);
}

TEST(FrameTest, NamesOfModesAndCodecs) {
  EXPECT_EQ(ModeName(Mode::kXor), "xor");
  EXPECT_EQ(ModeName(Mode::kAdd), "add");
  EXPECT_EQ(ModeName(Mode::kOverwrite), "overwrite");
  EXPECT_EQ(CodecName(Codec::kSparse), "sparse");
  EXPECT_EQ(CodecName(Codec::kZstd), "zstd");
  EXPECT_EQ(CodecName(Codec::kRaw), "raw");
}

TEST(FrameTest, FramesBackToBackParseInSequence) {
  std::mt19937_64 rng(2);
  std::string all;
  std::vector<std::vector<uint8_t>> payloads;
  for (int i = 0; i < 10; ++i) {
    std::vector<uint8_t> p;
    FrameHeader h = HeaderFor(DType::kF32, kWords, rng);
    h.chunk = static_cast<uint32_t>(i);
    p = RandomPayload(rng() % 200, rng);
    payloads.push_back(p);
    all += EncodeFrame(h, p);
  }
  size_t offset = 0;
  for (int i = 0; i < 10; ++i) {
    size_t consumed = 0;
    auto view = ParseFrame(Bytes(all).subspan(offset), &consumed);
    ASSERT_TRUE(view.ok()) << view.status().ToString();
    EXPECT_EQ(view->header.chunk, static_cast<uint32_t>(i));
    EXPECT_EQ(std::vector<uint8_t>(view->payload.begin(), view->payload.end()), payloads[static_cast<size_t>(i)]);
    offset += consumed;
  }
  EXPECT_EQ(offset, all.size());
}

TEST(FrameTest, TruncatedHeaderIsDataLoss) {
  std::mt19937_64 rng(3);
  const std::string frame = ValidFrame(rng);
  for (size_t n = 0; n < kFrameHeaderBytes; ++n) {
    auto r = ParseFrame(Bytes(frame).subspan(0, n));
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), Code::kDataLoss) << n << " " << r.status().ToString();
  }
}

TEST(FrameTest, TruncatedPayloadIsDataLoss) {
  std::mt19937_64 rng(4);
  const std::string frame = ValidFrame(rng);
  for (size_t n = kFrameHeaderBytes; n < frame.size(); ++n) {
    auto r = ParseFrame(Bytes(frame).subspan(0, n));
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), Code::kDataLoss) << n << " " << r.status().ToString();
    EXPECT_NE(r.status().message().find("truncated"), std::string::npos) << r.status().message();
  }
  EXPECT_TRUE(ParseFrame(Bytes(frame)).ok());
}

TEST(FrameTest, BadMagicIsInvalidArgument) {
  std::mt19937_64 rng(5);
  std::string frame = ValidFrame(rng);
  frame[0] = 'X';
  Reseal(frame);
  auto r = ParseFrame(Bytes(frame));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("magic"), std::string::npos);
}

TEST(FrameTest, UnknownVersionIsUnimplemented) {
  std::mt19937_64 rng(6);
  for (uint16_t v : {0, 2, 3, 0xFFFF}) {
    std::string frame = ValidFrame(rng);
    Poke<uint16_t>(frame, 4, v);
    // Whether or not the header checksum was updated, the version decides.
    for (bool reseal : {false, true}) {
      std::string f = frame;
      if (reseal) Reseal(f);
      auto r = ParseFrame(Bytes(f));
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().code(), Code::kUnimplemented) << v << " " << r.status().ToString();
    }
  }
}

TEST(FrameTest, WrongHeaderSizeIsInvalidArgument) {
  std::mt19937_64 rng(7);
  std::string frame = ValidFrame(rng);
  Poke<uint16_t>(frame, 6, 128);
  Reseal(frame);
  auto r = ParseFrame(Bytes(frame));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();
}

TEST(FrameTest, HeaderChecksumMismatchIsDataLoss) {
  std::mt19937_64 rng(8);
  const std::string frame = ValidFrame(rng);
  // Any edit of a covered field (offsets 8..91) without resealing.
  for (size_t off = 8; off < kHeaderCrcOffset; ++off) {
    std::string f = frame;
    f[off] = static_cast<char>(f[off] ^ 0x10);
    auto r = ParseFrame(Bytes(f));
    ASSERT_FALSE(r.ok()) << off;
    EXPECT_EQ(r.status().code(), Code::kDataLoss) << off << " " << r.status().ToString();
    EXPECT_NE(r.status().message().find("header checksum"), std::string::npos) << r.status().message();
  }
  // Or of the checksum itself.
  std::string f = frame;
  f[kHeaderCrcOffset + 1] = static_cast<char>(f[kHeaderCrcOffset + 1] ^ 1);
  auto r = ParseFrame(Bytes(f));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kDataLoss);
}

TEST(FrameTest, PayloadChecksumMismatchIsDataLoss) {
  std::mt19937_64 rng(9);
  std::vector<uint8_t> payload;
  const std::string frame = ValidFrame(rng, &payload);
  for (size_t i = 0; i < payload.size(); ++i) {
    std::string f = frame;
    f[kFrameHeaderBytes + i] = static_cast<char>(f[kFrameHeaderBytes + i] ^ 0x80);
    auto r = ParseFrame(Bytes(f));
    ASSERT_FALSE(r.ok()) << i;
    EXPECT_EQ(r.status().code(), Code::kDataLoss) << r.status().ToString();
    EXPECT_NE(r.status().message().find("payload checksum"), std::string::npos) << r.status().message();
  }
  // A payload checksum field that does not match (header resealed).
  std::string f = frame;
  uint32_t crc;
  std::memcpy(&crc, f.data() + 44, 4);
  Poke<uint32_t>(f, 44, crc + 1);
  Reseal(f);
  auto r = ParseFrame(Bytes(f));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kDataLoss);
}

void ExpectInvalid(const std::string& frame, const std::string& what) {
  auto r = ParseFrame(Bytes(frame));
  ASSERT_FALSE(r.ok()) << what;
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << what << ": " << r.status().ToString();
}

TEST(FrameTest, WordCountMustMatchElementsAndDtype) {
  std::mt19937_64 rng(10);
  const auto payload = RandomPayload(10, rng);
  for (int d = 0; d < kDTypeCount; ++d) {
    const DType dtype = static_cast<DType>(d);
    FrameHeader h = HeaderFor(dtype, kWords, rng);
    h.changed = 0;
    ASSERT_TRUE(ParseFrame(Bytes(EncodeFrame(h, payload))).ok()) << Name(dtype);
    FrameHeader bad = h;
    bad.words = h.words + 1;
    ExpectInvalid(EncodeFrame(bad, payload), std::string(Name(dtype)) + " words + 1");
    bad = h;
    bad.words = h.words - 1;
    ExpectInvalid(EncodeFrame(bad, payload), std::string(Name(dtype)) + " words - 1");
    bad = h;
    bad.elements = h.elements + 1;
    ExpectInvalid(EncodeFrame(bad, payload), std::string(Name(dtype)) + " elements + 1");
    bad = h;
    bad.word_bytes = static_cast<uint8_t>(h.word_bytes == 8 ? 4 : h.word_bytes * 2);
    ExpectInvalid(EncodeFrame(bad, payload), std::string(Name(dtype)) + " word size");
    bad = h;
    bad.word_bytes = 0;
    ExpectInvalid(EncodeFrame(bad, payload), std::string(Name(dtype)) + " word size 0");
  }
  // Packed types: an element count that is not a whole number of bytes.
  FrameHeader h = HeaderFor(DType::kF6_E2M3, 3, rng);  // 4 elements in 3 bytes
  h.changed = 0;
  ASSERT_TRUE(ParseFrame(Bytes(EncodeFrame(h, payload))).ok());
  h.elements = 5;  // 30 bits
  ExpectInvalid(EncodeFrame(h, payload), "F6 with 5 elements");
  h = HeaderFor(DType::kF4, 1, rng);
  h.changed = 0;
  h.elements = 1;  // half a byte
  ExpectInvalid(EncodeFrame(h, payload), "F4 with 1 element");
}

TEST(FrameTest, ChangedMustNotExceedWords) {
  std::mt19937_64 rng(11);
  FrameHeader h = HeaderFor(DType::kBF16, kWords, rng);
  h.changed = kWords;
  ASSERT_TRUE(ParseFrame(Bytes(EncodeFrame(h, {}))).ok());
  h.changed = kWords + 1;
  ExpectInvalid(EncodeFrame(h, {}), "changed > words");
  h.changed = 0xFFFFFFFFu;
  ExpectInvalid(EncodeFrame(h, {}), "changed = 2^32 - 1");
}

TEST(FrameTest, UnknownModeCodecOrDtypeIsInvalidArgument) {
  std::mt19937_64 rng(12);
  const std::string frame = ValidFrame(rng);
  for (uint8_t mode : {0, 4, 0xFF}) {
    std::string f = frame;
    Poke<uint8_t>(f, 36, mode);
    Reseal(f);
    ExpectInvalid(f, "mode " + std::to_string(mode));
  }
  for (uint8_t codec : {0, 4, 0xFF}) {
    std::string f = frame;
    Poke<uint8_t>(f, 37, codec);
    Reseal(f);
    ExpectInvalid(f, "codec " + std::to_string(codec));
  }
  for (int dtype : {kDTypeCount, kDTypeCount + 1, 0xFF}) {
    std::string f = frame;
    Poke<uint8_t>(f, 38, static_cast<uint8_t>(dtype));
    Reseal(f);
    ExpectInvalid(f, "dtype " + std::to_string(dtype));
  }
  // The same through EncodeFrame's typed fields.
  FrameHeader h = HeaderFor(DType::kU8, kWords, rng);
  h.mode = static_cast<Mode>(9);
  ExpectInvalid(EncodeFrame(h, {}), "typed mode 9");
  h.mode = Mode::kXor;
  h.codec = static_cast<Codec>(0);
  ExpectInvalid(EncodeFrame(h, {}), "typed codec 0");
}

TEST(FrameTest, NonzeroReservedFieldIsInvalidArgument) {
  std::mt19937_64 rng(13);
  const std::string frame = ValidFrame(rng);
  for (size_t off = 88; off < 92; ++off) {
    std::string f = frame;
    f[off] = 1;
    Reseal(f);
    ExpectInvalid(f, "reserved byte " + std::to_string(off));
  }
}

TEST(FrameTest, EverySingleBitFlipIsRejected) {
  std::mt19937_64 rng(14);
  for (Codec codec : {Codec::kSparse, Codec::kRaw}) {
    FrameHeader h = HeaderFor(DType::kF16, kWords, rng);
    h.mode = Mode::kXor;
    h.codec = codec;
    const std::string frame = EncodeFrame(h, RandomPayload(48, rng));
    ASSERT_TRUE(ParseFrame(Bytes(frame)).ok());
    for (size_t bit = 0; bit < frame.size() * 8; ++bit) {
      std::string f = frame;
      f[bit / 8] = static_cast<char>(f[bit / 8] ^ (1 << (bit % 8)));
      auto r = ParseFrame(Bytes(f));
      EXPECT_FALSE(r.ok()) << "flipping bit " << bit << " (byte " << bit / 8 << ") went unnoticed";
    }
  }
}

TEST(FrameTest, EmptyPayloadFrameParses) {
  std::mt19937_64 rng(15);
  FrameHeader h = HeaderFor(DType::kI64, kWords, rng);
  const std::string frame = EncodeFrame(h, {});
  size_t consumed = 0;
  auto r = ParseFrame(Bytes(frame), &consumed);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(consumed, kFrameHeaderBytes);
  EXPECT_TRUE(r->payload.empty());
  EXPECT_EQ(r->header.payload_crc, Crc32c(nullptr, 0));
}

}  // namespace
}  // namespace dcr
