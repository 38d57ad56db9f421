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

void PositionHashes(const DigestKey& key, uint64_t index, uint64_t out[2]) {
  const uint64_t block = index / kernels::kDigestBlock, j = index % kernels::kDigestBlock;
  out[0] = (kernels::DigestTable(0)[j] ^ kernels::BlockSeed(key.seed[0], block)) | 1;
  out[1] = (kernels::DigestTable(1)[j] ^ kernels::BlockSeed(key.seed[1], block)) | 1;
}

Digest DigestWords(const DigestKey& key, uint32_t word_bytes, uint64_t first_word, std::span<const uint8_t> bytes) {
  Digest d;
  kernels::Kernels().digest(word_bytes, key.seed, first_word, bytes.data(), bytes.size() / word_bytes, d.lane);
  return d;
}

}  // namespace dcr
