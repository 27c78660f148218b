/*
 * What every compiled kernel with an AMX path shares: whether the build targets AMX-BF16 (and
 * the AVX-512 BF16/BW instructions beside it), Linux's permission request for the tile data
 * state, and the tile configuration's layout. Included by the attention kernel
 * (worker/attention/csrc/amx_tiles.h) and the 4-bit and FP8 linears (worker/layers/csrc).
 *
 * A process may use the tiles only once Linux has granted it the state (arch_prctl
 * ARCH_REQ_XCOMP_PERM, which a kernel before 5.16 refuses); the grant lasts as long as the
 * process, for all its threads.
 */
#ifndef CONVEYOR_AMX_PERMISSION_H
#define CONVEYOR_AMX_PERMISSION_H

#include <stdint.h>

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__) && defined(__AVX512BW__)
#define CONVEYOR_AMX_BUILT 1
#include <immintrin.h>

/* The request (arch/x86/include/uapi/asm/prctl.h) through libc's syscall(), declared here: its
 * header would need _GNU_SOURCE, which drags in sys/select.h's select() beside the attention
 * kernel's own names. */
extern long syscall(long number, ...);
#define AMX_SYS_ARCH_PRCTL 158
#define AMX_ARCH_REQ_XCOMP_PERM 0x1023
#define AMX_XFEATURE_XTILEDATA 18

/* 1 once Linux granted this process the tile data state, asked at most once per library. */
static int amx_granted = 0;

/* Whether the tiles may run: want, and the permission (requested on the first want). */
static inline int amx_permission(int want) {
    /* The arguments as the longs the kernel reads: through "..." an int's upper half is
     * whatever the register held. */
    if (want && !amx_granted)
        amx_granted = syscall((long)AMX_SYS_ARCH_PRCTL, (long)AMX_ARCH_REQ_XCOMP_PERM,
                              (long)AMX_XFEATURE_XTILEDATA) == 0;
    return want && amx_granted;
}

/* LDTILECFG's 64-byte operand (palette 1). */
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* LDTILECFG of cfg. GCC does not count the instruction as reading cfg's bytes and may drop the
 * stores that fill it (seen: a configuring function outside its caller kept only the palette
 * and the first 32 bytes, and LDTILECFG faulted); the empty asm that takes cfg's address with
 * a memory clobber keeps every store before it. */
static inline void amx_load_config(const amx_config *cfg) {
    __asm__ volatile("" : : "r"(cfg) : "memory");
    _tile_loadconfig(cfg);
}
#endif

#endif /* CONVEYOR_AMX_PERMISSION_H */
