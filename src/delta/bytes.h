// Little-endian fixed-width fields and LEB128 varints for dcr's binary
// formats (docs/format.md). Readers never throw and never read past the end:
// a failed read sets ok() false and returns 0.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>

namespace dcr {

class ByteWriter {
 public:
  explicit ByteWriter(std::string& out) : out_(out) {}
  template <typename T>
  void Fixed(T v) {
    for (size_t i = 0; i < sizeof(T); ++i) out_.push_back(static_cast<char>(static_cast<uint64_t>(v) >> (8 * i)));
  }
  // Seven bits per byte, least significant group first, high bit set on all
  // but the last byte; at most 10 bytes.
  void Varint(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<char>(v | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<char>(v));
  }
  void Bytes(std::string_view s) { out_.append(s); }

 private:
  std::string& out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  bool ok() const { return ok_; }
  // A failed read found a malformed varint, not the end of the bytes.
  bool malformed() const { return malformed_; }
  size_t pos() const { return pos_; }
  size_t left() const { return ok_ ? bytes_.size() - pos_ : 0; }

  template <typename T>
  T Fixed() {
    if (!ok_ || bytes_.size() - pos_ < sizeof(T)) return Fail<T>();
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= uint64_t{bytes_[pos_ + i]} << (8 * i);
    pos_ += sizeof(T);
    return static_cast<T>(v);
  }
  // A varint in its shortest form (a trailing zero group is refused: one
  // value, one encoding) of at most 64 bits.
  uint64_t Varint() {
    uint64_t v = 0;
    for (int shift = 0; ok_ && shift < 64; shift += 7) {
      if (pos_ >= bytes_.size()) return Fail<uint64_t>();
      const uint8_t b = bytes_[pos_++];
      if ((shift == 63 && b > 1) || (b == 0 && shift > 0)) break;
      v |= uint64_t{b & 0x7fu} << shift;
      if (!(b & 0x80)) return v;
    }
    malformed_ = ok_;
    return Fail<uint64_t>();
  }
  std::span<const uint8_t> Bytes(size_t n) {
    if (!ok_ || bytes_.size() - pos_ < n) return Fail<std::span<const uint8_t>>();
    auto s = bytes_.subspan(pos_, n);
    pos_ += n;
    return s;
  }

 private:
  template <typename T>
  T Fail() {
    ok_ = false;
    return T{};
  }
  std::span<const uint8_t> bytes_;
  size_t pos_ = 0;
  bool ok_ = true;
  bool malformed_ = false;
};

}  // namespace dcr
