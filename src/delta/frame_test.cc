// Frames (include/dcr/frame.h): encode/parse round trips for every mode,
// codec and dtype and every varint length, and every kind of corruption
// rejected with its code.
#include "dcr/frame.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dcr/hash.h"

namespace dcr {
namespace {

std::span<const uint8_t> Bytes(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

FrameHeader RandomHeader(DType dtype, std::mt19937_64& rng) {
  FrameHeader h;
  h.tensor = static_cast<uint32_t>(rng() % 1000);
  h.chunk = static_cast<uint32_t>(rng() % 1000);
  h.dtype = dtype;
  h.changed = static_cast<uint32_t>(rng() % 100000);
  h.target_digest.lane[0] = rng() % kDigestPrime;
  h.target_digest.lane[1] = rng() % kDigestPrime;
  return h;
}

std::vector<uint8_t> RandomPayload(size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> p(n);
  for (auto& b : p) b = static_cast<uint8_t>(rng());
  return p;
}

// The checksum field's offset in an encoded frame.
size_t CrcOffset(const std::string& frame) {
  auto h = ParseFrameHeader(Bytes(frame));
  EXPECT_TRUE(h.ok()) << h.status().ToString();
  return h.ok() ? h->header_bytes - 4 : 0;
}

// Recomputes the checksum at `crc_at` after a deliberate edit, so that the
// parser gets past it to the field checks.
void Reseal(std::string& frame, size_t crc_at) {
  uint32_t crc = Crc32c(frame.data(), crc_at);
  crc = Crc32c(frame.data() + crc_at + 4, frame.size() - crc_at - 4, crc);
  std::memcpy(frame.data() + crc_at, &crc, 4);
}

std::string ValidFrame(std::mt19937_64& rng, std::vector<uint8_t>* payload_out = nullptr) {
  FrameHeader h = RandomHeader(DType::kBF16, rng);
  h.mode = Mode::kAdd;
  h.codec = Codec::kSparse;
  const auto payload = RandomPayload(37, rng);
  if (payload_out) *payload_out = payload;
  return EncodeFrame(h, payload);
}

TEST(FrameTest, RoundTripEveryModeCodecDtypeAndFieldSize) {
  std::mt19937_64 rng(1);
  int count = 0;
  const uint32_t sizes[] = {0, 127, 128, 16383, 16384, 0xFFFFFFFFu};  // varints of 1, 1, 2, 2, 3, 5 bytes
  for (Mode mode : {Mode::kXor, Mode::kAdd, Mode::kOverwrite}) {
    for (Codec codec : {Codec::kSparse, Codec::kZstd, Codec::kRaw}) {
      for (int d = 0; d < kDTypeCount; ++d) {
        const DType dtype = static_cast<DType>(d);
        for (size_t payload_size : {0u, 1u, 95u, 1000u}) {
          FrameHeader h = RandomHeader(dtype, rng);
          h.mode = mode;
          h.codec = codec;
          h.tensor = sizes[rng() % 6];
          h.chunk = sizes[rng() % 6];
          h.changed = sizes[rng() % 6];
          h.payload_bytes = 12345;  // EncodeFrame fills these three
          h.crc = 6789;
          h.header_bytes = 1;
          const auto payload = RandomPayload(payload_size, rng);
          std::string frame = EncodeFrame(h, payload);
          EXPECT_EQ(static_cast<uint8_t>(frame[0]), kFrameTag);
          // Trailing bytes (the next frame) are not part of this one.
          const size_t size = frame.size();
          frame += "trailing bytes of the next frame";
          size_t consumed = 0;
          auto view = ParseFrame(Bytes(frame), &consumed);
          ASSERT_TRUE(view.ok()) << view.status().ToString() << " " << Name(dtype) << " " << ModeName(mode) << " "
                                 << CodecName(codec);
          EXPECT_EQ(consumed, size);
          const uint32_t header_bytes = static_cast<uint32_t>(size - payload_size);
          EXPECT_GE(header_bytes, kMinFrameHeaderBytes);
          EXPECT_LE(header_bytes, kMaxFrameHeaderBytes);
          FrameHeader expected = h;
          expected.payload_bytes = static_cast<uint32_t>(payload_size);
          expected.header_bytes = header_bytes;
          expected.crc = Crc32c(payload.data(), payload.size(), Crc32c(frame.data(), header_bytes - 4));
          EXPECT_EQ(view->header, expected);
          EXPECT_EQ(std::vector<uint8_t>(view->payload.begin(), view->payload.end()), payload);
          EXPECT_EQ(view->payload.data(), reinterpret_cast<const uint8_t*>(frame.data()) + header_bytes)
              << "the payload is a view into the frame";
          ++count;
        }
      }
    }
  }
  EXPECT_EQ(count, 3 * 3 * kDTypeCount * 4);
}

TEST(FrameTest, HeaderSizeFollowsTheFields) {
  FrameHeader h;
  h.mode = Mode::kXor;
  h.codec = Codec::kSparse;
  EXPECT_EQ(EncodeFrame(h, {}).size(), kMinFrameHeaderBytes);
  h.tensor = h.chunk = h.changed = 0xFFFFFFFFu;
  const std::vector<uint8_t> payload(1 << 20);
  EXPECT_EQ(EncodeFrame(h, payload).size() - payload.size(), kMaxFrameHeaderBytes - 2);  // payload size: 3 bytes
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
    FrameHeader h = RandomHeader(DType::kF32, rng);
    h.mode = Mode::kOverwrite;
    h.codec = Codec::kRaw;
    h.chunk = static_cast<uint32_t>(i);
    payloads.push_back(RandomPayload(rng() % 200, rng));
    all += EncodeFrame(h, payloads.back());
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

TEST(FrameTest, TruncatedFrameIsDataLoss) {
  std::mt19937_64 rng(3);
  const std::string frame = ValidFrame(rng);
  for (size_t n = 0; n < frame.size(); ++n) {
    auto r = ParseFrame(Bytes(frame).subspan(0, n));
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), Code::kDataLoss) << n << " " << r.status().ToString();
    EXPECT_NE(r.status().message().find("truncated"), std::string::npos) << r.status().message();
  }
  EXPECT_TRUE(ParseFrame(Bytes(frame)).ok());
}

TEST(FrameTest, NotAFrameIsInvalidArgumentAndFormatVersion1IsUnimplemented) {
  std::mt19937_64 rng(5);
  std::string frame = ValidFrame(rng);
  for (uint8_t first : {0x00, 0x44, 0xD1, 0xD3, 0xFF}) {
    std::string f = frame;
    f[0] = static_cast<char>(first);
    auto r = ParseFrame(Bytes(f));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();
    EXPECT_NE(r.status().message().find("not a dcr frame"), std::string::npos) << r.status().message();
  }
  // A frame of format version 1: "DCRF", then the version as 16 bits.
  const std::string old = std::string("DCRF\x01\x00\x60\x00", 8) + std::string(88, '\0');
  auto r = ParseFrame(Bytes(old));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kUnimplemented) << r.status().ToString();
  EXPECT_NE(r.status().message().find("frame format version 1"), std::string::npos) << r.status().message();
}

TEST(FrameTest, ChecksumMismatchIsDataLoss) {
  std::mt19937_64 rng(8);
  std::vector<uint8_t> payload;
  const std::string frame = ValidFrame(rng, &payload);
  const size_t crc_at = CrcOffset(frame);
  // The digest, the checksum and every payload byte: parsed fields that stay
  // valid, so only the checksum tells.
  for (size_t off = crc_at - 16; off < frame.size(); ++off) {
    for (uint8_t bit : {0x01, 0x10}) {
      std::string f = frame;
      f[off] = static_cast<char>(f[off] ^ bit);
      auto r = ParseFrame(Bytes(f));
      if (off < crc_at && !ParseFrameHeader(Bytes(f)).ok()) continue;  // a digest lane past 2^61-1
      ASSERT_FALSE(r.ok()) << off;
      EXPECT_EQ(r.status().code(), Code::kDataLoss) << off << " " << r.status().ToString();
      EXPECT_NE(r.status().message().find("checksum mismatch"), std::string::npos) << r.status().message();
    }
  }
}

void ExpectInvalid(const std::string& frame, const std::string& what) {
  auto r = ParseFrame(Bytes(frame));
  ASSERT_FALSE(r.ok()) << what;
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << what << ": " << r.status().ToString();
}

TEST(FrameTest, UnknownModeCodecDtypeOrReservedBitsAreInvalidArgument) {
  std::mt19937_64 rng(12);
  const std::string frame = ValidFrame(rng);
  const size_t crc_at = CrcOffset(frame);
  const uint8_t kinds = static_cast<uint8_t>(frame[1]);
  for (uint8_t edit : {uint8_t(kinds & ~3), uint8_t(kinds & ~12), uint8_t(kinds | 0x10), uint8_t(kinds | 0x80)}) {
    std::string f = frame;
    f[1] = static_cast<char>(edit);
    Reseal(f, crc_at);
    ExpectInvalid(f, "mode/codec byte " + std::to_string(edit));
  }
  for (int dtype : {kDTypeCount, kDTypeCount + 1, 0xFF}) {
    std::string f = frame;
    f[2] = static_cast<char>(dtype);
    Reseal(f, crc_at);
    ExpectInvalid(f, "dtype " + std::to_string(dtype));
  }
  // The same through EncodeFrame's typed fields.
  FrameHeader h = RandomHeader(DType::kU8, rng);
  h.mode = Mode::kXor;
  h.codec = static_cast<Codec>(0);
  ExpectInvalid(EncodeFrame(h, {}), "typed codec 0");
  // A digest lane not below the prime.
  h.codec = Codec::kRaw;
  h.target_digest.lane[1] = kDigestPrime;
  ExpectInvalid(EncodeFrame(h, {}), "digest lane = 2^61-1");
}

TEST(FrameTest, VarintsMustBeShortestAndFit32Bits) {
  // tag, kinds (xor, sparse), dtype BF16, then tensor 0 written as 80 00
  // (not its shortest form), chunk, changed, payload bytes.
  std::string f = {static_cast<char>(kFrameTag), static_cast<char>(1 | 1 << 2), 6, '\x80', '\x00', 0, 0, 0};
  f += std::string(16, '\0');
  f += std::string(4, '\0');
  Reseal(f, f.size() - 4);
  ExpectInvalid(f, "a varint with a trailing zero group");
  // chunk 2^32: five bytes, but past 32 bits.
  f = {static_cast<char>(kFrameTag), static_cast<char>(1 | 1 << 2), 6, 0, '\x80', '\x80', '\x80', '\x80', '\x10', 0, 0};
  f += std::string(16, '\0');
  f += std::string(4, '\0');
  Reseal(f, f.size() - 4);
  ExpectInvalid(f, "a field of 2^32");
}

TEST(FrameTest, EverySingleBitFlipIsRejected) {
  std::mt19937_64 rng(14);
  for (Codec codec : {Codec::kSparse, Codec::kRaw}) {
    FrameHeader h = RandomHeader(DType::kF16, rng);
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
  FrameHeader h = RandomHeader(DType::kI64, rng);
  const std::string frame = EncodeFrame(h, {});
  size_t consumed = 0;
  auto r = ParseFrame(Bytes(frame), &consumed);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(consumed, frame.size());
  EXPECT_EQ(r->header.header_bytes, frame.size());
  EXPECT_TRUE(r->payload.empty());
}

}  // namespace
}  // namespace dcr
