/* _frame_simd.h compiled for AVX2 (see there); an empty unit off x86-64. */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2")
#define FRAME_ISA avx2
#include "_frame_simd.h"
#endif
