// Valid frames and frame object keys for the relay's tests.
#pragma once

#include <fmt/format.h>

#include <string>
#include <vector>

#include "dcr/frame.h"

namespace dcr::relay_testing {

// A raw overwrite frame of 64 U8 elements, every byte `fill`.
inline std::string MakeFrame(uint32_t chunk, uint8_t fill) {
  std::vector<uint8_t> payload(64, fill);
  FrameHeader h;
  h.chunk = chunk;
  h.changed = 64;
  h.mode = Mode::kOverwrite;
  h.codec = Codec::kRaw;
  h.dtype = DType::kU8;
  return EncodeFrame(h, payload);
}

inline std::string AttemptPrefix(uint64_t v, std::string_view attempt = "0000-0123abcd") {
  return fmt::format("attempts/v{:010}/{}/", v, attempt);
}
inline std::string ObjectKey(uint64_t v, uint32_t segment, std::string_view attempt = "0000-0123abcd") {
  return AttemptPrefix(v, attempt) + fmt::format("frames/s0-{:04}.bin", segment);
}

}  // namespace dcr::relay_testing
