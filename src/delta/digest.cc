#include "dcr/digest.h"

#include <fmt/format.h>

#include "dcr/hash.h"
#include "kernels.h"

namespace dcr {

std::string Digest::ToHex() const { return fmt::format("{:016x}{:016x}", lane[0], lane[1]); }

bool Digest::FromHex(std::string_view hex, Digest* out) {
  if (hex.size() != 32) return false;
  Digest d;
  for (int l = 0; l < 2; ++l) {
    uint64_t v = 0;
    for (size_t i = 0; i < 16; ++i) {
      const char c = hex[static_cast<size_t>(l) * 16 + i];
      int x;
      if (c >= '0' && c <= '9') x = c - '0';
      else if (c >= 'a' && c <= 'f') x = c - 'a' + 10;
      else return false;
      v = (v << 4) | static_cast<uint64_t>(x);
    }
    if (v >= kDigestPrime) return false;
    d.lane[l] = v;
  }
  *out = d;
  return true;
}

uint32_t WordBytes(DType dtype) {
  const DTypeInfo& info = Info(dtype);
  if (info.kind == DTypeKind::kComplex) return 4;
  if (info.bits < 8) return 1;
  return info.bits / 8;
}

DigestKey MakeDigestKey(std::string_view name) {
  return DigestKey{{Xxh3_64(name.data(), name.size(), 0x64637230), Xxh3_64(name.data(), name.size(), 0x64637231)}};
}

void LimbHashes(const DigestKey& key, uint64_t limb, uint64_t out[2]) {
  const uint64_t block = limb / kernels::kDigestBlock, j = limb % kernels::kDigestBlock;
  out[0] = kernels::LimbHash(kernels::DigestTable()[2 * j], kernels::BlockSeed(key.seed[0], block));
  out[1] = kernels::LimbHash(kernels::DigestTable()[2 * j + 1], kernels::BlockSeed(key.seed[1], block));
}

namespace {
// Adds H(limb) * y to d (y < 2^32).
void AddLimb(const DigestKey& key, uint64_t limb, uint64_t y, Digest* d) {
  uint64_t h[2];
  LimbHashes(key, limb, h);
  Digest term;
  term.lane[0] = kernels::ModPrime(static_cast<kernels::Uint128>(h[0]) * y);
  term.lane[1] = kernels::ModPrime(static_cast<kernels::Uint128>(h[1]) * y);
  *d += term;
}
}  // namespace

Digest DigestBytes(const DigestKey& key, uint64_t offset, std::span<const uint8_t> bytes) {
  Digest d;
  size_t i = 0;
  // A partial limb at either end: its bytes at their places in Y_m.
  auto partial = [&](uint64_t at, size_t n) {
    uint64_t y = 0;
    for (size_t k = 0; k < n; ++k) y |= static_cast<uint64_t>(bytes[i + k]) << (8 * ((at + k) % 4));
    AddLimb(key, at / 4, y, &d);
    i += n;
  };
  if (offset % 4 != 0) partial(offset, std::min<size_t>(bytes.size(), 4 - offset % 4));
  const size_t limbs = (bytes.size() - i) / 4;
  if (limbs > 0) {
    kernels::Kernels().digest(key.seed, (offset + i) / 4, bytes.data() + i, limbs, d.lane);
    i += limbs * 4;
  }
  if (i < bytes.size()) partial(offset + i, bytes.size() - i);
  return d;
}

Digest WordTerm(const DigestKey& key, uint64_t offset, uint32_t word_bytes, uint64_t word) {
  Digest d;
  if (word_bytes == 8) {
    AddLimb(key, offset / 4, word & 0xFFFFFFFFu, &d);
    AddLimb(key, offset / 4 + 1, word >> 32, &d);
  } else {
    AddLimb(key, offset / 4, word << (8 * (offset % 4)), &d);
  }
  return d;
}

}  // namespace dcr
