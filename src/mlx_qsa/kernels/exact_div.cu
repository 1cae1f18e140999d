//// kernel: check
// Every float32 bit pattern u in [lo, lo + n) (lo [1] uint32, n = the grid's threads * PER)
// through qsa::div_sqrt128 and through __fdiv_rn(x, sqrt(128)): bad [1] uint32 counts the
// patterns whose results differ in any bit (NaN results compare as bits too), and first [1]
// uint32 the complement of the smallest such pattern. Both start at 0 (the launcher's init
// value). Template: PER (patterns a thread).
const unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
const unsigned base = lo[0];
unsigned n_bad = 0u, first_bad = 0xFFFFFFFFu;
#pragma unroll 4
for (int i = 0; i < PER; ++i) {
  const unsigned u = base + (unsigned)(t * PER + i);
  const float x = __uint_as_float(u);
  const unsigned fast = __float_as_uint(qsa::div_sqrt128(x));
  const unsigned ieee = __float_as_uint(__fdiv_rn(x, 11.313708305358887f));
  if (fast != ieee) {
    ++n_bad;
    first_bad = min(first_bad, u);
  }
}
if (n_bad != 0u) {
  atomicAdd(bad, n_bad);
  atomicMax(first, ~first_bad);
}
