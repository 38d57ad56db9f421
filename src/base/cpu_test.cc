#include "dcr/cpu.h"

#include <gtest/gtest.h>

namespace dcr {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// GCC's runtime reads the CPU model itself: both readings must agree.
TEST(CpuTest, AgreesWithTheCompilerRuntime) {
  __builtin_cpu_init();
  EXPECT_EQ(Cpu().sse42, __builtin_cpu_supports("sse4.2") != 0);
  EXPECT_EQ(Cpu().avx2, __builtin_cpu_supports("avx2") != 0);
  EXPECT_EQ(Cpu().bmi1, __builtin_cpu_supports("bmi") != 0);
  EXPECT_EQ(Cpu().bmi2, __builtin_cpu_supports("bmi2") != 0);
}
#endif

TEST(CpuTest, IsReadOnce) { EXPECT_EQ(&Cpu(), &Cpu()); }

}  // namespace
}  // namespace dcr
