#pragma once
// The x86-64 instruction set extensions this CPU (and its OS) offers, read
// with cpuid and xgetbv. __builtin_cpu_supports needs the compiler runtime's
// CPU model, and zig's runtime (the wheel's toolchain) leaves it zero, which
// would silently select the baseline kernels.

namespace dcr {

struct CpuFeatures {
  bool sse42 = false;
  bool avx2 = false;  // and the OS saves the YMM registers
  bool bmi1 = false;
  bool bmi2 = false;
};

// All false off x86-64. Read once.
const CpuFeatures& Cpu();

}  // namespace dcr
