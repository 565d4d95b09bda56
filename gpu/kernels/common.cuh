// Storage types, conversions and warp helpers shared by the servesim kernels.
//
// NVRTC compiles these sources with no host headers, so nothing here includes <cuda_fp16.h> or
// <cuda_bf16.h>: half and bfloat16 values travel as raw 16-bit patterns and are converted with
// one PTX instruction (fp16) or a shift (bf16). Each storage type is a tag struct that names its
// raw element type, how many elements one 16-byte vector load carries, and how to convert.
#ifndef SERVESIM_COMMON_CUH
#define SERVESIM_COMMON_CUH

#define SERVESIM_FULL_MASK 0xffffffffu

// -inf as a bit pattern: NVRTC has no <math.h>, hence no INFINITY macro.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Running maxima start here rather than at -inf so that exp2f(m_old - m_new) is never
// exp2f(-inf - -inf) = NaN for a lane that has not seen a key yet; any real score is larger.
#define SERVESIM_NO_SCORE (-1.0e30f)

// Tensor-core helpers of a 16-bit storage type (PTX_TYPE "f16" / "bf16"; EMU_TYPE its code in the
// CPU emulator's mma shim): pack2 makes one .f16x2 / .bf16x2 register of two floats (lo in the
// low half, round to nearest even); mma16816 / mma1688 are d = a * b + c with fp32 accumulation,
// mma.sync m16n8k16 / m16n8k8 in the PTX ISA's fragment layouts (a: 4 / 2 registers, b: 2 / 1,
// c and d: 4 floats).
#ifdef SERVESIM_CPU_EMULATION
#define SERVESIM_PACK2(PTX_TYPE) r = (unsigned int)from_float(lo) | ((unsigned int)from_float(hi) << 16);
#define SERVESIM_MMA16816(PTX_TYPE, EMU_TYPE) __emu_mma_m16n8k16_f32(EMU_TYPE, d, a, b, c);
#define SERVESIM_MMA1688(PTX_TYPE, EMU_TYPE) __emu_mma_m16n8k8_f32(EMU_TYPE, d, a, b, c);
#else
#define SERVESIM_PACK2(PTX_TYPE) asm("cvt.rn." PTX_TYPE "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#define SERVESIM_MMA16816(PTX_TYPE, EMU_TYPE)                                                         \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 {%0,%1,%2,%3}, "          \
        "{%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"                                                  \
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                              \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),     \
          "f"(c[2]), "f"(c[3]));
#define SERVESIM_MMA1688(PTX_TYPE, EMU_TYPE)                                                          \
    asm("mma.sync.aligned.m16n8k8.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 {%0,%1,%2,%3}, {%4,%5}, "  \
        "{%6}, {%7,%8,%9,%10};"                                                                       \
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                              \
        : "r"(a[0]), "r"(a[1]), "r"(b[0]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif
#define SERVESIM_TENSOR_CORE_OPS(PTX_TYPE, EMU_TYPE)                                                  \
    static __device__ __forceinline__ unsigned int pack2(float lo, float hi) {                        \
        unsigned int r;                                                                               \
        SERVESIM_PACK2(PTX_TYPE)                                                                      \
        return r;                                                                                     \
    }                                                                                                 \
    static __device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4],           \
                                                    const unsigned (&b)[2], const float (&c)[4]) {    \
        SERVESIM_MMA16816(PTX_TYPE, EMU_TYPE)                                                         \
    }                                                                                                 \
    static __device__ __forceinline__ void mma1688(float (&d)[4], const unsigned (&a)[2],             \
                                                   const unsigned (&b)[1], const float (&c)[4]) {     \
        SERVESIM_MMA1688(PTX_TYPE, EMU_TYPE)                                                          \
    }

struct F32 {
    typedef float raw;
    static const int kVec = 4;  // elements per 16-byte vector
    static __device__ __forceinline__ float to_float(raw x) { return x; }
    static __device__ __forceinline__ raw from_float(float x) { return x; }
    static __device__ __forceinline__ void unpack(const uint4& v, float* out) {
        out[0] = __uint_as_float(v.x);
        out[1] = __uint_as_float(v.y);
        out[2] = __uint_as_float(v.z);
        out[3] = __uint_as_float(v.w);
    }
    // fp32 on tensor cores without tf32's rounding ("3xTF32", as CUTLASS's OpMultiplyAddFastF32
    // and cuBLAS's CUBLAS_COMPUTE_32F_FAST_TF32 do it): x = hi + lo, both tf32, and a product
    // x * y is hi_x hi_y + hi_x lo_y + lo_x hi_y (lo_x lo_y < 2^-20 |x y| is dropped).
    // hi is x with its low 13 mantissa bits cleared, exactly a tf32 value, so the mma's own
    // handling of an .f32 pattern does not enter; lo = x - hi is exact in fp32 and below
    // 2^-10 |x|, of which the mma keeps the top 11 significant bits: a product's error is below
    // 2^-19 |x y| (fp32's own rounding: 2^-24), its sum's as in fp32. Two instructions an element.
    static __device__ __forceinline__ void split_tf32(float x, unsigned& hi, unsigned& lo) {
        hi = __float_as_uint(x) & 0xffffe000u;
        lo = __float_as_uint(x - __uint_as_float(hi));
    }
    // d = a * b + c, mma.sync m16n8k8 with .tf32 inputs (a: 4 registers, b: 2; c, d: 4 floats).
    static __device__ __forceinline__ void mma1688(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                                   const float (&c)[4]) {
#ifdef SERVESIM_CPU_EMULATION
        __emu_mma_m16n8k8_tf32(d, a, b, c);
#else
        asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%11,%12,%13};"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
              "f"(c[3]));
#endif
    }
};

struct F16 {
    typedef unsigned short raw;
    static const int kVec = 8;
    static __device__ __forceinline__ float to_float(raw x) {
        float f;
#ifdef SERVESIM_CPU_EMULATION  // the tests' CPU emulator (tests/gpu/cuda_emu): no PTX there
        f = (float)__builtin_bit_cast(_Float16, x);
#else
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
#endif
        return f;
    }
    static __device__ __forceinline__ raw from_float(float x) {
        raw h;
#ifdef SERVESIM_CPU_EMULATION
        h = __builtin_bit_cast(raw, (_Float16)x);
#else
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
#endif
        return h;
    }
    // Both halves of a 32-bit word at once: the conversions read the halves in place (no shift
    // or mask per element).
    static __device__ __forceinline__ void unpack2(unsigned int w, float& lo, float& hi) {
#ifdef SERVESIM_CPU_EMULATION
        lo = (float)__builtin_bit_cast(_Float16, (raw)(w & 0xffffu));
        hi = (float)__builtin_bit_cast(_Float16, (raw)(w >> 16));
#else
        asm("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
            : "=f"(lo), "=f"(hi) : "r"(w));
#endif
    }
    static __device__ __forceinline__ void unpack(const uint4& v, float* out) {
        unpack2(v.x, out[0], out[1]);
        unpack2(v.y, out[2], out[3]);
        unpack2(v.z, out[4], out[5]);
        unpack2(v.w, out[6], out[7]);
    }
    SERVESIM_TENSOR_CORE_OPS("f16", 0)
};

struct BF16 {
    typedef unsigned short raw;
    static const int kVec = 8;
    static __device__ __forceinline__ float to_float(raw x) {
        return __uint_as_float(((unsigned int)x) << 16);
    }
    // Round to nearest even; NaN stays a (quiet) NaN.
    static __device__ __forceinline__ raw from_float(float x) {
        unsigned int u = __float_as_uint(x);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (raw)0x7fc0u;
        u += 0x7fffu + ((u >> 16) & 1u);
        return (raw)(u >> 16);
    }
    static __device__ __forceinline__ void unpack(const uint4& v, float* out) {
        const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = __uint_as_float(w[i] << 16);
            out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
    SERVESIM_TENSOR_CORE_OPS("bf16", 1)
};

// 2^x in one MUFU.EX2 (relative error ~2^-22, flushes denormals to zero): exp2f's accurate
// range handling costs four more instructions per call in the decode loop.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef SERVESIM_CPU_EMULATION
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(SERVESIM_FULL_MASK, x, off));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(SERVESIM_FULL_MASK, x, off);
    return x;
}

// log2 of a power of two, at compile time.
template <int N>
struct Log2 {
    static_assert(N > 0 && (N & (N - 1)) == 0, "Log2 of a power of two");
    static const int value = 1 + Log2<N / 2>::value;
};
template <>
struct Log2<1> {
    static const int value = 0;
};

// Physical address (in elements) of token `pos` of a sequence, for one kv head's row.
// 64-bit because a large pool (8k tokens x 256 sequences x 8 heads x 128) passes 2^31 elements.
__device__ __forceinline__ long long paged_row(const int* __restrict__ block_table, int pos,
                                               int block_size, int num_kv_heads, int head_dim,
                                               int kv_head) {
    const long long block = block_table[pos / block_size];
    const long long slot = block * block_size + (pos % block_size);
    return (slot * num_kv_heads + kv_head) * head_dim;
}

#endif  // SERVESIM_COMMON_CUH
