// The output gate fused into the split-K merge (QSA.md §9): o ⊙ sigmoid(g), written in the layout
// o_proj reads. Included (after common.cuh) only by kernels built with QSA_GATE (_launch.header_for).
//
// The numerics decision is MLX's order: sigmoid of the bf16 gate rounded to bf16, o rounded to
// bf16, their product rounded to bf16. The two steps are MLX's own device functors (the ones its
// `sigmoid` and `multiply` kernels, eager or compiled, run on bf16), from the headers MLX hands
// NVRTC, so the fused bits are those of the unfused graph by construction, not by imitation.
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"

namespace qsa {

// Merged row rh = h * S + row, column c -> out [1, S, H, D] (contiguous), reading the gate
// [1, S, H, D] in place through its strides (the layer's gate is a strided view of q_proj's
// output: each head's query and gate halves interleave).
template <int D>
struct GatedOut {
  __nv_bfloat16* out;
  const __nv_bfloat16* gate;
  long long g_row, g_head, g_col;  // gate strides over S, H, D
  int S, H;
  __device__ __forceinline__ void store(int rh, int c, float v) const {
    const int h = rh / S, row = rh - h * S;
    const __nv_bfloat16 g = gate[row * g_row + h * g_head + c * g_col];
    const __nv_bfloat16 sig = mlx::core::cu::Sigmoid{}(g);
    out[((long long)row * H + h) * D + c] = mlx::core::cu::Multiply{}(__float2bfloat16(v), sig);
  }
};

}  // namespace qsa
