// The C ABI between the FFI handler library and each per-variant kernel library.
// Every variant library (one shared object per KernelVariant, built by jaxflash.build) exports
// these functions with plain C linkage; the handler dlopens it and calls through them.
// Includes nothing but the C headers: the handler side must not see any exported kernel header.
#ifndef JAXFLASH_FFI_KERNEL_ABI_H_
#define JAXFLASH_FFI_KERNEL_ABI_H_

#include <stdint.h>

#define JAXFLASH_KERNEL_ABI_VERSION 17

#ifdef __cplusplus
extern "C" {
#endif

// score_mod / mask_mod variants read up to this many closed-over arrays (jaxflash.config
// MOD_MAX_ARRAYS), each of rank up to JAXFLASH_MAX_MOD_RANK (mod_ir.MAX_RANK).
#define JAXFLASH_MAX_MOD_ARRAYS 4
#define JAXFLASH_MAX_MOD_RANK 4
// The dtype codes of those arrays (jaxflash.kernels.compile.MOD_DTYPE_CODES); bool arrays are
// one byte per element.
enum {
  JAXFLASH_MOD_BOOL = 0, JAXFLASH_MOD_INT8 = 1, JAXFLASH_MOD_INT16 = 2, JAXFLASH_MOD_INT32 = 3,
  JAXFLASH_MOD_UINT8 = 4, JAXFLASH_MOD_UINT16 = 5, JAXFLASH_MOD_UINT32 = 6,
  JAXFLASH_MOD_FLOAT16 = 7, JAXFLASH_MOD_BFLOAT16 = 8, JAXFLASH_MOD_FLOAT32 = 9
};

// What a variant library was built for. The handler checks each call's attributes and buffers
// against it; the variant key is only a name.
typedef struct {
  int32_t direction;      // 0: forward (exports jaxflash_variant_fwd), 1: backward (_bwd),
                          // 2: split-KV decode (_decode)
  int32_t dtype;          // 0: float16, 1: bfloat16 (q, k, v, out and the gradients);
                          // 2: float8_e4m3fn q, k, v with bfloat16 or float16 out
                          // (forward only; JaxflashFwdArgs.out_float16)
  int32_t head_dim;       // of q and k
  int32_t head_dim_v;     // of v and out
  int32_t causal;         // 1: bottom-right aligned causal mask
  int32_t deterministic;  // backward: 1 when dQ is accumulated in a fixed order
  int32_t tile_m;         // query rows per tile (the backward's scratch rows round up to it;
                          // decode: packed query rows per CTA)
  int32_t max_dq_copies;  // backward: most dQ accumulator copies a call may hold (1 or 2)
  int32_t masked;         // 1: takes a JaxflashMask (windows, segment ids; causal at run time)
  int32_t tile_n;         // key rows per block (the masked operands' column / row padding)
  int32_t tile_counter;   // forward: 1 when it claims its tiles from JaxflashFwdArgs.tile_counter
  int32_t kv_fp8;         // decode: 1 when k and v are float8_e4m3fn caches with descales
                          // (JaxflashDecodeArgs.k_descale / v_descale), 0 when in q's dtype
  int32_t bias;           // 1: takes a JaxflashBias (masked variants only)
  int32_t mod_arrays;     // score_mod / mask_mod variants (masked): the arrays of a
                          // JaxflashModArrays they read; 0 otherwise
  int32_t mod_dtypes[JAXFLASH_MAX_MOD_ARRAYS];  // each array's JAXFLASH_MOD_* dtype code
  int32_t mod_ranks[JAXFLASH_MAX_MOD_ARRAYS];   // each array's rank (0 to JAXFLASH_MAX_MOD_RANK)
} JaxflashVariantInfo;

// The run-time operands of a masked variant (jaxflash/block_ranges.py computes them on the
// device). The kernel tiles one side ("rows": queries in the forward, keys in the backward)
// and visits blocks of the other ("columns"); row_tile / col_tile are tile_m / tile_n in the
// forward and tile_n / tile_m in the backward, row_tiles / col_blocks the lengths over them
// rounded up:
//   row_ids (batch, row_tiles * row_tile)    int32 segment ids of the rows, zero-padded
//   col_ids (batch, col_blocks * col_tile)   int32 segment ids of the columns, zero-padded
//   order   (batch * row_tiles)              int32 launch order: each entry holds b * row_tiles + t
//           (row tile t of batch b); batch b's tiles fill entries [b, b + 1) * row_tiles
//   ranges  (batch, row_tiles, 4)            int32 per entry of the order (ranges[b, k] for
//           entry b * row_tiles + k): [start, end) of the column blocks its tile visits, and
//           [full_lo, full_hi) within them that need no elementwise mask
//   ranks   (batch, row_tiles, col_blocks)   int32, deterministic backward only: how many key
//           tiles add into a query block before this one (the fixed order), NULL otherwise
// Query i then sees key j iff i' - window_left <= j <= i' + window_right (i' = i + seqlen_k -
// seqlen_q; the call's band, causal folded in by the handler) and their ids are equal.
typedef struct {
  const int32_t* row_ids;
  const int32_t* col_ids;
  const int32_t* ranges;
  const int32_t* order;
  const int32_t* ranks;
} JaxflashMask;

// The additive bias of a bias variant: bias[b, h, i, j] joins score (i, j) of batch b and query
// head h after the scale and softcap. bias is (batch, heads, rows, row_length) in q's dtype,
// dense row-major, 16-byte aligned, where each of batch, heads and rows is either 1 (broadcast:
// the kernel reads index 0) or the call's batch, num_heads or seqlen_q, and row_length is
// seqlen_k rounded up to a multiple of 8 (16-byte rows, as TMA needs; columns past seqlen_k are
// not read). Backward: dbias, (batch, num_heads, seqlen_q, row_length) in q's dtype, dense,
// 16-byte aligned, receives d loss / d score of every (b, h, i, j < seqlen_k), each element
// written once (the caller reduces it over the broadcast dims); its columns past seqlen_k are
// left as they were.
typedef struct {
  const void* bias;
  int32_t batch, heads, rows;  // the bias's leading extents (1 or full)
  int32_t row_length;          // its last extent: seqlen_k rounded up to a multiple of 8
  void* dbias;                 // backward only; NULL in the forward
} JaxflashBias;

// The arrays a score_mod / mask_mod variant reads (info.mod_arrays of them, in operand order,
// each of the dtype and rank its info lists), dense row-major; extents[k][0..rank) are array
// k's extents, each >= 1 (a rank-0 array is one element). Entries past info.mod_arrays are NULL.
typedef struct {
  const void* data[JAXFLASH_MAX_MOD_ARRAYS];
  int32_t extents[JAXFLASH_MAX_MOD_ARRAYS][JAXFLASH_MAX_MOD_RANK];
} JaxflashModArrays;

// The FP8 descales come per this many query rows or keys (jaxflash.config.FP8_DESCALE_ROWS).
#define JAXFLASH_FP8_DESCALE_ROWS 64

// The descale chunks that cover `length` query rows or keys in whole tiles of `tile` (a
// per-head variant's key tile may end inside a chunk): jaxflash.config.fp8_descale_chunks.
static inline int64_t jaxflash_fp8_descale_chunks(int64_t length, int64_t tile) {
  return ((length + tile - 1) / tile * tile + JAXFLASH_FP8_DESCALE_ROWS - 1) /
         JAXFLASH_FP8_DESCALE_ROWS;
}

// Forward call. Tensors are dense row-major, exactly as XLA hands them over:
//   q   (batch, seqlen_q, num_heads,    head_dim)    fp16/bf16, or e4m3 (FP8 variants)
//   k   (batch, seqlen_k, num_kv_heads, head_dim)
//   v   (batch, seqlen_k, num_kv_heads, head_dim_v)
//   out (batch, seqlen_q, num_heads,    head_dim_v)  same dtype as q; bf16 or fp16 for FP8
//                                                    variants (out_float16)
//   lse (batch, num_heads, seqlen_q)                  float32, natural log; -inf for empty rows
//   sink (num_heads)                                  float32 learnable sink logits, or NULL:
//       each row's softmax also runs over its head's sink (a column without a value), lse
//       includes it, and an empty row has lse = its sink
//   q_descale (batch, num_heads, q chunks)            FP8 variants: float32, one per 64 query
//       rows (x = x8 * descale), NULL otherwise
//   kv_descale (batch, num_kv_heads, k chunks, 4)     FP8 variants: float32, per 64 keys (k
//       descale, log2(v descale / v max), v max / v descale, v max), v max the largest v descale
//       of the (batch, kv head); NULL otherwise
//   (q chunks = jaxflash_fp8_descale_chunks(seqlen_q, tile_m), k chunks the same of seqlen_k
//   and tile_n)
//   tile_counter (1,)                                 int32 scratch of variants whose info has
//       tile_counter 1 (their CTAs claim tiles by atomic adds on it); it must be 0 at launch
//       (the handler zeroes it on the stream); NULL otherwise
typedef struct {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  int32_t batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, head_dim_v;
  float softmax_scale;
  int32_t window_left, window_right;  // masked variants: the band (JaxflashMask)
  float softcap;                      // > 0: scores become softcap * tanh(s / softcap)
                                      // (masked variants); 0: off
  JaxflashMask mask;                  // masked variants; all NULL otherwise
  const float* sink;                  // every variant; NULL: no sink
  const float* q_descale;             // FP8 variants; NULL otherwise
  const float* kv_descale;            // FP8 variants; NULL otherwise
  int32_t out_float16;                // FP8 variants: 1 writes out as float16, 0 as bfloat16
  int32_t* tile_counter;              // info.tile_counter variants; NULL otherwise
  JaxflashBias bias;                  // info.bias variants; bias NULL otherwise
  JaxflashModArrays mods;             // info.mod_arrays variants; all NULL otherwise
} JaxflashFwdArgs;

// Backward call (jaxflash/ffi/variant_bwd.cc): preprocess, main kernel, postprocess, in order on
// the stream. Inputs as in the forward plus
//   out, d_out (batch, seqlen_q, num_heads, head_dim_v)  same dtype as q
//   lse, d_lse (batch, num_heads, seqlen_q)              float32
// outputs (every element written)
//   dq (like q), dk (like k), dv (like v); dk/dv summed over the query heads of a group (GQA)
// and scratch, shapes from jaxflash.config.bwd_scratch_shapes (seqlen_q_rounded = seqlen_q
// rounded up to the variant's tile_m; contents need no initialisation):
//   dq_accum     (batch, num_heads, copies * seqlen_q_rounded, head_dim)   float32
//   lse_log2     (batch, num_heads, seqlen_q_rounded)                      float32
//   delta        (batch, num_heads, seqlen_q_rounded)                      float32
//   dq_semaphore (batch, num_heads, copies * seqlen_q_rounded / tile_m)    int32, deterministic
//                variants only (NULL otherwise)
// where copies = dq_copies below, 1 to JaxflashVariantInfo.max_dq_copies (copy c holds rows
// [c * seqlen_q_rounded, (c + 1) * seqlen_q_rounded) of each (batch, head); key block n adds
// into copy n % copies, and the postprocess sums the copies in index order); a library refuses
// more than it was built for.
typedef struct {
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const float* lse;
  const void* d_out;
  const float* d_lse;
  void* dq;
  void* dk;
  void* dv;
  float* dq_accum;
  float* lse_log2;
  float* delta;
  int32_t* dq_semaphore;
  int32_t batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, head_dim_v;
  float softmax_scale;
  int32_t window_left, window_right;  // masked variants: the band (JaxflashMask)
  float softcap;                      // > 0: as in the forward (masked variants); 0: off
  int32_t dq_copies;                  // dQ accumulator copies in dq_accum / dq_semaphore
  JaxflashMask mask;                  // masked variants; all NULL otherwise
  JaxflashBias bias;                  // info.bias variants (bias and dbias); NULL otherwise
  JaxflashModArrays mods;             // info.mod_arrays variants; all NULL otherwise
} JaxflashBwdArgs;

// Split-KV decode call (jaxflash/ffi/variant_decode.cc): the query rows of each (batch, kv head)
// against one split of that sequence's keys per CTA, keys read through a page table, then the
// merge of each row's splits. Tensors are dense row-major:
//   q           (batch, num_kv_heads, rows, head_dim)   fp16/bf16; rows = seqlen_q * group (group
//               = query heads per kv head): row i * group + j is query token i of query head
//               kv * group + j
//   k           (num_pages, page_size, num_kv_heads, head_dim)    same dtype as q, or
//               float8_e4m3fn (info.kv_fp8); a contiguous cache is num_pages = batch,
//               page_size = its length, max_pages = 0
//   v           (num_pages, page_size, num_kv_heads, head_dim_v)  as k
//   k_descale, v_descale (num_pages, num_kv_heads) float32, info.kv_fp8 variants (NULL
//               otherwise): key p of sequence b is k[its page, row, kv] * k_descale[its page,
//               kv] (a contiguous cache's page is its sequence), its value likewise
//   page_table  (batch, max_pages) int32: key position p of sequence b is row p % page_size of
//               page page_table[b, p / page_size] (the kernel clamps entries into the pool);
//               max_pages 0 (page_table may be NULL): contiguous caches, sequence b in page b
//   lengths     (batch,) int32: valid keys per sequence; the kernel clamps them to
//               [0, max(max_pages, 1) * page_size]
//   sink        (num_kv_heads, group) float32: the learnable sink of query head kv * group + j,
//               one more logit in its rows' softmax with no value; NULL: none
//   out_partial (batch, num_splits, num_kv_heads, rows, head_dim_v) float32, scratch: each
//               split's attention output over its keys
//   lse_partial (batch, num_splits, num_kv_heads, rows) float32, scratch: each split's
//               log-sum-exp of the scaled (and soft-capped) scores, natural log; -inf, with
//               out_partial 0, for a split in which a row sees no key
//   out         (batch, num_kv_heads, rows, head_dim_v) q's dtype: the attention output
//   lse         (batch, num_kv_heads, rows) float32: its log-sum-exp, the sink included; a
//               row with no key outputs 0 and lse -inf (or its sink)
// How a sequence's keys divide into the num_splits splits is the kernel's
// (kernels/decode_sm90.py); a second kernel of the call merges them through their lse
// (kernels/decode_combine.py). Query token i of sequence b sits at position lengths[b] -
// seqlen_q + i and sees key j < lengths[b] iff position - window_left <= j <= position +
// window_right.
typedef struct {
  const void* q;
  const void* k;
  const void* v;
  const int32_t* page_table;
  const int32_t* lengths;
  const float* sink;
  float* out_partial;
  float* lse_partial;
  void* out;
  float* lse;
  int32_t batch, rows, num_kv_heads, head_dim, head_dim_v, num_pages, page_size, max_pages,
      num_splits, seqlen_q;
  float softmax_scale;
  int32_t window_left, window_right;  // keys visible left / right of a query's position;
                                      // causal is window_right = 0; unbounded: 2^30
                                      // (jaxflash.config.WINDOW_UNBOUNDED)
  float softcap;                      // > 0: scores become softcap * tanh(s / softcap); 0: off
  const float* k_descale;             // info.kv_fp8 variants; NULL otherwise
  const float* v_descale;
} JaxflashDecodeArgs;

// Returns JAXFLASH_KERNEL_ABI_VERSION; the handler refuses a library with another version.
int32_t jaxflash_variant_abi_version(void);
// The KernelVariant.key the library was built for (a NUL-terminated static string).
const char* jaxflash_variant_key(void);
// What the library was built for (a static struct).
const JaxflashVariantInfo* jaxflash_variant_info(void);
// Loads the cubin on every visible device. Idempotent and thread-safe; 0 on success.
int32_t jaxflash_variant_load(void);
// Launches on `stream` (a cudaStream_t). 0 on success, else the CuTe DSL / CUDA status.
int32_t jaxflash_variant_fwd(const JaxflashFwdArgs* args, void* stream);
// Backward libraries export this instead of jaxflash_variant_fwd. Same return convention.
int32_t jaxflash_variant_bwd(const JaxflashBwdArgs* args, void* stream);
// Decode libraries export this instead. Same return convention.
int32_t jaxflash_variant_decode(const JaxflashDecodeArgs* args, void* stream);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // JAXFLASH_FFI_KERNEL_ABI_H_
