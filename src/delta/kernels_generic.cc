#define DCR_KERNEL_NS generic
#include "kernels.inc"
