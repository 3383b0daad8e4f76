/* CPU-only ABI smoke test of an FA-4 forward library (fa4_fwd_glue.cc): dlopen it, check the abi
 * version, key and info, and that calls it cannot run are refused before anything touches CUDA.
 * usage: abi_check_fwd lib.so KEY HEAD_DIM CAUSAL */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernel_abi.h"

typedef int32_t (*FwdFn)(const JaxflashFwdArgs*, void*);

int main(int argc, char** argv) {
  if (argc != 5) { fprintf(stderr, "usage: %s lib.so KEY HEAD_DIM CAUSAL\n", argv[0]); return 2; }
  const int d = atoi(argv[3]), causal = atoi(argv[4]);
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) { printf("dlopen failed: %s\n", dlerror()); return 1; }
  int32_t (*ver)(void) = (int32_t (*)(void))dlsym(lib, "jaxflash_variant_abi_version");
  const char* (*key)(void) = (const char* (*)(void))dlsym(lib, "jaxflash_variant_key");
  int32_t (*load)(void) = (int32_t (*)(void))dlsym(lib, "jaxflash_variant_load");
  FwdFn fwd = (FwdFn)dlsym(lib, "jaxflash_variant_fwd");
  const JaxflashVariantInfo* (*info)(void) =
      (const JaxflashVariantInfo* (*)(void))dlsym(lib, "jaxflash_variant_info");
  if (!ver || !key || !info || !load || !fwd) { printf("missing symbol\n"); return 1; }
  int fails = 0;
  fails += ver() != JAXFLASH_KERNEL_ABI_VERSION;
  fails += strcmp(key(), argv[2]) != 0;
  const JaxflashVariantInfo* i = info();
  printf("%s: abi %d, direction %d dtype %d head_dim %d head_dim_v %d causal %d tile %d x %d\n",
         key(), ver(), i->direction, i->dtype, i->head_dim, i->head_dim_v, i->causal, i->tile_m,
         i->tile_n);
  fails += i->direction != 0 || i->dtype != 1 || i->head_dim != d || i->head_dim_v != d ||
           i->causal != causal || i->masked != 0;
  fails += dlsym(lib, "jaxflash_variant_bwd") != NULL;
  /* Refused before any CUDA call: no args, a zeroed struct, null pointers, another head dim, a
   * group size not compiled (5), and each input the dense kernel does not take. */
  static float dummy[64] __attribute__((aligned(256)));
  JaxflashFwdArgs ok;
  memset(&ok, 0, sizeof(ok));
  ok.batch = 1; ok.seqlen_q = 128; ok.seqlen_k = 128; ok.num_heads = 2; ok.num_kv_heads = 2;
  ok.head_dim = d; ok.head_dim_v = d; ok.softmax_scale = 0.1f;
  ok.window_left = -1; ok.window_right = -1;
  JaxflashFwdArgs zero, nulls = ok, hd, g5, cap, sink, ids;
  memset(&zero, 0, sizeof(zero));
  ok.q = ok.k = ok.v = ok.out = dummy; ok.lse = dummy;
  hd = ok; hd.head_dim = hd.head_dim_v = d == 64 ? 128 : 64;
  g5 = ok; g5.num_heads = 5; g5.num_kv_heads = 1;
  cap = ok; cap.softcap = 30.0f;
  sink = ok; sink.sink = dummy;
  ids = ok; ids.mask.row_ids = (const int32_t*)dummy;
  const JaxflashFwdArgs* refused[] = {NULL, &zero, &nulls, &hd, &g5, &cap, &sink, &ids};
  const char* names[] = {"NULL", "zeroed", "null pointers", "other head_dim", "group 5",
                         "softcap", "sink", "segment ids"};
  for (int n = 0; n < 8; ++n) {
    int32_t s = fwd(refused[n], NULL);
    if (s == 0) { printf("accepted: %s\n", names[n]); ++fails; }
  }
  printf(fails ? "ABI CHECK FAILED (%d)\n" : "ABI CHECK PASSED\n", fails);
  return fails != 0;
}
