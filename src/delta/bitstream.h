// Bit-level writer and reader for the sparse codec. Bits are packed
// LSB-first into little-endian bytes. Internal to src/delta.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>

namespace dcr {

class BitWriter {
 public:
  // Writes into `out`, which has room for at least max_bits / 8 + 16 bytes
  // (8-byte stores run past the last byte written).
  explicit BitWriter(uint8_t* out) : begin_(out), p_(out) {}

  // Appends the low `n` bits of v (n <= 56). Flushes whole bytes each call
  // with one unaligned 8-byte store: no branches.
  [[gnu::always_inline]] void Put(uint64_t v, uint32_t n) {
    acc_ |= (v & (~0ull >> (63 - n) >> 1)) << fill_;
    fill_ += n;
    std::memcpy(p_, &acc_, 8);
    p_ += fill_ >> 3;
    acc_ >>= (fill_ & ~7u);  // fill_ <= 63: a shift of at most 56
    fill_ &= 7;
  }
  // Flushes remaining bits, zero-padded to a byte; returns the bytes written.
  size_t Finish() {
    if (fill_ > 0) {
      *p_++ = static_cast<uint8_t>(acc_);
      acc_ = 0;
      fill_ = 0;
    }
    return static_cast<size_t>(p_ - begin_);
  }
  static size_t BufferBytes(uint64_t max_bits) { return max_bits / 8 + 16; }

 private:
  uint8_t* begin_;
  uint8_t* p_;
  uint64_t acc_ = 0;
  uint32_t fill_ = 0;  // pending bits in acc_ (< 8 between calls)
};

// Reads what BitWriter wrote. Never reads outside `data`; reading past the
// end sets overrun() and yields zero bits. Between calls at least 40 bits
// are buffered (fewer only at the end of the data), so a Peek() always sees
// a whole unary prefix of up to 33 bits.
class BitReader {
 public:
  explicit BitReader(std::span<const uint8_t> data) : data_(data) { Refill(); }

  // The buffered bits, next bit lowest; zeros past the end of the data.
  uint64_t Peek() const { return acc_; }
  [[gnu::always_inline]] void Skip(uint32_t n) {
    if (n > fill_) {
      overrun_ = true;
      n = fill_;
    }
    acc_ = n == 64 ? 0 : acc_ >> n;
    fill_ -= n;
    consumed_ += n;
    if (fill_ < 40) Refill();
  }
  [[gnu::always_inline]] uint64_t Get(uint32_t n) {  // n <= 56
    if (fill_ < n) Refill();
    const uint64_t v = n == 0 ? 0 : acc_ & (~0ull >> (64 - n));
    Skip(n);
    return v;
  }
  // For decoders that parse a whole code from one Peek(): buffer at least
  // 56 bits when the data has them, and report how many are buffered.
  [[gnu::always_inline]] uint32_t Ensure56() {
    if (fill_ < 56) Refill();
    return fill_;
  }
  // Consumes n <= buffered bits without refilling (pair with Ensure56()).
  [[gnu::always_inline]] void Consume(uint32_t n) {
    acc_ >>= n;  // n <= 56
    fill_ -= n;
    consumed_ += n;
  }
  bool overrun() const { return overrun_; }
  // True when every bit after the consumed ones is zero padding within the
  // last byte (and nothing follows).
  bool AtPaddedEnd() const {
    const uint64_t total_bits = static_cast<uint64_t>(data_.size()) * 8;
    if (consumed_ > total_bits) return false;
    if ((total_bits - consumed_) >= 8) return false;
    return acc_ == 0;
  }

 private:
  // Tops the buffer up to at least 56 bits (or to the end of the data).
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
  }

  std::span<const uint8_t> data_;
  size_t pos_ = 0;
  uint64_t acc_ = 0;
  uint32_t fill_ = 0;
  uint64_t consumed_ = 0;
  bool overrun_ = false;
};

}  // namespace dcr
