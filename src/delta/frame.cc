#include "dcr/frame.h"

#include <fmt/format.h>

#include <bit>
#include <cstring>

#include "dcr/hash.h"

namespace dcr {
namespace {

// Little-endian field access at fixed offsets (docs/format.md).
template <typename T>
void Put(uint8_t* p, size_t off, T v) {
  std::memcpy(p + off, &v, sizeof v);  // x86-64 and aarch64 are little-endian
}
template <typename T>
T Get(const uint8_t* p, size_t off) {
  T v;
  std::memcpy(&v, p + off, sizeof v);
  return v;
}
static_assert(std::endian::native == std::endian::little, "dcr frames are little-endian; add byte swaps");

constexpr size_t kHeaderCrcOffset = 92;

}  // namespace

std::string_view ModeName(Mode m) {
  switch (m) {
    case Mode::kXor: return "xor";
    case Mode::kAdd: return "add";
    case Mode::kOverwrite: return "overwrite";
  }
  return "?";
}

bool ModeFromName(std::string_view name, Mode* mode) {
  for (Mode m : {Mode::kXor, Mode::kAdd, Mode::kOverwrite})
    if (name == ModeName(m)) {
      *mode = m;
      return true;
    }
  return false;
}

bool CodecFromName(std::string_view name, Codec* codec) {
  for (Codec c : {Codec::kSparse, Codec::kZstd, Codec::kRaw})
    if (name == CodecName(c)) {
      *codec = c;
      return true;
    }
  return false;
}

std::string_view CodecName(Codec c) {
  switch (c) {
    case Codec::kSparse: return "sparse";
    case Codec::kZstd: return "zstd";
    case Codec::kRaw: return "raw";
  }
  return "?";
}

std::string EncodeFrame(FrameHeader h, std::span<const uint8_t> payload) {
  h.payload_bytes = static_cast<uint32_t>(payload.size());
  h.payload_crc = Crc32c(payload.data(), payload.size());
  std::string out(kFrameHeaderBytes + payload.size(), '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  Put<uint32_t>(p, 0, kFrameMagic);
  Put<uint16_t>(p, 4, kFrameFormatVersion);
  Put<uint16_t>(p, 6, static_cast<uint16_t>(kFrameHeaderBytes));
  Put<uint32_t>(p, 8, h.tensor);
  Put<uint32_t>(p, 12, h.chunk);
  Put<uint64_t>(p, 16, h.first_element);
  Put<uint32_t>(p, 24, h.elements);
  Put<uint32_t>(p, 28, h.words);
  Put<uint32_t>(p, 32, h.changed);
  Put<uint8_t>(p, 36, static_cast<uint8_t>(h.mode));
  Put<uint8_t>(p, 37, static_cast<uint8_t>(h.codec));
  Put<uint8_t>(p, 38, static_cast<uint8_t>(h.dtype));
  Put<uint8_t>(p, 39, h.word_bytes);
  Put<uint32_t>(p, 40, h.payload_bytes);
  Put<uint32_t>(p, 44, h.payload_crc);
  Put<uint64_t>(p, 48, h.base_digest.lane[0]);
  Put<uint64_t>(p, 56, h.base_digest.lane[1]);
  Put<uint64_t>(p, 64, h.target_digest.lane[0]);
  Put<uint64_t>(p, 72, h.target_digest.lane[1]);
  Put<uint64_t>(p, 80, h.delta_id);
  Put<uint32_t>(p, 88, 0);  // reserved
  Put<uint32_t>(p, kHeaderCrcOffset, Crc32c(p, kHeaderCrcOffset));
  if (!payload.empty()) std::memcpy(p + kFrameHeaderBytes, payload.data(), payload.size());
  return out;
}

Result<FrameHeader> ParseFrameHeader(std::span<const uint8_t> bytes) {
  if (bytes.size() < kFrameHeaderBytes)
    return DataLoss(fmt::format("truncated frame: {} bytes, a header needs {}", bytes.size(), kFrameHeaderBytes));
  const uint8_t* p = bytes.data();
  if (Get<uint32_t>(p, 0) != kFrameMagic) return InvalidArgument("not a dcr frame (bad magic)");
  const uint16_t version = Get<uint16_t>(p, 4);
  if (version != kFrameFormatVersion)
    return Unimplemented(fmt::format("frame format version {} (this dcr reads {})", version, kFrameFormatVersion));
  if (Get<uint16_t>(p, 6) != kFrameHeaderBytes)
    return InvalidArgument(fmt::format("frame header size {} (expected {})", Get<uint16_t>(p, 6), kFrameHeaderBytes));
  const uint32_t header_crc = Get<uint32_t>(p, kHeaderCrcOffset);
  if (Crc32c(p, kHeaderCrcOffset) != header_crc) return DataLoss("frame header checksum mismatch");

  FrameHeader h;
  h.tensor = Get<uint32_t>(p, 8);
  h.chunk = Get<uint32_t>(p, 12);
  h.first_element = Get<uint64_t>(p, 16);
  h.elements = Get<uint32_t>(p, 24);
  h.words = Get<uint32_t>(p, 28);
  h.changed = Get<uint32_t>(p, 32);
  const uint8_t mode = Get<uint8_t>(p, 36), codec = Get<uint8_t>(p, 37), dtype = Get<uint8_t>(p, 38);
  h.word_bytes = Get<uint8_t>(p, 39);
  h.payload_bytes = Get<uint32_t>(p, 40);
  h.payload_crc = Get<uint32_t>(p, 44);
  h.base_digest.lane[0] = Get<uint64_t>(p, 48);
  h.base_digest.lane[1] = Get<uint64_t>(p, 56);
  h.target_digest.lane[0] = Get<uint64_t>(p, 64);
  h.target_digest.lane[1] = Get<uint64_t>(p, 72);
  h.delta_id = Get<uint64_t>(p, 80);
  const std::string where = fmt::format("frame (tensor {}, chunk {})", h.tensor, h.chunk);
  if (mode < 1 || mode > 3) return InvalidArgument(fmt::format("{}: unknown mode {}", where, mode));
  if (codec < 1 || codec > 3) return InvalidArgument(fmt::format("{}: unknown codec {}", where, codec));
  if (dtype >= kDTypeCount) return InvalidArgument(fmt::format("{}: unknown dtype {}", where, dtype));
  h.mode = static_cast<Mode>(mode);
  h.codec = static_cast<Codec>(codec);
  h.dtype = static_cast<DType>(dtype);
  if (h.word_bytes != WordBytes(h.dtype))
    return InvalidArgument(fmt::format("{}: word size {} is wrong for {}", where, h.word_bytes, Name(h.dtype)));
  const auto chunk_bytes = ByteSize(h.dtype, h.elements);
  if (!chunk_bytes || *chunk_bytes != static_cast<uint64_t>(h.words) * h.word_bytes)
    return InvalidArgument(
        fmt::format("{}: {} elements of {} are not {} words", where, h.elements, Name(h.dtype), h.words));
  if (h.changed > h.words)
    return InvalidArgument(fmt::format("{}: {} changed words in a chunk of {}", where, h.changed, h.words));
  if (Get<uint32_t>(p, 88) != 0) return InvalidArgument(fmt::format("{}: reserved field is not zero", where));
  return h;
}

Result<FrameView> ParseFrame(std::span<const uint8_t> bytes, size_t* consumed) {
  DCR_ASSIGN_OR_RETURN(FrameHeader h, ParseFrameHeader(bytes));
  const std::string where = fmt::format("frame (tensor {}, chunk {})", h.tensor, h.chunk);
  if (bytes.size() - kFrameHeaderBytes < h.payload_bytes)
    return DataLoss(
        fmt::format("{}: truncated payload: {} of {} bytes", where, bytes.size() - kFrameHeaderBytes, h.payload_bytes));
  const auto payload = bytes.subspan(kFrameHeaderBytes, h.payload_bytes);
  if (Crc32c(payload.data(), payload.size()) != h.payload_crc)
    return DataLoss(fmt::format("{}: payload checksum mismatch", where));
  if (consumed) *consumed = kFrameHeaderBytes + h.payload_bytes;
  return FrameView{h, payload};
}

}  // namespace dcr
