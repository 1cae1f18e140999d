//// kernel: stamp
// The GPU's global nanosecond timer when the stream reaches this launch, after `after` (read by
// nothing: the input only orders the launch behind its producer). One stamp before a queued pass
// of steps and one after its last output give the pass's span on the GPU, as torch's CUDA events
// around its own queued pass do; a host clock would add the build before the first launch and
// the wake-up of MLX's blocking event wait (40-420 us on the lent hosts, benchmarks/timeline.py).
if (threadIdx.x == 0 && blockIdx.x == 0) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  stamp[0] = t;
}
