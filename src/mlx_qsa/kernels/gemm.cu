// Kernel bodies of the GEMM y = x · Wᵀ + b (device code: gemm.cuh, included through `header=`;
// launcher: gemm.py). MLX generates each signature
//   (const __nv_bfloat16* x, Shape x_shape, const __nv_bfloat16* w, Shape w_shape,
//    const __nv_bfloat16* b, [const uint64_t* tmaps,] __nv_bfloat16* y[, uint8_t* scratch]);
// gemm.py's kernel_text declares the plan's constants (GemmPlan.template()) in front.

//// kernel: gemm
  qsa_gemm<TM, TN, TK, WARPS, WALK_M, STAGES, WGMMA, LAYOUT_M>(x, w, b, y, x_shape[0], w_shape[0],
                                                              x_shape[1]);
//// kernel: gemm_tma
  qsa_gemm_tma<TM, TN, TK, WARPS, WALK_M, STAGES, LAYOUT_M, PRODUCER_REGS, CONSUMER_REGS,
               CLUSTER, TMA_STORE, SPARE_BOXES>(
      x, w, b, reinterpret_cast<const unsigned long long*>(tmaps), y,
      reinterpret_cast<unsigned char*>(scratch), x_shape[0], w_shape[0], x_shape[1]);
