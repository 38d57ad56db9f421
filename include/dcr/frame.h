// Frames: one encoded chunk of one tensor, verifiable and applicable on its
// own, in any order (docs/format.md has the byte layout). A frame is a
// 96-byte header followed by its payload.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "dcr/digest.h"
#include "dcr/dtype.h"
#include "dcr/status.h"

namespace dcr {

inline constexpr uint32_t kFrameMagic = 0x46524344;  // "DCRF" little-endian
inline constexpr uint16_t kFrameFormatVersion = 1;
inline constexpr uint32_t kFrameHeaderBytes = 96;

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
  uint32_t tensor = 0;  // index into the delta's tensor list
  uint32_t chunk = 0;  // chunk index within the tensor
  uint64_t first_element = 0;  // chunk * chunk_elements
  uint32_t elements = 0;  // elements in this chunk
  uint32_t words = 0;  // words in this chunk (see WordBytes)
  uint32_t changed = 0;  // words whose bits change
  Mode mode = Mode::kOverwrite;
  Codec codec = Codec::kRaw;
  DType dtype = DType::kU8;
  uint8_t word_bytes = 1;
  uint32_t payload_bytes = 0;
  uint32_t payload_crc = 0;  // CRC32C of the payload
  Digest base_digest;  // the chunk's digest before
  Digest target_digest;  // ... and after applying
  uint64_t delta_id = 0;  // the delta (attempt) this frame belongs to

  friend bool operator==(const FrameHeader&, const FrameHeader&) = default;
};

// Serialises `header` (computing the header checksum) followed by `payload`.
// The caller fills payload_bytes and payload_crc (EncodeFrame does both).
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
// checked without the tensor: magic, version, header checksum, field ranges
// (words consistent with elements and dtype, changed <= words), that the
// payload is present, and its checksum. `*consumed` (optional) gets the
// frame's total size. Errors: kDataLoss (truncated, checksum mismatch),
// kInvalidArgument (malformed), kUnimplemented (newer format version).
Result<FrameView> ParseFrame(std::span<const uint8_t> bytes, size_t* consumed = nullptr);

// The same checks of the header alone (the first kFrameHeaderBytes of
// `bytes`): everything but the payload's presence and checksum.
Result<FrameHeader> ParseFrameHeader(std::span<const uint8_t> bytes);

}  // namespace dcr
