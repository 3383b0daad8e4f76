/* CPU-only ABI smoke test: dlopen the library, check abi version / key / info and that
 * invalid arguments are refused before anything touches CUDA. usage: abi_check lib.so */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include "kernel_abi.h"

int main(int argc, char** argv) {
  if (argc != 2) { fprintf(stderr, "usage: %s lib.so\n", argv[0]); return 2; }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) { printf("dlopen failed: %s\n", dlerror()); return 1; }
  int32_t (*ver)(void) = (int32_t (*)(void))dlsym(lib, "jaxflash_variant_abi_version");
  const char* (*key)(void) = (const char* (*)(void))dlsym(lib, "jaxflash_variant_key");
  int32_t (*load)(void) = (int32_t (*)(void))dlsym(lib, "jaxflash_variant_load");
  int32_t (*bwd)(const JaxflashBwdArgs*, void*) =
      (int32_t (*)(const JaxflashBwdArgs*, void*))dlsym(lib, "jaxflash_variant_bwd");
  const JaxflashVariantInfo* (*info)(void) =
      (const JaxflashVariantInfo* (*)(void))dlsym(lib, "jaxflash_variant_info");
  void* fwd = dlsym(lib, "jaxflash_variant_fwd");
  if (!ver || !key || !info || !load || !bwd) { printf("missing symbol\n"); return 1; }
  int fails = 0;
  printf("abi_version = %d\n", ver());
  fails += ver() != JAXFLASH_KERNEL_ABI_VERSION;
  printf("key = %s\n", key());
  fails += strcmp(key(), "fa4-sm90a-bf16-d128-dv128-m80n128") != 0;
  const JaxflashVariantInfo* i = info();
  printf("info: direction %d dtype %d head_dim %d head_dim_v %d causal %d deterministic %d "
         "tile_m %d max_dq_copies %d\n", i->direction, i->dtype, i->head_dim, i->head_dim_v,
         i->causal, i->deterministic, i->tile_m, i->max_dq_copies);
  fails += i->direction != 1 || i->dtype != 1 || i->head_dim != 128 || i->head_dim_v != 128 ||
           i->causal != 0 || i->deterministic != 0 || i->tile_m != 80 || i->max_dq_copies != 1;
  printf("jaxflash_variant_fwd exported: %s\n", fwd ? "yes" : "no");
  fails += fwd != NULL;
  int32_t s_null = bwd(NULL, NULL);
  JaxflashBwdArgs zero;
  memset(&zero, 0, sizeof(zero));
  int32_t s_zero = bwd(&zero, NULL);
  /* valid-looking shape but null pointers: must also be refused before any CUDA call */
  JaxflashBwdArgs nullp = zero;
  nullp.batch = 1; nullp.seqlen_q = 128; nullp.seqlen_k = 128; nullp.num_heads = 2;
  nullp.num_kv_heads = 2; nullp.head_dim = 128; nullp.head_dim_v = 128;
  nullp.softmax_scale = 0.088f; nullp.window_left = -1; nullp.window_right = -1;
  nullp.dq_copies = 1;
  int32_t s_nullp = bwd(&nullp, NULL);
  /* head_dim 64 with (fake, aligned, never dereferenced) pointers */
  JaxflashBwdArgs hd = nullp;
  static float dummy[64] __attribute__((aligned(256)));
  hd.q = hd.k = hd.v = hd.out = hd.d_out = dummy; hd.dq = hd.dk = hd.dv = dummy;
  hd.lse = hd.d_lse = dummy; hd.dq_accum = hd.lse_log2 = hd.delta = dummy;
  hd.head_dim = 64; hd.head_dim_v = 64;
  int32_t s_hd = bwd(&hd, NULL);
  /* unsupported GQA group (5) */
  JaxflashBwdArgs g5 = hd;
  g5.head_dim = 128; g5.head_dim_v = 128; g5.num_heads = 5; g5.num_kv_heads = 1;
  int32_t s_g5 = bwd(&g5, NULL);
  /* two dQ accumulator copies (max_dq_copies is 1) */
  JaxflashBwdArgs c2 = g5;
  c2.num_heads = 2; c2.num_kv_heads = 2; c2.dq_copies = 2;
  int32_t s_c2 = bwd(&c2, NULL);
  printf("bwd(NULL,NULL) = %d\nbwd(zeroed struct) = %d\nbwd(null pointers) = %d\n"
         "bwd(head_dim 64) = %d\nbwd(group 5) = %d\nbwd(dq_copies 2) = %d\n", s_null, s_zero,
         s_nullp, s_hd, s_g5, s_c2);
  fails += s_null == 0 || s_zero == 0 || s_nullp == 0 || s_hd == 0 || s_g5 == 0 || s_c2 == 0;
  printf(fails ? "ABI CHECK FAILED (%d)\n" : "ABI CHECK PASSED\n", fails);
  return fails != 0;
}
