#include "kernels.h"

#include <array>
#include <cstdlib>
#include <string_view>

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
    if (!BaselineIsa() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
        __builtin_cpu_supports("bmi2"))
      return KernelSet{avx2::CompareWholeBytes, avx2::DigestLimbs, avx2::FindChanges, avx2::DigestChanges,
                       avx2::AddCodes16, avx2::AddApply16};
#endif
    return KernelSet{generic::CompareWholeBytes, generic::DigestLimbs, generic::FindChanges, generic::DigestChanges,
                    nullptr, nullptr};
  }();
  return set;
}

}  // namespace dcr::kernels
