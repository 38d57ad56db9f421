#include "kernels.h"

#include <array>
#include <cstdlib>
#include <string_view>

#include "dcr/cpu.h"

namespace dcr::kernels {

const uint64_t* DigestTable() {
  // Fixed forever: changing a table changes every digest (docs/format.md).
  static const auto table = [] {
    std::array<uint64_t, 2 * kDigestBlock> t{};
    for (uint64_t l = 0; l < 2; ++l)
      for (uint64_t i = 0; i < kDigestBlock; ++i) t[2 * i + l] = DigestMix(DigestMix(0x6463722D64696765ull + l) ^ i);
    return t;
  }();
  return table.data();
}

void Digest16Start(Digest16Sum* s, const uint64_t seed[2], uint64_t first_word) {
  *s = Digest16Sum{};
  s->seed[0] = seed[0];
  s->seed[1] = seed[1];
  s->first_word = first_word;
  s->block = ~0ull;
}

// As DigestChangesTyped's scalar path (kernels.inc): h * d in 128-bit sums,
// the + d of H = h + 1 in scalar_sum.
void Digest16AddScalar(Digest16Sum* s, const Change<uint16_t>* changes, uint32_t n) {
  const uint64_t* table = DigestTable();
  for (uint32_t i = 0; i < n; ++i) {
    const uint64_t word = s->first_word + changes[i].position;
    const uint64_t limb = word / 2;
    const int64_t d = (int64_t{changes[i].new_word} - int64_t{changes[i].old_word}) * (int64_t{1} << (16 * (word % 2)));
    if (limb / kDigestBlock != s->block) {
      s->block = limb / kDigestBlock;
      s->s0 = BlockSeed(s->seed[0], s->block);
      s->s1 = BlockSeed(s->seed[1], s->block);
    }
    const uint64_t* t = table + 2 * (limb % kDigestBlock);
    s->acc0 += static_cast<Int128>(static_cast<int64_t>((t[0] ^ s->s0) >> 4)) * d;
    s->acc1 += static_cast<Int128>(static_cast<int64_t>((t[1] ^ s->s1) >> 4)) * d;
    s->scalar_sum += d;
  }
}

void Digest16Finish(Digest16Sum* s, uint64_t out[2]) {
  Int128 sum = s->scalar_sum;
  for (int k = 0; k < 4; ++k) sum += s->sum[k];
  const Int128 a0 = s->acc0 + s->lo[0] + s->lo[2] + ((static_cast<Int128>(s->hi[0]) + s->hi[2]) << 31);
  const Int128 a1 = s->acc1 + s->lo[1] + s->lo[3] + ((static_cast<Int128>(s->hi[1]) + s->hi[3]) << 31);
  out[0] = ModPrimeSigned(a0 + sum);
  out[1] = ModPrimeSigned(a1 + sum);
}

bool BaselineIsa() {
  static const bool forced = [] {
    const char* v = std::getenv("DCR_BASELINE_ISA");
    return v != nullptr && *v != '\0' && std::string_view(v) != "0";
  }();
  return forced;
}

const KernelSet& Kernels() {
  static const KernelSet set = [] {
#if defined(__x86_64__)
    if (!BaselineIsa() && Cpu().avx2 && Cpu().bmi1 && Cpu().bmi2)
      return KernelSet{avx2::CompareWholeBytes, avx2::DigestLimbs, avx2::FindChanges,   avx2::DigestChanges,
                       avx2::AddCodes16,        avx2::AddApply16,  avx2::AddPutDigest16};
#endif
    return KernelSet{generic::CompareWholeBytes,
                     generic::DigestLimbs,
                     generic::FindChanges,
                     generic::DigestChanges,
                     nullptr,
                     nullptr,
                     nullptr};
  }();
  return set;
}

}  // namespace dcr::kernels
