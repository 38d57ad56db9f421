// Frames: one encoded chunk of one tensor, verifiable and applicable on its
// own, in any order (docs/format.md has the byte layout). A frame is a
// compact header (27 to 43 bytes: varints, the chunk's target digest, a
// checksum of header and payload) followed by its payload.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "dcr/digest.h"
#include "dcr/dtype.h"
#include "dcr/status.h"

namespace dcr {

inline constexpr uint8_t kFrameTag = 0xD2;  // a frame's first byte: format version 2
inline constexpr uint32_t kOldFrameMagic = 0x46524344;  // "DCRF": format version 1 (refused)
inline constexpr uint32_t kMinFrameHeaderBytes = 27;
inline constexpr uint32_t kMaxFrameHeaderBytes = 43;

// How a frame's values relate to the receiver's bits.
enum class Mode : uint8_t {
  kXor = 1,  // value = old ^ new; needs the base bits
  kAdd = 2,  // value = image(new) - image(old) mod 2^word; needs the base bits
  kOverwrite = 3,  // value = new; idempotent, needs nothing
};
std::string_view ModeName(Mode mode);  // "xor", "add", "overwrite"
// The mode ModeName names; false (and *mode untouched) for any other text.
bool ModeFromName(std::string_view name, Mode* mode);

enum class Codec : uint8_t {
  kSparse = 1,  // Rice-coded position gaps, interleaved with coded values
  kZstd = 2,  // zstd frame of the dense layout
  kRaw = 3,  // the dense layout: one value per word of the chunk
};
std::string_view CodecName(Codec codec);  // "sparse", "zstd", "raw"
bool CodecFromName(std::string_view name, Codec* codec);  // as ModeFromName

struct FrameHeader {
  uint32_t tensor = 0;  // index into the run's tensor table
  uint32_t chunk = 0;  // chunk index within the tensor
  uint32_t changed = 0;  // words whose bits change
  Mode mode = Mode::kOverwrite;
  Codec codec = Codec::kRaw;
  DType dtype = DType::kU8;
  uint32_t payload_bytes = 0;
  Digest target_digest;  // the chunk's digest after applying
  uint32_t crc = 0;  // CRC32C of the header's other bytes and the payload
  uint32_t header_bytes = 0;  // of this header as encoded (set by EncodeFrame and the parsers)

  friend bool operator==(const FrameHeader&, const FrameHeader&) = default;
};

// Serialises `header` followed by `payload`, filling in payload_bytes, crc
// and header_bytes.
std::string EncodeFrame(FrameHeader header, std::span<const uint8_t> payload);

// A frame's header and payload. The payload is empty, header.payload_bytes
// notwithstanding, when a receiver dropped it once the frame was applied
// (DeltaReader::FromObjects, `released`): applying such a frame is refused.
struct FrameView {
  FrameHeader header;
  std::span<const uint8_t> payload;
  bool PayloadHeld() const { return payload.size() == header.payload_bytes; }
};

// Parses the frame at the start of `bytes` and checks everything that can be
// checked without the chunk: the tag, field ranges, that the payload is
// present, and the checksum. `*consumed` (optional) gets the frame's total
// size. Errors: kDataLoss (truncated, checksum mismatch), kInvalidArgument
// (malformed), kUnimplemented (another format version).
Result<FrameView> ParseFrame(std::span<const uint8_t> bytes, size_t* consumed = nullptr);

// The same checks of the header alone (at the start of `bytes`, of at most
// kMaxFrameHeaderBytes): everything but the payload's presence and the
// checksum.
Result<FrameHeader> ParseFrameHeader(std::span<const uint8_t> bytes);

}  // namespace dcr
