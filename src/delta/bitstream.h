// Bit-level writer and reader for the sparse codec. Bits are packed
// LSB-first into little-endian bytes. Internal to src/delta.
#pragma once

#include <cstdint>
#include <cstring>

namespace dcr {

class BitWriter {
 public:
  // Writes into `out`, which has room for at least max_bits / 8 + 16 bytes
  // (8-byte stores run past the last byte written).
  explicit BitWriter(uint8_t* out) : begin_(out), p_(out) {}

  // Appends the n <= 56 bits of v; v < 2^n (no bits above). Flushes whole
  // bytes each call with one unaligned 8-byte store: no branches.
  [[gnu::always_inline]] void Put(uint64_t v, uint32_t n) {
    acc_ |= v << fill_;
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
  // Bits written so far.
  uint32_t Bits() const { return static_cast<uint32_t>(p_ - begin_) * 8 + fill_; }
  static size_t BufferBytes(uint64_t max_bits) { return max_bits / 8 + 16; }

 private:
  uint8_t* begin_;
  uint8_t* p_;
  uint64_t acc_ = 0;
  uint32_t fill_ = 0;  // pending bits in acc_ (< 8 between calls)
};

// Reads what BitWriter wrote, from a copy followed by kPadding zero bytes,
// so that a refill is one unaligned 8-byte load, with no bounds branch. The
// window holds 56 to 63 bits after each refill (the 8 bytes loaded, less
// the partial last one); consuming bits shifts it, so the next bits are
// always at the bottom, and the next refill's load address never waits on
// the bits just decoded. Reading past the data yields zero bits.
class BitReader {
 public:
  static constexpr size_t kPadding = 64;

  // `data` holds `bytes` bytes and then kPadding zero bytes; reading starts
  // at bit `start` <= 8 * bytes.
  BitReader(const uint8_t* data, size_t bytes, uint64_t start = 0)
      : data_(data), end_(data + bytes), p_(data + start / 8) {
    Refill();
    Skip(static_cast<uint32_t>(start % 8));
  }

  // The next 56 or more bits, next bit lowest.
  [[gnu::always_inline]] uint64_t Peek() {
    Refill();
    return acc_;
  }
  // Consumes n bits, at most as many as the last Peek() returned.
  [[gnu::always_inline]] void Skip(uint32_t n) {
    acc_ >>= n;
    bits_ -= n;
  }
  [[gnu::always_inline]] uint64_t Get(uint32_t n) {  // n <= 56
    const uint64_t v = Peek() & ((1ull << n) - 1);
    Skip(n);
    return v;
  }
  uint64_t position() const { return static_cast<uint64_t>(p_ - data_) * 8 - bits_; }  // bits consumed
  // True when more bits were consumed than the data has.
  bool overrun() const { return position() > static_cast<uint64_t>(end_ - data_) * 8; }
  // A cheap, late overrun(): true once the window is 8 bytes past the data.
  // A decoder checks it at least every 200 bits consumed, which keeps its
  // reads inside the padding.
  [[gnu::always_inline]] bool exhausted() const { return p_ > end_ + 8; }
  // True when every bit after the consumed ones is zero padding within the
  // last byte (and nothing follows).
  bool AtPaddedEnd() {
    const uint64_t total = static_cast<uint64_t>(end_ - data_) * 8;
    return position() <= total && total - position() < 8 && Peek() == 0;
  }

 private:
  [[gnu::always_inline]] void Refill() {
    uint64_t w;
    std::memcpy(&w, p_, 8);  // little-endian host (see frame.cc)
    acc_ |= w << bits_;  // the bits above bits_ are the same data again, or zero
    p_ += (63 - bits_) >> 3;
    bits_ |= 56;
  }

  const uint8_t* data_;
  const uint8_t* end_;
  const uint8_t* p_;  // the next byte to load
  uint64_t acc_ = 0;
  uint32_t bits_ = 0;  // valid bits in acc_
};

}  // namespace dcr
