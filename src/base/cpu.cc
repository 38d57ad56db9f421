#include "dcr/cpu.h"

#if defined(__x86_64__)
#include <cpuid.h>

#include <cstdint>
#endif

namespace dcr {

namespace {

CpuFeatures Detect() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return f;
  f.sse42 = (c & (1u << 20)) != 0;
  const bool osxsave = (c & (1u << 27)) != 0, avx = (c & (1u << 28)) != 0;
  bool ymm_saved = false;
  if (osxsave && avx) {
    uint32_t xcr0 = 0, xcr0_high = 0;
    __asm__ volatile("xgetbv" : "=a"(xcr0), "=d"(xcr0_high) : "c"(0));
    ymm_saved = (xcr0 & 6u) == 6u;  // XMM and YMM state
  }
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return f;
  f.avx2 = ymm_saved && (b & (1u << 5)) != 0;
  f.bmi1 = (b & (1u << 3)) != 0;
  f.bmi2 = (b & (1u << 8)) != 0;
#endif
  return f;
}

}  // namespace

const CpuFeatures& Cpu() {
  static const CpuFeatures features = Detect();
  return features;
}

}  // namespace dcr
