// Kernel variant registry and its C entry points for Python (ctypes).
#include "variant_registry.h"

#include <dlfcn.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>

namespace jaxflash {
namespace {

// A variant's library in its kernel folder: <folder>/<key>/<this> (config.VARIANT_LIBRARY).
constexpr std::string_view kVariantLibrary = "libjaxflash_variant.so";

// std::less<> allows lookups by string_view without allocating a std::string per call.
using Registry = std::map<std::string, std::unique_ptr<VariantLibrary>, std::less<>>;

std::shared_mutex& RegistryMutex() {
  static auto* mu = new std::shared_mutex();  // leaked on purpose: no destruction-order issues
  return *mu;
}

Registry& GetRegistry() {
  static auto* registry = new Registry();
  return *registry;
}

std::mutex& FoldersMutex() {
  static auto* mu = new std::mutex();
  return *mu;
}

std::vector<std::string>& GetFolders() {
  static auto* folders = new std::vector<std::string>();
  return *folders;
}

template <typename Fn>
Fn LookUp(void* handle, const char* name) {
  return reinterpret_cast<Fn>(dlsym(handle, name));
}

}  // namespace

const VariantLibrary* FindVariant(std::string_view key) {
  std::shared_lock lock(RegistryMutex());
  const Registry& registry = GetRegistry();
  auto it = registry.find(key);
  return it == registry.end() ? nullptr : it->second.get();
}

std::string RegisterVariant(std::string_view key, std::string_view path) {
  std::unique_lock lock(RegistryMutex());
  Registry& registry = GetRegistry();
  if (registry.count(key)) return "";

  std::string path_str(path);
  std::string where = "kernel variant '" + std::string(key) + "' (" + path_str + ")";
  // RTLD_LOCAL: every variant library carries its own static CUDA runtime; keep them apart.
  void* handle = dlopen(path_str.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = dlerror();
    return "cannot open " + where + ": " + (reason ? reason : "unknown dlopen error");
  }
  auto fail = [&](const std::string& message) {
    dlclose(handle);
    return message;
  };

  auto abi_version = LookUp<int32_t (*)()>(handle, "jaxflash_variant_abi_version");
  auto variant_key = LookUp<const char* (*)()>(handle, "jaxflash_variant_key");
  auto variant_info = LookUp<const JaxflashVariantInfo* (*)()>(handle, "jaxflash_variant_info");
  auto load = LookUp<int32_t (*)()>(handle, "jaxflash_variant_load");
  auto fwd = LookUp<int32_t (*)(const JaxflashFwdArgs*, void*)>(handle, "jaxflash_variant_fwd");
  auto bwd = LookUp<int32_t (*)(const JaxflashBwdArgs*, void*)>(handle, "jaxflash_variant_bwd");
  auto decode = LookUp<int32_t (*)(const JaxflashDecodeArgs*, void*)>(
      handle, "jaxflash_variant_decode");
  // One direction per library: exactly one of the forward, backward and decode entries.
  const int entries = (fwd != nullptr) + (bwd != nullptr) + (decode != nullptr);
  if (!abi_version || !variant_key || !variant_info || !load || entries != 1) {
    return fail(where + " does not export the jaxflash kernel ABI (kernel_abi.h); rebuild it with "
                "`python -m jaxflash.build --force --variants " + std::string(key) + "`");
  }
  if (int32_t version = abi_version(); version != JAXFLASH_KERNEL_ABI_VERSION) {
    return fail(where + " implements kernel ABI version " + std::to_string(version) +
                ", this handler library expects " + std::to_string(JAXFLASH_KERNEL_ABI_VERSION) +
                "; rebuild it with `python -m jaxflash.build --force --variants " +
                std::string(key) + "`");
  }
  if (std::string_view built_for = variant_key(); built_for != key) {
    return fail(where + " was built for variant '" + std::string(built_for) + "'");
  }
  const JaxflashVariantInfo* info = variant_info();
  const int32_t direction = fwd != nullptr ? 0 : bwd != nullptr ? 1 : 2;
  if (info == nullptr || info->direction != direction) {
    return fail(where + " describes itself (jaxflash_variant_info) as another direction than "
                "the entry point it exports; rebuild it with `python -m jaxflash.build --force "
                "--variants " + std::string(key) + "`");
  }
  // Loading here, at registration, keeps cudaLibraryLoadData out of CUDA-graph capture.
  if (int32_t status = load(); status != 0) {
    return fail(where + ": loading the kernel module failed with status " +
                std::to_string(status) + " (is a CUDA GPU with a recent enough driver visible?)");
  }

  auto entry = std::make_unique<VariantLibrary>();
  entry->key = std::string(key);
  entry->path = std::move(path_str);
  entry->handle = handle;
  entry->info = *info;
  entry->fwd = fwd;
  entry->bwd = bwd;
  entry->decode = decode;
  registry.emplace(entry->key, std::move(entry));
  return "";
}

void SetKernelFolders(std::vector<std::string> folders) {
  std::lock_guard lock(FoldersMutex());
  GetFolders() = std::move(folders);
}

std::string RegisterFromFolders(std::string_view key) {
  if (FindVariant(key) != nullptr) return "";
  std::vector<std::string> folders;
  {
    std::lock_guard lock(FoldersMutex());
    folders = GetFolders();
  }
  std::string errors;
  for (const std::string& folder : folders) {
    std::string path = folder + "/" + std::string(key) + "/" + std::string(kVariantLibrary);
    if (access(path.c_str(), R_OK) != 0) continue;
    std::string error = RegisterVariant(key, path);
    if (error.empty()) return "";
    errors += "\n  " + error;
  }
  std::string searched;
  for (const std::string& folder : folders) searched += (searched.empty() ? "" : ", ") + folder;
  if (errors.empty()) {
    return "kernel variant '" + std::string(key) + "' is in none of the kernel folders (" +
           (searched.empty() ? std::string("none set") : searched) + ")";
  }
  return "kernel variant '" + std::string(key) + "' did not load from the kernel folders:" +
         errors;
}

}  // namespace jaxflash

namespace {
thread_local std::string last_error;
}  // namespace

extern "C" {

// Registers the library at `path` as variant `key`. 0 on success, else 1 and
// jaxflash_ffi_last_error() says why.
int32_t jaxflash_ffi_register_variant(const char* key, const char* path) {
  if (key == nullptr || path == nullptr) {
    last_error = "jaxflash_ffi_register_variant: key and path must not be null";
    return 1;
  }
  last_error = jaxflash::RegisterVariant(key, path);
  return last_error.empty() ? 0 : 1;
}

// The error of the last failed call on this thread ("" if none).
const char* jaxflash_ffi_last_error(void) { return last_error.c_str(); }

// Sets the kernel folders RegisterFromFolders searches: `count` NUL-terminated paths, in search
// order. 0 on success.
int32_t jaxflash_ffi_set_kernel_folders(const char* const* folders, int32_t count) {
  if (count < 0 || (count > 0 && folders == nullptr)) {
    last_error = "jaxflash_ffi_set_kernel_folders: folders must hold count paths";
    return 1;
  }
  std::vector<std::string> list;
  for (int32_t i = 0; i < count; ++i) {
    if (folders[i] == nullptr) {
      last_error = "jaxflash_ffi_set_kernel_folders: folder " + std::to_string(i) + " is null";
      return 1;
    }
    list.emplace_back(folders[i]);
  }
  jaxflash::SetKernelFolders(std::move(list));
  return 0;
}

// Registers `key` from the kernel folders (what a handler does for a variant it has not seen).
// 0 on success, else 1 and jaxflash_ffi_last_error() says why.
int32_t jaxflash_ffi_register_from_folders(const char* key) {
  if (key == nullptr) {
    last_error = "jaxflash_ffi_register_from_folders: key must not be null";
    return 1;
  }
  last_error = jaxflash::RegisterFromFolders(key);
  return last_error.empty() ? 0 : 1;
}

// 1 if `key` is registered in this process, else 0.
int32_t jaxflash_ffi_is_registered(const char* key) {
  return key != nullptr && jaxflash::FindVariant(key) != nullptr ? 1 : 0;
}

}  // extern "C"
