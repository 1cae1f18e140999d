//// kernel: partial
// Flash sparse decode, pass 1 (split-K): one CTA per (KV head j, split s) attends the G query heads
// of j over the tokens of its BPS = TOK / RATIO entries of the list [selected blocks..., tail].
// q [1, H, 1, D] bf16; keys, values [1, HKV, cap, D] bf16 read in place (rows >= T never read);
// block_ids [K] or [1, K] int32, block_valid likewise bool (a selection's row, in place);
// tlen [1] int32 = T - TOFF (TOFF 0: the context length T; TOFF 1: the row's position)
// -> part_o [H, NSPLIT, D] float32 (unnormalised), part_ml [H, NSPLIT, 2] float32 (max, sum).
// Template: D, G, TOK, RATIO, K, NSPLIT, SCALE_BITS, NT, TOFF.
extern __shared__ __align__(16) unsigned char qsa_dyn_smem[];
__shared__ int tok_s[TOK];
constexpr int BPS = TOK / RATIO;
const int tid = threadIdx.x;
const int s = blockIdx.x % NSPLIT, j = blockIdx.x / NSPLIT;
const long long cap = keys_shape[2];
const long long bstride = block_ids_strides[block_ids_ndim - 1];
const long long vstride = block_valid_strides[block_valid_ndim - 1];
if (tid < TOK) {
  const int pb = s * BPS + tid / RATIO, r = tid % RATIO;
  int t = -1;
  if (pb < K) {
    if (block_valid[pb * vstride]) {
      const long long tt = (long long)block_ids[pb * bstride] * RATIO + r;
      if (tt >= 0 && tt < cap) t = (int)tt;
    }
  } else if (pb == K) {
    const int T = tlen[0] + TOFF;
    const int tt = (T / RATIO) * RATIO + r;
    if (tt < T && tt < cap) t = tt;
  }
  tok_s[tid] = t;
}
__syncthreads();
const int h0 = j * G;
qsa::partial_attention<D, G, TOK, NT>(
    q + h0 * q_strides[1], q_strides[1],
    keys + j * keys_strides[1], keys_strides[2],
    values + j * values_strides[1], values_strides[2],
    tok_s, __int_as_float(SCALE_BITS),
    part_o + ((long long)h0 * NSPLIT + s) * D, (long long)NSPLIT * D,
    part_ml + ((long long)h0 * NSPLIT + s) * 2, (long long)NSPLIT * 2,
    qsa_dyn_smem);
#ifdef QSA_FUSED  // one launch: the last CTAs merge (ctr [2] int32, out [1, H, 1, D] bf16)
qsa::merge_when_done<D, NSPLIT, NT>(const_cast<int*>(ctr), gridDim.x, G * gridDim.x / NSPLIT,
                                    part_o, part_ml, out);
#endif

//// kernel: merge
// Split-K merge: part_o [R, NSPLIT, D], part_ml [R, NSPLIT, 2] -> out [R, D] bf16 (R = H * S,
// head-major, i.e. the layout of [1, H, S, D]). Fixed split order: deterministic.
// Grid R * D threads of 64. Template: D, NSPLIT.
const int rh = blockIdx.x / (D / 64);
const int d = (blockIdx.x % (D / 64)) * 64 + threadIdx.x;
qsa::merge_splits<D, NSPLIT>(part_o + (long long)rh * NSPLIT * D, part_ml + (long long)rh * NSPLIT * 2,
                             d, out + (long long)rh * D);
