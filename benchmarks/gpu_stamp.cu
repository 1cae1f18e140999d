//// kernel: qsa_gpu_stamp
// One thread writes the GPU's global nanosecond timer. Launched before the first and after the
// last call of a steady round (same stream, so after everything queued before it), it gives
// the round's GPU-side span, as torch's CUDA events give torch's.
if (threadIdx.x == 0 && blockIdx.x == 0) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  stamp[0] = t;
}
