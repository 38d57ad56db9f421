// Built with -mavx2 -mbmi -mbmi2 (see CMakeLists.txt); used only when the CPU
// has all three.
#define DCR_KERNEL_NS avx2
#include "kernels.inc"
