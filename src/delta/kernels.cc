#include "kernels.h"

#include <array>

namespace dcr::kernels {

const uint64_t* DigestTable(int lane) {
  // Fixed forever: changing a table changes every digest (docs/format.md).
  static const auto tables = [] {
    std::array<std::array<uint64_t, kDigestBlock>, 2> t{};
    for (int l = 0; l < 2; ++l)
      for (uint64_t i = 0; i < kDigestBlock; ++i) t[l][i] = DigestMix(DigestMix(0x6463722D64696765ull + l) ^ i);
    return t;
  }();
  return tables[lane].data();
}

const KernelSet& Kernels() {
  static const KernelSet set = [] {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2"))
      return KernelSet{avx2::CompareWholeBytes, avx2::DigestLimbs, avx2::FindChanges};
#endif
    return KernelSet{generic::CompareWholeBytes, generic::DigestLimbs, generic::FindChanges};
  }();
  return set;
}

}  // namespace dcr::kernels
