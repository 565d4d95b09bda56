// cuda_emu.h: run CUDA C++ kernels on the CPU, for correctness checks without a GPU.
//
// Every CUDA thread of a block is a cooperative fiber (its own stack, switched by a few lines of
// x86-64 assembly in emu_runtime.cpp); a block's fibers run on one OS thread, blocks one after
// another. A fiber runs until it reaches a synchronisation point (__syncthreads, __syncwarp, a
// shuffle or vote) and then yields, so between two barriers each thread runs alone, start to
// finish: that is the least synchronised schedule a correct kernel must tolerate, which makes a
// missing barrier show up as a wrong result. The order in which fibers are resumed (forward,
// reverse, random) and the order of blocks can be changed; a race-free kernel must give
// bit-identical results under every order.
//
// Checked at run time: a barrier or warp collective that can never complete (deadlock), warp
// collectives reached by lanes at different call sites or with different masks (divergence), a
// lane that exits while its warp waits for it in a collective, __syncthreads after some threads
// exited. __shared__ memory is filled with NaN bytes (0xff) before every block.
//
// Include before the kernel source (g++ -include cuda_emu.h). Kernel code is used unchanged,
// except inline PTX, which has no CPU meaning: the kernels give a C++ alternative under
// #ifdef SERVESIM_CPU_EMULATION. The runtime (emu_runtime.cpp) is one shared library; each
// module (what CuPy's RawModule compiles: the source plus a list of name expressions) is
// another, which lists its kernels with EMU_MODULE_TABLE (see emulator.py).
#ifndef CUDA_EMU_H
#define CUDA_EMU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <type_traits>
#include <utility>

// ---------------------------------------------------------------------------------------------
// Execution-space and declaration keywords.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// One copy per process: blocks run one at a time. The Python loader finds every __shared__
// variable in the symbol table (a kernel's static locals) and registers it, so that the runtime
// can fill it with 0xff bytes (NaN) before each block.
#define __shared__ static __attribute__((aligned(16)))
#define __constant__ static
// __restrict__ is a GNU C++ keyword already.

// ---------------------------------------------------------------------------------------------
// Built-in vector types (16-byte alignment as on the GPU: a misaligned uint4 access is UB, which
// -fsanitize=alignment reports).
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int a = 1, unsigned int b = 1, unsigned int c = 1) : x(a), y(b), z(c) {}
};
struct uint3 { unsigned int x, y, z; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
inline uint4 make_uint4(unsigned int a, unsigned int b, unsigned int c, unsigned int d) { return uint4{a, b, c, d}; }
inline uint2 make_uint2(unsigned int a, unsigned int b) { return uint2{a, b}; }
inline int4 make_int4(int a, int b, int c, int d) { return int4{a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
inline float2 make_float2(float a, float b) { return float2{a, b}; }

namespace emu {

struct ThreadState {
    dim3 tid;   // threadIdx
    int linear; // x + y * bx + z * bx * by
    int warp;
    int lane;
};

extern ThreadState* cur;  // the CUDA thread now running
extern dim3 block_idx, block_dim, grid_dim;

void syncthreads(const char* file, int line);
void syncwarp(unsigned mask, const char* file, int line);
// kind: 0 idx, 1 up, 2 down, 3 xor (CUDA's __shfl*_sync semantics, including `width`).
uint32_t shfl32(int kind, unsigned mask, uint32_t bits, int arg, int width, const char* file, int line);
// kind: 0 ballot, 1 any, 2 all.
unsigned vote(int kind, unsigned mask, int pred, const char* file, int line);
unsigned activemask();
// Tensor cores: mma.sync.aligned.m16n8k{k}.row.col.f32.{f16|bf16}.{f16|bf16}.f32, warp-collective.
// a: k / 4 registers of .f16x2 / .bf16x2, b: k / 8, c and d: 4 floats (PTX fragment layouts).
// MMA_TF32: mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (k = 8 only): a: 4 registers of
// one .tf32 each, b: 2 (the low 13 bits of each are ignored).
enum { MMA_F16 = 0, MMA_BF16 = 1, MMA_TF32 = 2 };
void mma_sync_f32(int k, int type, float* d, const uint32_t* a, const uint32_t* b, const float* c, const char* file,
                  int line);

template <typename V>
inline V shfl(int kind, unsigned mask, V v, int arg, int width, const char* file, int line) {
    static_assert(sizeof(V) == 4 || sizeof(V) == 8, "shuffle of a 4- or 8-byte value");
    if constexpr (sizeof(V) == 4) {
        uint32_t b;
        memcpy(&b, &v, 4);
        b = shfl32(kind, mask, b, arg, width, file, line);
        memcpy(&v, &b, 4);
    } else {
        uint32_t b[2];
        memcpy(b, &v, 8);
        b[0] = shfl32(kind, mask, b[0], arg, width, file, line);
        b[1] = shfl32(kind, mask, b[1], arg, width, file, line);
        memcpy(&v, b, 8);
    }
    return v;
}

// Kernel registry: name (exactly as CuPy's name_expressions spell it), parameter type codes
// (p pointer, i int, I unsigned, q long long, Q unsigned long long, f float, d double, ? bool,
// h short, H unsigned short) and a thunk that calls the kernel with cuLaunchKernel-style params.
struct KernelEntry {
    const char* name;
    const char* sig;
    void (*thunk)(void** params);
    const unsigned* aligns;  // per parameter: alignof(pointee) for pointers, 0 otherwise
};

template <typename... A>
struct Sig {};
template <typename... A>
constexpr Sig<A...> sig_of(void (*)(A...)) { return {}; }

template <typename T>
constexpr char type_code() {
    using U = std::decay_t<T>;
    if constexpr (std::is_pointer_v<U>) return 'p';
    else if constexpr (std::is_same_v<U, bool>) return '?';
    else if constexpr (std::is_same_v<U, int>) return 'i';
    else if constexpr (std::is_same_v<U, unsigned int>) return 'I';
    else if constexpr (std::is_same_v<U, long long> || std::is_same_v<U, long>) return 'q';
    else if constexpr (std::is_same_v<U, unsigned long long> || std::is_same_v<U, unsigned long>) return 'Q';
    else if constexpr (std::is_same_v<U, short>) return 'h';
    else if constexpr (std::is_same_v<U, unsigned short>) return 'H';
    else if constexpr (std::is_same_v<U, float>) return 'f';
    else if constexpr (std::is_same_v<U, double>) return 'd';
    else return 'X';
}

template <typename... A>
const char* sig_string(Sig<A...>) {
    static const char s[] = {type_code<A>()..., '\0'};
    return s;
}

template <typename T>
constexpr unsigned pointee_align() {
    using U = std::decay_t<T>;
    if constexpr (std::is_pointer_v<U> && !std::is_void_v<std::remove_pointer_t<U>>)
        return alignof(std::remove_cv_t<std::remove_pointer_t<U>>);
    else
        return 0;
}

template <typename... A>
const unsigned* align_array(Sig<A...>) {
    static const unsigned a[] = {pointee_align<A>()..., 0u};
    return a;
}

template <auto Fn, typename... A, size_t... I>
void call_with_params(void** p, Sig<A...>, std::index_sequence<I...>) {
    Fn(*static_cast<std::decay_t<A>*>(p[I])...);
}

template <auto Fn, typename... A>
void thunk_sig(void** p, Sig<A...> s) {
    call_with_params<Fn>(p, s, std::index_sequence_for<A...>{});
}

template <auto Fn>
void thunk_of(void** p) {
    thunk_sig<Fn>(p, sig_of(Fn));
}

}  // namespace emu

#define EMU_KERNEL(NAME, ...)                                                                        \
    ::emu::KernelEntry {                                                                             \
        NAME, ::emu::sig_string(::emu::sig_of(&__VA_ARGS__)), &::emu::thunk_of<&__VA_ARGS__>,         \
            ::emu::align_array(::emu::sig_of(&__VA_ARGS__))                                           \
    }

// ---------------------------------------------------------------------------------------------
// Thread / block coordinates.
#define threadIdx (::emu::cur->tid)
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)
#define warpSize 32

// ---------------------------------------------------------------------------------------------
// Synchronisation and warp intrinsics. The call site (file, line) comes in through GCC's
// __builtin_FILE / __builtin_LINE default arguments, so the kernel calls them as in CUDA.
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::emu::syncthreads(file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::emu::syncwarp(mask, file, line);
}
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

template <typename V>
inline V __shfl_sync(unsigned mask, V v, int src, int width = 32, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::emu::shfl(0, mask, v, src, width, file, line);
}
template <typename V>
inline V __shfl_up_sync(unsigned mask, V v, unsigned delta, int width = 32, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::emu::shfl(1, mask, v, (int)delta, width, file, line);
}
template <typename V>
inline V __shfl_down_sync(unsigned mask, V v, unsigned delta, int width = 32, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::emu::shfl(2, mask, v, (int)delta, width, file, line);
}
template <typename V>
inline V __shfl_xor_sync(unsigned mask, V v, int lane_mask, int width = 32, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::emu::shfl(3, mask, v, lane_mask, width, file, line);
}
inline unsigned __ballot_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return ::emu::vote(0, mask, pred, file, line);
}
inline int __any_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (int)::emu::vote(1, mask, pred, file, line);
}
inline int __all_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (int)::emu::vote(2, mask, pred, file, line);
}
inline unsigned __activemask() { return ::emu::activemask(); }

// Tensor-core mma.sync (the PTX instruction, which CUDA C++ reaches through inline asm): kernels
// call these under SERVESIM_CPU_EMULATION instead.
inline void __emu_mma_m16n8k16_f32(int type, float* d, const unsigned* a, const unsigned* b, const float* c,
                                   const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::emu::mma_sync_f32(16, type, d, a, b, c, file, line);
}
inline void __emu_mma_m16n8k8_f32(int type, float* d, const unsigned* a, const unsigned* b, const float* c,
                                  const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::emu::mma_sync_f32(8, type, d, a, b, c, file, line);
}
inline void __emu_mma_m16n8k8_tf32(float* d, const unsigned* a, const unsigned* b, const float* c,
                                   const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::emu::mma_sync_f32(8, ::emu::MMA_TF32, d, a, b, c, file, line);
}

// Atomics: fibers of a block never run at the same time, so plain read-modify-write is atomic.
template <typename V>
inline V atomicAdd(V* p, V v) { V old = *p; *p = old + v; return old; }
template <typename V>
inline V atomicMax(V* p, V v) { V old = *p; *p = old > v ? old : v; return old; }
template <typename V>
inline V atomicMin(V* p, V v) { V old = *p; *p = old < v ? old : v; return old; }
template <typename V>
inline V atomicExch(V* p, V v) { V old = *p; *p = v; return old; }
template <typename V>
inline V atomicCAS(V* p, V cmp, V v) { V old = *p; if (old == cmp) *p = v; return old; }

// ---------------------------------------------------------------------------------------------
// Bit casts and math. Host libm is at least as accurate as CUDA's non-fast-math functions
// (exp2f: CUDA 2 ulp, glibc < 1 ulp), so results differ from the GPU's only in the last bits.
inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned int x) { float f; memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
inline unsigned int __float_as_uint(float x) { unsigned int i; memcpy(&i, &x, 4); return i; }
inline double __longlong_as_double(long long x) { double d; memcpy(&d, &x, 8); return d; }
inline long long __double_as_longlong(double x) { long long i; memcpy(&i, &x, 8); return i; }
inline float __expf(float x) { return expf(x); }
inline float __exp2f(float x) { return exp2f(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
// Byte i of the result is byte (s >> 4i) & 7 of the 8-byte value {y, x} (x the low 4 bytes).
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned int r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned int)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
    return r;
}

// %globaltimer (ns): the host's monotonic clock.
inline unsigned long long __emu_global_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

// CUDA's overloaded device min / max (no std::min in device code).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// A module's table of kernels and the C entry points the Python loader reads it with.
#define EMU_MODULE_TABLE(...)                                                                      \
    static const ::emu::KernelEntry emu_module_table_[] = {__VA_ARGS__};                          \
    extern "C" int emu_module_count() { return (int)(sizeof emu_module_table_ / sizeof emu_module_table_[0]); } \
    extern "C" const ::emu::KernelEntry* emu_module_entry(int i) { return &emu_module_table_[i]; }

#endif  // CUDA_EMU_H
