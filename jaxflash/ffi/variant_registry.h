// Process-wide registry of kernel variant libraries: key -> dlopen handle and entry points.
// Python registers each library once (jaxflash_ffi_register_variant); handlers look keys up.
#ifndef JAXFLASH_FFI_VARIANT_REGISTRY_H_
#define JAXFLASH_FFI_VARIANT_REGISTRY_H_

#include <stdint.h>

#include <string>
#include <string_view>
#include <vector>

#include "kernel_abi.h"

namespace jaxflash {

struct VariantLibrary {
  std::string key;
  std::string path;
  void* handle = nullptr;  // from dlopen; never closed (handlers may run until exit)
  JaxflashVariantInfo info = {};  // what the library was built for
  // Exactly one is set: a library is a forward, a backward or a decode variant.
  int32_t (*fwd)(const JaxflashFwdArgs* args, void* stream) = nullptr;
  int32_t (*bwd)(const JaxflashBwdArgs* args, void* stream) = nullptr;
  int32_t (*decode)(const JaxflashDecodeArgs* args, void* stream) = nullptr;
};

// Returns the registered library for `key`, or nullptr. Entries live until process exit.
const VariantLibrary* FindVariant(std::string_view key);

// Opens `path`, checks its ABI version, key and info, loads its cubin on every visible device.
// Returns "" on success (also when `key` is already registered), else a readable error.
std::string RegisterVariant(std::string_view key, std::string_view path);

// The kernel folders, in search order, where RegisterFromFolders looks (jaxflash.kernel_store
// sets them when it loads this library).
void SetKernelFolders(std::vector<std::string> folders);

// Registers `key` from the first kernel folder whose <folder>/<key>/libjaxflash_variant.so
// registers (a library that fails is reported and the next folder tried). Returns "" on success
// (also when `key` is already registered), else what each folder gave.
std::string RegisterFromFolders(std::string_view key);

}  // namespace jaxflash

#endif  // JAXFLASH_FFI_VARIANT_REGISTRY_H_
