// The safetensors format, as pure functions over bytes (no I/O):
//   8-byte little-endian header length N, N bytes of UTF-8 JSON, data buffer.
// The parser accepts exactly the files the reference implementation accepts
// (no holes, no overlaps, sizes matching shapes, header <= 100,000,000 bytes,
// no duplicate names) and rejects everything else with kInvalidArgument (or
// kDataLoss for truncation) and a message naming the tensor and the problem.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dcr/dtype.h"
#include "dcr/status.h"

namespace dcr {

inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// A canonical tensor's identity and size.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  uint64_t numel = 0;  // product of shape (1 for a scalar)
  uint64_t nbytes = 0;  // numel * bits / 8
  friend bool operator==(const TensorInfo&, const TensorInfo&) = default;
};

// Builds a TensorInfo, checking that the element count and byte size fit in
// 64 bits and that sub-byte dtypes fill whole bytes.
Result<TensorInfo> MakeTensorInfo(std::string name, DType dtype, std::vector<uint64_t> shape);

using Metadata = std::vector<std::pair<std::string, std::string>>;

struct SafetensorsEntry {
  TensorInfo info;
  uint64_t offset = 0;  // begin, relative to the data buffer
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;  // N: the JSON's length; data starts at 8 + N
  uint64_t data_bytes = 0;  // length of the data buffer
  std::vector<SafetensorsEntry> entries;  // in data-offset order
  Metadata metadata;  // __metadata__, in file order
};

// Parses and validates the header of a file of `file_size` bytes whose first
// bytes are `prefix` (at least the 8-byte length and the JSON it announces).
// Errors: kDataLoss when the file is too short for what the header says,
// kInvalidArgument for anything malformed.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> prefix, uint64_t file_size);

// Encodes the 8-byte length and the JSON header for tensors laid out in the
// given order, back to back from offset 0. The JSON lists __metadata__ first
// (when non-empty), then the tensors in that order, and is padded with spaces
// to a multiple of 8 bytes.
std::string EncodeSafetensorsHeader(std::span<const TensorInfo> tensors, const Metadata& metadata);

}  // namespace dcr
