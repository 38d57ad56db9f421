// Built with -mavx2 (see CMakeLists.txt); used only when the CPU has AVX2.
#define DCR_KERNEL_NS avx2
#include "kernels.inc"
