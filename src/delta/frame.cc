#include "dcr/frame.h"

#include <fmt/format.h>

#include <cstring>

#include "bytes.h"
#include "dcr/hash.h"

namespace dcr {

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

namespace {

// The header's bytes before its checksum: tag, mode and codec, dtype,
// tensor, chunk, changed, payload bytes (varints), target digest.
void PutHeaderFields(const FrameHeader& h, std::string& out) {
  ByteWriter w(out);
  w.Fixed<uint8_t>(kFrameTag);
  w.Fixed<uint8_t>(static_cast<uint8_t>(static_cast<uint8_t>(h.mode) | static_cast<uint8_t>(h.codec) << 2));
  w.Fixed<uint8_t>(static_cast<uint8_t>(h.dtype));
  w.Varint(h.tensor);
  w.Varint(h.chunk);
  w.Varint(h.changed);
  w.Varint(h.payload_bytes);
  w.Fixed(h.target_digest.lane[0]);
  w.Fixed(h.target_digest.lane[1]);
}

// A varint that must fit 32 bits, or a malformed-header error.
bool Varint32(ByteReader& r, uint32_t* out) {
  const uint64_t v = r.Varint();
  *out = static_cast<uint32_t>(v);
  return r.ok() && v <= 0xFFFFFFFFu;
}

}  // namespace

std::string EncodeFrame(FrameHeader h, std::span<const uint8_t> payload) {
  h.payload_bytes = static_cast<uint32_t>(payload.size());
  std::string out;
  out.reserve(kMaxFrameHeaderBytes + payload.size());
  PutHeaderFields(h, out);
  uint32_t crc = Crc32c(out.data(), out.size());
  crc = Crc32c(payload.data(), payload.size(), crc);
  ByteWriter(out).Fixed<uint32_t>(crc);
  out.append(reinterpret_cast<const char*>(payload.data()), payload.size());
  return out;
}

Result<FrameHeader> ParseFrameHeader(std::span<const uint8_t> bytes) {
  if (bytes.empty()) return DataLoss("truncated frame: no bytes");
  if (bytes[0] != kFrameTag) {
    ByteReader old(bytes);
    if (old.Fixed<uint32_t>() == kOldFrameMagic) {
      const uint16_t version = old.Fixed<uint16_t>();
      return Unimplemented(fmt::format("frame format version {} (this dcr reads 2){}", version,
                                       version < 2 ? ": it was written by an older dcr" : ""));
    }
    return InvalidArgument(fmt::format("not a dcr frame (first byte {:02x}, not {:02x})", bytes[0], kFrameTag));
  }
  ByteReader r(bytes.first(std::min<size_t>(bytes.size(), kMaxFrameHeaderBytes)));
  FrameHeader h;
  r.Fixed<uint8_t>();
  const uint8_t kinds = r.Fixed<uint8_t>(), dtype = r.Fixed<uint8_t>();
  const bool fields =
      Varint32(r, &h.tensor) && Varint32(r, &h.chunk) && Varint32(r, &h.changed) && Varint32(r, &h.payload_bytes);
  h.target_digest.lane[0] = r.Fixed<uint64_t>();
  h.target_digest.lane[1] = r.Fixed<uint64_t>();
  h.crc = r.Fixed<uint32_t>();
  if (r.malformed() || (!r.ok() && bytes.size() >= kMaxFrameHeaderBytes))
    return InvalidArgument("malformed frame header (a varint not in its shortest form, or too long)");
  if (!r.ok()) return DataLoss(fmt::format("truncated frame: {} bytes, its header needs more", bytes.size()));
  if (!fields) return InvalidArgument("malformed frame header (a field beyond 32 bits)");
  h.header_bytes = static_cast<uint32_t>(r.pos());
  const std::string where = fmt::format("frame (tensor {}, chunk {})", h.tensor, h.chunk);
  const uint8_t mode = kinds & 3, codec = (kinds >> 2) & 3;
  if (mode == 0) return InvalidArgument(fmt::format("{}: unknown mode 0", where));
  if (codec == 0) return InvalidArgument(fmt::format("{}: unknown codec 0", where));
  if (kinds >> 4) return InvalidArgument(fmt::format("{}: reserved bits are set", where));
  if (dtype >= kDTypeCount) return InvalidArgument(fmt::format("{}: unknown dtype {}", where, dtype));
  if (h.target_digest.lane[0] >= kDigestPrime || h.target_digest.lane[1] >= kDigestPrime)
    return InvalidArgument(fmt::format("{}: a target digest lane is not below 2^61-1", where));
  h.mode = static_cast<Mode>(mode);
  h.codec = static_cast<Codec>(codec);
  h.dtype = static_cast<DType>(dtype);
  return h;
}

Result<FrameView> ParseFrame(std::span<const uint8_t> bytes, size_t* consumed) {
  DCR_ASSIGN_OR_RETURN(FrameHeader h, ParseFrameHeader(bytes));
  const std::string where = fmt::format("frame (tensor {}, chunk {})", h.tensor, h.chunk);
  if (bytes.size() - h.header_bytes < h.payload_bytes)
    return DataLoss(
        fmt::format("{}: truncated payload: {} of {} bytes", where, bytes.size() - h.header_bytes, h.payload_bytes));
  const auto payload = bytes.subspan(h.header_bytes, h.payload_bytes);
  uint32_t crc = Crc32c(bytes.data(), h.header_bytes - 4);
  crc = Crc32c(payload.data(), payload.size(), crc);
  if (crc != h.crc) return DataLoss(fmt::format("{}: checksum mismatch", where));
  if (consumed) *consumed = h.header_bytes + h.payload_bytes;
  return FrameView{h, payload};
}

}  // namespace dcr
