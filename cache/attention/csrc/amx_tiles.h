// What every AMX user in the extension shares: Linux's permission for the tile state and the one
// tile shape they all use. Included where the build has AMX-TILE (-march=native on Sapphire Rapids
// and later): tile_attention.h (prefill attention) and panel_linear.cpp (decode-sized linears).
#pragma once

#include <sys/syscall.h>  // arch_prctl
#include <unistd.h>

#include <cstdint>

namespace amx {

// Linux hands out AMX's 8 KiB of tile state only to a process that asks (arch_prctl, Linux 5.16+);
// where it refuses, callers run their vector path instead.
inline bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;                // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// Every tile as 16 rows of 64 bytes (palette 1): 16 x 32 bfloat16 operands, 16 x 16 float32 sums.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

}  // namespace amx
