/* shmloader copy: how a worker copies a large batch leaf into its slot.
 *
 * A plain memcpy writes through the cache: every destination line is first read from memory
 * (read-for-ownership), then written, and the batch evicts the worker's and the training
 * process's working sets on its way.  For a leaf far larger than the cache the training process
 * reads the batch from memory anyway, so those reads are pure loss: on the 2-core machine of
 * bench/, a 256 MiB batch of 4 MiB rows went into /dev/shm in 37 ms with streaming stores against
 * 45 ms with memcpy, and a training process summing the previous batch meanwhile read it in
 * 25-27 ms against 25-37 ms.  At 4 MiB the reader was slower (0.5 against 0.2 ms: the batch is
 * no longer in its cache), at 16-32 MiB it made no difference, so streaming is used only from
 * SHM_STREAM_MIN_BYTES of one leaf.
 *
 * Streaming (non-temporal) stores are weakly ordered: shm_copy_streaming ends with a store fence,
 * so the bytes are visible before the slot's READY release-store (ring.h).  Non-x86 builds, or
 * x86 builds without SSE2, copy with memcpy.
 */
#ifndef SHMLOADER_COPY_H
#define SHMLOADER_COPY_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define SHM_STREAM_MIN_BYTES (32ULL << 20)

/* memcpy(dst, src, n) with streaming stores where the CPU has them; dst and src must not overlap. */
static inline void shm_copy_streaming(void *dst, const void *src, size_t n)
{
#if defined(__SSE2__)
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    size_t i;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    for (i = head; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}

/* The copy for one leaf of `leaf_bytes` in all: streaming from SHM_STREAM_MIN_BYTES. */
static inline void shm_copy(void *dst, const void *src, size_t n, uint64_t leaf_bytes)
{
    if (leaf_bytes >= SHM_STREAM_MIN_BYTES)
        shm_copy_streaming(dst, src, n);
    else
        memcpy(dst, src, n);
}

#endif /* SHMLOADER_COPY_H */
