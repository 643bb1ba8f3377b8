// Memory for the CPU kernels (kernel.h): huge_page_alloc, and the per-thread
// cache of scratch buffers behind scratch_alloc / scratch_free.
#include <algorithm>
#include <cstdlib>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kernel.h"

namespace qfp8 {

// A buffer aligned to 2 MiB and, on Linux, advised for transparent huge
// pages before its first touch. Below 2 MiB, 64-byte aligned only: glibc
// maps a 2 MiB-aligned request afresh (a system call and page faults per
// call, which a small layer's call would pay several times over).
void* huge_page_alloc(size_t nbytes) {
  constexpr size_t kHugePage = size_t{2} << 20;
  void* data = nullptr;
  if (posix_memalign(&data, nbytes < kHugePage ? 64 : kHugePage, std::max<size_t>(nbytes, 1)) != 0) return nullptr;
#if defined(MADV_HUGEPAGE)
  const size_t whole = nbytes / kHugePage * kHugePage;
  if (whole > 0) madvise(data, whole, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
  return data;
}

namespace {

// Up to kCachedScratchBuffers freed buffers and kCachedScratchBytes in all
// per thread; a request takes the smallest cached buffer that holds it. So a
// prefill's layers reuse two to four buffers (a W8A8 convolution five)
// instead of mapping new memory at every call. What stays cached is held until the thread ends: at most
// 256 MB (a 2048-token W8A8 call of a 14336-wide layer needs 117 MB).
constexpr size_t kCachedScratchBuffers = 8;
constexpr size_t kCachedScratchBytes = size_t(256) << 20;

struct ScratchCache {
  struct Entry {
    void* data;
    size_t capacity;
  };
  std::vector<Entry> cached;
  size_t bytes = 0;
  ~ScratchCache() {
    for (const Entry& e : cached) std::free(e.data);
  }
};

thread_local ScratchCache scratch_cache;

}  // namespace

void* scratch_alloc(size_t nbytes, size_t* capacity) {
  std::vector<ScratchCache::Entry>& cached = scratch_cache.cached;
  auto best = cached.end();
  for (auto it = cached.begin(); it != cached.end(); ++it) {
    if (it->capacity >= nbytes && (best == cached.end() || it->capacity < best->capacity)) best = it;
  }
  if (best != cached.end()) {
    void* data = best->data;
    *capacity = best->capacity;
    scratch_cache.bytes -= best->capacity;
    cached.erase(best);
    return data;
  }
  *capacity = nbytes;
  return huge_page_alloc(nbytes);
}

void scratch_free(void* data, size_t capacity) {
  if (!data) return;
  if (capacity > kCachedScratchBytes) {
    std::free(data);
    return;
  }
  std::vector<ScratchCache::Entry>& cached = scratch_cache.cached;
  cached.push_back({data, capacity});
  scratch_cache.bytes += capacity;
  while (cached.size() > kCachedScratchBuffers || scratch_cache.bytes > kCachedScratchBytes) {
    // The smallest goes first: a larger buffer serves every request a smaller one would.
    auto smallest = std::min_element(cached.begin(), cached.end(),
                                     [](const auto& a, const auto& b) { return a.capacity < b.capacity; });
    std::free(smallest->data);
    scratch_cache.bytes -= smallest->capacity;
    cached.erase(smallest);
  }
}

}  // namespace qfp8
