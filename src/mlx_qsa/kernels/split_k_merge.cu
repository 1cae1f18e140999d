// The merge kernel of the split-K attention launchers (flash_decode.cu, rows_gather.cu), built
// by _launch.plan_split_k; the in-launch form calls the same qsa::merge_tile (common.cuh).
//// kernel: merge
// Split-K merge: part_o [R, NSPLIT, D], part_ml [R, NSPLIT, 2] -> out [R, D] bf16 (R = H * S,
// head-major, i.e. the layout of [1, H, S, D]). Fixed split order: deterministic.
// Grid: one CTA of NT threads per merge tile (R * D / merge_cols). Template: D, NSPLIT, NT.
constexpr int TPR = D / qsa::merge_cols<D>();
__shared__ __align__(16) float buf[qsa::merge_smem_floats<D, NSPLIT, NT>()];
qsa::merge_tile<D, NSPLIT, NT>(part_o, part_ml, out, blockIdx.x / TPR,
                               (blockIdx.x % TPR) * qsa::merge_cols<D>(), buf);
