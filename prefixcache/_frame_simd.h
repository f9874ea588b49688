/* A frame payload's copy and checksum (xxh3_64, seed 0), compiled once per x86 vector unit.
 *
 * The vendored xxhash.h picks its vector unit when compiled, and the extension's baseline is
 * SSE2; included from _core.c (SSE2) and _core_avx2.c / _core_avx512.c (each under a GCC target
 * pragma), this gives one copy of these two functions per unit, named by FRAME_ISA, which _core.c
 * picks from at import by what the CPU supports (as xxHash's own xxh_x86dispatch.c does; the
 * AVX-512 build hashes 2 MiB about 2.5x faster than SSE2 here). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define FRAME_CAT_(a, b) a##_##b
#define FRAME_CAT(a, b) FRAME_CAT_(a, b)
#define FRAME_CHUNK (64 * 1024) /* copy a chunk, then hash it while it is still in cache */

uint64_t FRAME_CAT(frame_xxh3_64, FRAME_ISA)(const void *data, size_t n);
uint64_t FRAME_CAT(frame_copy_xxh3_64, FRAME_ISA)(void *dst, const void *src, size_t n);

uint64_t
FRAME_CAT(frame_xxh3_64, FRAME_ISA)(const void *data, size_t n)
{
    return XXH3_64bits(data, n);
}

/* memcpy(dst, src, n) and the xxh3_64 of those bytes, reading the source once */
uint64_t
FRAME_CAT(frame_copy_xxh3_64, FRAME_ISA)(void *dst, const void *src, size_t n)
{
    if (n <= FRAME_CHUNK) {
        memcpy(dst, src, n);
        return XXH3_64bits(dst, n);
    }
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    for (size_t done = 0; done < n; done += FRAME_CHUNK) {
        size_t step = n - done < FRAME_CHUNK ? n - done : FRAME_CHUNK;
        memcpy((char *)dst + done, (const char *)src + done, step);
        XXH3_64bits_update(&state, (const char *)dst + done, step);
    }
    return XXH3_64bits_digest(&state);
}
