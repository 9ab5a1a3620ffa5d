// One cache line requested ahead of its use: into L1 (prefetcht0) or into L2 (prefetcht1), the
// level chosen at run time for the host (paged_attention.cpp, prefetch_into_l1).
//
// Inline assembly on x86 rather than __builtin_prefetch: with the hint chosen by a branch between
// two __builtin_prefetch calls, GCC 12 left no prefetch instruction at all in the decode kernel's
// bfloat16, float16 and fp8 instantiations (objdump), and a bfloat16 64 x 1,024 decode step ran
// 2.3x slower. A volatile asm statement is emitted wherever it is written.
#pragma once

namespace pagedserve {

inline void prefetch_line(const void* line, bool into_l1) {
#if defined(__x86_64__)
  const char* byte = static_cast<const char*>(line);
  if (into_l1) {
    asm volatile("prefetcht0 %0" : : "m"(*byte));
  } else {
    asm volatile("prefetcht1 %0" : : "m"(*byte));
  }
#else
  (void)into_l1;
  __builtin_prefetch(line, 0, 2);
#endif
}

}  // namespace pagedserve
