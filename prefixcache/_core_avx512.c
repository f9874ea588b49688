/* _frame_simd.h compiled for AVX512 (see there); an empty unit off x86-64. */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f")
#define FRAME_ISA avx512
#include "_frame_simd.h"
#endif
