#define DCR_KERNEL_NS generic
#include "compare_kernels.inc"
