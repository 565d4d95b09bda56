// A kernel that keeps the GPU busy for a given number of nanoseconds (by the global timer, so no
// clock rate is needed). The self-check queues it ahead of a timed round of launches: the host
// then enqueues the whole round while it spins, and the round's CUDA events time the kernels back
// to back, not the host's launch overhead between them (which, at a few microseconds a kernel,
// would otherwise be most of what they measure). One thread of one block; nothing else reads it.

static __device__ __forceinline__ unsigned long long servesim_global_ns() {
#ifdef SERVESIM_CPU_EMULATION
    return __emu_global_ns();
#else
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#endif
}

extern "C" __global__ void servesim_spin(unsigned long long ns) {
    const unsigned long long start = servesim_global_ns();
    while (servesim_global_ns() - start < ns) {
    }
}
