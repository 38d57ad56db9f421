// Bit-level writer and reader for the sparse codec. Bits are packed
// LSB-first into little-endian bytes. Internal to src/delta.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace dcr {

class BitWriter {
 public:
  explicit BitWriter(std::vector<uint8_t>* out) : out_(out) {}

  // Appends the low `n` bits of v (n <= 57).
  void Put(uint64_t v, uint32_t n) {
    acc_ |= (n == 0 ? 0 : (v & (~0ull >> (64 - n)))) << fill_;
    fill_ += n;
    if (fill_ >= 32) Spill();
  }
  // Appends 64 bits.
  void Put64(uint64_t v) {
    Put(v & 0xFFFFFFFFu, 32);
    Put(v >> 32, 32);
  }
  // Flushes remaining bits, zero-padded to a byte.
  void Finish() {
    while (fill_ > 0) {
      out_->push_back(static_cast<uint8_t>(acc_));
      acc_ >>= 8;
      fill_ = fill_ >= 8 ? fill_ - 8 : 0;
    }
  }

 private:
  void Spill() {
    const size_t old = out_->size();
    out_->resize(old + 4);
    const uint32_t lo = static_cast<uint32_t>(acc_);
    std::memcpy(out_->data() + old, &lo, 4);
    acc_ >>= 32;
    fill_ -= 32;
  }

  std::vector<uint8_t>* out_;
  uint64_t acc_ = 0;
  uint32_t fill_ = 0;  // valid bits in acc_ (< 32 between calls)
};

// Reads what BitWriter wrote. Never reads outside `data`; reading past the
// end sets overrun() and yields zero bits.
class BitReader {
 public:
  explicit BitReader(std::span<const uint8_t> data) : data_(data) { Refill(); }

  // The next 57+ bits (fewer valid near the end: the rest read as zero).
  uint64_t Peek() const { return acc_; }
  void Skip(uint32_t n) {
    if (n > fill_) {
      overrun_ = true;
      n = fill_;
    }
    acc_ = n == 64 ? 0 : acc_ >> n;
    fill_ -= n;
    consumed_ += n;
    if (fill_ < 57) Refill();
  }
  uint64_t Get(uint32_t n) {  // n <= 57
    const uint64_t v = n == 0 ? 0 : acc_ & (~0ull >> (64 - n));
    Skip(n);
    return v;
  }
  uint64_t Get64() {
    const uint64_t lo = Get(32);
    return lo | (Get(32) << 32);
  }
  bool overrun() const { return overrun_; }
  // Bits consumed so far.
  uint64_t consumed_bits() const { return consumed_; }
  // True when every bit after the consumed ones is zero padding within the
  // last byte (and nothing follows).
  bool AtPaddedEnd() const {
    const uint64_t total_bits = static_cast<uint64_t>(data_.size()) * 8;
    if (consumed_ > total_bits) return false;
    if ((total_bits - consumed_) >= 8) return false;
    return acc_ == 0;
  }

 private:
  void Refill() {
    if (pos_ + 8 <= data_.size()) {
      // Load 8 bytes, keep the whole ones that fit; bits above fill_ already
      // hold the next bytes' true values, so OR-ing them again is harmless.
      uint64_t w;
      std::memcpy(&w, data_.data() + pos_, 8);
      acc_ |= w << fill_;
      const uint32_t bytes = (63 - fill_) >> 3;
      pos_ += bytes;
      fill_ += bytes * 8;
      return;
    }
    while (fill_ <= 56 && pos_ < data_.size()) {
      acc_ |= static_cast<uint64_t>(data_[pos_++]) << fill_;
      fill_ += 8;
    }
    // Past the end: pretend zero bits so Peek() stays defined; Skip() beyond
    // the real bits sets overrun_.
  }

  std::span<const uint8_t> data_;
  size_t pos_ = 0;
  uint64_t acc_ = 0;
  uint32_t fill_ = 0;
  uint64_t consumed_ = 0;
  bool overrun_ = false;
};

}  // namespace dcr
