// Checksums and hashes over byte ranges. Thread-safe, allocation-free.
// Only (pointer, size) forms: overloads taking strings made it too easy to
// pass a length where a seed was meant.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dcr {

// XXH3-64 of `data` with `seed` (the reference XXH3_64bits_withSeed).
uint64_t Xxh3_64(const void* data, size_t size, uint64_t seed = 0);

// CRC32C (Castagnoli), as used by iSCSI/ext4/S3: Crc32c("123456789") == 0xE3069283.
// `crc` is a previous result to extend (0 to start). Uses SSE4.2 when present.
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

// The portable table-driven CRC32C; exposed so tests can compare it with the
// hardware path.
uint32_t Crc32cPortable(const void* data, size_t size, uint32_t crc = 0);

}  // namespace dcr
