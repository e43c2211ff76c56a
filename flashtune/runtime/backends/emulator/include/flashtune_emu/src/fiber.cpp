// Fiber context switching.
//
// x86-64: a hand-written switch that saves the callee-saved registers, MXCSR and the x87
// control word on the old stack and swaps stack pointers (about 25 ns per round trip,
// measured; glibc's swapcontext makes a sigprocmask system call each time and takes about
// 500 ns, which dominates a kernel's emulation time since every warp collective switches 32
// fibers). Other architectures fall back to ucontext.
#include <cstdlib>
#include <cstring>

#include "internal.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

namespace ftemu {

// A fiber that returns to the scheduler for good (thread exit, a fault) leaves its frames'
// AddressSanitizer red zones poisoned: the frames are never returned from. The next block
// reuses the stack, so its shadow must be cleared before anything is written there.
static void reset_stack_shadow(unsigned char* stack_lo, size_t stack_size) {
#if defined(__SANITIZE_ADDRESS__)
    __asan_unpoison_memory_region(stack_lo, stack_size);
#else
    (void)stack_lo;
    (void)stack_size;
#endif
}

}  // namespace ftemu

#if defined(__x86_64__)

extern "C" void ftemu_ctx_switch(void** save_sp, void* load_sp);

asm(R"(
    .text
    .globl ftemu_ctx_switch
    .hidden ftemu_ctx_switch
    .type ftemu_ctx_switch,@function
ftemu_ctx_switch:
    .cfi_startproc
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
    .cfi_endproc
    .size ftemu_ctx_switch,.-ftemu_ctx_switch
)");

namespace ftemu {

void context_init(Context* ctx, unsigned char* stack_lo, size_t stack_size, void (*entry)()) {
    reset_stack_shadow(stack_lo, stack_size);
    auto top = reinterpret_cast<uintptr_t>(stack_lo + stack_size) & ~uintptr_t{15};
    auto** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;                               // fake return address of `entry`
    *--sp = reinterpret_cast<void*>(entry);        // popped by `ret` of the switch
    for (int i = 0; i < 6; ++i) *--sp = nullptr;   // rbp rbx r12 r13 r14 r15
    --sp;                                          // MXCSR + x87 control word
    unsigned mxcsr;
    unsigned short fpucw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpucw));
    std::memcpy(reinterpret_cast<unsigned char*>(sp), &mxcsr, 4);
    std::memcpy(reinterpret_cast<unsigned char*>(sp) + 4, &fpucw, 2);
    ctx->sp = sp;
}

void context_switch(Context* from, Context* to) { ftemu_ctx_switch(&from->sp, to->sp); }

void context_release(Context*) {}

}  // namespace ftemu

#else  // portable fallback

#include <ucontext.h>

namespace ftemu {

static ucontext_t* uc_of(Context* ctx) {
    if (!ctx->uc) ctx->uc = std::calloc(1, sizeof(ucontext_t));
    return static_cast<ucontext_t*>(ctx->uc);
}

void context_init(Context* ctx, unsigned char* stack_lo, size_t stack_size, void (*entry)()) {
    reset_stack_shadow(stack_lo, stack_size);
    ucontext_t* uc = uc_of(ctx);
    getcontext(uc);
    uc->uc_stack.ss_sp = stack_lo;
    uc->uc_stack.ss_size = stack_size;
    uc->uc_link = nullptr;
    makecontext(uc, entry, 0);
}

void context_switch(Context* from, Context* to) { swapcontext(uc_of(from), uc_of(to)); }

void context_release(Context* ctx) {
    std::free(ctx->uc);
    ctx->uc = nullptr;
}

}  // namespace ftemu

#endif
