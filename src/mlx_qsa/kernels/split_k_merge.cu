// The merge kernel of the split-K attention launchers (flash_decode.cu, rows_gather.cu), built
// by _launch.plan_split_k; the in-launch form calls the same qsa::merge_tile (common.cuh).
//// kernel: merge
// Split-K merge: part_o [R, NSPLIT, D], part_ml [R, NSPLIT, 2] -> out [R, D] bf16 (R = H * S,
// head-major, i.e. the layout of [1, H, S, D]). Fixed split order: deterministic.
// With QSA_GATE: + gate [1, S, H, D] bf16 (any strides) -> out [1, S, H, D] = o * sigmoid(gate).
// Grid: one CTA of NT threads per merge tile (R * D / merge_cols). Template: D, NSPLIT, NT.
constexpr int TPR = D / qsa::merge_cols<D>();
__shared__ __align__(16) float buf[qsa::merge_smem_floats<D, NSPLIT, NT>()];
#ifdef QSA_GATE
const qsa::GatedOut<D> dst{out, gate, gate_strides[1], gate_strides[2], gate_strides[3],
                           (int)gate_shape[1], (int)gate_shape[2]};
#else
const qsa::PlainOut<D> dst{out};
#endif
qsa::merge_tile<D, NSPLIT, NT>(part_o, part_ml, dst, blockIdx.x / TPR,
                               (blockIdx.x % TPR) * qsa::merge_cols<D>(), buf);
