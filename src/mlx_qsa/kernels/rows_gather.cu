//// kernel: partial
// Rows-gather attention, pass 1 (split-K): one CTA per (row, KV head j, split s) attends the G
// query heads of j over slots [s * TOK, (s + 1) * TOK) of the row's slot list.
// q [1, H, S, D] bf16; keys, values [1, HKV, cap, D] bf16 read in place; slots [S, W] int32,
// slot_valid [S, W] bool (invalid slots contribute nothing)
// -> part_o [H * S, NSPLIT, D] float32, part_ml [H * S, NSPLIT, 2] float32 (head-major rows).
// Template: D, G, TOK, HKV, W, NSPLIT, SCALE_BITS, NT (S from q's shape).
extern __shared__ __align__(16) unsigned char qsa_dyn_smem[];
__shared__ int tok_s[TOK];
const int tid = threadIdx.x;
const int S = q_shape[2];
const int s = blockIdx.x % NSPLIT;
const int rj = blockIdx.x / NSPLIT;
const int j = rj % HKV, row = rj / HKV;
const long long cap = keys_shape[2];
if (tid < TOK) {
  const int slot = s * TOK + tid;
  int t = -1;
  if (slot < W && slot_valid[row * slot_valid_strides[0] + slot * slot_valid_strides[1]]) {
    const long long tt = slots[row * slots_strides[0] + slot * slots_strides[1]];
    if (tt >= 0 && tt < cap) t = (int)tt;
  }
  tok_s[tid] = t;
}
__syncthreads();
const int h0 = j * G;
qsa::partial_attention<D, G, TOK, NT>(
    q + h0 * q_strides[1] + row * q_strides[2], q_strides[1],
    keys + j * keys_strides[1], keys_strides[2],
    values + j * values_strides[1], values_strides[2],
    tok_s, __int_as_float(SCALE_BITS),
    part_o + (((long long)h0 * S + row) * NSPLIT + s) * D, (long long)S * NSPLIT * D,
    part_ml + (((long long)h0 * S + row) * NSPLIT + s) * 2, (long long)S * NSPLIT * 2,
    qsa_dyn_smem);
#ifdef QSA_FUSED  // one launch: the last CTAs merge (ctr [2] int32, out [1, H, S, D] bf16)
qsa::merge_when_done<D, NSPLIT, NT>(const_cast<int*>(ctr), gridDim.x, G * HKV * S,
                                    part_o, part_ml, out);
#endif

//// kernel: merge
// Split-K merge, as in flash_decode.cu: part_o [R, NSPLIT, D], part_ml [R, NSPLIT, 2]
// -> out [R, D] bf16 with R = H * S head-major ([1, H, S, D]). Grid R * D threads of 64.
// Template: D, NSPLIT.
const int rh = blockIdx.x / (D / 64);
const int d = (blockIdx.x % (D / 64)) * 64 + threadIdx.x;
qsa::merge_splits<D, NSPLIT>(part_o + (long long)rh * NSPLIT * D, part_ml + (long long)rh * NSPLIT * 2,
                             d, out + (long long)rh * D);
