// emu_runtime.cpp: the scheduler behind cuda_emu.h, guarded buffers, and the C entry points the
// Python side (emulator.py) calls through ctypes.
#include "cuda_emu.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

// ---------------------------------------------------------------------------------------------
// Context switch (System V x86-64): saves the callee-saved registers, MXCSR and the x87 control
// word on the current stack, stores the stack pointer in *save, and resumes the stack `next`.
extern "C" void emu_ctx_switch(void** save, void* next);
asm(R"(
    .text
    .globl emu_ctx_switch
    .hidden emu_ctx_switch
    .type emu_ctx_switch, @function
emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_ctx_switch, .-emu_ctx_switch
)");


namespace emu {

ThreadState* cur = nullptr;
dim3 block_idx, block_dim, grid_dim;

namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr int kExchangeWords = 12;  // the most 32-bit words one lane brings to a collective (mma)

enum State { READY, RUNNING, WAIT_BLOCK, WAIT_WARP, DONE };

struct Fiber {
    ThreadState ts;
    void* sp = nullptr;
    char* map = nullptr;  // guard page + stack
    State state = DONE;
    unsigned wait_gen = 0;
    const char* wait_file = "";
    int wait_line = 0;
};

struct BlockBarrier {
    unsigned gen = 0;
    int arrived = 0;
    const char* file = nullptr;
    int line = 0;
};

struct WarpSync {
    unsigned gen = 0;
    unsigned arrived = 0;  // lanes that arrived at the pending collective
    unsigned mask = 0;
    int kind = 0;          // 0 syncwarp, 1 shfl, 2 vote, 3 mma
    const char* file = nullptr;
    int line = 0;
    uint32_t xchg[2][32][kExchangeWords];  // each lane's words, per generation
    unsigned members;      // lanes that exist in this warp (partial last warp)
};

std::vector<Fiber> fibers;
std::vector<WarpSync> warps;
BlockBarrier bar;
Fiber* running = nullptr;
void* main_sp = nullptr;
int alive = 0, exited = 0;
bool aborting = false;
void** launch_params = nullptr;
void (*launch_thunk)(void**) = nullptr;

// Options (emu_set_options).
int schedule_mode = 0;      // 0 forward, 1 reverse, 2 random per round
int block_order_mode = 0;   // 0 forward (x fastest), 1 reverse, 2 random
bool poison_shared = true;
struct SharedVar { const KernelEntry* kernel; char* addr; size_t bytes; };
std::vector<SharedVar> shared_vars;  // a kernel's __shared__ variables, registered by the loader
std::mt19937_64 rng(1);

// Report of the current / last launch.
std::string errors, warnings;
long long stat_switches = 0, stat_collectives = 0, stat_barriers = 0;

const char* where() {
    static char buf[160];
    if (!running) return "host";
    snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", block_idx.x, block_idx.y, block_idx.z,
             running->ts.tid.x, running->ts.tid.y, running->ts.tid.z);
    return buf;
}

void add_error(const std::string& msg) {
    if (errors.size() < 4000) errors += msg + "\n";
    aborting = true;
}

void add_warning(const std::string& msg) {
    // One line per distinct message.
    if (warnings.find(msg) == std::string::npos && warnings.size() < 4000) warnings += msg + "\n";
}

std::string site(const char* file, int line) {
    std::string f = file ? file : "?";
    auto slash = f.rfind('/');
    if (slash != std::string::npos) f = f.substr(slash + 1);
    return f + ":" + std::to_string(line);
}

[[noreturn]] void fiber_main();

void* prepare_stack(Fiber& f) {
    if (!f.map) {
        f.map = (char*)mmap(nullptr, kStackBytes + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (f.map == MAP_FAILED) { perror("mmap stack"); abort(); }
        mprotect(f.map, 4096, PROT_NONE);  // stack overflow faults
    }
    uintptr_t top = ((uintptr_t)(f.map + 4096 + kStackBytes)) & ~(uintptr_t)15;
    uint64_t* sp = (uint64_t*)top;
    *--sp = 0;                            // fiber_main's (absent) return address: keeps alignment
    *--sp = (uint64_t)(uintptr_t)&fiber_main;  // where emu_ctx_switch's `ret` goes
    for (int i = 0; i < 6; ++i) *--sp = 0;     // rbp rbx r12 r13 r14 r15
    uint32_t mxcsr;
    uint16_t fpucw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpucw));
    --sp;
    memcpy((char*)sp, &mxcsr, 4);
    memcpy((char*)sp + 4, &fpucw, 2);
    return sp;
}

// Suspends the running fiber (its state says what it waits for) and returns to the scheduler.
void suspend() {
    Fiber* f = running;
    ++stat_switches;
    emu_ctx_switch(&f->sp, main_sp);
    // Resumed by the scheduler: `running` is f again.
}

void on_exit() {
    Fiber* f = running;
    f->state = DONE;
    --alive;
    ++exited;
    WarpSync& w = warps[f->ts.warp];
    if (w.arrived && (w.mask >> f->ts.lane & 1u)) {
        add_error("lane " + std::to_string(f->ts.lane) + " of warp " + std::to_string(f->ts.warp) + " (" + where() +
                  ") exited while its warp waits for it in a collective at " + site(w.file, w.line));
    }
    if (bar.arrived > 0 && bar.arrived == alive) {
        add_warning("__syncthreads at " + site(bar.file, bar.line) +
                    " completed only because the missing threads had exited (UB in CUDA)");
        bar.arrived = 0;
        bar.file = nullptr;
        ++bar.gen;
    }
}

[[noreturn]] void fiber_main() {
    launch_thunk(launch_params);
    on_exit();
    Fiber* f = running;
    emu_ctx_switch(&f->sp, main_sp);
    __builtin_unreachable();
}

bool runnable(const Fiber& f) {
    switch (f.state) {
        case READY: return true;
        case WAIT_BLOCK: return bar.gen != f.wait_gen;
        case WAIT_WARP: return warps[f.ts.warp].gen != f.wait_gen;
        default: return false;
    }
}

void run_block(int nthreads) {
    if ((int)fibers.size() < nthreads) fibers.resize(nthreads);
    const int bx = block_dim.x, by = block_dim.y;
    const int nwarps = (nthreads + 31) / 32;
    warps.assign(nwarps, WarpSync());
    for (int w = 0; w < nwarps; ++w) {
        const int n = std::min(32, nthreads - 32 * w);
        warps[w].members = n == 32 ? 0xffffffffu : ((1u << n) - 1u);
    }
    for (int i = 0; i < nthreads; ++i) {
        Fiber& f = fibers[i];
        f.ts.linear = i;
        f.ts.tid = dim3(i % bx, (i / bx) % by, i / (bx * by));
        f.ts.warp = i / 32;
        f.ts.lane = i % 32;
        f.state = READY;
        f.sp = prepare_stack(f);
    }
    bar = BlockBarrier();
    alive = nthreads;
    exited = 0;
    std::vector<int> order(nthreads);
    for (int i = 0; i < nthreads; ++i) order[i] = schedule_mode == 1 ? nthreads - 1 - i : i;
    while (alive > 0 && !aborting) {
        if (schedule_mode == 2) std::shuffle(order.begin(), order.end(), rng);
        bool progressed = false;
        for (int i : order) {
            Fiber& f = fibers[i];
            if (!runnable(f)) continue;
            f.state = RUNNING;
            running = &f;
            cur = &f.ts;
            ++stat_switches;
            emu_ctx_switch(&main_sp, f.sp);
            running = nullptr;
            progressed = true;
            if (aborting) break;
        }
        if (!progressed && !aborting) {
            std::string msg = "deadlock in block (" + std::to_string(block_idx.x) + "," + std::to_string(block_idx.y) +
                              "," + std::to_string(block_idx.z) + "):";
            int shown = 0;
            for (int i = 0; i < nthreads && shown < 8; ++i) {
                const Fiber& f = fibers[i];
                if (f.state == DONE) continue;
                msg += " thread " + std::to_string(i) + " waits in " +
                       (f.state == WAIT_BLOCK ? "__syncthreads" : "a warp collective") + " at " +
                       site(f.wait_file, f.wait_line) + ";";
                ++shown;
            }
            add_error(msg);
        }
    }
    running = nullptr;
    cur = nullptr;
}

// Warp collective: record this lane's `n` 32-bit words, wait for every lane of `mask`, return the
// buffer holding all lanes' words for this collective ([lane][word]).
const uint32_t (*warp_collective(int kind, unsigned mask, const uint32_t* words, int n, const char* file,
                                 int line))[kExchangeWords] {
    ++stat_collectives;
    Fiber* f = running;
    WarpSync& w = warps[f->ts.warp];
    const unsigned me = 1u << f->ts.lane;
    if (!(mask & me)) {
        add_error(std::string("lane not in its own mask at ") + site(file, line) + " (" + where() + ")");
        suspend();
    }
    if (mask & ~w.members) {
        add_error("collective mask names lanes that do not exist at " + site(file, line));
        suspend();
    }
    if (w.arrived == 0) {
        w.mask = mask;
        w.kind = kind;
        w.file = file;
        w.line = line;
        // A lane of the mask that already exited can never arrive.
        for (int l = 0; l < 32; ++l) {
            if ((mask >> l & 1u) && fibers[f->ts.warp * 32 + l].state == DONE) {
                add_error("warp collective at " + site(file, line) + " names lane " + std::to_string(l) +
                          " which has exited (" + where() + ")");
                suspend();
            }
        }
    } else if (w.mask != mask || w.kind != kind || w.file != file || w.line != line) {
        if (w.mask != mask || w.kind != kind || strcmp(w.file, file) != 0 || w.line != line) {
            add_error("divergent warp collectives: " + site(w.file, w.line) + " vs " + site(file, line) +
                      " (masks " + std::to_string(w.mask) + " / " + std::to_string(mask) + ", " + where() + ")");
            suspend();
        }
    }
    if (w.arrived & me) {
        add_error("lane arrived twice at a collective at " + site(file, line));
        suspend();
    }
    const unsigned gen = w.gen;
    memcpy(w.xchg[gen & 1][f->ts.lane], words, sizeof(uint32_t) * n);
    w.arrived |= me;
    if (w.arrived == mask) {
        w.arrived = 0;
        ++w.gen;
    } else {
        f->state = WAIT_WARP;
        f->wait_gen = gen;
        f->wait_file = file;
        f->wait_line = line;
        suspend();
    }
    return w.xchg[gen & 1];
}

}  // namespace

void syncthreads(const char* file, int line) {
    ++stat_barriers;
    Fiber* f = running;
    if (exited > 0)
        add_warning("__syncthreads at " + site(file, line) + " reached after " + std::to_string(exited) +
                    " thread(s) of the block exited (UB in CUDA)");
    if (bar.arrived == 0) {
        bar.file = file;
        bar.line = line;
    } else if (bar.line != line || strcmp(bar.file, file) != 0) {
        add_warning("__syncthreads reached at different sites: " + site(bar.file, bar.line) + " and " + site(file, line));
    }
    const unsigned gen = bar.gen;
    ++bar.arrived;
    if (bar.arrived == alive) {
        bar.arrived = 0;
        bar.file = nullptr;
        ++bar.gen;
        return;
    }
    f->state = WAIT_BLOCK;
    f->wait_gen = gen;
    f->wait_file = file;
    f->wait_line = line;
    suspend();
}

void syncwarp(unsigned mask, const char* file, int line) {
    const uint32_t none = 0;
    warp_collective(0, mask, &none, 1, file, line);
}

uint32_t shfl32(int kind, unsigned mask, uint32_t bits, int arg, int width, const char* file, int line) {
    if (width <= 0 || width > 32 || (width & (width - 1))) {
        add_error("shuffle width " + std::to_string(width) + " at " + site(file, line));
        suspend();
    }
    const int lane = running->ts.lane;
    const auto vals = warp_collective(1, mask, &bits, 1, file, line);
    const int seg = lane & ~(width - 1);
    int src = lane;
    switch (kind) {
        case 0: src = seg + (arg & (width - 1)); break;
        case 1: src = lane - arg; if (src < seg) src = lane; break;
        case 2: src = lane + arg; if (src >= seg + width) src = lane; break;
        case 3: src = lane ^ arg; if (src >= seg + width) src = lane; break;
    }
    if (src < 0 || src > 31 || !(mask >> src & 1u)) {
        add_warning("shuffle at " + site(file, line) + " reads lane " + std::to_string(src) +
                    " outside the mask (undefined value)");
        return 0xffffffffu;
    }
    return vals[src][0];
}

unsigned vote(int kind, unsigned mask, int pred, const char* file, int line) {
    const uint32_t bit = pred ? 1u : 0u;
    const auto vals = warp_collective(2, mask, &bit, 1, file, line);
    unsigned ballot = 0;
    for (int l = 0; l < 32; ++l)
        if ((mask >> l & 1u) && vals[l][0]) ballot |= 1u << l;
    if (kind == 0) return ballot;
    if (kind == 1) return ballot != 0;
    return ballot == mask;
}

// One 16-bit element of an .f16x2 / .bf16x2 register as a double (exact).
static double half_value(uint32_t reg, int high, int type) {
    const uint16_t bits = (uint16_t)(high ? reg >> 16 : reg & 0xffffu);
    if (type == MMA_BF16) {
        const uint32_t u = (uint32_t)bits << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return (double)__builtin_bit_cast(_Float16, bits);
}

// One .tf32 element (a whole 32-bit register) as a double: the sign, the 8-bit exponent and the
// top 10 mantissa bits of the .f32 pattern; the low 13 bits are dropped (truncation, not
// rounding), so a kernel that leaves information there loses it. The PTX ISA leaves tf32's
// layout to the implementation; ptxas treats the low bits as unused (it drops an AND that clears
// them before an mma operand), and servesim's kernels pass exact tf32 values wherever it matters.
static double tf32_value(uint32_t reg) {
    const uint32_t u = reg & 0xffffe000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void mma_sync_f32(int k, int type, float* d, const uint32_t* a, const uint32_t* b, const float* c, const char* file,
                  int line) {
    const bool tf32 = type == MMA_TF32;
    if (tf32 ? k != 8 : ((k != 8 && k != 16) || (type != MMA_F16 && type != MMA_BF16))) {
        add_error("mma shape/type not emulated at " + site(file, line));
        suspend();
    }
    // The whole warp brings its fragments (A: k/4 registers, B: k/8, C: 4); each lane then
    // rebuilds A [16 x k], B [k x 8] and C [16 x 8] from all of them and computes its own 4
    // elements of D, with the layouts of the PTX ISA ("Matrix Fragments for mma.m16n8k16 /
    // mma.m16n8k8 with floating point type"): groupID = lane >> 2, threadID_in_group = lane % 4.
    // .tf32 (m16n8k8 only): one element per register, A: 4 registers, B: 2.
    const int na = tf32 ? 4 : k / 4, nb = tf32 ? 2 : k / 8;
    uint32_t words[kExchangeWords];
    memcpy(words, a, 4 * na);
    memcpy(words + na, b, 4 * nb);
    memcpy(words + na + nb, c, 16);
    const auto all = warp_collective(3, 0xffffffffu, words, na + nb + 4, file, line);
    double A[16][16], B[16][8], C[16][8];
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, t = lane & 3;
        if (tf32) {
            for (int i = 0; i < 4; ++i)  // a_i: row g (+8 for i = 1, 3), col t (+4 for i = 2, 3)
                A[g + 8 * (i & 1)][t + 4 * (i >> 1)] = tf32_value(all[lane][i]);
            for (int i = 0; i < 2; ++i)  // b_i: row t (+4 for i = 1), col g
                B[t + 4 * i][g] = tf32_value(all[lane][na + i]);
        }
        for (int i = 0; i < (tf32 ? 0 : 2 * na); ++i)  // a_i: row g (+8 for i = 2,3,6,7), col 2t + (i & 1) (+8 for i >= 4)
            A[g + 8 * ((i >> 1) & 1)][2 * t + (i & 1) + 8 * (i >> 2)] = half_value(all[lane][i / 2], i & 1, type);
        for (int i = 0; i < (tf32 ? 0 : 2 * nb); ++i)  // b_i: row 2t + (i & 1) (+8 for i >= 2), col g
            B[2 * t + (i & 1) + 8 * (i >> 1)][g] = half_value(all[lane][na + i / 2], i & 1, type);
        for (int i = 0; i < 4; ++i) {  // c_i: row g (+8 for i >= 2), col 2t + (i & 1)
            float f;
            memcpy(&f, &all[lane][na + nb + i], 4);
            C[g + 8 * (i >> 1)][2 * t + (i & 1)] = f;
        }
    }
    // Products of two 16-bit floats or two tf32 values (11-bit significands) are exact in
    // double; the sum is rounded once to float (the GPU's internal accumulation order and
    // rounding are not documented: this models an exact dot product).
    const int lane = running->ts.lane, g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        double acc = C[row][col];
        for (int kk = 0; kk < k; ++kk) acc += A[row][kk] * B[kk][col];
        d[i] = (float)acc;
    }
}

unsigned activemask() {
    // Cooperative fibers have no notion of lanes converged "now": report the live lanes.
    unsigned m = 0;
    const int w = running->ts.warp;
    for (int l = 0; l < 32; ++l) {
        const int i = w * 32 + l;
        if ((warps[w].members >> l & 1u) && fibers[i].state != DONE) m |= 1u << l;
    }
    return m;
}

}  // namespace emu

// ---------------------------------------------------------------------------------------------
// Guarded buffers: data abutting a PROT_NONE page, so a read or write past the end (mode 0) or
// before the start (mode 1) faults, and the fault handler names the buffer.
namespace {

struct Guarded {
    char* map;
    size_t map_bytes;
    char* user;
    size_t bytes;
    char name[64];
};
std::vector<Guarded> guarded;

char altstack[1 << 16];

void write_str(const char* s) { ssize_t r = write(2, s, strlen(s)); (void)r; }

void on_fault(int sig, siginfo_t* info, void*) {
    char buf[512];
    const char* addr = (const char*)info->si_addr;
    snprintf(buf, sizeof buf, "\n[emu] %s at address %p while running %s\n", sig == SIGSEGV ? "SIGSEGV" : "SIGBUS",
             (void*)addr, emu::running ? "a kernel thread" : "host code");
    write_str(buf);
    if (emu::running) {
        snprintf(buf, sizeof buf, "[emu]   block (%u,%u,%u) of grid (%u,%u,%u), thread (%u,%u,%u)\n",
                 emu::block_idx.x, emu::block_idx.y, emu::block_idx.z, emu::grid_dim.x, emu::grid_dim.y,
                 emu::grid_dim.z, emu::running->ts.tid.x, emu::running->ts.tid.y, emu::running->ts.tid.z);
        write_str(buf);
        const uintptr_t lo = (uintptr_t)emu::running->map, hi = lo + 4096;
        if ((uintptr_t)addr >= lo && (uintptr_t)addr < hi) write_str("[emu]   (fiber stack overflow)\n");
    }
    for (const Guarded& g : guarded) {
        const char* lo = g.map;
        const char* hi = g.map + g.map_bytes;
        if (addr >= lo && addr < hi) {
            long long off = (long long)(addr - g.user);
            snprintf(buf, sizeof buf, "[emu]   in the guard region of buffer '%s' (%zu bytes): offset %lld from its start\n",
                     g.name, g.bytes, off);
            write_str(buf);
        }
    }
    _exit(86);
}

}  // namespace

extern "C" {

void* emu_guard_alloc(size_t bytes, size_t align, int mode, const char* name) {
    const size_t page = 4096;
    const size_t data_pages = (bytes + page - 1) / page + 1;
    const size_t map_bytes = (data_pages + 2) * page;
    char* map = (char*)mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) return nullptr;
    mprotect(map, page, PROT_NONE);
    mprotect(map + map_bytes - page, page, PROT_NONE);
    char* data_start = map + page;
    char* data_end = map + map_bytes - page;
    char* user;
    if (mode == 1) {
        user = data_start;
    } else {
        uintptr_t u = (uintptr_t)(data_end - bytes);
        u &= ~(uintptr_t)(align - 1);
        user = (char*)u;
    }
    Guarded g;
    g.map = map;
    g.map_bytes = map_bytes;
    g.user = user;
    g.bytes = bytes;
    snprintf(g.name, sizeof g.name, "%s", name ? name : "?");
    guarded.push_back(g);
    return user;
}

void emu_guard_free(void* user) {
    for (size_t i = 0; i < guarded.size(); ++i) {
        if (guarded[i].user == user) {
            munmap(guarded[i].map, guarded[i].map_bytes);
            guarded.erase(guarded.begin() + i);
            return;
        }
    }
}

void emu_install_fault_handler() {
    stack_t ss;
    ss.ss_sp = altstack;
    ss.ss_size = sizeof altstack;
    ss.ss_flags = 0;
    sigaltstack(&ss, nullptr);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
}

void emu_set_options(int schedule, int block_order, int poison, unsigned long long seed) {
    emu::schedule_mode = schedule;
    emu::block_order_mode = block_order;
    emu::poison_shared = poison != 0;
    emu::rng.seed(seed);
}

const char* emu_entry_name(const emu::KernelEntry* e) { return e->name; }
const char* emu_entry_sig(const emu::KernelEntry* e) { return e->sig; }

void emu_register_shared(const emu::KernelEntry* kernel, void* addr, size_t bytes) {
    emu::shared_vars.push_back(emu::SharedVar{kernel, (char*)addr, bytes});
}

long long emu_shared_bytes() {
    long long n = 0;
    for (auto& v : emu::shared_vars) n += (long long)v.bytes;
    return n;
}

// Launches kernel `e` (an entry of a module's table) over grid x block with cuLaunchKernel-style
// params (each a pointer to the argument's value). `sig` is the caller's idea of the parameter
// types (see KernelEntry). Returns 0 on success; 1 bad signature / misaligned pointer / bad
// shape; 2 a runtime error (deadlock, divergence, ...). emu_errors / emu_warnings describe the
// last launch.
int emu_launch(const emu::KernelEntry* e, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
               void** params, const char* sig) {
    using namespace emu;
    errors.clear();
    warnings.clear();
    aborting = false;
    stat_switches = stat_collectives = stat_barriers = 0;
    if (strcmp(e->sig, sig) != 0) {
        errors = std::string("argument types '") + sig + "' do not match the kernel's parameters '" + e->sig + "'";
        return 1;
    }
    // CUDA needs every access naturally aligned: a pointer argument misaligned for its pointee
    // type faults (misaligned address) at its first access.
    for (int i = 0; e->sig[i]; ++i) {
        if (e->sig[i] != 'p' || !e->aligns[i]) continue;
        const uintptr_t ptr = (uintptr_t)(*(void**)params[i]);
        if (ptr % e->aligns[i]) {
            errors = std::string("pointer argument ") + std::to_string(i) + " = " + std::to_string(ptr) +
                     " is not aligned to its pointee type's " + std::to_string(e->aligns[i]) +
                     " bytes (misaligned address on a GPU)";
            return 1;
        }
    }
    const unsigned long long nthreads = (unsigned long long)bx * by * bz;
    if (nthreads == 0 || nthreads > 1024 || gx == 0 || gy == 0 || gz == 0) {
        errors = "bad launch shape";
        return 1;
    }
    grid_dim = dim3(gx, gy, gz);
    block_dim = dim3(bx, by, bz);
    launch_params = params;
    launch_thunk = e->thunk;
    std::vector<SharedVar*> mine;
    for (auto& v : shared_vars)
        if (v.kernel == e) mine.push_back(&v);
    const unsigned long long nblocks = (unsigned long long)gx * gy * gz;
    std::vector<unsigned long long> order;
    if (block_order_mode != 0) {
        order.resize(nblocks);
        for (unsigned long long i = 0; i < nblocks; ++i) order[i] = block_order_mode == 1 ? nblocks - 1 - i : i;
        if (block_order_mode == 2) std::shuffle(order.begin(), order.end(), rng);
    }
    for (unsigned long long b = 0; b < nblocks && !aborting; ++b) {
        const unsigned long long id = order.empty() ? b : order[b];
        block_idx = dim3(id % gx, (id / gx) % gy, id / ((unsigned long long)gx * gy));
        if (poison_shared)
            for (auto* v : mine) memset(v->addr, 0xff, v->bytes);
        run_block((int)nthreads);
    }
    return aborting ? 2 : 0;
}

const char* emu_errors() { return emu::errors.c_str(); }
const char* emu_warnings() { return emu::warnings.c_str(); }
long long emu_stat(int which) {
    return which == 0 ? emu::stat_switches : which == 1 ? emu::stat_collectives : emu::stat_barriers;
}

}  // extern "C"
